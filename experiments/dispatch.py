"""How long the host takes to issue one program while the GPU is still running the last: the
question behind the two-GPU stages issuing an item in ~20 ms where the GPU needs ~5
(experiments/results/2026-11-30-h200x2-serve/, the traces of `load.py --trace`).

A serving stage issues item k+1 while item k runs, with per-item operands that come from the
host as numpy arrays (the item's tokens, positions, pages; its sequence number), states donated,
and, with the edge ops, a program with side effects (which JAX calls through its Python path).
This times the same shapes of call on one GPU with a program of `--layers` GEMMs
(`--rows` x `--dim` by `--dim` x `--ff`), issued `--items` times back to back:

- `ops`: per-item operands as numpy arrays (`np`), put on the device just before the call
  (`put`), device arrays made before the loop, one per item (`dev`), or one device array for
  every item (`same`: the operands keep their addresses from run to run);
- `call`: `jax.jit(f)` or its `.lower().compile()` object, as the stages hold it;
- `effect`: the program carries `kernjax.kernels.ffi.mark` (a side effect; no slot, so it writes nothing);
- `--every_layer`: every layer reads the per-item operand (as every layer of a model reads the
  item's positions and pages), not the first alone;
- `--xla_modes`: each mode runs in a process of its own, its XLA flags set before the client
  starts: `default`; `nocb`, no CUDA graphs (`--xla_gpu_enable_command_buffer=`);
  `skip_profiled` (`--xla_gpu_command_buffer_update_mode=SKIP_PROFILED`: XLA pins the addresses
  that held still over 3 runs and stops updating the graph's commands that use them).
  XLA updates a CUDA graph's commands whose buffers moved before every launch: 2.5 ms an item
  on a qwen3-4b stage.

For each, the median time of one issue on the host, the wall time per item over the run, and
the GPU's own time per item (one item alone, waited for). An issue that takes the GPU's time
means the host waits for the device on every item, and no item overlaps the next one's launch.

    python -m experiments.dispatch            # one GPU; on the CPU it runs, and means little
    python -m experiments.dispatch --ops dev,same --calls compiled --effects 0 --every_layer \\
        --xla_modes default,nocb,skip_profiled
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from experiments import harness

FLAGS = {"default": "", "nocb": "--xla_gpu_enable_command_buffer=",
         "skip_profiled": "--xla_gpu_command_buffer_update_mode=SKIP_PROFILED"}


def rows_in_this_process(a) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from kernjax.kernels import ffi

    def program(effect: bool):
        def f(state, w, x, pos, k):
            y, add = x, pos.astype(x.dtype)[:, None]
            for _ in range(a.layers):
                y = jnp.tanh(y @ w).astype(x.dtype)
                y = y + add if a.every_layer else y
            if effect:
                y = ffi.mark(y, k)
            state = state.at[pos[0] % state.shape[0]].set(y[0])
            return state, y[-1].sum() + k[0]
        return f

    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((a.dim, a.ff)) / a.dim ** 0.5, jnp.bfloat16)
    xs = [rng.standard_normal((a.rows, a.dim)).astype(jnp.bfloat16) for _ in range(a.items)]
    poss = [np.full((a.rows,), i, np.int32) for i in range(a.items)]
    ks = [np.asarray([i], np.int32) for i in range(a.items)]
    rows = []
    for ops, call, effect in itertools.product(a.ops.split(","), a.calls.split(","),
                                               [bool(int(e)) for e in a.effects.split(",")]):
        state = jnp.zeros((1024, a.dim), jnp.bfloat16)
        fn = jax.jit(program(effect), donate_argnums=0)
        if call == "compiled":
            fn = fn.lower(state, w, xs[0], poss[0], ks[0]).compile()
        state, r = fn(state, w, xs[0], poss[0], ks[0])  # compile, warm
        jax.block_until_ready((state, r))
        t = time.perf_counter()
        state, r = fn(state, w, xs[1], poss[1], ks[1])
        jax.block_until_ready((state, r))
        alone = time.perf_counter() - t
        n = 1 if ops == "same" else a.items
        dev = [jax.device_put(v) for v in (*xs[:n], *poss[:n], *ks[:n])] \
            if ops in ("dev", "same") else None
        if dev:
            jax.block_until_ready(dev)
        issue, puts, outs = [], [], []
        t0 = time.perf_counter()
        for i in range(a.items):
            args = (xs[i], poss[i], ks[i])
            if dev:
                j = i % n
                args = (dev[j], dev[n + j], dev[2 * n + j])
            elif ops == "put":
                t = time.perf_counter()
                args = jax.device_put(args)
                puts.append(time.perf_counter() - t)
            t = time.perf_counter()
            state, r = fn(state, w, *args)
            issue.append(time.perf_counter() - t)
            outs.append(r)
        jax.block_until_ready((state, outs))
        wall = (time.perf_counter() - t0) / a.items
        row = {"xla": a.xla_modes, "ops": ops, "call": call, "effect": effect,
               "issue_ms": 1e3 * statistics.median(issue),
               "put_ms": 1e3 * statistics.median(puts) if puts else 0.0,
               "wall_ms_per_item": 1e3 * wall, "alone_ms": 1e3 * alone}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=100)
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--dim", type=int, default=2560)
    ap.add_argument("--ff", type=int, default=2560)
    ap.add_argument("--items", type=int, default=40)
    ap.add_argument("--ops", default="np,put,dev", help="of np, put, dev, same")
    ap.add_argument("--calls", default="jit,compiled")
    ap.add_argument("--effects", default="0,1")
    ap.add_argument("--every_layer", action="store_true")
    ap.add_argument("--xla_modes", default="default", help=f"of {', '.join(FLAGS)}")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    if a.child:
        rows_in_this_process(a)
        return 0
    rows = []
    for mode in a.xla_modes.split(","):
        if mode not in FLAGS:
            ap.error(f"--xla_modes: {mode!r} is not one of {', '.join(FLAGS)}")
        env = harness.child_env(XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {FLAGS[mode]}")
        argv, skip = [], False
        for x in sys.argv[1:]:  # all but --xla_modes and its value
            if not skip and not x.startswith("--xla_modes"):
                argv.append(x)
            skip = x == "--xla_modes"
        p = subprocess.run([*harness.module("dispatch"), *argv, "--xla_modes", mode, "--child"],
                           env=env, capture_output=True, text=True, timeout=600)
        got = [json.loads(x) for x in p.stdout.splitlines() if x.startswith("{")]
        print(p.stdout, end="", flush=True)
        if p.returncode:
            print(f"mode {mode}: exit {p.returncode}\n{p.stderr[-2000:]}", flush=True)
        rows += got
    import jax

    print(f"\n{jax.devices()[0].device_kind}, jax {jax.__version__}, {a.layers} GEMMs of "
          f"{a.rows}x{a.dim} by {a.dim}x{a.ff} a program"
          f"{', each layer reading the per-item operand' if a.every_layer else ''}, "
          f"{a.items} items")
    print("| xla | ops | call | effect | issue ms | put ms | wall ms/item | alone ms |")
    print("|---|---|---|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['xla']} | {r['ops']} | {r['call']} | {r['effect']} | {r['issue_ms']:.3f} | "
              f"{r['put_ms']:.3f} | {r['wall_ms_per_item']:.3f} | {r['alone_ms']:.3f} |")
    if a.out:
        Path(a.out).write_text(json.dumps({"record": harness.record(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
