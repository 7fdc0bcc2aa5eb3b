"""The whole program and a cut's stages compiled in separate processes, two of them at once with an
empty XLA cache, give the same bytes. On a GPU each process could time its own GEMM candidates and
pick, and round, differently; kernjax points XLA's per-fusion autotune cache at one directory for
all of them, compiled under a lock (`kernjax/xla.py`). On an H200 (jax 0.11.2, 2026-12-02) the
bytes agree and XLA wrote nothing to that cache. On the CPU: the same path, nothing to tune."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import jax
import numpy as np
import pytest

from kernjax import weights as ckpts
from kernjax import xla


def test_whole_and_stages_in_separate_processes_give_the_same_bytes(tmp_path):
    gpu = jax.default_backend() == "gpu"
    model, at, chunk, n = ("qwen3-0.6b", "14", 512, 1300) if gpu else ("qwen3-tiny", "2", 64, 150)
    ckpts.random_checkpoint(model, seed=0, dtype="bfloat16")  # made once, before the processes
    # an empty cache: what this process's kernjax set is replaced in the children (xla.configure)
    env = {**os.environ, "KERNJAX_XLA_CACHE": str(tmp_path / "xla")}
    py = [sys.executable, "-m"]
    subprocess.run([*py, "kernjax.cut", "--model", model, "--dtype", "bfloat16", "--at", at,
                    "--chunk", str(chunk), "--seqs", "1", "--context", "2048",
                    "--out", str(tmp_path / "cut")], env=env, check=True, capture_output=True)
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "stage0").symlink_to(tmp_path / "cut" / "whole")
    tokens = " ".join(map(str, np.random.default_rng(1).integers(0, 500, n)))

    def start(stages, save):  # on a GPU each program's autotune results also dumped, to read
        dump = f" --xla_gpu_dump_autotune_results_to={tmp_path}/tuned-{stages}.txt" if gpu else ""
        return subprocess.Popen([*py, "kernjax.run", "--stages", str(tmp_path / stages), "--tokens",
                                 tokens, "--chunk", str(chunk), "--save", str(tmp_path / save)],
                                env={**env, "XLA_FLAGS": env.get("XLA_FLAGS", "") + dump},
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

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
    assert any((tmp_path / "xla" / "jax").iterdir()), "the programs were not compiled into the cache"
    # The autotune cache (the lock file is there whatever XLA did): on an H200, jax 0.11.2's XLA
    # wrote no result to it for these programs (2026-12-02), so what makes the processes agree
    # is not sharing; said here as an expected failure until that is understood (roadmap K6).
    tuned = [p for p in (tmp_path / "xla" / "autotune").rglob("*") if p.name != ".lock"]
    if gpu and not tuned:
        dumped = {p.name: p.read_text().count("results {") for p in tmp_path.glob("tuned-*")}
        pytest.xfail("the bytes agree; XLA wrote no autotune result to share (docs/bitwise.md); "
                     f"results it dumped: {dumped}")


AUTOTUNE = rf"{xla.AUTOTUNE_FLAG}=\S+"


def test_the_compile_lock_guards_the_directory_xla_writes_to(monkeypatch, tmp_path):
    """A child inherits its parent's XLA_FLAGS: its lock must be on the directory those name."""
    monkeypatch.setenv("KERNJAX_XLA_CACHE", str(tmp_path / "own"))
    monkeypatch.setenv("XLA_FLAGS", f"--xla_foo=1 {xla.AUTOTUNE_FLAG}={tmp_path}/p")
    assert xla.autotune_dir() == tmp_path / "p"
    monkeypatch.setenv("XLA_FLAGS", re.sub(AUTOTUNE, "", os.environ["XLA_FLAGS"]))
    assert xla.autotune_dir() == tmp_path / "own" / "autotune"


def test_a_child_process_keeps_its_own_xla_cache_and_the_users(tmp_path):
    """What a kernjax parent set for its cache is inherited, not chosen: a child given a cache of
    its own (`KERNJAX_XLA_CACHE`) uses it, one not given one keeps the parent's, and what the user
    set stays (importing kernjax imports no jax, so each child costs a fraction of a second)."""
    keys = ("XLA_FLAGS", "JAX_COMPILATION_CACHE_DIR", "KERNJAX_XLA_SET")
    base = {k: v for k, v in os.environ.items() if k not in keys}

    def child(cache, **env):
        code = f"import json, os, kernjax; print(json.dumps([os.environ.get(k) for k in {keys}]))"
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env=base | {"KERNJAX_XLA_CACHE": str(tmp_path / cache)} | env)
        assert p.returncode == 0, p.stderr
        return dict(zip(keys, json.loads(p.stdout)))

    def uses(got, at, jax_dir):
        return re.findall(AUTOTUNE, got["XLA_FLAGS"]) == [f"{xla.AUTOTUNE_FLAG}={tmp_path / at}"] and \
            got["JAX_COMPILATION_CACHE_DIR"] == str(tmp_path / jax_dir)

    parent = child("p")
    assert uses(parent, "p/autotune", "p/jax"), parent
    assert uses(child("c", **parent), "c/autotune", "c/jax")
    assert uses(child("p", **parent), "p/autotune", "p/jax")
    user = parent | {"XLA_FLAGS": f"{xla.AUTOTUNE_FLAG}={tmp_path}/u",
                     "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "uj")}
    assert uses(child("c", **user), "u", "uj")
