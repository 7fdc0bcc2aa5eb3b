"""Chunked-prefill attention over a paged KV state: a Mosaic GPU kernel for Hopper (H200).

The route for f16 and head_dim 64 since 2026-12-01; bf16 with head_dim 128 runs FlashAttention-3
(`kernjax/kernels/attention_fa3.py`), 1.2-1.4x this kernel on an H200 (`docs/bitwise.md`).

The same function as `kernjax/kernels/attention_pallas.py` (the Triton kernel, kept for float32,
for head dims other than 64 and 128 and for f16 on pages of 128 rows), shaped like
FlashAttention-3: tensor-core products issued asynchronously (wgmma), keys and values brought
in by the TMA, one warpgroup that only moves memory and two that compute, taking turns on the
tensor cores (handed over one way at hardware named barriers, as FlashAttention-3's scheduler
barriers do).

Work split. A CTA takes `2 * block_q` consecutive rows of one sequence (a *tile*) for one query
head; compute warpgroup w owns rows `w * block_q ..` of the tile. Tiles are found by walking
`cu_seqlens` (a static loop of scalar loads), taken from the end so the longest start first; the
padding rows past `cu_seqlens[seqs]` form one more segment whose tiles write zeros. The grid has
`rows // (2 * block_q) + seqs + 1` tile slots, enough for any `cu_seqlens`; unused ones exit.

Keys. Step t covers keys `t * block_kv ..` of the sequence, aligned to key 0, in increasing
order, up to the block holding the tile's last position. The memory warpgroup copies each of
the block's pages (16 keys) from `kv[page, :, 0|1, kv_head]` to its rows of a shared-memory slot
(one TMA per page, all arriving on the slot's barrier) and refills a slot once both compute
warpgroups have released it. Page ids past the page table are clamped; the keys they bring are
past every row's position.

Exactness. A row's online softmax (float32, base 2) sees the blocks 0 .. its own last in order; a
block where every key is visible takes the unmasked path, the rest mask score by score (the same
bits either way for a visible key). A block wholly past a row's position is an exact no-op for it
(scores -inf: the maximum stays, alpha = 1, p = 0), and its warpgroup may run a few such blocks
when the other rows of its tile reach further: the result of a row depends only on its sequence
and its position, never on what else the item holds or where in a tile the row falls. For p = 0
to add exactly nothing, the values it meets must be finite: on its last step the CTA zeroes the
rows of the value block past its last position (a page's unused slots, pages past the context),
so stale pages may hold anything, NaN included. No split-K, no atomics: the same bits run after
run.

GQA: a CTA takes one query head h and its memory warpgroup copies kv head h // G (G = H / KV),
so any G works (kv_heads dividing heads), 3 and 5 included (`tests/test_gqa.py`).

Requirements: bf16 or f16; D 64 or 128 (with block_kv 128 and 2 steps, D 192 or 256 would need
more than the 227 KiB of shared memory a CTA may have); the rows of one sequence at
consecutive positions (as every prefill chunk has them): row `cu_seqlens[s] + i` at
`positions[cu_seqlens[s]] + i`.

Without a GPU: it lowers (Mosaic GPU's layout inference included) under an abstract H200 mesh,
as the Triton kernel does (`attention_pallas.py`), and runs in Mosaic GPU's interpreter (`interpret`;
`tests/test_attention_hopper.py`).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu

PAGE = 16
# The experimental options by name (`experiments/attention.py --kernel hopper-<name>`, the GPU
# tests under KERNJAX_TRY_VARIANTS, `gpu_gate.sh variant`); `chunk_attention`'s doc says each.
VARIANTS = {"mbarrier": dict(named=False), "overlap": dict(overlap=True),
            "overlap-turns": dict(overlap=True, turns=True),
            "overlap-named": dict(overlap=True, turns=True, named=True),
            "fma-exp": dict(fma_exp=32), "fma-exp-16": dict(fma_exp=16)}


def _exp2_fma(x):
    """2^x for x <= 0 (-inf gives 2^-125) on the FMA and integer pipes, not MUFU's: round(x)
    by the 1.5 * 2^23 trick (its low mantissa bits), a degree-3 polynomial for 2^f on
    [-0.5, 0.5] (within 1.02e-4 relative; P is rounded to bf16 after), the exponent added in the
    bits. Experimental (`fma_exp`); the barrier lowers to an empty asm in Mosaic GPU."""
    x = jnp.maximum(x, -125.0)
    j = lax.optimization_barrier(x + 12582912.0)  # else (x + M) - M folds to x
    f = x - (j - 12582912.0)
    p = 1.0 + f * (0.69328292 + f * (0.24221076 + f * 0.05500875))
    e = lax.shift_left(lax.bitcast_convert_type(j, jnp.int32) - 0x4B400000, 23)
    return lax.bitcast_convert_type(lax.bitcast_convert_type(p, jnp.int32) + e, jnp.float32)


def _unnumbered_kernel_modules() -> None:
    """Mosaic GPU (jax 0.11.2) names each kernel module it lowers `<kernel>_<n>`, n counting the
    modules this process has lowered (`mosaic_gpu.dump_basename`, for its dump files), and the
    name goes into the serialized kernel and so into JAX's persistent compilation cache key: the
    same program lowered after a different number of kernels missed the cache (an 8 s compile on
    the H200 where a load takes well under one). Before the module is serialized the name loses
    its number (it only names dump files: kernels that dump would share them)."""
    import re

    from jax._src.lib.mlir import ir
    from jax.experimental.mosaic.gpu import core

    serde = getattr(core, "_run_serde_pass", None)
    if serde is None or getattr(serde, "_kernjax", False):
        return

    def run_serde_pass(module, *args, **kwargs):
        attrs = module.operation.attributes
        if "mosaic_gpu.dump_basename" in attrs:
            name = ir.StringAttr(attrs["mosaic_gpu.dump_basename"]).value
            attrs["mosaic_gpu.dump_basename"] = ir.StringAttr.get(
                re.sub(r"_\d+$", "", name), module.context)
        return serde(module, *args, **kwargs)

    run_serde_pass._kernjax = True
    core._run_serde_pass = run_serde_pass


_unnumbered_kernel_modules()


def supports(q_dtype, head_dim: int, page: int = PAGE) -> bool:
    """Whether this kernel takes the dtype, head_dim and page (rows a page: 16); any GQA ratio
    (a CTA reads kv head h // G for its query head h). `attention.route` routes the rest."""
    return jnp.dtype(q_dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) and \
        head_dim in (64, 128) and page == PAGE


def _named_barrier(op: str, wg, mine: bool):
    """`bar.<op> <id>, 256` on compute warpgroup `wg`'s own named barrier (id 14 + wg) or on the
    other's: hardware barriers of both compute warpgroups (256 threads), not shared-memory ones
    (Mosaic GPU's own warpgroup barriers take ids 1-3). A warpgroup waits (`sync`) at its own for
    the turn the other hands it (`arrive`: 128 arrivals, and on without waiting)."""
    for w in (0, 1):
        @pl.when(wg == w)
        @plgpu.inline_mgpu()
        def bar_op(_, w=w):
            mgpu_utils.inline_ptx(f"bar.{op} {14 + (w if mine else 1 - w)}, 256;",
                                  has_side_effects=True, convergent=True)


def _segment(cu_ref, j, *, seqs, rows, tile):
    """(segment, first row, end row) of tile slot j counted from the end of the list of every
    segment's tiles; segment `seqs` is the padding, `seqs + 1` means no tile."""
    s, r0, end, first = (jnp.int32(v) for v in (seqs + 1, 0, 0, 0))
    for seg in range(seqs + 1):
        a = cu_ref[seg]
        b = cu_ref[seg + 1] if seg < seqs else jnp.int32(rows)
        n = lax.div(b - a + (tile - 1), jnp.int32(tile))
        hit = (j >= first) & (j < first + n)
        s = lax.select(hit, jnp.int32(seg), s)
        r0 = lax.select(hit, a + (j - first) * tile, r0)
        end = lax.select(hit, b, end)
        first = first + n
    return s, r0, end


def _store_rows(src, dst, head, start, n, block_q):
    """Copies rows 0 .. n-1 of `src` (SMEM) to rows start .. start+n-1 of `dst[:, head]` (GMEM),
    exactly: one TMA per set bit of n, since a TMA's row count is static."""
    off = 0
    size = block_q
    while size:
        bit = n & size

        @pl.when(bit != 0)
        def _copy(off=off, size=size):
            plgpu.copy_smem_to_gmem(src.at[pl.ds(off, size)], dst.at[pl.ds(start + off, size), head])

        off = off + bit
        size //= 2
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _kernel(cu_ref, pos_ref, pt_ref, q_ref, kv_ref, o_ref, scoped, *, seqs, rows, width, pages,
            groups, slots, scale, block_q, block_kv, steps, interpret, overlap, turns, named,
            fma_exp=0):
    (qo2, out2, k_smem, v_smem), (k_ready, v_ready, q_ready), (k_free, v_free), turn = scoped[:4]
    dtype = q_ref.dtype
    d = q_ref.shape[-1]
    head = lax.axis_index("heads")
    wg = lax.axis_index("wg")
    j = jnp.int32(slots - 1) - lax.axis_index("tiles")
    s, r0, end = _segment(cu_ref, j, seqs=seqs, rows=rows, tile=2 * block_q)
    n_cta = jnp.minimum(end - r0, jnp.int32(2 * block_q))
    per_block = block_kv // PAGE

    def take_turn():  # both compute warpgroups meet
        plgpu.barrier_arrive(turn)
        plgpu.barrier_wait(turn)

    def await_turn():  # before issuing products: named, wait for this warpgroup's turn
        _named_barrier("sync", wg, mine=True) if named else take_turn()

    def pass_turn():  # after issuing them: named, hand the turn over and go on
        _named_barrier("arrive", wg, mine=False) if named else take_turn()

    def own_rows():
        rw = r0 + wg * block_q
        return rw, jnp.clip(end - rw, 0, block_q)

    @pl.when(s == seqs)
    def _padding():
        @pl.when(wg < 2)
        def _zeros():
            out = out2.at[wg]
            rw, n = own_rows()
            out[...] = plgpu.layout_cast(jnp.zeros((block_q, d), dtype), plgpu.Layout.WGMMA)
            plgpu.commit_smem()
            _store_rows(out, o_ref, head, rw, n, block_q)

    @pl.when(s < seqs)
    def _attend():
        pos0 = pos_ref[r0]
        hi = pos0 + n_cta - 1  # the tile's last position
        cta_steps = lax.div(hi, jnp.int32(block_kv)) + 1

        @pl.when(wg < 2)
        def _compute():
            plgpu.set_max_registers(232, action="increase")
            qo = qo2.at[wg]
            rw, n = own_rows()
            pw = pos0 + wg * block_q  # position of the warpgroup's first row
            kv_steps = lax.select(n > 0, lax.div(pw + n - 1, jnp.int32(block_kv)) + 1,
                                  jnp.int32(0))
            n_full = jnp.minimum(lax.div(pw + 1, jnp.int32(block_kv)), kv_steps)
            c = scale * math.log2(math.e)

            @pl.when(n > 0)
            def _load_q():
                # Through the untiled buffer: a TMA into a tiled one needs a row start that is
                # a multiple of 8, and a sequence's rows start anywhere.
                staged = out2.at[wg]
                plgpu.copy_gmem_to_smem(q_ref.at[pl.ds(rw, block_q), head], staged,
                                        q_ready.at[wg])
                plgpu.barrier_wait(q_ready.at[wg])
                qo[...] = plgpu.load(staged, layout=plgpu.Layout.WGMMA)
                plgpu.commit_smem()

            m = plgpu.layout_cast(jnp.full((block_q,), -jnp.inf, jnp.float32),
                                  plgpu.Layout.WGMMA.reduce(1))
            l = plgpu.layout_cast(jnp.zeros((block_q,), jnp.float32),
                                  plgpu.Layout.WGMMA.reduce(1))
            acc = plgpu.layout_cast(jnp.zeros((block_q, d), jnp.float32), plgpu.Layout.WGMMA)

            def release(t):
                """A step this warpgroup's rows do not need: its keys and values waited for
                (every phase of a barrier waited on is observed: the interpreter checks it)
                and released."""
                slot = lax.rem(t, jnp.int32(steps))
                plgpu.barrier_wait(k_ready.at[slot])
                plgpu.barrier_wait(v_ready.at[slot])
                plgpu.barrier_arrive(k_free.at[slot])
                plgpu.barrier_arrive(v_free.at[slot])

            def zero_values_past_the_tile(t, slot):
                """On the CTA's last step, the value rows past its last position: a page's
                unused slots may hold anything, and 0 * NaN is not 0."""
                @pl.when((t == cta_steps - 1) & (lax.rem(hi + 1, jnp.int32(block_kv)) != 0))
                def _zero():
                    for half in range(block_kv // 64):
                        ref = v_smem.at[slot, pl.ds(half * 64, 64)]
                        ki = plgpu.broadcasted_iota(jnp.int32, (64, d), 0,
                                                    layout=plgpu.Layout.WGMMA)
                        v = plgpu.load(ref, layout=plgpu.Layout.WGMMA)
                        ref[...] = jnp.where(ki + (t * block_kv + half * 64) <= hi, v,
                                             jnp.zeros_like(v))
                    plgpu.commit_smem()

            def softmax(qk, t, m, l, masked):
                """Row maxima, probabilities (float32), row sums and the factor that rescales
                what came before, for the scores of step t."""
                if masked:
                    qi = plgpu.broadcasted_iota(jnp.int32, (block_q, block_kv), 0,
                                                layout=plgpu.Layout.WGMMA)
                    ki = plgpu.broadcasted_iota(jnp.int32, (block_q, block_kv), 1,
                                                layout=plgpu.Layout.WGMMA)
                    qk = jnp.where(qi + pw >= ki + t * block_kv, qk, -jnp.inf)
                m_new = jnp.maximum(m, qk.max(axis=1) * c)
                alpha = jnp.exp2(m - m_new)
                x = qk * c - lax.broadcast_in_dim(m_new, qk.shape, [0])
                if fma_exp:  # the last fma_exp columns' exponentials off the MUFU pipe
                    n = block_kv - fma_exp
                    p = jnp.concatenate([jnp.exp2(x[:, :n]), _exp2_fma(x[:, n:])], axis=1)
                else:
                    p = jnp.exp2(x)
                return p, m_new, l * alpha + p.sum(axis=1), alpha

            def pingpong(acc, m, l):
                """The two compute warpgroups take turns on the tensor cores: one's softmax runs
                while the other's products do."""
                @pl.when(kv_steps > 0)
                def _first_keys():
                    plgpu.barrier_wait(k_ready.at[0])

                pl.when(wg == 1)(await_turn)

                def _next_keys_when(t):
                    @pl.when(t + 1 < kv_steps)
                    def _next_keys():
                        plgpu.barrier_wait(k_ready.at[lax.rem(t + 1, jnp.int32(steps))])

                def step(t, carry, masked):
                    acc, m, l = carry
                    slot = lax.rem(t, jnp.int32(steps))

                    def scores(ref):
                        plgpu.wgmma(ref, qo, k_smem.at[slot].transpose((1, 0)))
                        pass_turn()
                        return ref[...]

                    qk = pl.run_scoped(scores, plgpu.ACC((block_q, block_kv), jnp.float32))
                    plgpu.barrier_arrive(k_free.at[slot])
                    p, m_new, l, alpha = softmax(qk, t, m, l, masked)
                    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                    p16 = p.astype(dtype)
                    acc, l, m_new, p16 = lax.optimization_barrier((acc, l, m_new, p16))
                    if named:  # a turn handed over is awaited at once
                        plgpu.barrier_wait(v_ready.at[slot])
                        await_turn()
                    else:
                        plgpu.barrier_arrive(turn)
                        plgpu.barrier_wait(v_ready.at[slot])
                        plgpu.barrier_wait(turn)
                    if masked:
                        zero_values_past_the_tile(t, slot)

                    def values(ref):
                        plgpu.wgmma(ref, p16, v_smem.at[slot])
                        _next_keys_when(t)

                    if interpret:  # the interpreter has neither run_state nor a wgmma from
                        # registers: P through shared memory, and the same sum, not fused
                        p_smem = scoped[-1].at[wg]
                        p_smem[...] = p16
                        plgpu.commit_smem()

                        def values_from_smem(ref):
                            plgpu.wgmma(ref, p_smem, v_smem.at[slot])
                            _next_keys_when(t)
                            return ref[...]

                        acc = acc + pl.run_scoped(values_from_smem,
                                                  plgpu.ACC((block_q, d), jnp.float32))
                    else:
                        acc = pl.run_state(values)(plgpu.ACC.init(acc))
                    plgpu.barrier_arrive(v_free.at[slot])
                    return acc, m_new, l

                def drain(t, _):  # steps this warpgroup's rows do not need
                    release(t)
                    pass_turn()
                    await_turn()

                carry = lax.fori_loop(0, n_full, functools.partial(step, masked=False), (acc, m, l))
                acc, m, l = lax.fori_loop(n_full, kv_steps, functools.partial(step, masked=True),
                                          carry)
                lax.fori_loop(kv_steps, cta_steps, drain, None)
                pl.when(wg == 0)(pass_turn)
                return acc, l

            def overlapped(acc, m, l):
                """Each warpgroup on its own, its softmax of step t running while its product
                of step t-1's probabilities with the values does (FlashAttention-3's
                intra-warpgroup overlap): issue S_t = Q K_t^T and O += P_{t-1} V_{t-1}, wait
                for S_t alone, softmax, wait for O, rescale. A warpgroup without rows runs
                step 0 for nothing (it stores nothing) and drains the rest. With `turns`, the
                two warpgroups also alternate (FlashAttention-3 does both): each meets the other
                right after issuing a step's products, one step apart, so one's softmax runs
                while the other's products do. Every warpgroup meets the other once per step
                of the CTA, plus once more, at the start (1) or at the end (0). With `named`,
                the turn passes one way: awaited before issuing, handed over after.
                Slower than `pingpong` (2026-12-01, one H200, this module at `71df809`:
                453/491/516 against 444/546/555 TFLOP/s at 512, 2048, 8192 rows on 8192
                keys; 447/498/532 against 497/518/534 in another call): ptxas puts the
                wait for O right after the wait for S_t, before the softmax's first write into
                registers O's or S_t's products used, so the softmax never overlaps O
                (docs/lessons.md). ptxas keeps that wait in place only behind a shared-memory
                access that depends on the softmax (FlashAttention-3's is its K slot's
                release): with the new row sums stored to a scratch before O is read (`2cd4fee`)
                all 66 exponentials of a step ran between the two waits, and the kernel was
                slower still, 392/444/482 against 450/520/525 (one H200, 2026-12-01)."""
                def handover():  # after issuing products
                    if turns:
                        pass_turn()

                def before_issue():  # one way (named), a turn is awaited before issuing
                    if turns and named:
                        await_turn()

                s0 = plgpu.layout_cast(jnp.zeros((block_q, block_kv), jnp.float32),
                                       plgpu.Layout.WGMMA)
                own_steps = jnp.maximum(kv_steps, 1)
                if turns:
                    pl.when(wg == 1)(await_turn)
                plgpu.barrier_wait(k_ready.at[0])

                def first(ref):
                    plgpu.wgmma(ref, qo, k_smem.at[0].transpose((1, 0)))
                    handover()
                    return ref[...]

                qk = pl.run_scoped(first, plgpu.ACC((block_q, block_kv), jnp.float32))
                plgpu.barrier_arrive(k_free.at[0])
                p, m, l, _ = softmax(qk, 0, m, l, True)

                def step(t, carry, masked):
                    acc, m, l, p16 = carry
                    slot, prev = lax.rem(t, jnp.int32(steps)), lax.rem(t - 1, jnp.int32(steps))
                    plgpu.barrier_wait(k_ready.at[slot])
                    plgpu.barrier_wait(v_ready.at[prev])
                    before_issue()

                    def body(refs):
                        s_ref, o_ref, p_ref, m_ref, l_ref, a_ref = refs
                        plgpu.wgmma(s_ref, qo, k_smem.at[slot].transpose((1, 0)))
                        plgpu.wgmma(o_ref, p16, v_smem.at[prev])
                        handover()
                        qk = plgpu.wgmma_accumulator_load(s_ref, wait_n=1)  # S_t, not O
                        p_ref[...], m_ref[...], l_ref[...], a_ref[...] = softmax(
                            qk, t, m, l, masked)

                    # P_t leaves in float32 and becomes bf16 once O's product is done: converted
                    # inside, it went into the registers P_{t-1} V_{t-1} was still reading, and
                    # ptxas serialized every wgmma of the kernel (C7513; 35-40 % slower)
                    _, acc, p, m, l, alpha = pl.run_state(body)(
                        (plgpu.ACC.init(s0), plgpu.ACC.init(acc), s0, m, l, m))
                    plgpu.barrier_arrive(k_free.at[slot])
                    plgpu.barrier_arrive(v_free.at[prev])
                    return (acc * lax.broadcast_in_dim(alpha, acc.shape, [0]), m, l,
                            p.astype(dtype))

                split = jnp.maximum(n_full, 1)
                carry = lax.fori_loop(1, split, functools.partial(step, masked=False),
                                      (acc, m, l, p.astype(dtype)))
                acc, m, l, p16 = lax.fori_loop(split, own_steps,
                                               functools.partial(step, masked=True), carry)
                last = own_steps - 1
                slot = lax.rem(last, jnp.int32(steps))
                plgpu.barrier_wait(v_ready.at[slot])
                zero_values_past_the_tile(last, slot)

                def values(ref):
                    plgpu.wgmma(ref, p16, v_smem.at[slot])
                    handover()

                before_issue()
                acc = pl.run_state(values)(plgpu.ACC.init(acc))
                plgpu.barrier_arrive(v_free.at[slot])

                @pl.loop(own_steps, cta_steps)
                def _drain(t):
                    release(t)
                    before_issue()
                    handover()

                if turns:
                    pl.when(wg == 0)(await_turn)
                return acc, l

            acc, l = (overlapped if overlap else pingpong)(acc, m, l)
            acc = acc / lax.broadcast_in_dim(l, acc.shape, [0])
            out = out2.at[wg]
            out[...] = acc.astype(dtype)
            plgpu.commit_smem()
            _store_rows(out, o_ref, head, rw, n, block_q)

        @pl.when(wg == 2)
        def _memory():
            plgpu.set_max_registers(40, action="decrease")
            kv_head = lax.div(head, jnp.int32(groups))

            def copy(t, slot, which, smem, ready):
                for i in range(per_block):
                    g = jnp.minimum(t * per_block + i, width - 1)
                    page = jnp.clip(pt_ref[s * width + g], 0, pages - 1)
                    plgpu.copy_gmem_to_smem(kv_ref.at[page, :, which, kv_head],
                                            smem.at[slot, pl.ds(i * PAGE, PAGE)], ready.at[slot])

            for t in range(steps):
                @pl.when(t < cta_steps)
                def _fill(t=t):
                    copy(jnp.int32(t), t, 0, k_smem, k_ready)
                    copy(jnp.int32(t), t, 1, v_smem, v_ready)

            @pl.loop(jnp.int32(0), cta_steps - steps)
            def _refill(t):
                slot = lax.rem(t, jnp.int32(steps))
                plgpu.barrier_wait(k_free.at[slot])
                copy(t + steps, slot, 0, k_smem, k_ready)
                plgpu.barrier_wait(v_free.at[slot])
                copy(t + steps, slot, 1, v_smem, v_ready)

            @pl.loop(jnp.maximum(cta_steps - steps, 0), cta_steps)
            def _last_releases(t):
                slot = lax.rem(t, jnp.int32(steps))
                plgpu.barrier_wait(k_free.at[slot])
                plgpu.barrier_wait(v_free.at[slot])


def lower_for_h200(rows: int = 512, *, fn=None, **kw) -> jax.stages.Lowered:
    """`chunk_attention` (or `fn`, another version of it) lowered for an H200 on any machine,
    under an abstract device: Qwen3-4B's heads (32 over 8, D 128, bf16), `rows` query rows, 4
    sequences over 257 pages; `kw` goes to the kernel (block sizes, the experimental options)."""
    fn = fn or chunk_attention
    S = jax.ShapeDtypeStruct
    args = (S((257, 16, 2, 8, 128), jnp.bfloat16), S((rows, 32, 128), jnp.bfloat16),
            S((rows,), jnp.int32), S((5,), jnp.int32), S((4, 64), jnp.int32))
    return on_h200(lambda *a: fn(*a, scale=128 ** -0.5, **kw), *args)


def abstract_h200(num_cores=None):
    """A context in which Pallas kernels lower for an H200 on any machine (an abstract device)."""
    dev = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=num_cores,
                                      platform="gpu")
    return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",),
                                                                    abstract_device=dev))


def on_h200(fn, *args, num_cores=None) -> jax.stages.Lowered:
    """`fn` of `args` (shapes) lowered for an H200 on any machine, under an abstract device."""
    with abstract_h200(num_cores):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))


@functools.partial(jax.jit, static_argnames=("scale", "block_q", "block_kv", "steps", "interpret",
                                             "overlap", "turns", "named", "fma_exp"))
def chunk_attention(kv, q, positions, cu_seqlens, page_table, *, scale: float,
                    block_q: int = 64, block_kv: int = 128, steps: int = 2,
                    interpret=False, overlap: bool = False, turns: bool = False,
                    named: bool | None = None, fma_exp: int = 0) -> jax.Array:
    """Paged, packed, bottom-right causal attention for one prefill chunk (Hopper).

    kv: `[pages, 16, 2, KV, D]` (axis 2: 0 keys, 1 values); q: `[rows, H, D]`, same dtype (bf16
    or f16); positions: int32 `[rows]`; cu_seqlens: int32 `[seqs + 1]`; page_table: int32
    `[seqs, width]`; scale: the softmax scale (static).

    block_q: rows per compute warpgroup (a multiple of 64: wgmma's M); a CTA takes 2 * block_q.
    block_kv: keys per step (a multiple of 64). steps: key/value slots in shared memory.
    interpret: Mosaic GPU's interpreter (CPU tests; `True` or its `InterpretGPUParams`).
    overlap: each warpgroup overlaps its softmax with its own products (FlashAttention-3's
      intra-warpgroup overlap) instead of taking turns with the other; GPU only (the
      interpreter runs neither `run_state` nor a product from registers). Experimental: not the
      default until measured faster and tested on the GPU.
    turns: with overlap, the two warpgroups also take turns issuing their products (overlap
      within and between warpgroups, as FlashAttention-3 has both). Experimental too; with
      `named=True`, the turns pass one way as below (run and timed on the H200: slower than
      the default, `overlapped` says why).
    named: the compute warpgroups hand each other the turn at hardware named barriers, one way
      (FlashAttention-3's scheduler barriers): each waits at its own before issuing its
      products and, once they are issued, arrives at the other's without waiting. Otherwise
      (the interpreter, which runs no inline PTX; `overlap`) both meet at a shared-memory
      mbarrier, and each also waits there for the other's softmax. The same sums either way.
      Default: on the GPU without overlap. With overlap it needs turns. The hand-overs of
      each schedule are modelled and checked in `experiments/turns_model.py`: change both.
    fma_exp: the last `fma_exp` key columns of each step take their exponentials from a
      polynomial on the FMA pipes (`_exp2_fma`) instead of MUFU.EX2, which does 16 a cycle per
      SM and holds a warp's 64 a step for ~512 cycles (FlashAttention-4's split). Other bits;
      experimental: slower on the H200 (2026-12-01, `283f2d9`, beside the default in one call:
      32 columns 473/493 against 527/519 TFLOP/s at 2048/8192 rows on 8192 keys, 16 columns
      483/513; each within 2.1e-3 of the float32 reference, as the default; 16 columns again
      in 4 rounds both ways, `4f6cb52`: 479.4/494.0 against 497.9/510.9, slower in 7 of 8).
    Returns `[rows, H, D]` in q's dtype; padding rows (`cu_seqlens[seqs]` on) are zero.
    """
    pages, page, two, kv_heads, d = kv.shape
    rows, heads, dq = q.shape
    seqs, width = page_table.shape
    if page != PAGE or two != 2 or dq != d or heads % kv_heads or kv.dtype != q.dtype:
        raise ValueError(f"bad shapes: kv {kv.shape} {kv.dtype}, q {q.shape} {q.dtype}")
    if not supports(q.dtype, d):
        raise ValueError(f"the Hopper kernel takes bf16/f16 and head_dim 64 or 128, not "
                         f"{q.dtype}, {d}")
    if cu_seqlens.shape != (seqs + 1,) or positions.shape != (rows,):
        raise ValueError(f"bad shapes: cu_seqlens {cu_seqlens.shape}, positions {positions.shape}")
    if turns and not overlap:
        raise ValueError("turns=True goes with overlap=True (without overlap the warpgroups "
                         "take turns already)")
    if overlap and interpret:
        raise ValueError("overlap runs on a GPU only: Mosaic GPU's interpreter has neither "
                         "run_state nor a wgmma from registers")
    if named is None:
        named = not interpret and not overlap
    if named and (interpret or (overlap and not turns)):
        raise ValueError("named runs on a GPU only (the interpreter runs no inline PTX), and "
                         "with overlap only with turns")
    if fma_exp % 8 or not 0 <= fma_exp < block_kv:
        raise ValueError(f"fma_exp {fma_exp} must be a multiple of 8 below block_kv {block_kv}")
    if block_q % 64 or block_kv % 64 or steps < 2:
        raise ValueError(f"block_q {block_q} and block_kv {block_kv} must be multiples of 64, "
                         f"steps {steps} at least 2")
    slots = rows // (2 * block_q) + seqs + 1
    kernel = functools.partial(
        _kernel, seqs=seqs, rows=rows, width=width, pages=pages, groups=heads // kv_heads,
        slots=slots, scale=float(scale), block_q=block_q, block_kv=block_kv, steps=steps,
        interpret=bool(interpret), overlap=bool(overlap), turns=bool(turns),
        named=bool(named), fma_exp=int(fma_exp))
    swizzled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))

    scratch = (
        (plgpu.SMEM((2, block_q, d), q.dtype, transforms=swizzled),
         plgpu.SMEM((2, block_q, d), q.dtype),
         plgpu.SMEM((steps, block_kv, d), q.dtype, transforms=swizzled),
         plgpu.SMEM((steps, block_kv, d), q.dtype, transforms=swizzled)),
        (plgpu.Barrier(num_arrivals=block_kv // PAGE, num_barriers=steps),
         plgpu.Barrier(num_arrivals=block_kv // PAGE, num_barriers=steps),
         plgpu.Barrier(num_barriers=2)),
        (plgpu.Barrier(num_arrivals=2, num_barriers=steps),) * 2,
        plgpu.Barrier(num_arrivals=2),
    ) + ((plgpu.SMEM((2, block_q, block_kv), q.dtype, transforms=swizzled),) if interpret else ())

    def chunk_attention_kernel(*refs):
        kernel(*refs[:6], refs[6:])

    return plgpu.kernel(
        chunk_attention_kernel,
        scratch_types=scratch,
        out_type=jax.ShapeDtypeStruct((rows, heads, d), q.dtype),
        grid=(heads, slots),
        grid_names=("heads", "tiles"),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret or None,
    )(cu_seqlens.astype(jnp.int32), positions.astype(jnp.int32),
      page_table.astype(jnp.int32).reshape(-1), q, kv)
