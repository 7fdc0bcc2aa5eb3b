"""MLA over a paged latent state (`models/mla.py`), small config of models.md §3.4 (4 heads,
kv_lora 64, nope 32, rope 16 unrotated, v 32): the blockwise absorbed form (and the naive form)
against the float32 dense reference, padding rows zero, batch invariance, and write+attend in
chunks against a textbook causal MLA built from §3.2."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernjax.core.item import Piece, Shape, make_item
from kernjax.models import mla
from tests.test_attention import lease

PAGE = mla.PAGE
H, LORA, NOPE, ROPE, V = 4, 64, 32, 16, 32
SCALE = mla.softmax_scale(NOPE, ROPE)


def paged(rng, lengths, chunks, *, width, dtype, rows, seqs):
    """A random latent state holding `lengths[i]` tokens of each sequence on shuffled pages (two
    spare pages unused), and the item of each sequence's last `chunks[i]` rows."""
    pages, item = lease(rng, lengths, chunks, width=width, rows=rows, seqs=seqs)
    state = rng.standard_normal((pages, PAGE, LORA + ROPE)).astype(np.float32)
    q_nope = rng.standard_normal((rows, H, NOPE)).astype(np.float32)
    q_pe = rng.standard_normal((rows, H, ROPE)).astype(np.float32)
    w = (rng.standard_normal((H * (NOPE + V), LORA)) / np.sqrt(LORA)).astype(np.float32)
    cast = lambda x: jnp.asarray(x, dtype)  # noqa: E731
    return (cast(state), cast(q_nope), cast(q_pe), cast(w), jnp.asarray(item["positions"]),
            jnp.asarray(item["cu_seqlens"]), jnp.asarray(item["page_table"]))


CASES = [  # (lengths, chunk rows per sequence, rows, seqs, width, block)
    ([40], [40], 48, 1, 4, 32),  # one sequence from position 0, padding rows after it
    ([100], [7], 8, 1, 8, 32),  # a chunk at the end of a 100-token context, last page part full
    ([37, 0, 1, 64], [5, 0, 1, 16], 24, 5, 5, 32),  # packed, an empty piece and an empty slot
    ([129, 17, 50, 3], [64, 17, 9, 2], 96, 4, 9, 128),  # four packed
]
reference = jax.jit(functools.partial(mla.reference, scale=SCALE))


def _f32(args, dtype):
    return [a.astype(jnp.float32) if a.dtype == dtype else a for a in args]


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-5), ("bfloat16", 1e-2)])
@pytest.mark.parametrize("case", CASES)
def test_attend_is_mla(case, dtype, tol, form="absorbed"):
    lengths, chunks, rows, seqs, width, block = case
    rng = np.random.default_rng(len(lengths) * 100 + rows)
    args = paged(rng, lengths, chunks, width=width, dtype=dtype, rows=rows, seqs=seqs)
    fn = jax.jit(functools.partial(mla.attend, scale=SCALE, block=block, form=form))
    got = fn(*args)
    assert got.dtype == jnp.dtype(dtype)
    ref = np.asarray(reference(*_f32(args, dtype)))
    got = np.asarray(got, np.float32)
    assert got.shape == (rows, H, V) and not np.isnan(got).any()
    n = sum(chunks)
    err = np.linalg.norm(got[:n] - ref[:n]) / np.linalg.norm(ref[:n])
    print(f"\n{form} {dtype} lengths={lengths}: rel err {err:.2e}")
    assert err < tol
    assert not got[n:].any(), "padding rows must be written as zeros"


@pytest.mark.parametrize("case", CASES)
def test_absorbed_and_naive_agree(case):
    lengths, chunks, rows, seqs, width, block = case
    rng = np.random.default_rng(5)
    args = paged(rng, lengths, chunks, width=width, dtype="float32", rows=rows, seqs=seqs)
    a, b = (np.asarray(jax.jit(functools.partial(mla.attend, scale=SCALE, block=block,
                                                 form=form))(*args))
            for form in ("absorbed", "naive"))
    err = np.linalg.norm(a - b) / np.linalg.norm(b)
    print(f"\nabsorbed vs naive lengths={lengths}: rel err {err:.2e}")
    assert err < 1e-5


@pytest.mark.parametrize("form", ["absorbed", "naive"])
def test_attend_is_batch_invariant(form):
    """The same sequence alone, and packed in another slot with others, gives the same bytes."""
    rng = np.random.default_rng(7)
    state, qn, qp, w, pos, cu, table = paged(rng, [150, 33, 90], [20, 33, 11], width=12,
                                             dtype="bfloat16", rows=64, seqs=3)
    fn = jax.jit(functools.partial(mla.attend, scale=SCALE, block=32, form=form))
    packed = np.asarray(fn(state, qn, qp, w, pos, cu, table))
    a, b = int(cu[2]), int(cu[3])  # the third sequence, moved to slot 0 and row 0
    move = lambda x: jnp.zeros_like(x).at[: b - a].set(x[a:b])  # noqa: E731
    cu1 = jnp.asarray([0, b - a, b - a, b - a], jnp.int32)
    table1 = jnp.zeros_like(table).at[0].set(table[2])
    alone = np.asarray(fn(state, move(qn), move(qp), w, move(pos), cu1, table1))
    assert alone[: b - a].tobytes() == packed[a:b].tobytes()


def test_write_then_attend_in_chunks_is_causal_mla():
    """x -> §3.2's projections; two sequences prefilled in two chunks (packed, shuffled pages,
    padding rows whose writes drop) through `latent`, `write`, `attend`, against a dense causal
    MLA computed from the same projections in float32."""
    rng = np.random.default_rng(11)
    D, eps, rows, seqs, width, pages = 48, 1e-5, 40, 2, 4, 10
    wq = rng.standard_normal((H * (NOPE + ROPE), D)) / np.sqrt(D)
    wa = rng.standard_normal((LORA + ROPE, D)) / np.sqrt(D)
    wn = 1.0 + 0.1 * rng.standard_normal(LORA)
    wb = rng.standard_normal((H * (NOPE + V), LORA)) / np.sqrt(LORA)
    lens, split = [40, 25], [22, 10]
    xs = [rng.standard_normal((n, D)) for n in lens]
    page_ids = [(7, 2, 9), (4, 1)]
    f = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    state = jnp.zeros((pages, PAGE, LORA + ROPE), jnp.float32)
    outs = [[], []]

    @jax.jit
    def chunk(state, x, slots, positions, cu_seqlens, page_table):
        q = (x @ f(wq).T).reshape(rows, H, NOPE + ROPE)
        ckv, k_pe = mla.latent(x @ f(wa).T, f(wn), kv_lora=LORA, eps=eps)
        state = mla.write(state, ckv, k_pe, slots)
        return state, mla.attend(state, q[..., :NOPE], q[..., NOPE:], f(wb), positions,
                                 cu_seqlens, page_table, scale=SCALE, block=32)

    for c in range(2):
        pieces = [(i, (0, split[i]) if c == 0 else (split[i], lens[i])) for i in range(2)]
        item = make_item([Piece(np.zeros(b - a, np.int32), a, page_ids[i])
                          for i, (a, b) in pieces], Shape(rows, seqs, width, pages, PAGE))
        x = np.zeros((rows, D))
        x[:sum(b - a for _, (a, b) in pieces)] = np.concatenate([xs[i][a:b]
                                                                 for i, (a, b) in pieces])
        state, o = chunk(state, f(x), jnp.asarray(item["slots"]),
                         jnp.asarray(item["positions"]), jnp.asarray(item["cu_seqlens"]),
                         jnp.asarray(item["page_table"]))
        at = 0
        for i, (a, b) in pieces:
            outs[i].append(np.asarray(o[at:at + b - a]))
            at += b - a
        assert not np.asarray(o[at:]).any()
    hi = jax.lax.Precision.HIGHEST
    for i in range(2):  # textbook: k = [k_nope | k_pe] per head, causal softmax, no rotation
        x = f(xs[i])
        q = jnp.dot(x, f(wq).T, precision=hi).reshape(-1, H, NOPE + ROPE)
        c = jnp.dot(x, f(wa).T, precision=hi)
        ckv = c[:, :LORA] * jax.lax.rsqrt(jnp.mean(c[:, :LORA] ** 2, -1, keepdims=True) + eps)
        kv = jnp.dot(ckv * f(wn), f(wb).T, precision=hi).reshape(-1, H, NOPE + V)
        k = jnp.concatenate([kv[..., :NOPE], jnp.broadcast_to(c[:, None, LORA:],
                                                              (len(x), H, ROPE))], -1)
        s = jnp.einsum("thd,uhd->htu", q, k, precision=hi) * SCALE
        s = jnp.where(jnp.tril(jnp.ones((len(x), len(x)), bool)), s, -jnp.inf)
        ref = np.asarray(jnp.einsum("htu,uhv->thv", jax.nn.softmax(s, -1), kv[..., NOPE:],
                                    precision=hi))
        got = np.concatenate(outs[i])
        err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
        print(f"\nwrite+attend seq {i}: rel err {err:.2e}")
        assert err < 1e-5
