"""The attention call's portable route (`kernjax/kernels/attention.py: blockwise`): the right function
against a float32 reference, padding rows written as zeros, and batch invariance: a sequence's
rows have the same bits alone and packed with others, in the op and through a whole program."""

from __future__ import annotations

import dataclasses

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernjax import models
from kernjax.core.cut import whole
from kernjax.core.item import Piece, Shape, item_shape, make_item
from kernjax.kernels import attention
from kernjax.artifact import export_stage

def lease(rng, lengths, chunks, *, width, rows, seqs, page=16):
    """`(pages, item)`: sequences of `lengths[i]` tokens on shuffled pages of `page` rows (two
    spare pages stay unused, page 0 is never leased) and the item of each sequence's last
    `chunks[i]` rows."""
    need = [-(-n // page) for n in lengths]
    ids = rng.permutation(np.arange(1, sum(need) + 3))
    pieces, at = [], 0
    for n, c, k in zip(lengths, chunks, need):
        pieces.append(Piece(np.zeros(c, np.int32), n - c, tuple(int(i) for i in ids[at:at + k])))
        at += k
    return len(ids) + 1, make_item(pieces, Shape(rows, seqs, width, len(ids) + 1, page))


def paged(rng, lengths, chunks, *, kvh, heads, d, width, dtype, rows, seqs, page=16):
    """A random paged state holding `lengths[i]` tokens of each sequence on shuffled pages, and the
    item of each sequence's last `chunks[i]` rows (their keys are already in the pages)."""
    pages, item = lease(rng, lengths, chunks, width=width, rows=rows, seqs=seqs, page=page)
    kv = rng.standard_normal((pages, page, 2, kvh, d)).astype(np.float32)
    q = rng.standard_normal((rows, heads, d)).astype(np.float32)
    cast = lambda x: jnp.asarray(x, dtype)  # noqa: E731
    return (cast(kv), cast(q), jnp.asarray(item["positions"]), jnp.asarray(item["cu_seqlens"]),
            jnp.asarray(item["page_table"]))


CASES = [  # (lengths, chunk rows per sequence, rows, seqs, width, block, page)
    ([40], [40], 48, 1, 4, 32, 16),  # one sequence from position 0, padding rows after it
    ([100], [7], 8, 1, 8, 32, 16),  # a chunk at the end of a 100-token context, last page part full
    ([37, 1, 64], [5, 1, 16], 24, 4, 5, 32, 16),  # three packed, one empty slot
    ([129, 17], [64, 17], 96, 2, 9, 128, 16),
    # pages of 128 (head_dim 128's, `attention.page_size`): one page a key block, or two
    ([300, 129, 5], [44, 129, 5], 192, 4, 3, 128, 128),
    ([300, 40], [300, 1], 320, 2, 3, 256, 128),
]


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-5), ("bfloat16", 1e-2)])
@pytest.mark.parametrize("case", CASES)
def test_blockwise_is_attention(case, dtype, tol):
    lengths, chunks, rows, seqs, width, block, page = case
    rng = np.random.default_rng(len(lengths) * 100 + rows)
    args = paged(rng, lengths, chunks, kvh=2, heads=4, d=16, width=width, dtype=dtype,
                 rows=rows, seqs=seqs, page=page)
    got = jax.jit(functools.partial(attention.blockwise, scale=0.25, block=block))(*args)
    ref = attention.reference(*[a.astype(jnp.float32) if a.dtype == dtype else a for a in args],
                              scale=0.25)
    got, ref = np.asarray(got, np.float32), np.asarray(ref)
    assert got.shape == (rows, 4, 16) and not np.isnan(got).any()
    n = sum(chunks)
    assert np.linalg.norm(got[:n] - ref[:n]) / np.linalg.norm(ref[:n]) < tol
    assert not got[n:].any(), "padding rows must be written as zeros"


def test_blockwise_is_batch_invariant():
    """The same sequence alone, and packed in another slot with others, gives the same bytes."""
    rng = np.random.default_rng(7)
    kw = dict(kvh=2, heads=4, d=16, width=12, dtype="bfloat16", rows=64, seqs=3)
    kv, q, pos, cu, table = paged(rng, [150, 33, 90], [20, 33, 11], **kw)
    fn = jax.jit(functools.partial(attention.blockwise, scale=0.25, block=32))
    packed = np.asarray(fn(kv, q, pos, cu, table))
    # Alone: the third sequence moved to slot 0 and row 0, the same pages and queries.
    a, b = int(cu[2]), int(cu[3])
    q1 = jnp.zeros_like(q).at[: b - a].set(q[a:b])
    pos1 = jnp.zeros_like(pos).at[: b - a].set(pos[a:b])
    cu1 = jnp.asarray([0, b - a, b - a, b - a], jnp.int32)
    table1 = jnp.zeros_like(table).at[0].set(table[2])
    alone = np.asarray(fn(kv, q1, pos1, cu1, table1))
    assert alone[: b - a].tobytes() == packed[a:b].tobytes()


def _alone(args, i, rows, seqs):
    """Sequence `i` of an item's args moved to slot 0 and row 0 of an item of `rows` rows and
    `seqs` slots, with the same pages and queries."""
    kv, q, pos, cu, table = args
    a, b = int(cu[i]), int(cu[i + 1])
    q1 = jnp.zeros((rows, *q.shape[1:]), q.dtype).at[: b - a].set(q[a:b])
    pos1 = jnp.zeros((rows,), pos.dtype).at[: b - a].set(pos[a:b])
    cu1 = jnp.asarray([0] + [b - a] * seqs, jnp.int32)
    table1 = jnp.zeros((seqs, table.shape[1]), table.dtype).at[0].set(table[i])
    return (kv, q1, pos1, cu1, table1), b - a


@pytest.mark.parametrize("group", [1, 2, 4, pytest.param(3, marks=pytest.mark.xfail(
    jax.default_backend() == "cpu", strict=True,
    reason="open: on the CPU, with g = 3 a row of an item of 3 rows or fewer is 1 ulp off"))])
def test_a_sequence_has_the_same_bits_in_any_company_on_either_route(group):
    """Many one-row sequences (a decode bucket: each tile takes the keys of the few sequences
    near it) and few (each tile takes every sequence's): a sequence's rows are the bytes it
    gets alone, in float32, whatever the group size."""
    rng = np.random.default_rng(group)
    n = 40
    lengths = [int(x) for x in rng.integers(2, 120, n)]
    chunks = [1] * (n - 1) + [2]
    kw = dict(kvh=2, heads=2 * group, d=16, width=8, dtype="float32", page=16)
    fn = jax.jit(functools.partial(attention.blockwise, scale=0.25, block=32))
    many = paged(rng, lengths, chunks, rows=48, seqs=48, **kw)
    few = paged(np.random.default_rng(group), lengths[:5], [1, 1, 1, 1, 2], rows=8, seqs=6,
                **kw)
    for args, seqs in ((many, n), (few, 5)):
        out = np.asarray(fn(*args))
        for i in (0, 1, seqs // 2, seqs - 1):
            one, k = _alone(args, i, rows=2, seqs=1)
            a = int(args[3][i])
            assert np.asarray(fn(*one))[:k].tobytes() == out[a:a + k].tobytes(), (seqs, i)


@pytest.mark.parametrize("head_dim", [32, 64])
def test_a_prompt_alone_and_packed_gives_the_same_logits(head_dim):
    """Through the whole qwen3-tiny program (bf16, 4 sequences an item), two chunks each. On a
    GPU, head_dim 32 takes the Triton kernel, 64 the Mosaic GPU one; on the CPU, blockwise."""
    fam, cfg = models.named("qwen3-tiny")
    cfg = dataclasses.replace(cfg, head_dim=head_dim)
    program = fam.program(cfg, dtype="bfloat16", rows=64, seqs=4, context=256)
    shape = item_shape(program, fam.page(cfg))
    donate = tuple(i for i, s in enumerate(program.inputs) if s.role == "state")
    fn = jax.jit(export_stage(whole(program)).call, donate_argnums=donate)
    rng = np.random.default_rng(3)
    weights = {s.name: jnp.asarray(0.05 * rng.standard_normal(s.shape), s.dtype)
               for s in program.inputs if s.role == "weight"}
    lo = [o.name for o in program.outputs].index("logits")
    prompt, other, third = (rng.integers(0, cfg.vocab, n) for n in (50, 40, 30))

    def run(chunks):  # chunks: per item, a list of (tokens, start, pages)
        states = {s.name: jnp.zeros(s.shape, s.dtype) for s in program.inputs if s.role == "state"}
        outs = []
        for pieces in chunks:
            item = make_item([Piece(t, a, p) for t, a, p in pieces], shape)
            args = [weights.get(s.name, states.get(s.name)) if s.role in ("weight", "state")
                    else item[s.name] for s in program.inputs]
            out = fn(*args)
            states.update({o.name: v for o, v in zip(program.outputs, out) if o.role == "state"})
            outs.append(np.asarray(out[lo]))
        return outs

    alone = run([[(prompt[:30], 0, (5, 2, 9, 4))], [(prompt[30:], 30, (5, 2, 9, 4))]])
    packed = run([[(other[:34], 0, (1, 3, 6)), (prompt[:30], 0, (10, 7, 11, 8))],
                  [(third, 0, (12, 13)), (other[34:], 34, (1, 3, 6)),
                   (prompt[30:], 30, (10, 7, 11, 8))]])
    assert alone[0][0].tobytes() == packed[0][1].tobytes()
    assert alone[1][0].tobytes() == packed[1][2].tobytes()


def test_the_cuda_route_is_chosen_by_dtype_and_shape():
    """bf16 with head_dim 128 runs FlashAttention-3 (`kj_fa3`) on CUDA; f16 or head_dim 64 the
    Mosaic GPU kernel; float32 the Triton one. The program says so, whatever device traced it."""
    from jax import export

    def lowered(dtype, d, page=16):
        kv = jax.ShapeDtypeStruct((9, page, 2, 2, d), dtype)
        q = jax.ShapeDtypeStruct((32, 8, d), dtype)
        i32 = [jax.ShapeDtypeStruct(s, jnp.int32) for s in ((32,), (3,), (2, 4))]
        f = jax.jit(lambda *a: attention.chunk_attention(*a, scale=d ** -0.5))
        return str(jax.make_jaxpr(f)(kv, q, *i32)), f, (kv, q, *i32)

    jaxpr, f, args = lowered(jnp.bfloat16, 128)
    assert "kj_fa3" in jaxpr and "mosaic" not in jaxpr
    ok = [export.DisabledSafetyCheck.custom_call("kj_fa3")]
    assert "kj_fa3" in export.export(f, platforms=["cuda"], disabled_checks=ok)(*args).mlir_module()
    for dtype, d in ((jnp.float16, 128), (jnp.bfloat16, 64)):
        assert "kj_fa3" not in lowered(dtype, d)[0]
    # pages of 128 (head_dim 128's): FlashAttention-3 reads them in place; the Mosaic GPU kernel
    # takes pages of 16 only, so f16 on pages of 128 goes to the Triton kernel
    assert "kj_fa3" in lowered(jnp.bfloat16, 128, page=128)[0]
    f16 = lowered(jnp.float16, 128, page=128)[0]
    assert "kj_fa3" not in f16 and "mosaic" not in f16


def test_a_page_is_128_rows_at_head_dim_128_and_16_elsewhere():
    """The page is a model constant (`page(cfg)`), so the state's shape and the cut id are the
    same on every platform; blockwise takes any page that whole key blocks hold."""
    fam, tiny = models.named("qwen3-tiny")
    _, big = models.named("qwen3-4b")
    assert (fam.page(tiny), fam.page(big)) == (16, 128)
    small = dataclasses.replace(big, layers=1, intermediate=256, vocab=512)
    program = fam.program(small, dtype="bfloat16", rows=64, context=300)
    kv = next(s for s in program.inputs if s.name == "kv.0")
    table = next(s for s in program.inputs if s.name == "page_table")
    assert kv.shape[1] == 128 and table.shape == (1, 3)  # 300 keys: 3 pages of 128
    assert item_shape(program, fam.page(small)).page == 128
    args = paged(np.random.default_rng(0), [40], [40], kvh=2, heads=4, d=16, width=1,
                 dtype="float32", rows=48, seqs=1, page=128)
    with pytest.raises(ValueError, match="key blocks of 64 rows must hold whole pages of 128"):
        attention.blockwise(*args, scale=0.25, block=64)


def test_a_flashattention_library_that_does_not_load_is_named_not_fatal(tmp_path):
    """kernjax.kernels.ffi loads FlashAttention-3 when it can; a bad library is reported by kj_fa3 when a
    program needs it (csrc/fa3.cu) and keeps nothing else from running."""
    from kernjax.kernels import ffi

    ffi.register()
    ext = ffi._extension()
    if not ext.has_cuda():
        pytest.skip("the extension was built without nvcc: no kj_fa3")
    bad = tmp_path / "libkj_fa3.so"
    bad.write_bytes(b"not a library")
    said = ext.fa3_load(str(bad))
    assert str(bad) in said and "cannot load" in said
    empty = tmp_path / "empty.so"
    assert "cannot load" in ext.fa3_load(str(empty))
