"""The attention call on CUDA GPUs for bf16 with head_dim 128: FlashAttention-3's forward.

FlashAttention-3 (github.com/Dao-AILab/flash-attention, `hopper/`) is a public library this
repository does not hold: `scripts/fa3` builds the one instantiation kernjax runs (csrc/fa3/glue.cu:
varlen queries and keys, causal, no split of the keys) into build/fa3/libkj_fa3.so, and the XLA
FFI handler `kj_fa3` (csrc/fa3.cu) calls it on XLA's stream. Pages of 128 rows (head_dim 128's,
`attention.page_size`) it reads in place, one page a key block, with TMA through the page table.
Pages of 16 it could read only row by row (~20 % slower), so for those the handler first copies
each sequence's pages into one contiguous run of keys. Measured on an H200:
`experiments/attention.py --kernel fa3-paged` (docs/bitwise.md).

The function is `attention.chunk_attention`'s: each sequence's rows are the last of its context
(positions consecutive, the last at `positions[cu[s + 1] - 1]`), so FlashAttention's bottom-right
causal mask over that many keys is the row-by-row rule. A row's bits do not depend on the item:
the keys are not split, a tile never spans two sequences, and a block past a row's own position
is masked to zero. Any GQA ratio (kv_heads dividing heads): the instantiation packs no heads
(`PackGQA` off), so each query head h reads kv head h // (heads / kv_heads). Padding rows are
zeroed by the handler. With pages of 16, an item's sequences
must not share pages (kernjax's pool never shares one): the gathered keys have room for distinct
pages only, and the kernel stops the program if they do not fit. That room is the item's whole
key capacity (seqs x the page table's width, at most the pool's pages), a temporary of the call:
64 MiB for one 16k sequence at qwen3-4b's 8 KV heads, 1 GiB for 16 of them. Pages of 128 need
none.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kernjax.core import lowering
from kernjax.kernels import ffi


PAGES = (16, 128)  # rows a page: gathered (csrc/fa3.cu's kPage), or read in place (kPageTma)


def supports(dtype, q_shape, kv_shape) -> bool:
    """Whether this route takes these shapes (FlashAttention-3 is built for bf16, D = 128, pages
    of `PAGES` rows; any kv_heads dividing heads)."""
    return (jnp.dtype(dtype) == jnp.bfloat16 and q_shape[-1] == 128 and kv_shape[1] in PAGES
            and q_shape[1] % kv_shape[3] == 0)


def chunk_attention(kv, q, positions, cu_seqlens, page_table, *, scale: float):
    if not supports(q.dtype, q.shape, kv.shape):
        raise ValueError(f"kj_fa3 takes bf16 with head_dim 128: q {q.dtype}{list(q.shape)}, "
                         f"kv {list(kv.shape)}")
    try:
        ffi.register()
    except ffi.ExtensionError:
        pass  # a platform that runs the program says so, naming kj_fa3
    rows, heads, d = q.shape
    seqs, width = page_table.shape
    # csrc/fa3.h: the scheduler's scratch (KjFa3MetaInts), each sequence's key count, where its
    # keys start (seqs + 1), and the keys gathered out of pages of 16 (KjFa3KeyRows rows; none
    # for pages of 128, read in place)
    meta = 4 * (-(-seqs // 4) * 4) + 1 + 2 * seqs + 1
    key_rows = 0 if kv.shape[1] == 128 else \
        min(seqs * (-(-width * 16 // 128) * 128), kv.shape[0] * 16 + 128 * seqs)
    target = "kj_fa3" if lowering.current().fa3_graphs else "kj_fa3_ungraphed"
    o, _, _, _ = jax.ffi.ffi_call(target, (
        jax.ShapeDtypeStruct(q.shape, q.dtype),
        jax.ShapeDtypeStruct((heads, rows), jnp.float32),
        jax.ShapeDtypeStruct((meta,), jnp.int32),
        jax.ShapeDtypeStruct((key_rows, *kv.shape[2:]), kv.dtype)))(
            kv, q, positions.astype(jnp.int32), cu_seqlens.astype(jnp.int32),
            page_table.astype(jnp.int32), scale=np.float32(scale))
    return o
