"""Which algorithms XLA:GPU picks for kernjax's GEMMs, and do two processes pick alike?

On qwen3-4b's GEMM calls as the model runs them (`gemms.layer_cases`: q/k/v one fused weight, o,
gate and up, down), at `--rows`: each flag set compiles them in a fresh process with caches of its
own, and prints, per GEMM, the kernel XLA chose (the custom call's target and its
`selected_algorithm`, or a Triton GEMM fusion's tiling), its time and compile time, how many
autotune results XLA dumped (`--xla_gpu_dump_autotune_results_to`), the files in its per-fusion
autotune cache (where JAX puts it when its persistent cache is on, whatever `XLA_FLAGS` says:
`xla_gpu_per_fusion_autotune_cache_dir/` in that cache's directory), and the cache hits and
misses its autotuner logs (`TF_CPP_VMODULE=autotuner_pass=1`; on an H200 with jax 0.11.2 it logged none). Flag sets (`--sets`): `kernjax`, `kernjax-again`
(kernjax's flags: each GEMM's first candidate, untimed), `timed`
(`--xla_gpu_exclude_nondeterministic_ops=false`: XLA times the candidates), `det`, `det-again`
(the untimed flag named explicitly), `newcache` (timed, with XLA's new cache format), `det-blas`,
`det-blas-again`, `timed-blas` (`--xla_gpu_enable_cublaslt=false`; with jax 0.11.2 XLA still
calls cuBLASLt) and `level0`
(`--xla_gpu_autotune_level=0`: no cuBLAS at all). A set named with `-shared` (`timed-shared`,
`timed-shared-again`) shares one XLA cache with the other `-shared` sets of the run (no compiled
program kept, XLA's per-fusion autotune results shared). `--layouts oi,io` times each product also on
its weights stored [in, out] (the model holds them [out, in]). docs/bitwise.md item 3 reads the
results.

    python -m experiments.autotune --rows 512,8192 --sets timed,kernjax,kernjax-again
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import tempfile
import time
from pathlib import Path

from experiments import harness

DET = "--xla_gpu_exclude_nondeterministic_ops=true"  # XLA takes each GEMM's first config, untimed
SETS = {"kernjax": "", "kernjax-again": "", "timed": "--xla_gpu_exclude_nondeterministic_ops=false",
        "det": DET, "det-again": DET, "level0": "--xla_gpu_autotune_level=0",
        "newcache": "--xla_gpu_exclude_nondeterministic_ops=false "
                    "--xla_gpu_use_new_autotune_cache_format=true",
        "det-blas": f"{DET} --xla_gpu_enable_cublaslt=false",  # legacy cuBLAS's first choice
        "det-blas-again": f"{DET} --xla_gpu_enable_cublaslt=false",
        "timed-blas": "--xla_gpu_exclude_nondeterministic_ops=false --xla_gpu_enable_cublaslt=false"}
DEFAULT_SETS = "timed,kernjax,kernjax-again"
D, Q, KV, F = 2560, 4096, 1024, 9728  # qwen3-4b: hidden, q heads x 128, kv heads x 128, MLP


def child(rows: list[int], iters: int, layouts: list[str]) -> dict:
    import kernjax  # noqa: F401  (its XLA flags, unless XLA_FLAGS names them)
    import jax

    from experiments.gemms import layer_cases, operands  # the model's GEMM calls
    from experiments.harness import timed  # median ms of rounds

    out = {}
    cases = {}
    for lay in layouts:  # oi: weights [out, in] as the model holds them; io: [in, out]
        cases.update(layer_cases(D, Q, KV, F, inout=lay == "io"))
    for r in rows:
        for name, (f, shapes, flops_per_row) in cases.items():
            def g(*a, f=f):
                return f(*a)
            g.__name__ = f"{name}_{r}"  # the HLO module's name
            args = operands(jax.random.key(0), shapes(r))
            t = time.perf_counter()
            run = jax.jit(g).lower(*args).compile()
            compile_s = time.perf_counter() - t
            ms = timed(run, args, iters)
            tflops = round(flops_per_row * r / ms / 1e9, 1)
            out[f"{name}_{r}"] = {"ms": round(ms, 4), "tflops": tflops, "compile_s": round(compile_s, 2)}
    return out


def gemm(line: str) -> tuple[str, str, str | None] | None:
    """A GEMM of an optimized HLO module's text (one instruction a line): its result and operand
    shapes, its kind and XLA's choice for it: a cuBLAS custom call's target and the algorithm
    selected, or a Triton GEMM fusion and its tiling: `triton_gemm` (`MxNxK`, then split_k,
    stages, warps, ... where given), or `triton_nested_gemm` (jax 0.11.2 on an H200), a fusion
    whose tiles XLA gives on it and on each operand fusion inside it (`AxB`, ';' between tiles,
    then stages, warps, ...); else None."""
    t = re.search(r'custom_call_target="(__cublas[^"]*)"', line)
    if t is not None:
        alg = re.search(r'"selected_algorithm":"?(-?\d+)', line)
        return " ".join(re.findall(r"\w+\[[\d,]*\]", line[:t.start()])), t.group(1), alg and alg.group(1)
    kind = re.search(r'"kind":"__(triton\w*gemm)(?:_fusion)?"', line)
    if kind is None:
        return None
    shapes = re.findall(r"\w+\[[\d,]*\]", line[:line.find(", kind=")])
    c = re.search(r'"(triton_gemm_config|block_level_fusion_config)":', line)
    cfg = json.JSONDecoder().raw_decode(line, c.end())[0] if c else {}
    if "output_tiles" in cfg:
        tile = ";".join("x".join(map(str, t.get("sizes", []))) for t in cfg.pop("output_tiles"))
    else:
        tile = "x".join(str(cfg.pop(k, "?")) for k in ("block_m", "block_n", "block_k"))
    return " ".join(shapes), kind.group(1), ",".join([tile, *(f"{k}={v}" for k, v in sorted(cfg.items()))])


def pick(g: tuple[str, str, str | None]) -> str:
    """A GEMM of `gemm` as `kind[choice]`."""
    return f"{g[1]}[{g[2] or '?'}]"


def kernels(dump: Path) -> dict:
    """Per module: the GEMM kernels of its optimized HLO, as `kind[choice]` strings."""
    found = {}
    for p in dump.glob("*after_optimizations.txt"):
        m = re.search(r"jit_(\w+?_\d+)\.", p.name)
        if m:
            found[m.group(1)] = [pick(g) for g in map(gemm, p.read_text().splitlines()) if g]
    return found


def main() -> None:
    global D, Q, KV, F
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="512,8192")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--sizes", default=f"{D},{Q},{KV},{F}",
                    help="hidden, q heads x 128, kv heads x 128, MLP (default qwen3-4b's)")
    ap.add_argument("--sets", default=DEFAULT_SETS, help=f"flag sets, of {', '.join(SETS)}")
    ap.add_argument("--layouts", default="oi",
                    help="weights as the model holds them, [out, in] (oi), and/or [in, out] (io)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    D, Q, KV, F = (int(x) for x in a.sizes.split(","))
    rows = [int(x) for x in a.rows.split(",")]
    if a.child:
        print(json.dumps(child(rows, a.iters, a.layouts.split(","))))
        return
    results = {}
    shared = tempfile.TemporaryDirectory()  # the XLA cache of the `-shared` sets, one for them all
    for label in a.sets.split(","):
        base = label.replace("-shared", "")  # timed-shared-again: timed's flags
        flags = SETS[base if base in SETS else base.replace("-again", "")]
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            xla_dir = Path(shared.name if "-shared" in label else tmp) / "xla"
            env = harness.child_env(KERNJAX_XLA_CACHE=str(xla_dir))
            if "-shared" in label:  # no program kept: each compiles, its autotune results shared
                env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "1000000"
            env.update(TF_CPP_VMODULE="autotuner_pass=1", TF_CPP_MIN_LOG_LEVEL="0")
            env.pop("KERNJAX_XLA_SET", None)  # XLA_FLAGS below replaces any the caller had
            env["XLA_FLAGS"] = (f"{flags} --xla_dump_to={tmp}/dump --xla_dump_hlo_as_text "
                                f"--xla_gpu_dump_autotune_results_to={tmp}/tuned.txt "
                                f"--xla_gpu_dump_autotune_logs_to={tmp}/tuning-log.txt").strip()
            t = time.perf_counter()
            p = subprocess.run([*harness.module("autotune"), "--child", "--rows", a.rows, "--iters",
                                str(a.iters), "--sizes", a.sizes, "--layouts", a.layouts],
                               env=env, capture_output=True,
                               text=True)
            if p.returncode:
                print(f"{label}: failed\n{p.stderr[-3000:]}")
                continue
            timed = json.loads(p.stdout.strip().splitlines()[-1])
            tuned = tmp / "tuned.txt"
            dumped = tuned.read_text().count("results {") if tuned.exists() else None
            stats = re.findall(r"cache stats: hits=(\d+), misses=(\d+)", p.stderr)
            hits, misses = (sum(int(x[i]) for x in stats) for i in (0, 1))
            log = tmp / "tuning-log.txt"
            logged = len(log.read_bytes()) if log.exists() else None
            # where JAX points XLA's per-fusion autotune cache (its persistent cache's directory)
            cached = [q for q in (xla_dir / "jax" / "xla_gpu_per_fusion_autotune_cache_dir").rglob("*")
                      if q.is_file()]
            picks = kernels(tmp / "dump")
            results[label] = {"timed": timed, "picks": picks}
            print(f"## {label} (XLA_FLAGS += `{flags or 'nothing'}`): {time.perf_counter() - t:.1f} s; "
                  f"autotune results dumped: {dumped}; files in the per-fusion cache: {len(cached)}; "
                  f"autotuner passes {len(stats)}, cache hits {hits}, misses {misses}; "
                  f"its log (`--xla_gpu_dump_autotune_logs_to`): {logged} bytes")
            if cached:  # one of them, its name and its start
                print(f"one of its files: {cached[0].name}, {cached[0].stat().st_size} bytes")
            if logged:  # what XLA's autotuner says it did, the start of it
                print("its log begins:\n" + log.read_text()[:2500])
            print("| GEMM | rows | kernels XLA chose | ms | TFLOP/s | compile s |\n|---|---:|---|---:|---:|---:|")
            for k, v in timed.items():
                name, r = k.rsplit("_", 1)
                print(f"| {name} | {r} | {' '.join(picks.get(k, ['?']))} | {v['ms']} | {v['tflops']} "
                      f"| {v['compile_s']} |", flush=True)
            for lay in a.layouts.split(","):  # a layer's four GEMM calls, over 36 layers
                for r in rows:
                    ms = sum(v["ms"] for k, v in timed.items()
                             if k.endswith(f"_{r}") and k.endswith("_io_%d" % r) == (lay == "io"))
                    print(f"{label}: 36 layers of GEMMs, weights {lay}, {r} rows: {36 * ms:.2f} ms")
    for a_, b_, what in [("kernjax", "kernjax-again", "two processes with kernjax's flags"),
                         ("det", "det-again", f"two processes with {DET}"),
                         ("timed", "kernjax", "timed and untimed (kernjax's flags)"),
                         ("det-blas", "det-blas-again", "two processes with legacy cuBLAS untimed"),
                         ("timed-shared", "timed-shared-again",
                          "two processes timed, one after the other, sharing XLA's caches"),
                         ("kernjax", "level0", "autotuning off and kernjax's flags")]:
        if a_ in results and b_ in results:
            same = results[a_]["picks"] == results[b_]["picks"]
            print(f"{what} chose the same kernels: {same}")


if __name__ == "__main__":
    main()
