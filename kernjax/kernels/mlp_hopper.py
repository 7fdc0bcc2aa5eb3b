"""The dense MLP's `gate_up` and `silu_mul` calls on Hopper: one GEMM of kernjax's own (Mosaic
GPU) whose epilogue applies silu·mul, where no cut falls between the two (roadmap K13).

XLA runs `gate_up` as two cuBLASLt GEMMs writing gate and up (318 MB a layer of qwen3-4b at
8192 rows), then `silu_mul` as a fusion reading them back. Here one kernel computes both
products per tile, rounds each to bf16 as the GEMM apart would, applies `silu_mul_f32` in its
epilogue and writes only the product: 0.117 ms a layer less at 8192 rows on an H200, 4.2 ms over
qwen3-4b's 36 layers (`experiments/fused_mlp.py`, 2026-12-03).

Split = whole: where a cut falls between the two calls, `gate_up` runs the same GEMM writing gate
and up rounded to bf16 (`gate_up`), and `silu_mul` the same `silu_mul_f32` as a kernel of its own
(`silu_mul`): the same code on the same bf16 values, so the same bits (fused and apart agree
bit for bit at 512, 2048 and 8192 rows, `experiments/fused_mlp.py`). The GEMM accumulates each
output over K in one order, 64 columns of K at a time in wgmma's k16 steps; cuBLASLt's gate and
up came out the same bits, but nothing here relies on that.

Weights are read as a checkpoint stores them ([out, in]: B is transposed in shared memory), so
the program's inputs and its jaxpr (and so the cut id) do not change. Shapes the kernel does not
tile (`fits`) keep XLA's lowering, in the whole program and in every stage alike. The CPU never
runs this: there the calls run as they are.
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
from jax import lax

from kernjax.core import lowering

EPI = 64  # epilogue tiles of 64 x 64


def sm_count() -> int:
    """The GPU's SMs, one CTA each; an H200's 132 where the kernels are only lowered."""
    return jax.devices()[0].core_count if jax.default_backend() == "gpu" else 132


def silu_mul_f32(g, u):
    """silu(g)·u of bf16 g and u, in float32, rounded once: the one piece of code the fused
    epilogue and the kernel apart both run."""
    g32, u32 = g.astype(jnp.float32), u.astype(jnp.float32)
    return (g32 / (1.0 + jnp.exp(-g32)) * u32).astype(g.dtype)


# name: (silu·mul, Mosaic GPU's approx_math) of the kernels' epilogue; experiments/fused_mlp.py
# times others in its place (roadmap K15, 2026-12-04: a tanh form slower in the program)
EPILOGUES = {"exact": (silu_mul_f32, False)}


def epilogue() -> tuple:
    """(silu·mul, approx_math) that the fused GEMM's epilogue and `silu_mul_kernel` both run."""
    return EPILOGUES["exact"]


def tiling(rows: int) -> dict:
    """The tiles for `rows` rows, measured on an H200 (`experiments/fused_mlp.py`): a
    warpgroup's tile, its two side by side (`wg_n`) or one above the other, the CTAs' order.
    Above 2048 rows three pipeline steps: the 8k prefill in 126.5 ms against 128.4 with four
    (experiments/results/2026-12-03-h200-mlp-steps/); alone, tilings this close differ by less
    than the kernel's 8 % spread within a call (experiments/results/2026-12-03-h200-726eeb0/).
    The lowering table's `mlp_across` (`across_tiles`): four steps and one pipeline across a
    CTA's tiles; its `mlp_tile="64x256"` (`wide_tiles`): above 2048 rows, 64 x 128 wgmmas."""
    small = dict(tile_m=64, tile_n=256, tile_k=64, steps=3, wg_n=False, minor=1, width=1)
    if rows <= 2048:
        t = small
    elif wide_tiles():  # the small rows' tiles in the large rows' order
        t = dict(small, minor=0, width=8)
    else:
        t = dict(tile_m=128, tile_n=128, tile_k=64, steps=3, wg_n=True, minor=0, width=8)
    if across_tiles():
        t.update(steps=4, across=True)
    return t


def across_tiles() -> bool:
    """The lowering table's `mlp_across` (`kernjax cut --mlp_across`): the GEMM's pipeline across each CTA's tiles with four steps (`gemm`'s
    `across`; roadmap K15), an A/B knob, off by default. It changes no bit measured; the cut id
    holds it all the same."""
    return lowering.current().mlp_across


def wide_tiles() -> bool:
    """The lowering table's `mlp_tile="64x256"` (`kernjax cut --mlp_tile 64x256`): above 2048 rows each compute warpgroup takes 64 rows by 128
    columns of gate and of up, the two one above the other (64 x 128 wgmmas, where the default,
    `128x128`, has 128 rows by 64 columns side by side and 64 x 64 wgmmas), roadmap K15. The same
    CTA tile (128 x 128) and stages; a quarter less shared-memory traffic (Nsight Compute at
    8192 rows: 67 % busy against 89 %, 1.9 % fewer cycles at the profiler's clock, 2026-12-04);
    in the 8k program 126.40 ms against 126.32, three alternated rounds (2026-12-04). An A/B
    knob, default 128x128; every tiling measured gives cuBLASLt's bits for gate and up; the cut
    id holds it all the same."""
    return lowering.current().mlp_tile == "64x256"


def _cta(t: dict) -> tuple[int, int]:
    """A CTA's rows and output columns (of gate·up) under tiling `t`."""
    half = t["tile_n"] // 2
    return (t["tile_m"], 2 * half) if t["wg_n"] else (2 * t["tile_m"], half)


def fits(x, wg, wu) -> bool:
    """Whether the kernel tiles these operands: x [rows, K], gate and up [F, K], all bf16 and
    2-d, rows, F and K whole multiples of the tiles. Every lowering here asks the same."""
    if not (x.ndim == wg.ndim == wu.ndim == 2 and wg.shape == wu.shape
            and x.dtype == wg.dtype == wu.dtype == jnp.bfloat16 and x.shape[1] == wg.shape[1]):
        return False
    t = tiling(x.shape[0])
    cta_m, cta_n = _cta(t)
    return (x.shape[0] % cta_m == 0 and wg.shape[0] % cta_n == 0
            and x.shape[1] % t["tile_k"] == 0 and (t["tile_n"] // 2) % EPI == 0)


def gemm(x, wg, wu, *, fused: bool, tile_m: int, tile_n: int, tile_k: int, steps: int,
         wg_n: bool, minor: int, width: int, across: bool = False, ctas: int | None = None,
         interpret=None):
    """x [M, K] times gate and up [F, K] (as stored) on Hopper. Each compute warpgroup of a CTA
    takes tile_m rows by tile_n / 2 columns of gate and the same of up; the CTA's two side by
    side (wg_n) or one above the other; tiles in `plgpu.planar_snake` order (minor 0 rows, 1
    columns, `width` tiles wide). fused: silu_mul_f32 of gate and up rounded to bf16, [M, F];
    else gate and up rounded to bf16, two [M, F].

    across (roadmap K15): one pipeline over all of a CTA's tiles (Mosaic GPU's pipeline of
    pipelines: the producer loads the next tile's first steps while the warpgroups run this
    tile's epilogue), where the steps over K are a multiple of `steps` and every SM has two tiles
    or more; else a pipeline a tile. The same MMAs in the same order and the same epilogue: the
    same bits. ctas: CTAs to run (default one an SM); interpret: Mosaic GPU's interpreter (both
    for CPU tests)."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    m, k = x.shape
    f = wg.shape[0]
    half = tile_n // 2
    cta_m, cta_n = _cta(dict(tile_m=tile_m, tile_n=tile_n, wg_n=wg_n))
    if m % cta_m or k % tile_k or f % cta_n or half % EPI:
        raise ValueError(f"rows {m}, K {k}, F {f}: tiles {cta_m} x {cta_n} x {tile_k} do not divide")
    swz = plgpu.find_swizzle(tile_k * 16)
    tr = (plgpu.TilingTransform((8, swz // 2)), plgpu.SwizzleTransform(swz))
    out_swz = plgpu.find_swizzle(EPI * 16)
    out_tr = (plgpu.TilingTransform((8, out_swz // 2)), plgpu.SwizzleTransform(out_swz))
    m_tiles, n_tiles = m // cta_m, f // cta_n
    outs = 1 if fused else 2
    silu_mul, approx = epilogue()
    ctas = ctas or sm_count()
    across = across and (k // tile_k) % steps == 0 and m_tiles * n_tiles >= 2 * ctas

    def body(x_gmem, g_gmem, u_gmem, *out_gmem):
        def pipeline(step, context, state=None):
            spec = lambda shape: plgpu.BlockSpec(  # noqa: E731
                shape, lambda kk: (0, kk), transforms=tr, memory_space=plgpu.SMEM)
            return plgpu.emit_pipeline_warp_specialized(
                step, grid=(k // tile_k,), memory_registers=40,
                in_specs=[spec((cta_m, tile_k)), spec((cta_n, tile_k)), spec((cta_n, tile_k))],
                wg_axis="wg", num_compute_wgs=2, max_concurrent_steps=steps,
                compute_context=context, pipeline_state=state)

        nothing = lambda *_, **__: None  # noqa: E731

        @functools.partial(
            pl.run_scoped,
            allocs=pipeline(nothing, nothing).get_allocations(x_gmem, g_gmem, u_gmem),
            out_smem=plgpu.SMEM((2, 2, EPI, EPI), x.dtype, transforms=out_tr),
            collective_axes="wg")
        def scope(allocs, out_smem):
            wg = lax.axis_index("wg")

            @plgpu.nd_loop((m_tiles * n_tiles,), collective_axes="sm")
            def tiles(info):
                (lin,) = info.index
                mi, ni = plgpu.planar_snake(lin, (m_tiles, n_tiles), minor, width)
                rows, cols = pl.ds(mi * cta_m, cta_m), pl.ds(ni * cta_n, cta_n)
                wg_rows = pl.ds(0 if wg_n else wg * tile_m, tile_m)
                wg_cols = pl.ds(wg * half if wg_n else 0, half)

                def context(run):
                    @functools.partial(pl.run_scoped,
                                       g_acc=plgpu.ACC((tile_m, half), jnp.float32),
                                       u_acc=plgpu.ACC((tile_m, half), jnp.float32))
                    def acc_scope(g_acc, u_acc):
                        run((g_acc, u_acc))
                        g_all, u_all = g_acc[...], u_acc[...]
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                        slot = 0
                        for r, c in itertools.product(range(tile_m // EPI), range(half // EPI)):
                            at = (slice(r * EPI, (r + 1) * EPI), slice(c * EPI, (c + 1) * EPI))
                            g, u = g_all[at].astype(x.dtype), u_all[at].astype(x.dtype)
                            for o, part in enumerate([silu_mul(g, u)] if fused else [g, u]):
                                plgpu.wait_smem_to_gmem(1, wait_read_only=True)
                                out_smem[wg, slot] = part
                                plgpu.commit_smem()
                                plgpu.copy_smem_to_gmem(
                                    out_smem.at[wg, slot],
                                    out_gmem[o].at[rows].at[wg_rows].at[at[0]]
                                    .at[:, pl.ds(ni * cta_n + (wg * half if wg_n else 0)
                                                 + c * EPI, EPI)])
                                slot ^= 1

                def step(_, x_smem, g_smem, u_smem, accs):
                    a = x_smem.at[wg_rows]
                    plgpu.wgmma(accs[0], a, g_smem.at[wg_cols].transpose((1, 0)))
                    plgpu.wgmma(accs[1], a, u_smem.at[wg_cols].transpose((1, 0)))
                    plgpu.wgmma_wait(0)
                    return accs

                state = None
                if across:  # the first of the CTA's tiles starts the pipeline, its last stops it
                    p = plgpu.PipelinePipeline
                    state = jnp.where(info.local_index == 0, int(p.START),
                                      jnp.where(info.local_index == info.num_local_steps - 1,
                                                int(p.STOP), int(p.STEADY)))
                pipeline(step, context, state)(x_gmem.at[rows, :], g_gmem.at[cols, :],
                                               u_gmem.at[cols, :], allocations=allocs)

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    return plgpu.kernel(
        body, out_type=[jax.ShapeDtypeStruct((m, f), x.dtype)] * outs,
        grid=(ctas,), grid_names=("sm",), num_threads=3, thread_name="wg",
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup, approx_math=approx),
        **({"interpret": interpret} if interpret is not None else {}))(x, wg, wu)


def silu_mul_kernel(g, u, *, block=(64, 128)):
    """`silu_mul_f32` (the `epilogue()` the fused GEMM runs) over [M, F] bf16 g and u as a
    Mosaic GPU kernel of its own: each SM pipelines its share of the blocks through shared memory."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    m, n = g.shape
    silu_mul, approx = epilogue()
    spec = pl.BlockSpec(block, lambda i, j: (i, j))
    grid = min(sm_count(), m // block[0])
    per = -(-(m // block[0]) // grid)  # block rows per SM

    def body(g_gmem, u_gmem, o_gmem):
        sm = lax.axis_index("sm")

        def step(_, g_smem, u_smem, o_smem):
            o_smem[...] = silu_mul(g_smem[...], u_smem[...])

        rows = pl.ds(jnp.minimum(sm * per, m // block[0] - per) * block[0], per * block[0])
        plgpu.emit_pipeline(step, grid=(per, n // block[1]), in_specs=[spec, spec],
                            out_specs=[spec], max_concurrent_steps=2)(
            g_gmem.at[rows], u_gmem.at[rows], o_gmem.at[rows])

    params = {"compiler_params": plgpu.CompilerParams(approx_math=True)} if approx else {}
    return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((m, n), g.dtype),
                        grid=(grid,), grid_names=("sm",), **params)(g, u)


# The calls' GPU lowerings (kernjax.core.trace.on_gpu): None keeps XLA's, for shapes that do not fit.
def fused_call(x, wg, wu):
    """`gate_up` then `silu_mul`, one kernel: silu(gate)·up."""
    if not fits(x, wg, wu):
        return None
    return gemm(x, wg, wu, fused=True, **tiling(x.shape[0]))[0]


def gate_up_call(x, wg, wu):
    """`gate_up` alone (a cut after it): the fused kernel's GEMM, gate and up written."""
    if not fits(x, wg, wu):
        return None
    return tuple(gemm(x, wg, wu, fused=False, **tiling(x.shape[0])))


def silu_mul_call(g, u):
    """`silu_mul` alone (a cut before it): the fused kernel's epilogue as a kernel, for the
    shapes whose `gate_up` the GEMM runs (`fits` on the operands gate_up would have had)."""
    x = jax.ShapeDtypeStruct((g.shape[0], 64), g.dtype) if g.ndim == 2 else g
    w = jax.ShapeDtypeStruct((g.shape[-1], 64), g.dtype)
    if g.ndim != 2 or g.shape != u.shape or g.dtype != u.dtype or not fits(x, w, w):
        return None
    return silu_mul_kernel(g, u)
