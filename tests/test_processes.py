"""The whole program and a cut's stages compiled in separate processes, two of them at once with an
empty XLA cache, give the same bytes. On a GPU this is what the shared autotune cache and the
compile lock buy (`kernjax/xla.py`): without them each process times its own GEMM candidates and
may pick, and round, differently. On the CPU it checks the same path with nothing to tune."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import numpy as np

from kernjax import weights as ckpts


def test_whole_and_stages_in_separate_processes_give_the_same_bytes(tmp_path):
    gpu = jax.default_backend() == "gpu"
    model, at, chunk, n = ("qwen3-0.6b", "14", 512, 1300) if gpu else ("qwen3-tiny", "2", 64, 150)
    ckpts.random_checkpoint(model, seed=0, dtype="bfloat16")  # made once, before the processes
    env = {**os.environ, "KERNJAX_XLA_CACHE": str(tmp_path / "xla")}
    py = [sys.executable, "-m"]
    subprocess.run([*py, "kernjax.cut", "--model", model, "--dtype", "bfloat16", "--at", at,
                    "--chunk", str(chunk), "--seqs", "1", "--context", "2048",
                    "--out", str(tmp_path / "cut")], env=env, check=True, capture_output=True)
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "stage0").symlink_to(tmp_path / "cut" / "whole")
    tokens = " ".join(map(str, np.random.default_rng(1).integers(0, 500, n)))

    def start(stages, save):
        return subprocess.Popen([*py, "kernjax.run", "--stages", str(tmp_path / stages), "--tokens",
                                 tokens, "--chunk", str(chunk), "--save", str(tmp_path / save)],
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def wait(p):
        out, _ = p.communicate(timeout=600)
        assert p.returncode == 0, out[-3000:]

    first = [start("w", "whole1.npz"), start("cut", "stages.npz")]  # together, the cache empty
    for p in first:
        wait(p)
    wait(start("w", "whole2.npz"))  # alone, the cache full
    got = [np.load(tmp_path / f) for f in ("whole1.npz", "stages.npz", "whole2.npz")]
    for g in got[1:]:
        assert g["logits"].tobytes() == got[0]["logits"].tobytes()
        assert g["token"] == got[0]["token"]
    if gpu:
        assert any((tmp_path / "xla" / "autotune").rglob("*")), "no autotune result was shared"
