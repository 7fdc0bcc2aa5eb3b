"""The whole program and a cut's stages compiled in separate processes, two of them at once with an
empty XLA cache, give the same bytes. On a GPU each process could time its own GEMM candidates and
pick, and round, differently (on an H200 with jax 0.11.2 two processes did, `experiments/
autotune.py`); kernjax has XLA take each GEMM's first candidate untimed (`kernjax/runtime/xla.py`), and the
test reads the algorithms both processes chose from their optimized programs. On the CPU: the same
path, nothing to choose."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import numpy as np

from experiments import autotune  # its reader of the GEMMs in XLA's optimized HLO
from kernjax import weights as ckpts
from kernjax.runtime import xla


def test_whole_and_stages_in_separate_processes_give_the_same_bytes(tmp_path):
    gpu = jax.default_backend() == "gpu"
    model, at, chunk, n = ("qwen3-0.6b", "14", 512, 1300) if gpu else ("qwen3-tiny", "2", 64, 150)
    ckpts.random_checkpoint(model, seed=0, dtype="bfloat16")  # made once, before the processes
    # an empty cache: what this process's kernjax set is replaced in the children (xla.configure)
    # and every program kept, however fast it compiled (JAX keeps those over 1 s: on a fast CPU none)
    env = {**os.environ, "KERNJAX_XLA_CACHE": str(tmp_path / "xla"),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
    py = [sys.executable, "-m", "kernjax"]
    subprocess.run([*py, "cut", "--model", model, "--dtype", "bfloat16", "--at", at,
                    "--chunk", str(chunk), "--seqs", "1", "--context", "2048", "--decode", "1",
                    "--out", str(tmp_path / "cut")], env=env, check=True, capture_output=True)
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "stage0").symlink_to(tmp_path / "cut" / "whole")
    tokens = " ".join(map(str, np.random.default_rng(1).integers(0, 500, n)))

    def start(stages, save):  # on a GPU each program's optimized HLO dumped, to read
        dump = f" --xla_dump_to={tmp_path}/dump-{stages} --xla_dump_hlo_as_text" if gpu else ""
        return subprocess.Popen([*py, "run", "--stages", str(tmp_path / stages), "--tokens",
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
    if gpu:  # the same GEMM, the same algorithm, in the whole program and in the stages
        whole, stages = gemm_choices(tmp_path / "dump-w"), gemm_choices(tmp_path / "dump-cut")
        common = whole.keys() & stages.keys()
        # q/k/v, o and down at least (gate and up run in kernjax's own kernel, models/mlp_hopper)
        assert len(common) >= 3, (whole, stages, unread(tmp_path / "dump-w"))
        assert {k: whole[k] for k in common} == {k: stages[k] for k in common}


def gemm_choices(dump) -> dict[str, set]:
    """The GEMMs of the optimized programs in `dump` (cuBLAS calls, Triton GEMM fusions): their
    result and operand shapes, to what XLA chose for GEMMs of those shapes (`kind[choice]`)."""
    found = {}
    for p in dump.glob("*after_optimizations.txt"):
        for g in filter(None, map(autotune.gemm, p.read_text().splitlines())):
            found.setdefault(g[0], set()).add(autotune.pick(g))
    return found


def unread(dump, most=4) -> list[str]:
    """Lines of the optimized programs in `dump` that look like a GEMM (a dot, a Triton fusion)
    and that `autotune.gemm` does not read, cut to 600 characters: what a failed check shows."""
    lines = (line for p in sorted(dump.glob("*after_optimizations.txt"))
             for line in p.read_text().splitlines())
    return [line.strip()[:600] for line in lines if (" dot(" in line or "__triton" in line)
            and autotune.gemm(line) is None][:most]


def test_gemm_choices_reads_the_choice_of_each_gemm_by_its_shapes(tmp_path):
    (tmp_path / "m.sm_9.0_gpu_after_optimizations.txt").write_text(
        '  %c = (bf16[512,3072]{1,0}, s8[0]{0}) custom-call(bf16[512,1024]{1,0} %x, '
        'bf16[3072,1024]{1,0} %w), custom_call_target="__cublas$lt$matmul", '
        'backend_config={"gemm_backend_config":{"selected_algorithm":"3"}}\n'
        '  %d = bf16[512,3072]{1,0} fusion(bf16[512,3072]{1,0} %c), kind=kLoop\n'
        '  %t = bf16[512,1024]{1,0} fusion(bf16[512,3072]{1,0} %d, bf16[1024,3072]{1,0} %v), '
        'kind=kCustom, calls=%gemm_fusion, backend_config={"fusion_backend_config":{"kind":'
        '"__triton_gemm","triton_gemm_config":{"block_m":"64","block_n":"128","block_k":"32",'
        '"split_k":"1","num_stages":"4","num_warps":"4"}}}\n'
        '  %n = bf16[512,256]{1,0} fusion(bf16[512,1024]{1,0} %t, bf16[256,1024]{1,0} %u), '
        'kind=kCustom, calls=%gemm_fusion_dot, backend_config={"operation_queue_id":"0",'
        '"fusion_backend_config":{"kind":"__triton_nested_gemm_fusion","block_level_fusion_config":'
        '{"num_warps":"8","output_tiles":[{"sizes":["128","256"]}],"num_ctas":1,"num_stages":4}}}\n'
        '  %o = bf16[512,1024]{1,0} fusion(bf16[512,1024]{1,0} %p), kind=kCustom, calls=%p0, '
        'backend_config={"fusion_backend_config":{"kind":"__triton_nested_gemm_fusion",'
        '"block_level_fusion_config":{"output_tiles":[{"sizes":["128","64"]}]}}}\n'
        '  %s = f32[512]{0} fusion(bf16[512,1024]{1,0} %t), kind=kCustom, calls=%r, backend_config='
        '{"fusion_backend_config":{"kind":"__triton","block_level_fusion_config":{}}}\n')
    assert [line.split(" = ")[0] for line in unread(tmp_path)] == ["%s"]  # a Triton fusion, no GEMM
    assert gemm_choices(tmp_path) == {
        "bf16[512,256] bf16[512,1024] bf16[256,1024]":
            {"triton_nested_gemm[128x256,num_ctas=1,num_stages=4,num_warps=8]"},
        "bf16[512,1024] bf16[512,1024]": {"triton_nested_gemm[128x64]"},
        "bf16[512,3072] s8[0] bf16[512,1024] bf16[3072,1024]": {"__cublas$lt$matmul[3]"},
        "bf16[512,1024] bf16[512,3072] bf16[1024,3072]":
            {"triton_gemm[64x128x32,num_stages=4,num_warps=4,split_k=1]"}}


def test_a_child_process_keeps_its_own_xla_cache_and_the_users(tmp_path):
    """What a kernjax parent set for its cache is inherited, not chosen: a child given a cache of
    its own (`KERNJAX_XLA_CACHE`) uses it, one not given one keeps the parent's, and what the user
    set stays, its XLA flags too (importing kernjax imports no jax: a fraction of a second)."""
    keys = ("XLA_FLAGS", "JAX_COMPILATION_CACHE_DIR", "KERNJAX_XLA_SET",
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS")
    base = {k: v for k, v in os.environ.items() if k not in keys}

    def child(cache, **env):
        code = f"import json, os, kernjax; print(json.dumps([os.environ.get(k) for k in {keys}]))"
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env=base | {"KERNJAX_XLA_CACHE": str(tmp_path / cache)} | env)
        assert p.returncode == 0, p.stderr
        return dict(zip(keys, json.loads(p.stdout)))

    def uses(got, jax_dir, flag=xla.UNTIMED):
        return got["XLA_FLAGS"].split().count(flag) == 1 and \
            got["JAX_COMPILATION_CACHE_DIR"] == str(tmp_path / jax_dir)

    parent = child("p")
    assert uses(parent, "p/jax"), parent
    assert uses(child("c", **parent), "c/jax")
    assert uses(child("p", **parent), "p/jax")
    timed = "--xla_gpu_exclude_nondeterministic_ops=false"
    user = parent | {"XLA_FLAGS": timed, "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "uj")}
    got = child("c", **user)
    assert uses(got, "uj", timed) and xla.UNTIMED not in got["XLA_FLAGS"], got
    # every program kept, a stage's too (under JAX's 1 s), unless the user chose a threshold
    assert parent["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] == "0", parent
    kept = child("c", **parent | {"JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "5"})
    assert kept["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] == "5", kept
