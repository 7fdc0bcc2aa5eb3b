"""What merging a layer's GEMMs would buy qwen3-4b, before the model is changed for it.

At 8k tokens in one chunk, GEMMs are 78 of the 133 ms (`docs/bitwise.md`), as five calls a layer
(q, k, v, gate and up separate; o; down) with silu·mul a call of its own between them. This
times, on random bf16 operands at `--rows` rows, each way a layer's GEMMs could run:

- `qkv 3`: q, k and v as three products (the model's layout until `6ca9e29`), each fenced
  like a call;
- `qkv 1`: one product over the weights concatenated at load (6144 columns; the model's now);
- `gate_up 2` against `gate_up 1` (19456 columns), the same way;
- `silu_mul+down 2`: silu(gate)·up and the down product as two calls (today), against
  `silu_mul+down 1`: both in one call, where XLA may fuse the product's prologue (Triton).

Each case is one jitted function of `optimization_barrier`-fenced parts, as kernjax lowers calls
on a GPU; kernjax's XLA flags apply (it is imported first), and any in `XLA_FLAGS`. Prints ms and
TFLOP/s per case.

`--layer` times instead the layer's GEMMs as the model runs them (`models.qwen3.linear`: weights
[out, in], q/k/v one weight as the model derives it at load), one call each: `qkv_proj`,
`o_proj`, `gate_up`, `down_proj`, and their sum over 36 layers. `--pallas` times the same products through JAX's
Mosaic GPU matmul (`jax.experimental.pallas.ops.gpu.hopper_matmul_mgpu`, on weights transposed
once beforehand) at each of a few tilings, the best of them per product, checked against XLA's:
whether a GEMM of our own (with silu·mul in its epilogue, say) could start from cuBLAS's speed.

`--out DIR` writes the tables with the run's record (results.json, README.md).

    python -m experiments.gemms --rows 512,2048,8192
    XLA_FLAGS=--xla_gpu_enable_cublaslt=true python -m experiments.gemms --rows 8192 --layer --pallas
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import kernjax  # noqa: F401  (its XLA flags: no dot merger, GEMMs chosen untimed)
import jax
import jax.numpy as jnp
import numpy as np

from experiments import harness
from experiments.harness import fenced, timed

D, Q, KV, F = 2560, 4096, 1024, 9728  # qwen3-4b: hidden, q heads x 128, kv heads x 128, MLP


def cases():
    dot = fenced(lambda x, w: x @ w)
    qkv3 = lambda x, wq, wk, wv: [dot(x, w) for w in (wq, wk, wv)]  # noqa: E731
    qkv1 = dot
    gu2 = lambda x, wg, wu: [dot(x, w) for w in (wg, wu)]  # noqa: E731
    sm = fenced(lambda g, u: jax.nn.silu(g) * u)
    down = fenced(lambda h, w: h @ w)
    sd2 = lambda g, u, w: down(sm(g, u), w)  # noqa: E731
    sd1 = fenced(lambda g, u, w: (jax.nn.silu(g) * u) @ w)
    return {
        "qkv 3": (qkv3, lambda r: [(r, D), (D, Q), (D, KV), (D, KV)], 2 * D * (Q + 2 * KV)),
        "qkv 1": (qkv1, lambda r: [(r, D), (D, Q + 2 * KV)], 2 * D * (Q + 2 * KV)),
        "gate_up 2": (gu2, lambda r: [(r, D), (D, F), (D, F)], 2 * D * 2 * F),
        "gate_up 1": (qkv1, lambda r: [(r, D), (D, 2 * F)], 2 * D * 2 * F),
        "silu_mul+down 2": (sd2, lambda r: [(r, F), (r, F), (F, D)], 2 * F * D),
        "silu_mul+down 1": (sd1, lambda r: [(r, F), (r, F), (F, D)], 2 * F * D),
    }


def layer_cases(d=None, q=None, kv=None, f=None, inout=False):
    """The model's GEMM calls a layer (`models.qwen3.linear`, weights [out, in]; q/k/v one weight,
    as the model derives it at load), at sizes `d, q, kv, f` (default this module's). `inout`:
    the same products on weights stored [in, out] (x @ w), as a load could derive them; the
    names end in `_io`."""
    from kernjax.models.qwen3 import exact, linear

    def lin(x, w):
        return (jnp.einsum("...i,io->...o", x, w, precision=exact(x.dtype)) if inout
                else linear(x, w))

    d, q, kv, f = (x or y for x, y in zip((d, q, kv, f), (D, Q, KV, F)))
    one = fenced(lin)
    two = fenced(lambda x, w1, w2: (lin(x, w1), lin(x, w2)))
    w = (lambda o, i: (i, o)) if inout else (lambda o, i: (o, i))
    cases = {  # name: (fn, shapes of x and the weights, FLOPs a row)
        "qkv_proj": (one, lambda r: [(r, d), w(q + 2 * kv, d)], 2 * d * (q + 2 * kv)),
        "o_proj": (one, lambda r: [(r, q), w(d, q)], 2 * q * d),
        "gate_up": (two, lambda r: [(r, d), w(f, d), w(f, d)], 2 * d * 2 * f),
        "down_proj": (one, lambda r: [(r, f), w(d, f)], 2 * f * d),
    }
    return {k + "_io" * inout: v for k, v in cases.items()}


def operands(key, shapes):
    return [jax.random.normal(k, s, jnp.bfloat16) * 0.05
            for k, s in zip(jax.random.split(key, len(shapes)), shapes)]


def pallas_best(x, ws, iters):
    """The best of a few tilings of JAX's Mosaic GPU matmul for x @ wᵀ for each w in ws, as
    (ms of all, config, max abs difference from XLA's product)."""
    from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm

    M = hm.MatmulDimension
    best = (float("inf"), None, None)
    wts = [jnp.asarray(w.T) for w in ws]
    ref = [np.asarray(x @ w.T, np.float32) for w in ws]
    for tm, tn, steps, wgd, minor, width in [
            (128, 128, 4, M.N, M.N, 8), (128, 128, 4, M.N, M.M, 8), (128, 128, 4, M.M, M.N, 8),
            (128, 128, 4, M.N, M.N, 16), (128, 64, 5, M.N, M.N, 8), (64, 128, 5, M.N, M.N, 8),
            (128, 128, 3, M.N, M.N, 4), (128, 256, 3, M.M, M.N, 8)]:
        cfg = hm.TuningConfig(tile_m=tm, tile_n=tn, tile_k=64, max_concurrent_steps=steps,
                              grid_minor_dim=minor, grid_tile_width=width, wg_dimension=wgd)
        run = jax.jit(lambda x, *wts, cfg=cfg: [hm.matmul(x, w, None, cfg) for w in wts])
        try:
            ms = timed(run, (x, *wts), iters)
        except Exception as e:  # a tiling that does not fit this shape or shared memory
            print(f"  pallas {cfg.tile_m}x{cfg.tile_n} s{steps} wg={wgd} minor={minor} w{width}: "
                  f"{type(e).__name__}: {str(e).splitlines()[0][:100]}", flush=True)
            continue
        if ms < best[0]:
            err = max(float(np.max(np.abs(np.asarray(o, np.float32) - r)))
                      for o, r in zip(run(x, *wts), ref))
            best = (ms, f"{tm}x{tn} s{steps} wg={wgd} minor={minor} w{width}", err)
    return best


def main_layer(a, rows, report):
    report.note(f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')}")
    report.table("rows", "call", "XLA ms", "TFLOP/s", "Mosaic GPU ms", "TFLOP/s", "its tiling",
                 "max diff", right="rlrrrrlr")
    key = jax.random.key(0)
    for r in rows:
        total = [0.0, 0.0]
        for name, (f, shapes, flops_per_row) in layer_cases().items():
            args = operands(key, shapes(r))
            ms = timed(jax.jit(f), args, a.iters)
            tf = lambda t: flops_per_row * r / t / 1e9  # noqa: E731
            total[0] += ms
            cells = ["", "", "", ""]
            if a.pallas:
                pms, cfg, err = pallas_best(args[0], args[1:], a.iters)
                total[1] += pms
                cells = [f"{pms:.4f}", f"{tf(pms):.1f}", cfg, f"{err:.3g}"]
            report.row(r, name, f"{ms:.4f}", f"{tf(ms):.1f}", *cells)
        mosaic = f"{36 * total[1]:.2f}" if a.pallas else ""
        report.row(r, "36 layers", f"{36 * total[0]:.2f}", "", mosaic, "", "", "")


def main():
    global D, Q, KV, F
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="512,2048,8192")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--layer", action="store_true", help="the model's GEMM calls, one by one")
    ap.add_argument("--pallas", action="store_true", help="with --layer: JAX's Mosaic GPU matmul too")
    ap.add_argument("--sizes", default=f"{D},{Q},{KV},{F}",
                    help="hidden, q heads x 128, kv heads x 128, MLP (default qwen3-4b's)")
    ap.add_argument("--out", default=None, help="a directory for results.json and README.md")
    a = ap.parse_args()
    D, Q, KV, F = (int(x) for x in a.sizes.split(","))
    report = harness.Report(f"A layer's GEMMs at sizes {a.sizes}", __doc__.split("\n\n")[0])
    report.note(f"{jax.devices()[0].device_kind}, jax {jax.__version__}")
    if a.layer:
        main_layer(a, [int(x) for x in a.rows.split(",")], report)
    else:
        report.table("rows", "case", "ms", "TFLOP/s", right="rlrr")
        key = jax.random.key(0)
        for r in (int(x) for x in a.rows.split(",")):
            for name, (f, shapes, flops_per_row) in cases().items():
                args = operands(key, shapes(r))
                ms = timed(jax.jit(f), args, a.iters)
                report.row(r, name, f"{ms:.4f}", f"{flops_per_row * r / ms / 1e9:.1f}")
    report.write(a.out and Path(a.out))


if __name__ == "__main__":
    main()
