"""The head of every program: logits, log-probabilities, top-k and sampling, the same bits for a
row whatever else its item holds.

These are the bodies of a model's last calls (`lm_head`, `sample`, `score`); models supply their
own GEMM (`matmul`, x @ wᵀ with the checkpoint's [out, in] weight) and nothing here knows a model.

The vocabulary is taken in slices of at most `SLICE` columns (full slices in a loop, then the
rest): logits are made one slice at a time, and log-probabilities come from an online
log-sum-exp over the slices, so the score of a whole chunk never holds a `[rows, vocab]` float32
array, only `[rows, SLICE]`. The logits of `lm_head` are made in the same slices and its
log-probabilities by the same online pass, so a token's log-probability is one function of its
row's hidden state, whether it was sampled (`sample`) or scored as part of a prompt (`score`);
which bits that function gives for a row does not depend on its neighbours where the GEMM gives
every row the same reduction order at every row count (XLA's CPU GEMM does for two rows or more;
`pad_rows` keeps one-row GEMMs off its GEMV).

Sampling is a pure function of the row's logits and its fills: `sampling` [n, 4] float32 holds
(temperature, top_p, top_k, min_p) and `rng` [n, 3] uint32 (seed, choice, step). Temperature 0
is greedy (the first maximum). Otherwise the logits are divided by the temperature, the filters
keep a token that is among the `top_k` largest (0: no limit), inside the smallest set whose
probability reaches `top_p` (1: no limit) and at least `min_p` times as likely as the most likely
token (0: no limit), all three on that one distribution, and the token is the Gumbel-max draw
over what is kept, with the key `fold_in(fold_in(key(seed), choice), step)`. The log-probabilities
returned are the model's own (`log_softmax` of the raw logits, as vLLM's default): the chosen
token's and the `K` largest.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from kernjax.kernels.reduce import rowsum

K = 20       # top log-probabilities every program returns per row (OpenAI's most)
SLICE = 8192  # vocabulary columns per slice
STEP = 16     # the largest k XLA:GPU's TopK kernel takes (past it, each row is sorted whole)
F32 = jnp.float32


def top_k(x, k: int):
    """`jax.lax.top_k(x, k)` (each row's k largest, largest first, the lower index first among
    equals) taken at most `STEP` at a time: the next step's candidates are the row with the ones
    taken set to -inf. The same values and indices where every row has k entries above -inf
    (the taken ones are never candidates again). On a GPU each step is XLA's TopK kernel (k <= 16,
    rows of 1024 or more), where one top-20 is a sort of the row."""
    x = jnp.asarray(x)
    vals, idx = [], []
    rows = jnp.arange(x.shape[0])[:, None]
    while k > 0:
        v, i = jax.lax.top_k(x, min(k, STEP))
        vals.append(v)
        idx.append(i)
        k -= v.shape[1]
        if k > 0:
            x = x.at[rows, i].set(-jnp.inf)
    return jnp.concatenate(vals, axis=1), jnp.concatenate(idx, axis=1)


def pad_rows(x):
    """`x` [rows, d] with a copy of its one row when it has one: XLA's CPU GEMM reduces a row
    in one order for any row count from two up, and its GEMV (one row) in another; undo with
    `[:1]`."""
    return jnp.concatenate([x, x]) if x.shape[0] == 1 else x


def _bounds(vocab: int, slice_: int) -> tuple[int, int, int]:
    """(slice width, full slices, the rest's width) of a vocabulary of `vocab` columns."""
    s = min(vocab, slice_)
    return s, vocab // s, vocab - (vocab // s) * s


def logits(a, w, matmul: Callable, *, slice_: int = SLICE):
    """`matmul(a, w)` [rows, vocab] (in `matmul`'s dtype), made one vocabulary slice at a time:
    each slice's columns are the GEMM of that slice of `w`, as `score` makes them."""
    vocab = w.shape[0]
    s, n, rest = _bounds(vocab, slice_)
    rows = a.shape[0]
    a2 = pad_rows(a)
    dt = jax.eval_shape(matmul, a2, w[:1]).dtype

    def one(j, out):
        ws = jax.lax.dynamic_slice_in_dim(w, j * s, s, axis=0)
        return jax.lax.dynamic_update_slice_in_dim(out, matmul(a2, ws)[:rows], j * s, axis=1)

    out = jax.lax.fori_loop(0, n, one, jnp.zeros((rows, vocab), dt))
    if rest:
        out = out.at[:, n * s:].set(matmul(a2, w[n * s:])[:rows])
    return out


def _online(slices: Callable, vocab: int, rows: int, targets, *, slice_: int):
    """The online pass over the vocabulary: `slices(start, width)` gives the float32 logits of
    columns `start..start+width`. Returns (log-probability of each row's target, top-K ids,
    top-K log-probabilities)."""
    s, n, rest = _bounds(vocab, slice_)
    k = min(K, vocab)

    def update(carry, start, width, lg):
        m, z, tgt, tv, ti = carry
        m_new = jnp.maximum(m, lg.max(-1))
        z = z * jnp.exp(m - m_new) + rowsum(jnp.exp(lg - m_new[:, None]))
        at = targets - start
        inside = (at >= 0) & (at < width)
        hit = jnp.take_along_axis(lg, jnp.clip(at, 0, width - 1)[:, None], axis=1)[:, 0]
        tgt = jnp.where(inside, hit, tgt)
        cv = jnp.concatenate([tv, lg], axis=1)
        ci = jnp.concatenate([ti, start + jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32),
                                                           (rows, width))], axis=1)
        tv, at_k = top_k(cv, k)
        return m_new, z, tgt, tv, jnp.take_along_axis(ci, at_k, axis=1)

    carry = (jnp.full((rows,), -jnp.inf, F32), jnp.zeros((rows,), F32), jnp.zeros((rows,), F32),
             jnp.full((rows, k), -jnp.inf, F32), jnp.zeros((rows, k), jnp.int32))
    carry = jax.lax.fori_loop(0, n, lambda j, c: update(c, j * s, s, slices(j * s, s)), carry)
    if rest:
        carry = update(carry, n * s, rest, slices(n * s, rest))
    m, z, tgt, tv, ti = carry
    lse = m + jnp.log(z)
    return tgt - lse, ti, tv - lse[:, None]


def score(a, w, targets, matmul: Callable, *, slice_: int = SLICE):
    """Every row's log-probability of its target token and its top-K, from the hidden states
    `a` [rows, d] and the head's weight `w` [vocab, d]: (float32 [rows], int32 [rows, K],
    float32 [rows, K]). Only one slice's logits exist at a time."""
    a2 = pad_rows(a)
    rows = a.shape[0]

    def slices(start, width):
        ws = jax.lax.dynamic_slice_in_dim(w, start, width, axis=0) if not isinstance(
            start, int) else w[start:start + width]
        return matmul(a2, ws)[:rows].astype(F32)

    return _online(slices, w.shape[0], rows, targets, slice_=slice_)


def logprobs(x, targets, *, slice_: int = SLICE):
    """`score`'s outputs from logits `x` [n, vocab] already made (by `logits`, slice by slice)."""
    def slices(start, width):
        return jax.lax.dynamic_slice_in_dim(x, start, width, axis=1).astype(F32)

    return _online(slices, x.shape[1], x.shape[0], targets, slice_=slice_)


def sample(x, sampling, rng, *, slice_: int = SLICE):
    """The next token of each row of logits `x` [n, vocab] and its log-probability and top-K
    (the module docstring's rules): (int32 [n], float32 [n], int32 [n, K], float32 [n, K]).
    The draw runs only when a row samples, and the sort only when a row asks for top_k or
    top_p; a filter a row does not ask for keeps every token, so no row's token depends on
    what its neighbours ask."""
    n, vocab = x.shape
    x32 = x.astype(F32)
    temp, top_p, top_k, min_p = (sampling[:, i] for i in range(4))
    greedy = jnp.argmax(x32, axis=-1).astype(jnp.int32)

    def draw(_):
        z = x32 / jnp.where(temp > 0, temp, 1.0)[:, None]
        top = z.max(-1, keepdims=True)
        keep = jnp.exp(z - top) >= min_p[:, None]  # p >= min_p * max p, with no sum

        def ranked(keep):
            desc = -jnp.sort(-z, axis=-1)
            kk = jnp.clip(top_k, 1, vocab).astype(jnp.int32)
            kth = jnp.take_along_axis(desc, (kk - 1)[:, None], axis=1)
            e = jnp.exp(desc - top)
            p_desc = e / rowsum(e)[:, None]
            # the probability of the larger tokens, by a fixed-order scan
            before = jax.lax.associative_scan(jnp.add, p_desc, axis=1) - p_desc
            last = jnp.maximum(jnp.sum(before < top_p[:, None], axis=-1), 1) - 1
            pth = jnp.take_along_axis(desc, last[:, None].astype(jnp.int32), axis=1)
            return (keep & jnp.where(top_k[:, None] >= 1, z >= kth, True)
                    & jnp.where(top_p[:, None] < 1, z >= pth, True))

        keep = jax.lax.cond(jnp.any((top_k >= 1) | (top_p < 1)), ranked, lambda k: k, keep)

        def gumbel(r):
            key = jax.random.fold_in(jax.random.fold_in(jax.random.key(r[0]), r[1]), r[2])
            return jax.random.gumbel(key, (vocab,), F32)

        g = jax.vmap(gumbel)(rng)
        return jnp.argmax(jnp.where(keep, z + g, -jnp.inf), axis=-1).astype(jnp.int32)

    drawn = jax.lax.cond(jnp.any(temp > 0), draw, lambda _: greedy, None)
    token = jnp.where(temp > 0, drawn, greedy)
    lp, ti, tl = logprobs(x, token, slice_=slice_)
    return token, lp, ti, tl
