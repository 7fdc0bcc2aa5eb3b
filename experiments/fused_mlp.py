"""Roadmap K13's question, before any model change: is gate/up with silu·mul in the GEMM's
epilogue faster than gate/up then silu·mul, and does it give the bits of the two run apart?

qwen3-4b's MLP input at `--rows` rows: x [rows, 2560] bf16, gate and up weights [9728, 2560]
(as a checkpoint stores them). Timed, per row count, median of 5 rounds:

- `xla`: the model's calls as kernjax lowers them on a GPU: gate/up (two products) fenced by
  `optimization_barrier`, then silu·mul fenced (`models.qwen3.silu_mul`);
- `apart`: a GEMM of kernjax's own (Mosaic GPU, two compute warpgroups splitting the rows, a
  third issuing TMA) writing gate and up, then silu·mul as a Mosaic GPU kernel of its own: what a
  cut between the two calls would run;
- `fused`: the same GEMM, silu·mul applied in its epilogue to the accumulators rounded to bf16,
  only the product written: what a program holding both calls would run.

The weights are laid out once (not timed) as [2560, 2 × 9728]: per block of `tile_n / 2`
columns, gate's then up's, so that one warpgroup's accumulator holds both for the same columns.
Prints ms per row count, `fused` against `xla`, the largest difference from `xla`, whether
`fused` and `apart` agree bit for bit (the condition for K13's split = whole), whether the GEMM's
gate and up are cuBLASLt's bit for bit (then a cut could keep cuBLASLt's GEMM), and whether
`fused` is the epilogue's silu·mul compiled by XLA on cuBLASLt's gate and up (then a cut could
keep XLA's kernels altogether).

    python experiments/fused_mlp.py --rows 512,2048,8192
    python experiments/fused_mlp.py --rows 512 --lower   # on a CPU: lower only, run nothing
"""

from __future__ import annotations

import argparse
import functools
import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kernjax  # noqa: E402,F401  (its XLA flags, as the model's calls compile)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from gemms import fenced, timed  # noqa: E402  (a call's barriers; median ms of rounds)

D, F = 2560, 9728  # qwen3-4b: hidden, MLP


def silu_mul(g, u):
    """silu(g)·u of bf16 g and u, in float32, rounded once: the one piece of code both the
    epilogue and the kernel apart run."""
    g, u = g.astype(jnp.float32), u.astype(jnp.float32)
    return (g / (1.0 + jnp.exp(-g)) * u).astype(jnp.bfloat16)


def sms() -> int:
    """The GPU's SMs; an H200's 132 where the kernels are only lowered."""
    return jax.devices()[0].core_count if jax.default_backend() == "gpu" else 132


def interleave(wg, wu, half: int):
    """[out, in] gate and up weights as one [in, 2·out]: per block of `half` columns, gate's,
    then up's."""
    (f, d) = wg.shape
    blocks = lambda w: w.T.reshape(d, f // half, half)  # noqa: E731
    return jnp.stack([blocks(wg), blocks(wu)], axis=2).reshape(d, 2 * f)


def gemm(x, w, *, tile_m: int, tile_n: int, tile_k: int, steps: int, fused: bool,
         wg_n: bool = False, minor: int = 1, width: int = 1):
    """x [M, K] @ w [K, 2F] (`interleave`d by tile_n / 2), each compute warpgroup of a CTA's two
    tile_m rows by tile_n columns, the two side by side (wg_n) or one above the other; the
    CTAs' tiles in `plgpu.planar_snake` order (minor dimension 0 rows, 1 columns, `width` tiles
    wide). fused: silu·mul of each block's gate and up halves, [M, F]; else gate and up, two
    [M, F]."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    m, k = x.shape
    half = tile_n // 2
    cta_m, cta_n = (tile_m, 2 * tile_n) if wg_n else (2 * tile_m, tile_n)
    if m % cta_m or k % tile_k or (2 * F) % cta_n:
        raise ValueError(f"rows {m}, K {k}: tiles {cta_m} x {cta_n} x {tile_k} do not divide")
    swz = plgpu.find_swizzle(tile_k * 16)
    tr = (plgpu.TilingTransform((8, swz // 2)), plgpu.SwizzleTransform(swz))
    epi = 64  # epilogue tiles of 64 x 64
    out_swz = plgpu.find_swizzle(epi * 16)
    out_tr = (plgpu.TilingTransform((8, out_swz // 2)), plgpu.SwizzleTransform(out_swz))
    m_tiles, n_tiles = m // cta_m, 2 * F // cta_n
    outs = 1 if fused else 2

    def body(x_gmem, w_gmem, *out_gmem):
        def pipeline(step, context):
            return plgpu.emit_pipeline_warp_specialized(
                step, grid=(k // tile_k,), memory_registers=40,
                in_specs=[plgpu.BlockSpec((cta_m, tile_k), lambda kk: (0, kk), transforms=tr,
                                          memory_space=plgpu.SMEM),
                          plgpu.BlockSpec((tile_k, cta_n), lambda kk: (kk, 0), transforms=tr,
                                          memory_space=plgpu.SMEM)],
                wg_axis="wg", num_compute_wgs=2, max_concurrent_steps=steps,
                compute_context=context)

        nothing = lambda *_, **__: None  # noqa: E731

        @functools.partial(
            pl.run_scoped,
            allocs=pipeline(nothing, nothing).get_allocations(x_gmem, w_gmem),
            out_smem=plgpu.SMEM((2, 2, epi, epi), jnp.bfloat16, transforms=out_tr),
            collective_axes="wg")
        def scope(allocs, out_smem):
            wg = lax.axis_index("wg")

            @plgpu.nd_loop((m_tiles * n_tiles,), collective_axes="sm")
            def tiles(info):
                (lin,) = info.index
                mi, ni = plgpu.planar_snake(lin, (m_tiles, n_tiles), minor, width)
                rows = pl.ds(mi * cta_m, cta_m)
                wg_rows = pl.ds(0 if wg_n else wg * tile_m, tile_m)
                wg_cols = pl.ds(wg * tile_n if wg_n else 0, tile_n)
                block = ni * (cta_n // tile_n) + (wg if wg_n else 0)  # of gate | up, tile_n wide

                def context(run):
                    @functools.partial(pl.run_scoped,
                                       acc_ref=plgpu.ACC((tile_m, tile_n), jnp.float32))
                    def acc_scope(acc_ref):
                        run(acc_ref)
                        acc = acc_ref[...]
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                        slot = 0
                        for r, c in itertools.product(range(tile_m // epi), range(half // epi)):
                            at = (slice(r * epi, (r + 1) * epi), slice(c * epi, (c + 1) * epi))
                            g = acc[at].astype(jnp.bfloat16)
                            u = acc[at[0], half + c * epi:half + (c + 1) * epi].astype(jnp.bfloat16)
                            parts = [silu_mul(g, u)] if fused else [g, u]
                            for o, part in enumerate(parts):
                                plgpu.wait_smem_to_gmem(1, wait_read_only=True)
                                out_smem[wg, slot] = part
                                plgpu.commit_smem()
                                plgpu.copy_smem_to_gmem(
                                    out_smem.at[wg, slot],
                                    out_gmem[o].at[rows].at[wg_rows].at[at[0]]
                                    .at[:, pl.ds(block * half + c * epi, epi)])
                                slot ^= 1

                def step(_, x_smem, w_smem, acc_ref):
                    plgpu.wgmma(acc_ref, x_smem.at[wg_rows], w_smem.at[:, wg_cols])
                    plgpu.wgmma_wait(0)
                    return acc_ref

                pipeline(step, context)(x_gmem.at[rows, :],
                                        w_gmem.at[:, pl.ds(ni * cta_n, cta_n)],
                                        allocations=allocs)

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    return plgpu.kernel(
        body, out_type=[jax.ShapeDtypeStruct((m, F), jnp.bfloat16)] * outs,
        grid=(sms(),), grid_names=("sm",), num_threads=3, thread_name="wg",
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup))(x, w)


def silu_mul_kernel(g, u, *, block=(64, 128)):
    """`silu_mul` over [M, F] bf16 g and u as a Mosaic GPU kernel of its own: each SM pipelines
    its share of the blocks through shared memory."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    m, n = g.shape
    spec = pl.BlockSpec(block, lambda i, j: (i, j))
    per = -(-(m // block[0]) // sms())  # block rows per SM

    def body(g_gmem, u_gmem, o_gmem):
        sm = lax.axis_index("sm")

        def step(_, g_smem, u_smem, o_smem):
            o_smem[...] = silu_mul(g_smem[...], u_smem[...])

        rows = pl.ds(jnp.minimum(sm * per, m // block[0] - per) * block[0], per * block[0])
        plgpu.emit_pipeline(step, grid=(per, n // block[1]), in_specs=[spec, spec],
                            out_specs=[spec], max_concurrent_steps=2)(
            g_gmem.at[rows], u_gmem.at[rows], o_gmem.at[rows])

    return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((m, n), jnp.bfloat16),
                        grid=(min(sms(), m // block[0]),), grid_names=("sm",))(g, u)


def config(text: str) -> tuple[str, dict]:
    """`--tiles`' one config as (its name, `gemm`'s keywords)."""
    tm, tn, tk, steps, *rest = text.split(",")
    wgs, minor, width = rest + ["M", "N", "1"][len(rest):]
    name = f"{tm}x{tn}x{tk} s{steps} wg={wgs} {minor}{width}"
    return name, dict(tile_m=int(tm), tile_n=int(tn), tile_k=int(tk), steps=int(steps),
                      wg_n=wgs == "N", minor="MN".index(minor), width=int(width))


def for_h200(fn, *args) -> str:
    """`fn` lowered for an H200 (132 SMs) on any machine, as text."""
    from models.attention_hopper import on_h200

    return on_h200(fn, *args, num_cores=132).as_text(debug_info=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="512,2048,8192")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--tiles", default="128,128,64,4,N,M,8;128,128,64,3,M,N,8;64,256,64,3,M,N,1",
                    help="tile_m,tile_n,tile_k,steps[,wgs,minor,width] per config, ';' between: "
                         "a warpgroup's tile; its two warpgroups side by side (wgs N) or one "
                         "above the other (M, the default); tiles ordered by plgpu.planar_snake "
                         "along `minor` (M or N, default N), `width` tiles wide (default 1)")
    ap.add_argument("--lower", action="store_true", help="lower the kernels only (a CPU can)")
    a = ap.parse_args()
    from models.qwen3 import linear, silu_mul as model_silu_mul

    configs = [config(c) for c in a.tiles.split(";")]
    keys = jax.random.split(jax.random.key(0), 3)
    wg, wu = ((0.02 * jax.random.normal(kk, (F, D), jnp.float32)).astype(jnp.bfloat16)
              for kk in keys[1:])
    gate_up = jax.jit(fenced(lambda x, wg, wu: (linear(x, wg), linear(x, wu))))
    silu = jax.jit(fenced(model_silu_mul))
    xla = lambda x, wg, wu: silu(*gate_up(x, wg, wu))  # noqa: E731
    silu_k = jax.jit(silu_mul_kernel)
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; qwen3-4b MLP, D={D} F={F}",
          flush=True)
    print("| rows | tiles | xla ms | apart ms | fused ms | fused / xla | max diff vs xla | "
          "fused = apart | gate, up = cuBLASLt's | fused = XLA's silu·mul of them |\n"
          "|---:|---|---:|---:|---:|---:|---:|---|---|---|", flush=True)
    for rows in map(int, a.rows.split(",")):
        x = jax.random.normal(keys[0], (rows, D), jnp.float32).astype(jnp.bfloat16)
        ref = None if a.lower else np.asarray(xla(x, wg, wu), np.float32)
        gu_xla = None if a.lower else gate_up(x, wg, wu)  # cuBLASLt's, untimed
        own_silu = None if a.lower else jax.jit(fenced(silu_mul))(*gu_xla)
        t_xla = None if a.lower else timed(xla, (x, wg, wu), a.iters)
        for name, kw in configs:
            w = interleave(wg, wu, kw["tile_n"] // 2)
            fused = jax.jit(functools.partial(gemm, fused=True, **kw))
            apart_gemm = jax.jit(functools.partial(gemm, fused=False, **kw))
            apart = lambda x, w: silu_k(*apart_gemm(x, w))  # noqa: E731
            try:
                if a.lower:
                    S = jax.ShapeDtypeStruct
                    gu = [S((rows, F), jnp.bfloat16)] * 2
                    texts = [for_h200(f, *args) for f, args in [
                        (fused, (x, w)), (apart_gemm, (x, w)), (silu_mul_kernel, gu)]]
                    assert all("mosaic_gpu" in t for t in texts)
                    print(f"| {rows} | {name} | lowered for an H200 | | | | | | | |", flush=True)
                    continue
                out_f, out_a = fused(x, w)[0], apart(x, w)
                t_f, t_a = timed(fused, (x, w), a.iters), timed(apart, (x, w), a.iters)
            except Exception as e:  # a tiling that does not fit: say so, go on
                print(f"| {rows} | {name} | {type(e).__name__}: {(str(e).splitlines() or [""])[0][:120]} "
                      "| | | | | | | |", flush=True)
                continue
            f32 = np.asarray(out_f, np.float32)
            diff = float(np.max(np.abs(f32 - ref)))
            bits = lambda *v: b"".join(np.asarray(t).tobytes() for t in v)  # noqa: E731
            same = bits(out_f) == bits(out_a)
            gemm_same = bits(*apart_gemm(x, w)) == bits(*gu_xla)
            silu_same = bits(out_f) == bits(own_silu)
            print(f"| {rows} | {name} | {t_xla:.4f} | {t_a:.4f} | {t_f:.4f} | {t_f / t_xla:.3f} | "
                  f"{diff:.3g} | {same} | {gemm_same} | {silu_same} |", flush=True)


if __name__ == "__main__":
    main()
