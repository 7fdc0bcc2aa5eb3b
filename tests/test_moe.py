"""MoE: routing (sigmoid, correction bias, top-k, renormalised, scaled) and the MXFP4 experts read
from the GEMM shuffle layout (models.md §3.3, §4.3)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernjax.models import moe as M
from kernjax.kernels import mxfp4 as q

H, I, E, K, IS, SCALE = 64, 32, 8, 2, 32, 2.446


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@functools.lru_cache(maxsize=None)
def _model(seed: int = 0):
    """Random experts quantised with `mxfp4.quantize`, in checkpoint and GEMM layouts."""
    rng = np.random.default_rng(seed)
    g = lambda *s: (rng.standard_normal(s) / np.sqrt(s[-1])).astype(np.float32)  # noqa: E731
    raw = {"w1": g(E, I, H), "w3": g(E, I, H), "w2": g(E, H, I)}
    qz = {k: q.quantize(v) for k, v in raw.items()}
    deq = {k: q.dequantize(*v) for k, v in qz.items()}
    gemm1, gemm2 = M.gemm_layout(qz["w1"], qz["w3"], qz["w2"])
    return dict(
        x=rng.standard_normal((16, H)).astype(np.float32),
        w_router=g(E, H), bias=(0.1 * rng.standard_normal(E)).astype(np.float32),
        shared=(g(IS, H), g(IS, H), g(H, IS)), qz=qz, deq=deq, gemm1=gemm1, gemm2=gemm2)


_moe = jax.jit(M.moe, static_argnames=("top_k", "scale"))


def _run(m, x, gemm1=None, gemm2=None, shared=None):
    return _moe(x, m["w_router"], m["bias"], gemm1 or m["gemm1"], gemm2 or m["gemm2"],
                shared or m["shared"], top_k=K, scale=SCALE)


def _ref(m, x, shared=None):
    d = m["deq"]
    return M.moe_reference(x, m["w_router"], m["bias"], d["w1"], d["w3"], d["w2"],
                           shared or m["shared"], top_k=K, scale=SCALE)


def test_layout_shapes():
    m = _model()
    (p1, s1), (p2, s2) = m["gemm1"], m["gemm2"]
    assert p1.shape == (E, 2 * 32, H // 2) and p1.dtype == jnp.uint8  # gated: 2 x 32 rows
    assert s1.shape == (E, 128 * 4) and p2.shape == (E, H, I // 2) and s2.shape == (E, 128 * 4)
    # the layout really permutes: GEMM1 shuffled row 1 is logical row 2 of [up; gate] = up_2
    # (32-row shuffle: row 1 <- 4; gated interleave: 4 <- up_2), row 8 is gate_0
    rows = q.shuffle_rows(2 * I, gated=True)
    assert rows[:3].tolist() == [0, 2, 4] and rows[8] == 32  # up_0, up_1, up_2 ... gate_0
    np.testing.assert_array_equal(np.asarray(p1)[:, 1], m["qz"]["w3"][0][:, 2])
    np.testing.assert_array_equal(np.asarray(p1)[:, 8], m["qz"]["w1"][0][:, 0])


def test_float32_matches_reference():
    m = _model()
    got, want = _run(m, m["x"]), _ref(m, m["x"])
    assert got.dtype == jnp.float32
    err = _rel(got, want)
    print(f"float32 rel err {err:.3e}, max abs {np.abs(np.asarray(got) - want).max():.3e}")
    assert err < 1e-5


def test_bf16_matches_reference():
    m = _model()
    xb = jnp.asarray(m["x"], jnp.bfloat16)
    sb = tuple(jnp.asarray(a, jnp.bfloat16) for a in m["shared"])
    got = _run(m, xb, shared=sb)
    assert got.dtype == jnp.bfloat16
    err = _rel(got, _ref(m, xb, shared=sb))  # the reference reads the same bf16 values in f32
    print(f"bf16 rel err {err:.3e}")
    assert err < 2e-2


def test_unshuffled_weights_give_a_wrong_answer():
    """Proves `moe` reads the layout: checkpoint-order rows (scales in the flat swizzle but not
    row-permuted), or shuffled bytes with unpermuted scales, both miss the reference."""
    m = _model()
    qz, want = m["qz"], _ref(m, m["x"])

    def flat(s):  # swizzle only, no row permutation
        e, rows, k_sf = s.shape
        off = q.sf_offsets(rows, k_sf)
        out = np.zeros((e, off.size), np.uint8)
        out[:, off[:rows, :k_sf].reshape(-1)] = s.reshape(e, -1)
        return jnp.asarray(out)

    p1 = np.concatenate([qz["w3"][0], qz["w1"][0]], 1)
    s1 = np.concatenate([qz["w3"][1], qz["w1"][1]], 1)
    raw1, raw2 = (jnp.asarray(p1), flat(s1)), (jnp.asarray(qz["w2"][0]), flat(qz["w2"][1]))
    errs = [_rel(_run(m, m["x"], gemm1=raw1), want), _rel(_run(m, m["x"], gemm2=raw2), want),
            _rel(_run(m, m["x"], gemm1=(m["gemm1"][0], flat(s1))), want)]
    print("unshuffled rel errs", [f"{e:.2f}" for e in errs])
    assert min(errs) > 0.1


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_batch_invariance_bitwise(dtype):
    """A token's output has the same bits whatever the other rows hold (same shapes)."""
    m = _model()
    rng = np.random.default_rng(7)
    x = jnp.asarray(m["x"], dtype)
    y = np.asarray(_run(m, x).astype(jnp.float32)).view(np.uint32)
    for keep in (0, 5, 15):
        other = rng.standard_normal(m["x"].shape).astype(np.float32)
        for fill in (other, np.zeros_like(other)):
            x2 = np.where(np.arange(16)[:, None] == keep, m["x"], fill)
            y2 = np.asarray(_run(m, jnp.asarray(x2, dtype)).astype(jnp.float32)).view(np.uint32)
            np.testing.assert_array_equal(y2[keep], y[keep])


def test_routing_matches_definition_and_bias_moves_selection_only():
    m = _model()
    x = jnp.asarray(m["x"])
    s = jax.nn.sigmoid(jnp.dot(x, m["w_router"].T, precision="highest"))
    ids, w = M.route(x, m["w_router"], np.zeros(E, np.float32), top_k=K, scale=SCALE)
    assert ids.dtype == jnp.int32 and w.dtype == jnp.float32 and ids.shape == (16, K)
    np.testing.assert_array_equal(ids, np.argsort(-np.asarray(s), 1, kind="stable")[:, :K])
    np.testing.assert_allclose(w.sum(1), SCALE, rtol=1e-6)
    # a large bias on expert 5 makes every token pick it; weights stay the unbiased scores,
    # renormalised over the chosen set and scaled
    bias = np.zeros(E, np.float32)
    bias[5] = 10.0
    ids_b, w_b = M.route(x, m["w_router"], bias, top_k=K, scale=SCALE)
    assert (np.asarray(ids_b)[:, 0] == 5).all()
    assert (np.asarray(ids_b) != np.asarray(ids)).any()
    chosen = np.take_along_axis(np.asarray(s), np.asarray(ids_b), 1)
    np.testing.assert_allclose(w_b, chosen / chosen.sum(1, keepdims=True) * SCALE, rtol=1e-6)
    np.testing.assert_allclose(w_b.sum(1), SCALE, rtol=1e-6)
    # the bias is not in the weights: doubling it (same choice) leaves them bitwise unchanged
    ids_2, w_2 = M.route(x, m["w_router"], 2 * bias, top_k=K, scale=SCALE)
    np.testing.assert_array_equal(ids_2, ids_b)
    np.testing.assert_array_equal(w_2, w_b)


def test_routing_ties_go_to_the_lowest_index():
    x = np.ones((3, H), np.float32)
    w0 = np.zeros((E, H), np.float32)  # every score 0.5
    ids, w = M.route(x, w0, np.zeros(E, np.float32), top_k=3, scale=1.0)
    assert np.asarray(ids).tolist() == [[0, 1, 2]] * 3
    np.testing.assert_array_equal(w, np.full((3, 3), 1 / 3, np.float32))
    bias = np.array([0, 0, 0, 1, 0, 0, 1, 0.5], np.float32)  # 3 and 6 tie at the top, then 7
    ids, w = M.route(x, w0, bias, top_k=3, scale=2.0)
    assert np.asarray(ids).tolist() == [[3, 6, 7]] * 3
    np.testing.assert_allclose(w, np.full((3, 3), 2 / 3), rtol=1e-6)
    # and under jit
    ids_j, _ = jax.jit(M.route, static_argnames=("top_k", "scale"))(x, w0, bias, top_k=2,
                                                                   scale=1.0)
    assert np.asarray(ids_j).tolist() == [[3, 6]] * 3
