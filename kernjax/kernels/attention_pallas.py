"""Chunked-prefill attention over a paged KV state: a Pallas kernel for the Triton backend (H200).

`chunk_attention` computes, for every row `r` of sequence `s` (rows `cu_seqlens[s]` ..
`cu_seqlens[s+1]-1`), softmax(q[r] . k * scale) @ v over keys `0 .. positions[r]` of `s`, read
through `page_table[s]` from `kv[page, offset, 0|1, kv_head]` (pages of P tokens, a power of
two). The chunk's own keys are already in the pages, so the mask is causal by absolute position
(bottom-right aligned).

Grid `(tiles, kv heads)`. A tile is `block_q` consecutive rows of one sequence, starting at
`cu_seqlens[s] + t * block_q`, times the `G = H / KV` query heads that share kv head `h` (GQA): its
M dimension is `block_q * G` rounded up to a power of two, at least 16 (`tile_rows`; slot `i <
block_q * G` is row `i // G`, head `h * G + i % G`; the slots past it load no query and store
nothing), so a key/value block is loaded once for all `G` heads. Any `G` works: a power of two
fills the tile (`block_q` 32 by default: 128 slots for Qwen3-4B's G = 4), another takes the most
rows that fit 128 slots (42 rows for G = 3, 126 slots; 25 for G = 5, 125 slots). A slot's
products are its own row's and head's, so what the idle slots hold changes no bit of the others.

Program `j` finds its (sequence, tile) by walking `cu_seqlens` (a static loop of scalar loads);
there are `rows // block_q + seqs + 1` tile slots, enough for any `cu_seqlens`, and the unused
ones exit at once. Tiles are taken from the end, so the longest
(largest positions) start first. After the sequences comes one more segment, the padding rows
`cu_seqlens[seqs] .. rows - 1`, whose tiles write zeros.

Keys are processed in blocks of `block_k` aligned to key position 0, in increasing order, with an
online softmax in float32 (base 2); P is cast to the input dtype before P @ V, accumulated in
float32. Blocks where every key is visible to every row of the tile run without a mask; the last
few (up to the tile's largest position) are masked per row and key. A masked score gives p = 0
exactly, and a block wholly past a row's position is an exact no-op for it (m unchanged, so
alpha = exp2(0) = 1, and p = 0 adds 0 to l and acc), so a row's result depends only on its own sequence and its offset in that sequence's chunk: not on
what else the item holds, and not on the grid. No split-K, no atomics.

Keys are gathered per key: the page of key j is `page_table[s, j // P]`, and its row in `kv`
viewed as `[pages * P * 2 * KV, D]` is `((page * P + j % P) * 2 + 0|1) * KV + h`. Loads past
the tile's last position are masked (never read), so stale pages can hold anything, even NaN.

Requirements (Triton): `block_k` and `D` powers of two, each at least 16; pages of a power of two
rows (`supports`, which `kernjax/kernels/attention.py` asks before it routes a shape here).

Lowering without a GPU (jax 0.11.2): the Triton lowering asks the device for its compute
capability, so lower (or `jax.export` with `platforms=["cuda"]`) under
`jax.sharding.use_abstract_mesh(AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(
"NVIDIA H200", None, "gpu")))`; export also needs `disabled_checks=[export.DisabledSafetyCheck.
custom_call("__gpu$xla.gpu.triton")]`. An export for both "cpu" and "cuda" fails, even with the
kernel in `lax.platform_dependent`'s cuda branch: every branch is lowered for every platform,
and a pallas_call has no CPU lowering outside interpret mode.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

# Finite, so a row with nothing visible yet stays finite; after scaling, never overflows.
MASK = -0.7 * float(jnp.finfo(jnp.float32).max)


def _kernel(cu_ref, pos_ref, pt_ref, q_ref, kv_ref, o_ref, *, seqs, rows, heads, kv_heads,
            width, page, scale, block_q, block_k, tile):
    groups = heads // kv_heads
    # Program j takes the j-th tile from the end of the list of every segment's tiles, segments
    # being the sequences and then the padding rows: the longest tiles start first.
    j = pl.num_programs(0) - 1 - pl.program_id(0)
    h = pl.program_id(1)
    # int32 scalars, not Python ints: Triton's select lowering gives a weak-typed literal the
    # predicate's type (i1) when both operands are literals.
    s, r0, end, first = (jnp.int32(v) for v in (seqs + 1, 0, 0, 0))  # s = seqs + 1: no tile
    for seg in range(seqs + 1):  # static: a few scalar loads and selects per sequence
        a = cu_ref[seg]
        b = cu_ref[seg + 1] if seg < seqs else rows
        n = (b - a + block_q - 1) // block_q
        hit = (j >= first) & (j < first + n)
        s = jnp.where(hit, jnp.int32(seg), s)
        r0 = jnp.where(hit, a + (j - first) * block_q, r0)
        end = jnp.where(hit, b, end)
        first = first + n
    i = jnp.arange(tile)  # tile slot i < block_q * G: row i // G, query head h * G + i % G
    row = r0 + i // groups
    row_ok = row < end
    if tile > block_q * groups:  # the slots past block_q * G idle
        row_ok = row_ok & (i < block_q * groups)
    q_rows = row * heads + h * groups + i % groups  # rows of q viewed as [rows * H, D]
    col = jnp.arange(q_ref.shape[-1])[None, :]
    out = o_ref.at[q_rows[:, None], col]

    @pl.when(s == seqs)
    def _padding():
        plgpu.store(out, jnp.zeros(out.shape, o_ref.dtype), mask=row_ok[:, None])

    @pl.when(s < seqs)
    def _attend():
        q = plgpu.load(q_ref.at[q_rows[:, None], col], mask=row_ok[:, None], other=0)
        q_pos = plgpu.load(pos_ref.at[row], mask=row_ok, other=0)
        lo = jnp.min(jnp.where(row_ok, q_pos, jnp.iinfo(jnp.int32).max))
        hi = jnp.max(jnp.where(row_ok, q_pos, 0))
        qk_scale = scale * math.log2(math.e)
        # f32 (tests) asks for IEEE products; bf16 takes the default (tensor cores).
        prec = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None

        def body(b, carry, masked):
            acc, m_i, l_i = carry
            k_pos = b * block_k + jnp.arange(block_k)
            k_ok = (k_pos <= hi) if masked else None
            # Page ids per key; with `masked`, keys past the tile are never read.
            pg = plgpu.load(pt_ref.at[s * width + (k_pos >> (page.bit_length() - 1))],
                            mask=k_ok, other=0 if masked else None)  # k_pos // page
            k_row = ((pg * page + (k_pos & (page - 1))) * 2) * kv_heads + h
            mk = k_ok[:, None] if masked else None
            other = 0 if masked else None
            k = plgpu.load(kv_ref.at[k_row[:, None], col], mask=mk, other=other)
            v = plgpu.load(kv_ref.at[k_row[:, None] + kv_heads, col], mask=mk, other=other)
            qk = plgpu.dot(q, k, trans_b=True, precision=prec) * qk_scale  # [M, block_k] f32
            if masked:
                qk = jnp.where(k_pos[None, :] <= q_pos[:, None], qk, MASK)
            m_new = jnp.maximum(m_i, jnp.max(qk, axis=1))
            alpha = jnp.exp2(m_i - m_new)
            p = jnp.exp2(qk - m_new[:, None])
            l_new = l_i * alpha + jnp.sum(p, axis=1)
            acc = acc * alpha[:, None] + plgpu.dot(p.astype(v.dtype), v, precision=prec)
            return acc, m_new, l_new

        d = q_ref.shape[-1]
        carry = (jnp.zeros((i.size, d), jnp.float32), jnp.full((i.size,), -jnp.inf, jnp.float32),
                 jnp.zeros((i.size,), jnp.float32))
        n_full = (lo + 1) // block_k  # blocks whose keys every row of the tile sees
        n_all = hi // block_k + 1
        carry = lax.fori_loop(0, n_full, functools.partial(body, masked=False), carry)
        carry = lax.fori_loop(n_full, n_all, functools.partial(body, masked=True), carry)
        acc, _, l_i = carry
        plgpu.store(out, (acc / l_i[:, None]).astype(o_ref.dtype), mask=row_ok[:, None])


DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _pow2(n: int) -> bool:
    return n >= 1 and not n & (n - 1)


def supports(dtype, q_shape, kv_shape) -> bool:
    """Whether this kernel takes these shapes: q `[rows, H, D]` and kv `[pages, P, 2, KV, D]` of
    `dtype` (float32, bf16 or f16) with D a power of two of at least 16, P a power of two and KV
    dividing H (any ratio: `tile_rows`)."""
    rows, heads, d = q_shape
    pages, page, two, kv_heads, dk = kv_shape
    return (jnp.dtype(dtype) in DTYPES and d == dk and d >= 16 and _pow2(d) and _pow2(page)
            and two == 2 and kv_heads >= 1 and heads % kv_heads == 0)


def tile_rows(groups: int, block_q: int | None = None) -> tuple[int, int]:
    """`(block_q, tile)`: query rows a tile takes and its height in slots (`block_q * groups`
    rounded up to a power of two, at least 16). By default 32 rows for a power-of-two `groups`
    (a tile of 32 * groups: 128 for G = 4), else the most rows whose slots fit 128 (at least 1)."""
    if block_q is None:
        block_q = 32 if _pow2(groups) else max(1, 128 // groups)
    if block_q < 1:
        raise ValueError(f"block_q = {block_q} must be at least 1")
    return block_q, max(16, 1 << (block_q * groups - 1).bit_length())


@functools.partial(jax.jit, static_argnames=("scale", "block_q", "block_k", "interpret",
                                             "num_warps", "num_stages"))
def chunk_attention(kv, q, positions, cu_seqlens, page_table, *, scale: float,
                    block_q: int | None = None, block_k: int = 64, interpret: bool = False,
                    num_warps: int | None = None, num_stages: int | None = None) -> jax.Array:
    """Paged, packed, bottom-right causal attention for one prefill chunk.

    kv: `[pages, P, 2, KV, D]` (axis 2: 0 keys, 1 values); q: `[rows, H, D]`, same dtype (bf16,
    f16, or f32); positions: int32 `[rows]`; cu_seqlens: int32 `[seqs + 1]`; page_table:
    int32 `[seqs, width]`; scale: the softmax scale (static). Any H / KV (`supports`).

    block_q: query rows per tile (`tile_rows`); the tile is `block_q * H / KV` slots rounded up
    to a power of two, so the default (32 rows for a power-of-two H / KV) makes it 128 for
    H / KV = 4 (Qwen3-4B), and 126 of 128 slots for H / KV = 3 (42 rows). block_k: keys per
    block. num_warps / num_stages: Triton's, by default 8 / 3 for a 128 x 128 tile of q (for
    sm_90a, Triton 3.9 + ptxas compile a 128-tall tile with block_k 64 into 244 registers without
    spills; a 256-tall one spills).
    interpret: run in Pallas interpret mode (CPU tests).
    Returns `[rows, H, D]` in q's dtype; padding rows (`cu_seqlens[seqs]` on) are zero.
    """
    pages, page, two, kv_heads, d = kv.shape
    rows, heads, dq = q.shape
    seqs, width = page_table.shape
    if kv.dtype != q.dtype or not supports(q.dtype, q.shape, kv.shape):
        raise ValueError(f"the Triton kernel takes float32, bf16 or f16 q [rows, H, D] and kv "
                         f"[pages, P, 2, KV, D] of one dtype, D a power of two >= 16, P a power "
                         f"of two, KV dividing H: kv {kv.shape} {kv.dtype}, q {q.shape} {q.dtype}")
    if cu_seqlens.shape != (seqs + 1,) or positions.shape != (rows,):
        raise ValueError(f"bad shapes: cu_seqlens {cu_seqlens.shape}, positions {positions.shape}")
    if block_k < 16 or not _pow2(block_k):
        raise ValueError(f"block_k = {block_k} must be a power of two >= 16")
    groups = heads // kv_heads
    block_q, tile = tile_rows(groups, block_q)
    if num_warps is None:
        num_warps = 8 if tile * d >= 128 * 128 else 4
    if num_stages is None:
        num_stages = 3 if d <= 128 else 2
    kernel = functools.partial(
        _kernel, seqs=seqs, rows=rows, heads=heads, kv_heads=kv_heads, width=width, page=page,
        scale=float(scale), block_q=block_q, block_k=block_k, tile=tile)
    out = pl.pallas_call(
        kernel,
        grid=(rows // block_q + seqs + 1, kv_heads),  # enough tiles for any cu_seqlens
        out_shape=jax.ShapeDtypeStruct((rows * heads, d), q.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="chunk_attention",
    )(cu_seqlens.astype(jnp.int32), positions.astype(jnp.int32),
      page_table.astype(jnp.int32).reshape(-1), q.reshape(rows * heads, d), kv.reshape(-1, d))
    return out.reshape(rows, heads, d)
