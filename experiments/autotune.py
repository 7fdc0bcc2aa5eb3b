"""Does XLA:GPU autotune kernjax's GEMMs, and would autotuning change what they run?

`tests/test_processes.py` found that XLA writes no autotune result while compiling a whole
program and its stages (`docs/bitwise.md`, item 3). This asks why, on qwen3-4b's GEMM calls as
the model runs them (`models.qwen3.linear`, weights [out, in]; q/k/v one fused weight), at
`--rows`: each flag set compiles them in a fresh process with an autotune cache of its own, and
prints, per GEMM, the kernel XLA chose (the custom call's target, its `selected_algorithm`, or a
Triton GEMM fusion's tiling), its time, and how many autotune results XLA dumped
(`--xla_gpu_dump_autotune_results_to`). Flag sets: kernjax's flags (twice, two processes: do
their choices agree?), `--xla_gpu_exclude_nondeterministic_ops=true` twice (XLA's autotuner then
takes each GEMM's first candidate without timing: the same in every process, but as fast?) and
`--xla_gpu_autotune_level=0` (no cuBLAS at all). XLA's autotuner logs its cache hits and misses
(`TF_CPP_VMODULE=autotuner_pass=1`): the probe counts them.

    python experiments/autotune.py --rows 512,8192 --sets kernjax,kernjax-again,det,det-again
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
DET = "--xla_gpu_exclude_nondeterministic_ops=true"  # XLA takes each GEMM's first config, untimed
SETS = {"kernjax": "", "kernjax-again": "", "det": DET, "det-again": DET,
        "level0": "--xla_gpu_autotune_level=0", "timed": "--xla_gpu_exclude_nondeterministic_ops=false",
        "newcache": "--xla_gpu_exclude_nondeterministic_ops=false "
                    "--xla_gpu_use_new_autotune_cache_format=true",
        "det-blas": f"{DET} --xla_gpu_enable_cublaslt=false",  # legacy cuBLAS's first choice
        "det-blas-again": f"{DET} --xla_gpu_enable_cublaslt=false"}
D, Q, KV, F = 2560, 4096, 1024, 9728  # qwen3-4b: hidden, q heads x 128, kv heads x 128, MLP


def child(rows: list[int], iters: int) -> dict:
    sys.path[:0] = [str(HERE.parents[1]), str(HERE.parent)]
    import kernjax  # noqa: F401,E402  (its XLA flags: no dot merger, the autotune cache)
    import jax
    import jax.numpy as jnp
    from gemms import timed  # the median of 5 rounds of `iters` runs, in ms
    from models.qwen3 import linear

    fence = jax.lax.optimization_barrier
    shapes = {"qkv": [(Q + 2 * KV, D)], "o": [(D, Q)], "gate_up": [(F, D), (F, D)],
              "down": [(D, F)]}
    ins = {"qkv": D, "o": Q, "gate_up": D, "down": F}
    out = {}
    key = jax.random.key(0)
    for r in rows:
        for name, ws in shapes.items():
            def f(x, *w):
                x, w = fence((x, w))
                return fence(tuple(linear(x, wi) for wi in w))
            f.__name__ = f"{name}_{r}"  # the HLO module's name
            args = [jax.random.normal(k, s, jnp.bfloat16) * 0.05 for k, s in
                    zip(jax.random.split(key, 1 + len(ws)), [(r, ins[name]), *ws])]
            t = time.perf_counter()
            run = jax.jit(f).lower(*args).compile()
            compile_s = time.perf_counter() - t
            ms = timed(run, args, iters)
            flops = 2 * r * ins[name] * sum(w[0] for w in ws)
            out[f"{name}_{r}"] = {"ms": round(ms, 4), "tflops": round(flops / ms / 1e9, 1),
                                  "compile_s": round(compile_s, 2)}
    return out


def kernels(dump: Path) -> dict:
    """Per module: the GEMM kernels of its optimized HLO, as `target[algorithm]` strings."""
    found = {}
    for p in dump.glob("*after_optimizations.txt"):
        m = re.search(r"jit_(\w+?_\d+)\.", p.name)
        if not m:
            continue
        picks = []
        for line in p.read_text().splitlines():
            t = re.search(r'custom_call_target="([^"]+)"', line)
            if t and ("gemm" in t.group(1) or "matmul" in t.group(1)):
                alg = re.search(r'"selected_algorithm":"?(-?\d+)', line)
                picks.append(f"{t.group(1)}[{alg.group(1) if alg else '?'}]")
            if '"__triton_gemm"' in line:  # a Triton GEMM fusion, its tiling in its config
                tile = re.search(r'"block_m":"?(\d+)"?,"block_n":"?(\d+)"?,"block_k":"?(\d+)', line)
                picks.append("triton_gemm" + (f"[{'x'.join(tile.groups())}]" if tile else ""))
        found[m.group(1)] = picks
    return found


def main() -> None:
    global D, Q, KV, F
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="512,8192")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--sizes", default=f"{D},{Q},{KV},{F}",
                    help="hidden, q heads x 128, kv heads x 128, MLP (default qwen3-4b's)")
    ap.add_argument("--sets", default=",".join(SETS), help=f"flag sets, of {', '.join(SETS)}")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    D, Q, KV, F = (int(x) for x in a.sizes.split(","))
    rows = [int(x) for x in a.rows.split(",")]
    if a.child:
        print(json.dumps(child(rows, a.iters)))
        return
    results = {}
    for label in a.sets.split(","):
        flags = SETS[label]
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            env = dict(os.environ, KERNJAX_XLA_CACHE=str(tmp / "xla"))
            env.update(TF_CPP_VMODULE="autotuner_pass=1", TF_CPP_MIN_LOG_LEVEL="0")
            env.pop("KERNJAX_XLA_SET", None)  # XLA_FLAGS below replaces any the caller had
            env["XLA_FLAGS"] = (f"{flags} --xla_dump_to={tmp}/dump --xla_dump_hlo_as_text "
                                f"--xla_gpu_dump_autotune_results_to={tmp}/tuned.txt").strip()
            t = time.perf_counter()
            p = subprocess.run([sys.executable, str(HERE), "--child", "--rows", a.rows, "--iters",
                                str(a.iters), "--sizes", a.sizes], env=env, capture_output=True,
                               text=True)
            if p.returncode:
                print(f"{label}: failed\n{p.stderr[-3000:]}")
                continue
            timed = json.loads(p.stdout.strip().splitlines()[-1])
            tuned = tmp / "tuned.txt"
            dumped = tuned.read_text().count("results {") if tuned.exists() else None
            stats = re.findall(r"cache stats: hits=(\d+), misses=(\d+)", p.stderr)
            hits, misses = (sum(int(x[i]) for x in stats) for i in (0, 1))
            cached = [q.name for q in (tmp / "xla" / "autotune").rglob("*") if q.name != ".lock"]
            picks = kernels(tmp / "dump")
            results[label] = {"timed": timed, "picks": picks}
            print(f"## {label} (XLA_FLAGS += `{flags or 'nothing'}`): {time.perf_counter() - t:.1f} s; "
                  f"autotune results dumped: {dumped}; files in the per-fusion cache: {len(cached)}; "
                  f"autotuner passes {len(stats)}, cache hits {hits}, misses {misses}")
            print("| GEMM | rows | kernels XLA chose | ms | TFLOP/s | compile s |\n|---|---:|---|---:|---:|---:|")
            for k, v in timed.items():
                name, r = k.rsplit("_", 1)
                print(f"| {name} | {r} | {' '.join(picks.get(k, ['?']))} | {v['ms']} | {v['tflops']} "
                      f"| {v['compile_s']} |", flush=True)
    for a_, b_, what in [("kernjax", "kernjax-again", "two processes with kernjax's flags"),
                         ("det", "det-again", f"two processes with {DET}"),
                         ("kernjax", "det", f"{DET} and kernjax's flags"),
                         ("det-blas", "det-blas-again", "two processes with legacy cuBLAS untimed"),
                         ("kernjax", "level0", "autotuning off and kernjax's flags")]:
        if a_ in results and b_ in results:
            same = results[a_]["picks"] == results[b_]["picks"]
            print(f"{what} chose the same kernels: {same}")


if __name__ == "__main__":
    main()
