"""Roadmap K13: gate/up with silu·mul in the GEMM's epilogue (`kernjax/kernels/mlp_hopper.py`), against
the model's two calls as XLA runs them and against the same GEMM and epilogue run apart.

qwen3-4b's MLP input at `--rows` rows: x [rows, 2560] bf16, gate and up weights [9728, 2560]
(as a checkpoint stores them). Timed, per row count, median of 5 rounds:

- `xla`: the model's calls as kernjax lowers them on a GPU without K13: gate/up (two cuBLASLt
  products) fenced by `optimization_barrier`, then silu·mul fenced (`models.qwen3.silu_mul`);
- `apart`: `mlp_hopper.gemm` writing gate and up, then `mlp_hopper.silu_mul_kernel`: what a cut
  between the two calls runs;
- `fused`: the same GEMM with `silu_mul_f32` in its epilogue: what a program holding both runs.

Prints ms per row count and tiling (`model` is `mlp_hopper.tiling`'s choice), `fused` against
`xla`, the largest difference from `xla`, whether `fused` and `apart` agree bit for bit (K13's
split = whole), whether the GEMM's gate and up are cuBLASLt's bit for bit, and whether `fused` is
XLA's compile of `silu_mul_f32` on cuBLASLt's gate and up.

`--epilogues` (roadmap K15's question: is the epilogue what keeps the fused GEMM at ~715
TFLOP/s in the program, against ~765 for cuBLAS's down_proj?) times each tiling with other
epilogues, patched into `mlp_hopper.gemm` for the run only (the model's kernel is `exact`):
`mul` writes g·u rounded once (the same loads, conversions and stores as `exact`, with no
`exp` and no division: the floor of the epilogue's arithmetic); `bare` writes the bf16 gate
alone, but then nothing reads up's products and their MMAs may go as dead code (2026-12-04 it
read 0.825 ms at 8192 rows, the H200's rated 989 TFLOP/s on a ~1600 MHz machine): not a floor;
`approx`
the same `silu_mul_f32` under Mosaic GPU's `approx_math` (exp as `ex2.approx`); `tanh`
g·(0.5·tanh(g/2) + 0.5)·u under `approx_math` (`tanh.approx`, no division). The variants change
the bits; `fused = apart` compares with `silu_mul_kernel` traced exact, so it says True for
`exact` only. On an H200 (2026-12-04) `mul` read what `exact` read (one reading each; a reading
spreads ~8 %, more than silu's share of the kernel, ~2 % by the profile below), and `tanh` was
slower in the program (`gpu_gate.sh ab`).

A variant that read x's tile into registers once for gate and up (wgmma's A from registers)
ran slower, alone and in the program (2026-12-04; `gemm`'s `regs_a` at `920948a`). Nsight Compute
then found the tensor pipe idle ~12 % of the fused GEMM's cycles at the tiles' edges; a config's
eighth field `X` runs one pipeline across each CTA's tiles (`gemm`'s `across`, four steps), so
that the producer loads the next tile while the warpgroups run the epilogue (roadmap K15; what
the model runs with `kernjax cut --mlp_across`; here `--lowering mlp_across=true` for the `model`
tiling). In that profile the epilogue's samples sit in
conversions (F2F, a quarter-rate instruction: 128 a thread a tile for gate and up) and silu·mul's
`ex2`/`rcp`. On an H200 (2026-12-04, experiments/results/2026-12-04-h200-k15-schedules/), in the
8k program: `across` within 0.2 ms of a pipeline a tile; gate and up rounded by integer
operations (`f7e1922`) 1.2 ms slower, by packed conversions (`cvt.rn.bf16x2.f32`, `6bd45fd`)
within 0.1 ms; the warpgroups on tiles of their own in turns (ping-pong, `cedeaef`) 2.9 ms
slower. Those three left the model; their commits hold them (roadmap K15).

`--lowering KNOB=VALUE,...` (`kernjax.core.lowering.Lowering`, as `kernjax cut`'s options) sets
the knobs `model` reads (`mlp_tile`, `mlp_across`); `--out DIR` writes the table with the run's
record (results.json, README.md).

    python -m experiments.fused_mlp --rows 512,2048,8192
    python -m experiments.fused_mlp --rows 8192 --tiles model --epilogues exact,mul,tanh,exact,mul
    python -m experiments.fused_mlp --rows 8192 --tiles "model;128,128,64,4,N,M,8,X;model"
    python -m experiments.fused_mlp --rows 8192 --tiles model --lowering mlp_tile=64x256
    python -m experiments.fused_mlp --rows 512 --lower   # on a CPU: lower only, run nothing
"""

from __future__ import annotations

import argparse
import contextlib
import functools
from pathlib import Path

import kernjax  # noqa: F401  (its XLA flags, as the model's calls compile)
import jax
import jax.numpy as jnp
import numpy as np

from experiments import harness
from experiments.harness import fenced, timed  # a call's barriers; median ms of rounds
from kernjax.core import lowering
from kernjax.kernels import mlp_hopper
from kernjax.kernels.mlp_hopper import gemm, silu_mul_f32, silu_mul_kernel, tiling

D, F = 2560, 9728  # qwen3-4b: hidden, MLP


def mul_f32(g, u):
    """g·u in float32, rounded once: `silu_mul_f32` without its silu."""
    return (g.astype(jnp.float32) * u.astype(jnp.float32)).astype(g.dtype)


def tanh_silu_mul_f32(g, u):
    """silu(g)·u as g·(0.5·tanh(g/2) + 0.5)·u in float32, rounded once."""
    g32 = g.astype(jnp.float32)
    return (g32 * (0.5 * jnp.tanh(0.5 * g32) + 0.5) * u.astype(jnp.float32)).astype(g.dtype)


# name: (the epilogue's silu·mul, Mosaic GPU's approx_math): the model's own and four to measure
EPILOGUES = {**mlp_hopper.EPILOGUES, "mul": (mul_f32, False), "bare": (lambda g, u: g, False),
             "approx": (silu_mul_f32, True), "tanh": (tanh_silu_mul_f32, True)}


@contextlib.contextmanager
def epilogue(name: str):
    """`mlp_hopper.gemm` (and `silu_mul_kernel`, traced inside) with EPILOGUES[name] for the
    block; `mlp_hopper.epilogue` again after."""
    own = mlp_hopper.epilogue
    mlp_hopper.epilogue = lambda: EPILOGUES[name]
    try:
        yield
    finally:
        mlp_hopper.epilogue = own


def config(text: str) -> tuple[str, dict]:
    """`--tiles`' one config as (its name, `gemm`'s keywords)."""
    tm, tn, tk, steps, *rest = text.split(",")
    wgs, minor, width, pipe = rest + ["M", "N", "1", "T"][len(rest):]
    name = f"{tm}x{tn}x{tk} s{steps} wg={wgs} {minor}{width}" + (" across" if pipe == "X" else "")
    return name, dict(tile_m=int(tm), tile_n=int(tn), tile_k=int(tk), steps=int(steps),
                      wg_n=wgs == "N", minor="MN".index(minor), width=int(width),
                      across=pipe == "X")


def for_h200(fn, *args) -> str:
    """`fn` lowered for an H200 (132 SMs) on any machine, as text."""
    from kernjax.kernels.attention_hopper import on_h200

    return on_h200(fn, *args, num_cores=132).as_text(debug_info=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="512,2048,8192")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--tiles", default="model;128,128,64,4,N,M,8;64,256,64,3,M,N,1",
                    help="tile_m,tile_n,tile_k,steps[,wgs,minor,width,pipe] per config, ';' "
                         "between: a warpgroup's tile; its two warpgroups side by side (wgs N) "
                         "or one above the other (M, the default); tiles ordered by "
                         "plgpu.planar_snake along `minor` (M or N, default N), `width` tiles "
                         "wide (default 1); pipe X: one pipeline across a CTA's tiles "
                         "(mlp_hopper.gemm's `across`), T (the default) one a tile; "
                         "`model`: mlp_hopper.tiling's for the rows")
    ap.add_argument("--epilogues", default="exact",
                    help=f"the fused GEMM's epilogues to time, of {','.join(EPILOGUES)} (above)")
    ap.add_argument("--lower", action="store_true", help="lower the kernels only (a CPU can)")
    ap.add_argument("--lowering", default="", help="kernjax's kernel knobs, KNOB=VALUE,... of "
                    "kernjax.core.lowering.Lowering: what `model` tiles by")
    ap.add_argument("--out", default=None, help="a directory for results.json and README.md")
    a = ap.parse_args()
    for bad in set(a.epilogues.split(",")) - set(EPILOGUES):
        ap.error(f"--epilogues: {bad!r} is not one of {','.join(EPILOGUES)}")
    try:
        knobs = harness.lowering(a.lowering)
    except ValueError as e:
        ap.error(str(e))
    with lowering.use(knobs):
        run(a)


def run(a) -> None:
    from kernjax.models.qwen3 import linear, silu_mul as model_silu_mul

    keys = jax.random.split(jax.random.key(0), 3)
    wg, wu = ((0.02 * jax.random.normal(kk, (F, D), jnp.float32)).astype(jnp.bfloat16)
              for kk in keys[1:])
    gate_up = jax.jit(fenced(lambda x, wg, wu: (linear(x, wg), linear(x, wu))))
    silu = jax.jit(fenced(model_silu_mul))
    xla = lambda x, wg, wu: silu(*gate_up(x, wg, wu))  # noqa: E731
    silu_k = jax.jit(silu_mul_kernel)
    report = harness.Report("gate/up with silu·mul in the GEMM's epilogue, against the model's "
                            "calls and apart", __doc__.split("\n\n")[0])
    report.note(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; qwen3-4b MLP, D={D} "
                f"F={F}; lowering {lowering.current()}")
    report.table("rows", "tiles", "xla ms", "apart ms", "fused ms", "fused / xla",
                 "max diff vs xla", "fused = apart", "gate, up = cuBLASLt's",
                 "fused = XLA's silu·mul of them", right="rlrrrrrlll")
    for rows in map(int, a.rows.split(",")):
        x = jax.random.normal(keys[0], (rows, D), jnp.float32).astype(jnp.bfloat16)
        ref = None if a.lower else np.asarray(xla(x, wg, wu), np.float32)
        gu_xla = None if a.lower else gate_up(x, wg, wu)  # cuBLASLt's, untimed
        own_silu = None if a.lower else jax.jit(fenced(silu_mul_f32))(*gu_xla)
        if not a.lower:
            silu_k(*gu_xla)  # traced here, exact: `apart` keeps the model's epilogue under any
        t_xla = None if a.lower else timed(xla, (x, wg, wu), a.iters)
        for (name, kw), epi in ((("model", tiling(rows)) if c == "model" else config(c), e)
                                for c in a.tiles.split(";") for e in a.epilogues.split(",")):
            name += "" if epi == "exact" else f" {epi}"
            w = (wg, wu)
            fused = jax.jit(functools.partial(gemm, fused=True, **kw))
            apart_gemm = jax.jit(functools.partial(gemm, fused=False, **kw))
            apart = lambda x, *w: silu_k(*apart_gemm(x, *w))  # noqa: E731
            with epilogue(epi):  # each kernel traced with the variant, then the model's
                try:
                    if a.lower:
                        S = jax.ShapeDtypeStruct
                        gu = [S((rows, F), jnp.bfloat16)] * 2
                        texts = [for_h200(f, *args) for f, args in [
                            (fused, (x, *w)), (apart_gemm, (x, *w)), (silu_mul_kernel, gu)]]
                        assert all("mosaic_gpu" in t for t in texts)
                        report.row(rows, name, "lowered for an H200", *[""] * 7)
                        continue
                    out_f, out_a = fused(x, *w)[0], apart(x, *w)
                    t_f, t_a = timed(fused, (x, *w), a.iters), timed(apart, (x, *w), a.iters)
                except Exception as e:  # a tiling that does not fit: say so, go on
                    report.row(rows, name, f"{type(e).__name__}: "
                               f"{(str(e).splitlines() or [''])[0][:120]}", *[""] * 7)
                    continue
            f32 = np.asarray(out_f, np.float32)
            diff = float(np.max(np.abs(f32 - ref)))
            bits = lambda *v: b"".join(np.asarray(t).tobytes() for t in v)  # noqa: E731
            same = bits(out_f) == bits(out_a)
            gemm_same = bits(*apart_gemm(x, *w)) == bits(*gu_xla)
            silu_same = bits(out_f) == bits(own_silu)
            report.row(rows, name, f"{t_xla:.4f}", f"{t_a:.4f}", f"{t_f:.4f}",
                       f"{t_f / t_xla:.3f}", f"{diff:.3g}", same, gemm_same, silu_same)
    report.write(a.out and Path(a.out))


if __name__ == "__main__":
    main()
