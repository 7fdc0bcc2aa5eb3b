"""docs/bitwise.md's "what is left" lever of ~1 ms: the residual add and the next RMSNorm
(`models.qwen3.add_norm`, the calls `post_attn_norm` and `next_input_norm`) as one kernel.

XLA compiles the call into two kernels: the add, writing the residual, then the norm reading it
back: 210 MB a layer at 8192 rows of qwen3-4b where one kernel moves 168 MB. Timed here, median
of rounds, per row count at D = 2560, bf16:

- `xla`: the call as kernjax lowers it on a GPU (fenced by `optimization_barrier`);
- `triton BMxW`: one Pallas Triton kernel, BM rows per program (a row's 2560 columns padded to
  4096 lanes and masked), W warps: the sum rounded to bf16 (as XLA rounds it), its square summed
  in float32, the norm as `models.qwen3.rms` computes it.

Prints ms, the kernel against `xla`, whether its residual is XLA's bit for bit (it must be: one
rounded add), and the largest difference of its normed rows from XLA's (the sum of squares may be
added in another order).

`--out DIR` writes the table with the run's record (results.json, README.md).

    python -m experiments.add_norm --rows 512,2048,8192
    python -m experiments.add_norm --rows 64 --interpret   # on a CPU: Pallas interpret mode
"""

from __future__ import annotations

import argparse
import functools
from pathlib import Path

import kernjax  # noqa: F401  (its XLA flags, as the model's calls compile)
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from experiments import harness
from experiments.harness import fenced, timed  # a call's barriers; median ms of rounds

D, EPS = 2560, 1e-6  # qwen3-4b


def add_norm(y, h, w, *, eps: float = EPS, block_rows: int = 4, warps: int = 4,
             interpret: bool = False):
    """(rms(h + y) · w, h + y) of [rows, d] bf16 y and h in one Pallas Triton kernel."""
    import jax.experimental.pallas as pl
    from jax.experimental.pallas import triton as plgpu

    rows, d = h.shape
    lanes = 1 << (d - 1).bit_length()

    def kernel(y_ref, h_ref, w_ref, n_ref, s_ref):
        r = pl.program_id(0) * block_rows + jnp.arange(block_rows)
        c = jnp.arange(lanes)
        ok = (r < rows)[:, None] & (c < d)[None, :]
        at = r[:, None] * d + c[None, :]
        f32 = lambda ref: plgpu.load(ref.at[at], mask=ok, other=0).astype(jnp.float32)  # noqa: E731
        s = (f32(h_ref) + f32(y_ref)).astype(h.dtype)
        x = s.astype(jnp.float32)
        inv = lax.rsqrt(jnp.sum(x * x, axis=1, keepdims=True) / d + eps)
        wt = plgpu.load(w_ref.at[c], mask=c < d, other=0)
        plgpu.store(n_ref.at[at], wt[None, :] * (x * inv).astype(h.dtype), mask=ok)
        plgpu.store(s_ref.at[at], s, mask=ok)

    n, s = pl.pallas_call(
        kernel, grid=(-(-rows // block_rows),),
        out_shape=[jax.ShapeDtypeStruct((rows * d,), h.dtype)] * 2,
        compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=1),
        interpret=interpret, name="add_norm")(y.reshape(-1), h.reshape(-1), w)
    return n.reshape(rows, d), s.reshape(rows, d)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="512,2048,8192")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--configs", default="1x4;2x4;4x4;4x8;8x8",
                    help="block rows x warps per kernel, ';' between")
    ap.add_argument("--interpret", action="store_true", help="Pallas interpret mode (a CPU)")
    ap.add_argument("--out", default=None, help="a directory for results.json and README.md")
    a = ap.parse_args()
    from kernjax.models.qwen3 import add_norm as model_add_norm

    xla = jax.jit(fenced(functools.partial(model_add_norm, eps=EPS)))
    k = jax.random.split(jax.random.key(0), 3)
    w = (1 + 0.1 * jax.random.normal(k[2], (D,), jnp.float32)).astype(jnp.bfloat16)
    report = harness.Report("The residual add and the next RMSNorm as one kernel, against XLA's",
                            __doc__.split("\n\n")[0])
    report.note(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; add + RMSNorm, D={D}")
    report.table("rows", "kernel", "ms", "/ xla", "residual = xla's", "max diff of normed vs xla",
                 right="rlrrlr")
    for rows in map(int, a.rows.split(",")):
        y, h = (jax.random.normal(kk, (rows, D), jnp.float32).astype(jnp.bfloat16) for kk in k[:2])
        ref_n, ref_s = xla(y, h, w)
        t_xla = None if a.interpret else timed(xla, (y, h, w), a.iters)
        if t_xla is not None:
            report.row(rows, "xla", f"{t_xla:.4f}", "1.000", "", "")
        for cfg in a.configs.split(";"):
            bm, warps = map(int, cfg.split("x"))
            fn = jax.jit(functools.partial(add_norm, block_rows=bm, warps=warps,
                                           interpret=a.interpret))
            try:
                n, s = fn(y, h, w)
                ms = None if a.interpret else timed(fn, (y, h, w), a.iters)
            except Exception as e:  # a config Triton refuses: say so, go on
                report.row(rows, f"triton {cfg}", f"{type(e).__name__}: "
                           f"{(str(e).splitlines() or [''])[0][:120]}", "", "", "")
                continue
            same = np.asarray(s).tobytes() == np.asarray(ref_s).tobytes()
            diff = float(np.max(np.abs(np.asarray(n, np.float32) - np.asarray(ref_n, np.float32))))
            t = ["interpreted", ""] if ms is None else [f"{ms:.4f}", f"{ms / t_xla:.3f}"]
            report.row(rows, f"triton {cfg}", *t, same, f"{diff:.3g}")
    report.write(a.out and Path(a.out))


if __name__ == "__main__":
    main()
