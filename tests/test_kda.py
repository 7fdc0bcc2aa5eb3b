"""KDA (`kernjax/kernels/kda.py`): the recurrent reference against a hand computation and a per-sequence
float64 oracle, the chunked form against the reference by fla's rule (models.md §2.5), padding rows
that change nothing, and a sequence giving the same result alone and packed with others."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

from kernjax.kernels import kda

naive = jax.jit(kda.naive)
chunked = jax.jit(kda.chunked, static_argnames="chunk")
flash = jax.jit(kda.flash)  # the custom op kj_kda: its CPU handler here, CUDA on a GPU


def assert_close(ref, got, ratio=5e-3):
    """fla's `assert_close`: max abs error ≤ 1e-6, or relative RMS error below `ratio`."""
    ref, got = np.asarray(ref, np.float64), np.asarray(got, np.float64)
    err = np.abs(ref - got).max()
    rel = np.sqrt(np.mean((ref - got) ** 2) / max(np.mean(ref ** 2), 1e-30))
    assert err <= 1e-6 or rel < ratio, (err, rel)
    return err, rel


# The chunked forms (`kda.chunked`, and `kda.flash`'s CPU handler) against the float32
# recurrence on the CPU reach a relative RMS error of at most 8e-7 (max abs 1.1e-6) over CASES
# and FLASH_CASES (measured 2026-12-07): float32 rounding in a chunk's sums, a few ulps (eps
# 1.2e-7). Bounded at 1e-5, 12x that, so a change in summation order passes and a wrong term
# (an error of 1e-3 or more) does not. On a GPU (TF32 matmuls, other orders): fla's 5e-3.
F32 = 1e-5 if jax.default_backend() == "cpu" else 5e-3


def inputs(rng, lengths, T, *, H=2, K=16, h0=True, decay=4.0):
    """A packed batch as KDA sees it: l2-normalised q/k, g = logsigmoid(randn)/decay ≤ 0,
    β = sigmoid(randn) ∈ (0, 1), random padding rows past cu[-1], fp32 h0 ~ randn (or None)."""
    l2 = lambda x: x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)  # noqa: E731
    f = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    g = (-np.logaddexp(0, -f(T, H, K)) / decay).astype(np.float32)
    beta = (1 / (1 + np.exp(-f(T, H)))).astype(np.float32)
    state = f(len(lengths), H, K, K) if h0 else None
    return [l2(f(T, H, K)), l2(f(T, H, K)), f(T, H, K), g, beta, cu, state]


def oracle(q, k, v, g, beta, cu, h0):
    """§2.3: the recurrence run on each slice separately, in float64 numpy."""
    K, N = q.shape[-1], len(cu) - 1
    o, final = np.zeros(v.shape), np.zeros((N,) + q.shape[1:] + v.shape[-1:])
    for s in range(N):
        S = np.zeros(final.shape[1:]) if h0 is None else h0[s].astype(np.float64)
        for t in range(cu[s], cu[s + 1]):
            S = S * np.exp(g[t])[:, :, None]
            pred = np.einsum("hkv,hk->hv", S, k[t])
            S = S + (beta[t][:, None] * k[t])[:, :, None] * (v[t] - pred)[:, None, :]
            o[t] = np.einsum("hkv,hk->hv", S, q[t] * K ** -0.5)
        final[s] = S
    return o, final


def test_hand_case():
    """T=2, H=1, K=V=1 (scale 1): with S0=h0, decay a_t=exp(g_t),
    S1 = a1·S0 + β1·k1·(v1 − k1·a1·S0), o1 = q1·S1, and the same for t=2."""
    q, k, v = [[[1.0]], [[3.0]]], [[[1.0]], [[2.0]]], [[[2.0]], [[4.0]]]
    g, beta, cu = np.log([[[0.5]], [[0.5]]]), [[0.5], [0.25]], np.array([0, 2])
    args = [np.asarray(x, np.float32) for x in (q, k, v, g, beta)] + [cu]
    # h0 = 0: S1 = 0 + 0.5·1·(2 − 0) = 1, o1 = 1; S2 = 0.5 + 0.25·2·(4 − 2·0.5) = 2, o2 = 3·2 = 6
    # h0 = 4: S1 = 2 + 0.5·(2 − 2) = 2, o1 = 2; S2 = 1 + 0.25·2·(4 − 2·1) = 2, o2 = 6
    four = np.full((1, 1, 1, 1), 4, np.float32)
    for h0, want_o, want_s in ((None, [1, 6], 2), (four, [2, 6], 2)):
        for fn in (naive, chunked, functools.partial(chunked, chunk=1)):
            o, s = fn(*args, h0)
            np.testing.assert_allclose(np.asarray(o).ravel(), want_o, rtol=1e-6)
            np.testing.assert_allclose(np.asarray(s).ravel(), [want_s], rtol=1e-6)


CASES = [  # (lengths, T, K, h0, decay)
    ([300], 320, 16, False, 4.0),
    ([1, 63, 64, 65, 100], 320, 32, True, 4.0),
    ([128, 0, 127, 7], 320, 16, True, 1.0),  # an empty sequence keeps its initial state
    ([150, 149], 320, 32, False, 0.1),  # strong decay: Γ reaches about −590 within a chunk
    ([5, 200, 33, 1, 60], 320, 16, False, 4.0),
]


@pytest.mark.parametrize("case", CASES)
def test_chunked_matches_naive(case):
    lengths, T, K, h0, decay = case
    rng = np.random.default_rng(sum(lengths) + K)
    args = inputs(rng, lengths, T, K=K, h0=h0, decay=decay)
    o_n, s_n = map(np.asarray, naive(*args))
    o_c, s_c = map(np.asarray, chunked(*args))
    o_ref, s_ref = oracle(*args)
    n = args[5][-1]
    assert_close(o_ref[:n], o_n[:n], 1e-5)
    assert_close(s_ref, s_n, 1e-5)
    assert_close(o_n, o_c, F32)
    assert_close(s_n, s_c, F32)
    assert np.isfinite(o_c).all() and not o_n[n:].any() and not o_c[n:].any()
    if h0 and 0 in lengths:
        i = lengths.index(0)
        assert (s_n[i] == args[6][i]).all() and (s_c[i] == args[6][i]).all()


@pytest.mark.parametrize("fn", [naive, chunked], ids=["naive", "chunked"])
def test_padding_changes_nothing(fn):
    """The same sequences with 0 or 70 random padding rows after them: identical real rows, zero
    padding rows, identical final states (bitwise)."""
    lengths = [90, 37]
    args = inputs(np.random.default_rng(1), lengths, 127 + 70)
    short = [x[:127] for x in args[:5]] + args[5:]
    o0, s0 = map(np.asarray, fn(*short))
    o1, s1 = map(np.asarray, fn(*args))
    assert (o1[:127] == o0).all() and (s1 == s0).all() and not o1[127:].any()


@pytest.mark.parametrize("fn", [naive, chunked, flash], ids=["naive", "chunked", "flash"])
def test_alone_vs_packed(fn):
    """Sequence of length 100 with its initial state, alone (T=100) and packed third of four with
    padding (T=320): the same output rows and final state, bitwise."""
    lengths = [70, 13, 100, 64]
    args = inputs(np.random.default_rng(2), lengths, 320, h0=True)
    a, b = 83, 183
    alone = [x[a:b] for x in args[:5]] + [np.array([0, 100], np.int32), args[6][2:3]]
    o0, s0 = map(np.asarray, fn(*alone))
    o1, s1 = map(np.asarray, fn(*args))
    assert (o1[a:b] == o0).all() and (s1[2] == s0[0]).all()


# ---- the custom op kj_kda (csrc/kda.{h,cc,cu}): the CPU handler here, CUDA on a GPU ----

FLASH_CASES = {
    "one-short": ([5], 8, 16),
    "varlen-with-empty-and-padding": ([1, 17, 0, 40, 16], 90, 32),
    "long-decay": ([100, 3], 110, 64),
}


@pytest.mark.parametrize("case", list(FLASH_CASES))
def test_flash_matches_the_recurrence(case):
    lengths, T, K = FLASH_CASES[case]
    args = inputs(np.random.default_rng(len(case)), lengths, T, K=K)
    o, final = flash(*args)
    want_o, want_final = oracle(*args)
    n = int(args[5][-1])
    assert_close(want_o[:n], o[:n], F32)
    assert_close(want_final, final, F32)
    assert (np.asarray(o[n:]) == 0).all(), "padding rows are zero"
    # The same algorithm as the chunked reference at chunk 16, to float32 rounding.
    ref_o, ref_final = chunked(*args, chunk=16)
    np.testing.assert_allclose(o, ref_o, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(final, ref_final, rtol=1e-4, atol=1e-5)
    again = flash(*args)
    assert np.asarray(again[0]).tobytes() == np.asarray(o).tobytes(), "run to run"


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
@pytest.mark.parametrize("seed", range(3))
def test_flash_on_the_gpu_random_varlen_batches(seed):
    """K = V = 128, 1 to 16 sequences of 1 to 5000 rows: fla's rule against the float32 naive
    recurrence on the same device, bitwise run to run, alone = packed."""
    rng = np.random.default_rng(seed)
    lengths = list(rng.integers(1, 5001, rng.integers(1, 17)))
    T = sum(lengths) + 7
    args = inputs(rng, lengths, T, K=128)
    o, final = flash(*args)
    want_o, want_final = naive(*args)
    n = int(args[5][-1])
    assert_close(want_o[:n], o[:n])
    assert_close(want_final, final)
    again = flash(*args)
    assert np.asarray(again[0]).tobytes() == np.asarray(o).tobytes()
    a, b = int(args[5][0]), int(args[5][1])  # the first sequence alone
    alone = flash(*(x[a:b] for x in args[:5]), np.array([0, b - a], np.int32), args[6][:1])
    assert np.asarray(alone[0]).tobytes() == np.asarray(o[a:b]).tobytes()
