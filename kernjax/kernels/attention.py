"""Chunked-prefill attention over a paged KV state: the body of every `attn` call.

One item holds the rows of up to `seqs` sequences, split by `cu_seqlens` (rows past
`cu_seqlens[-1]` are padding). Row r of sequence s sits at absolute position `positions[r]` and
attends over keys 0..positions[r] of s (causal, aligned bottom-right: the chunk's own keys are
already in the pages), read through `page_table[s]` from `kv` `[pages, page, 2, kv_heads, head_dim]`
(`page` rows a page: 128 where FlashAttention-3 reads the pages in place, else 16; `page_size`).
GQA: query head h reads kv head h // (heads / kv_heads). Scores and softmax in float32, the
probabilities cast to the input dtype before they meet the values (as flash attention does),
padding rows written as zeros.

Every route follows the same rules, so that its cost follows the context the item's sequences
have, not the page table's width, and a row's bits do not depend on what else its item holds:
keys are visited in blocks aligned to key 0 (in order; FlashAttention-3 from the last block
down), with an online softmax, up to the last block any row of the tile needs; a block past a
row's own position is an exact no-op for it (its probabilities are 0 and its running maximum
does not move, or stays -inf until a key is visible). No score matrix is ever whole.

Routes, chosen per platform by `jax.lax.platform_dependent` (so the traced program, and the cut
id, are the same everywhere): `blockwise` below on every platform but CUDA; on CUDA GPUs the
first of these that takes the dtype and shapes (`route`):
- FlashAttention-3 through the FFI handler `kj_fa3` (`kernjax/kernels/attention_fa3.py`; built
  by `scripts/fa3`): bf16, head_dim 128, pages of 16 or 128 rows;
- the Mosaic GPU kernel `kernjax/kernels/attention_hopper.py` (wgmma and TMA, for Hopper): bf16
  or f16, head_dim 64 or 128, pages of 16 rows;
- the Pallas Triton kernel `kernjax/kernels/attention_pallas.py`: float32, bf16 or f16, head_dim
  a power of two of at least 16, pages of a power of two rows;
- `blockwise`, for the rest (a head_dim such as 80 or 96).
Every route takes any GQA ratio (kv_heads dividing heads): FlashAttention-3 and the Mosaic GPU
kernel read kv head h // G for query head h, and the Triton kernel rounds its tile (rows times
the G heads of a kv head) up to a power of two, the extra slots idle (`attention_pallas.
tile_rows`). The choice is by dtype and shape only, never by the device present, so a program
traced without a GPU is the one that runs on it, and a whole program and each stage of its cut
take the same route. Only the chosen route is traced into the cuda branch, so no kernel is traced
for shapes it refuses. `blockwise` is also the GPU kernels' reference in the tests.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kernjax.kernels.reduce import rowsum

NEG = -1e30  # a masked score: finite, so a row that has seen no key yet gets p = 0, not NaN


def page_size(head_dim: int) -> int:
    """Rows a KV page holds for a model of `head_dim`: 128 for head_dim 128, whose bf16 attention
    FlashAttention-3 runs, reading each page in place with TMA as one key block (a page must be a
    whole 128-row block for that); else 16, so a short prompt wastes little of its last page.
    A model constant, the same on every platform (the state's shape is in the cut id)."""
    return 128 if head_dim == 128 else 16


ROUTES = ("attention_fa3", "attention_hopper", "attention_pallas", "blockwise")


def route(dtype, q_shape, kv_shape) -> str:
    """The name of the route (`ROUTES`: a module of `kernjax/kernels`, or `blockwise`) that runs
    attention of q `[rows, heads, head_dim]` over kv `[pages, page, 2, kv_heads, head_dim]` of
    `dtype` on a CUDA GPU: the first that takes them (the module docstring's list)."""
    from . import attention_fa3, attention_hopper, attention_pallas

    q_shape, kv_shape = tuple(q_shape), tuple(kv_shape)
    if len(q_shape) != 3 or len(kv_shape) != 5 or kv_shape[2] != 2 or q_shape[2] != kv_shape[4]:
        raise ValueError(f"attention takes q [rows, heads, head_dim] and kv [pages, page, 2, "
                         f"kv_heads, head_dim]: q {list(q_shape)}, kv {list(kv_shape)}")
    heads, kv_heads = q_shape[1], kv_shape[3]
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"attention needs kv_heads dividing heads: {heads} heads over "
                         f"{kv_heads} kv heads")
    if attention_fa3.supports(dtype, q_shape, kv_shape):
        return "attention_fa3"
    if attention_hopper.supports(dtype, q_shape[-1], kv_shape[1]):
        return "attention_hopper"
    if attention_pallas.supports(dtype, q_shape, kv_shape):
        return "attention_pallas"
    return "blockwise"


def chunk_attention(kv, q, positions, cu_seqlens, page_table, *, scale: float):
    """`[rows, heads, head_dim]` attention output; the arguments are the module docstring's."""
    import importlib

    name = route(q.dtype, q.shape, kv.shape)
    gpu = blockwise if name == "blockwise" else \
        importlib.import_module(f"{__package__}.{name}").chunk_attention
    return jax.lax.platform_dependent(
        kv, q, positions, cu_seqlens, page_table,
        default=functools.partial(blockwise, scale=scale),
        cuda=functools.partial(gpu, scale=scale))


def exact(dtype):
    """float32 products in full precision (a GPU takes float32 dots as TF32 otherwise); `None`
    (the default) for bf16, whose products are exact on every backend."""
    return jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None


def item_rows(positions, cu_seqlens, page_table, *, page: int, block: int, own_at):
    """What every blockwise route needs of an item: the page table padded to whole key blocks,
    each row's sequence (`own`, clamped for padding rows and indexed with `own_at` to broadcast
    against the caller's score layout), which rows are real (`valid`) and how many key blocks the
    item's longest row reaches (`needed`)."""
    if block % page:
        raise ValueError(f"key blocks of {block} rows must hold whole pages of {page} rows")
    seqs, width = page_table.shape
    per = block // page
    nb = -(-width // per)
    table = jnp.pad(page_table, ((0, 0), (0, nb * per - width)))
    seq = jnp.searchsorted(cu_seqlens[1:], jnp.arange(positions.shape[0]), side="right")
    valid = seq < seqs
    own = jnp.minimum(seq, seqs - 1)[own_at]
    needed = (jnp.max(jnp.where(valid, positions, -1)) + block) // block
    return table, own, valid, needed


TILE = 8  # the query rows of every attention GEMM on the blockwise route (each g heads)


def blockwise(kv, q, positions, cu_seqlens, page_table, *, scale: float, block: int = 128):
    """Online-softmax attention in plain JAX, `block` keys at a time, over the needed blocks only.

    Each block is GEMMs of TILE query rows (their g heads of one kv head) against the keys of
    each sequence the tile's rows may belong to; each row then *selects* its own sequence's
    scores (never sums over sequences), and likewise for the values. Every GEMM has the same M, N
    and K (TILE * g, the block, the head size) whatever the item holds, batched so none is merged
    with another: a row's arithmetic is the same whichever slot its sequence has and however many
    rows and sequences the item holds (XLA's CPU GEMMs order a row's sum by the problem's shape).
    Measured exception: with g = 3, a row of an item of at most 3 rows is 1 ulp off the same
    row in a larger item (`tests/test_attention.py`).
    """
    rows, heads, d = q.shape
    kvh = kv.shape[3]
    g = heads // kvh
    seqs, page = page_table.shape[0], kv.shape[1]
    per = block // page
    table, own, valid, needed = item_rows(positions, cu_seqlens, page_table, page=page,
                                          block=block, own_at=slice(None))
    f32 = jnp.float32
    prec = exact(q.dtype)
    m = rows * g  # the GEMMs' rows: each query row's g heads of one kv head
    tile = TILE * g  # whole query rows a tile
    tiles = -(-m // tile)
    # A tile's rows belong to consecutive sequences, at most `near` of them: each tile is
    # multiplied by the keys of the `near` sequences from its first row's on
    near = -(-tile // g) + 1
    # with few sequences, each tile takes every sequence's keys, broadcast rather than gathered
    # (the same GEMMs and more of them: the bits are the same either way)
    every = seqs <= 2 * near
    near = seqs if every else near
    at = jnp.arange(m)
    if every:
        pick = own[at // g]
    else:
        first = own[jnp.minimum(jnp.arange(tiles) * tile // g, rows - 1)]
        cand = jnp.minimum(first[:, None] + jnp.arange(near), seqs - 1)  # [tiles, near]
        pick = jnp.clip(own[at // g] - first[at // tile], 0, near - 1)
    pick = pick[None, :, None, None]
    qg = q.reshape(rows, kvh, g, d).transpose(1, 0, 2, 3).reshape(kvh, m, d)
    qg = jnp.pad(qg, ((0, 0), (0, tiles * tile - m), (0, 0)))
    qg = jnp.broadcast_to(qg.reshape(kvh, tiles, 1, tile, d), (kvh, tiles, near, tile, d))

    def per_row(x):  # [kvh, tiles, near, tile, n] -> each row's own sequence's [kvh, rows, g, n]
        x = x.transpose(0, 1, 3, 2, 4).reshape(kvh, tiles * tile, near, x.shape[-1])[:, :m]
        return jnp.take_along_axis(x, pick, axis=2)[:, :, 0].reshape(kvh, rows, g, x.shape[-1])

    def step(b, carry):
        mx, l, acc = carry
        pages = jax.lax.dynamic_slice_in_dim(table, b * per, per, axis=1)
        blk = kv[pages].reshape(seqs, block, 2, kvh, d)
        blk = (jnp.broadcast_to(blk, (tiles, *blk.shape)) if every
               else blk[cand])  # [tiles, near, b, 2, kvh, d]
        blk = blk.transpose(3, 4, 0, 1, 2, 5)  # [2, kvh, tiles, near, b, d]
        s = per_row(jnp.einsum("ktumd,ktubd->ktumb", qg, blk[0], preferred_element_type=f32,
                               precision=prec)) * scale
        key = b * block + jnp.arange(block)
        mask = (valid[:, None] & (key[None, :] <= positions[:, None]))[None, :, None, :]
        s = jnp.where(mask, s, NEG)
        m_new = jnp.maximum(mx, s.max(-1))
        p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
        alpha = jnp.exp(mx - m_new)
        pm = jnp.pad(p.astype(q.dtype).reshape(kvh, m, block),
                     ((0, 0), (0, tiles * tile - m), (0, 0)))
        pm = jnp.broadcast_to(pm.reshape(kvh, tiles, 1, tile, block),
                              (kvh, tiles, near, tile, block))
        pv = per_row(jnp.einsum("ktumb,ktubd->ktumd", pm, blk[1], preferred_element_type=f32,
                                precision=prec))
        return m_new, l * alpha + rowsum(p), acc * alpha[..., None] + pv

    init = (jnp.full((kvh, rows, g), NEG, f32), jnp.zeros((kvh, rows, g), f32),
            jnp.zeros((kvh, rows, g, d), f32))
    _, l, acc = jax.lax.fori_loop(0, needed, step, init)
    o = acc / jnp.where(l > 0, l, 1.0)[..., None]
    o = jnp.where(valid[None, :, None, None], o, 0.0).astype(q.dtype)
    return o.transpose(1, 0, 2, 3).reshape(rows, heads, d)


def reference(kv, q, positions, cu_seqlens, page_table, *, scale: float):
    """The same function in float32 with the whole score matrix, for tests: slow, obviously right."""
    rows, heads, d = q.shape
    seqs, width = page_table.shape
    kvh, n_keys = kv.shape[3], width * kv.shape[1]
    ctx = kv[page_table.reshape(-1)].reshape(seqs, n_keys, 2, kvh, d).astype(jnp.float32)
    seq = jnp.searchsorted(cu_seqlens[1:], jnp.arange(rows), side="right")
    valid = seq < seqs
    keys = ctx[jnp.minimum(seq, seqs - 1)]  # [rows, keys, 2, kvh, d]
    qg = q.astype(jnp.float32).reshape(rows, kvh, heads // kvh, d)
    hi = jax.lax.Precision.HIGHEST
    s = jnp.einsum("rkgd,rtkd->rkgt", qg, keys[:, :, 0], precision=hi) * scale
    mask = valid[:, None] & (jnp.arange(n_keys)[None, :] <= positions[:, None])
    p = jax.nn.softmax(jnp.where(mask[:, None, None], s, -jnp.inf), axis=-1)
    o = jnp.einsum("rkgt,rtkd->rkgd", p, keys[:, :, 1], precision=hi)
    return jnp.where(valid[:, None, None, None], o, 0.0).reshape(rows, heads, d)
