"""MXFP4 storage and the GEMM shuffle layout (models.md §4)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from kernjax.kernels import mxfp4 as q

GRID = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6])


def _bits(a) -> np.ndarray:
    return np.asarray(a, np.float32).view(np.uint32)


def _both(x):
    """quantize in numpy and jnp, asserting they agree bit for bit."""
    p, s = q.quantize(x)
    pj, sj = q.quantize_jnp(x)
    np.testing.assert_array_equal(np.asarray(pj), p)
    np.testing.assert_array_equal(np.asarray(sj), s)
    d = q.dequantize(p, s)
    np.testing.assert_array_equal(_bits(q.dequantize_jnp(p, s)), _bits(d))
    return p, s, d


def _wide(rng, shape):
    """Random float32 over a wide range: normals, subnormals, zeros of both signs."""
    x = rng.standard_normal(shape) * np.exp2(rng.integers(-140, 120, shape[:-1] + (1,)))
    x = x.astype(np.float32)
    x[rng.random(shape) < 0.05] = 0.0
    x[rng.random(shape) < 0.05] = -0.0
    return x


def test_packing_and_scale_by_hand():
    x = np.zeros(32, np.float32)
    x[:4] = [1.0, -6.0, 0.5, 3.0]  # amax 6: floor(log2 6) - 2 = 0 -> code 127, scale 1
    p, s, d = _both(x)
    assert s.tolist() == [127]
    assert p[:3].tolist() == [0xF2, 0x51, 0x00]  # even element in the low nibble; -6 = 8|7
    np.testing.assert_array_equal(d, x)


def test_round_trip_is_nearest_with_the_ocp_scale():
    rng = np.random.default_rng(0)
    x = _wide(rng, (8, 4, 256))
    p, s, d = _both(x)
    amax = np.abs(x.astype(np.float64)).reshape(8, 4, -1, 32).max(-1)
    with np.errstate(divide="ignore"):
        want = np.where(amax > 0, np.floor(np.log2(amax)) - 2 + 127, 0)
    np.testing.assert_array_equal(s, np.maximum(want, 0))
    scale = np.repeat(np.exp2(s.astype(np.float64) - 127), 32, -1)
    y = np.abs(x.astype(np.float64)) / scale
    err = np.min(np.abs(y[..., None] - GRID), -1)  # distance to the nearest grid value
    got = np.abs(d.astype(np.float64) - x) / scale
    np.testing.assert_array_equal(got, np.where(y > 6, y - 6, err))  # nearest, or saturated
    assert (np.signbit(d) == np.signbit(x)).all()
    assert got.max() < 2 and (got[y <= 6] <= 1).all()  # y < 8; half the widest step (4 -> 6)


def test_grid_values_times_powers_of_two_are_exact():
    rng = np.random.default_rng(1)
    codes = rng.integers(0, 16, (64, 128))
    e = rng.integers(-120, 120, (64, 4, 1))
    x = (np.where(codes & 8, -1, 1) * GRID[codes & 7]).reshape(64, 4, 32) * np.exp2(e)
    x = x.reshape(64, 128).astype(np.float32)
    _, _, d = _both(x)
    np.testing.assert_array_equal(d, x)


def test_ties_go_to_the_even_code():
    x = np.zeros(32, np.float32)
    x[:8] = [4, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5]  # scale 1
    _, s, d = _both(x)
    assert s.tolist() == [127] and d[:8].tolist() == [4, 0, 1, 1, 2, 2, 4, 4]


def test_special_blocks():
    x = np.zeros((6, 32), np.float32)
    x[1] = -0.0
    x[2] = 5.0     # all equal: scale 1, 5 is a tie between 4 and 6 -> 4
    x[3] = 0.375   # all equal: floor(log2 .375) - 2 = -4, 0.375 * 16 = 6: exact
    x[4, 0], x[4, 1], x[4, 2] = 7.9, 6.5, -100.0  # amax 100: scale 2^4; 7.9/16 -> 0.5
    x[5] = np.linspace(-1, 1, 32)
    p, s, d = _both(x)
    assert s[:, 0].tolist() == [0, 0, 127, 123, 131, 125]
    assert (p[0] == 0).all() and (p[1] == 0x88).all()  # +0 and -0 codes
    np.testing.assert_array_equal(_bits(d[:2]), _bits(x[:2]))
    assert (d[2] == 4).all() and (d[3] == 0.375).all()
    assert d[4, :3].tolist() == [8.0, 8.0, -96.0]  # 6.5/16 = .41 -> .5; -100/16 -> -6 saturated
    with pytest.raises(ValueError):
        q.quantize(np.zeros(48))


def test_saturation():
    x = np.full(32, 1.0, np.float32)
    x[0] = 7.99  # floor(log2 7.99) - 2 = 0: 7.99 clips to 6
    x[1] = -7.0
    _, s, d = _both(x)
    assert s.tolist() == [127] and d[:3].tolist() == [6.0, -6.0, 1.0]


def test_tiny_blocks_clamp_the_scale_and_keep_subnormals():
    t = np.float32
    x = np.zeros((4, 32), np.float32)
    x[0, :3] = [t(2.0**-128), t(-3 * 2.0**-129), t(2.0**-149)]  # subnormal amax: scale 2^-127
    x[1, :2] = [t(2.0**-125), t(2.0**-127)]                      # floor(log2) - 2 = -127 exactly
    x[2, :2] = [t(2.0**-124), t(3e-39)]                           # scale 2^-126
    x[3] = t(1e-45)                                               # the smallest subnormal
    _, s, d = _both(x)
    assert s[:, 0].tolist() == [0, 0, 1, 0]
    # y = 0.5, 0.75 (a tie: to 1, the even code), 2^-22 (to 0)
    assert d[0, :3].tolist() == [2.0**-128, -(2.0**-127), 0.0]
    assert d[1, :2].tolist() == [2.0**-125, 2.0**-127]
    assert d[2, 0] == 2.0**-124 and d[2, 1] == 2.0**-127  # 3e-39 / 2^-126 = 0.255 -> 0.5
    assert (d[3] == 0).all()


def test_negation_flips_only_sign_bits():
    x = _wide(np.random.default_rng(2), (16, 64))
    p, s = q.quantize(x)
    pn, sn = q.quantize(-x)
    np.testing.assert_array_equal(sn, s)
    np.testing.assert_array_equal(pn, p ^ 0x88)


def test_dequantize_numpy_and_jnp_agree_on_every_byte():
    """All 256 bytes at all 256 scales (NaN at 0xFF, overflow to inf at 253/254, subnormals)."""
    packed = np.tile(np.arange(256, dtype=np.uint8), (256, 1))  # row c: every byte, 512 values
    scales = np.repeat(np.arange(256, dtype=np.uint8), 16).reshape(256, 16)  # row c: scale c
    d = q.dequantize(packed, scales)
    np.testing.assert_array_equal(_bits(q.dequantize_jnp(packed, scales)), _bits(d))
    assert np.isnan(d[255]).sum() == 512 and np.isinf(d[254]).any()


# ---- the GEMM shuffle layout ----------------------------------------------------------------

def _triton_swizzle(s: np.ndarray) -> np.ndarray:
    """triton_kernels BlackwellMXScaleLayout on [M, K_sf] (rows already permuted): pad, reshape
    [M/128, 4, 32, K_sf/4, 4], swap axes 1 and 3, flatten."""
    m, k = s.shape
    s = np.pad(s, [(0, -m % 128), (0, -k % 4)])
    mp, kp = s.shape
    return s.reshape(mp // 128, 4, 32, kp // 4, 4).transpose(0, 3, 2, 1, 4).reshape(-1)


@pytest.mark.parametrize("m,k_sf", [(32, 1), (64, 2), (128, 4), (160, 3), (256, 5)])
@pytest.mark.parametrize("gated", [False, True])
def test_shuffle_round_trip_and_swizzle(m, k_sf, gated):
    rng = np.random.default_rng(m * 10 + k_sf)
    p = rng.integers(0, 256, (3, m, k_sf * 16), dtype=np.uint8)
    s = rng.integers(0, 256, (3, m, k_sf), dtype=np.uint8)
    rows = q.shuffle_rows(m, gated)
    assert sorted(rows.tolist()) == list(range(m))  # a bijection
    ps, ss = q.shuffle(p, s, gated)
    assert ps.shape == p.shape and ss.shape == (3, -(-m // 128) * 128 * -(-k_sf // 4) * 4)
    np.testing.assert_array_equal(np.asarray(ps), p[:, rows])
    for e in range(3):
        np.testing.assert_array_equal(np.asarray(ss[e]), _triton_swizzle(s[e][rows]))
    pu, su = q.unshuffle(ps, ss, gated)
    np.testing.assert_array_equal(np.asarray(pu), p)
    np.testing.assert_array_equal(np.asarray(su), s)
    ps2, ss2 = q.shuffle(pu, su, gated)  # and back: shuffle . unshuffle = identity on the image
    np.testing.assert_array_equal(np.asarray(ps2), np.asarray(ps))
    np.testing.assert_array_equal(np.asarray(ss2), np.asarray(ss))
    # dequantising the shuffled rows with their scales = the original rows, permuted
    np.testing.assert_array_equal(q.dequantize(np.asarray(ps), s[:, rows]),
                                  q.dequantize(p, s)[:, rows])


def test_layout_by_hand():
    """M = 32, K = 64 (K_sf = 2): out row j = in row (j % 8)*4 + j // 8; scale (m, k) of the
    shuffled rows at byte 16*m + k of a 128x4 = 512-byte tile, the rest zero padding."""
    assert q.shuffle_rows(32)[:10].tolist() == [0, 4, 8, 12, 16, 20, 24, 28, 1, 5]
    assert q.shuffle_rows(32)[31] == 31
    p = np.repeat(np.arange(32, dtype=np.uint8)[:, None], 32, 1)  # row r holds bytes r
    s = (np.arange(32)[:, None] * 2 + np.arange(2) + 1).astype(np.uint8)  # s[r, k] = 2r + k + 1
    ps, ss = q.shuffle(p, s)
    ps, ss = np.asarray(ps), np.asarray(ss)
    assert ps[:, 0][:9].tolist() == [0, 4, 8, 12, 16, 20, 24, 28, 1]
    assert ss.shape == (512,)
    assert ss[0:3].tolist() == [1, 2, 0]        # row 0, k = 0, 1, then padding (k = 2, 3)
    assert ss[16:18].tolist() == [9, 10]        # shuffled row 1 = row 4
    assert ss[128:130].tolist() == [3, 4]       # shuffled row 8 = row 1
    assert (ss[2:16] == 0).all() and (ss[32 * 16:] == 0).all()
    # M = 128: rows 32..63 land at ((m % 128) // 32) * 4 = 4 within each 16-byte group
    s128 = np.arange(128 * 4, dtype=np.uint16).reshape(128, 4).astype(np.uint8)
    _, ss = q.shuffle(np.zeros((128, 64), np.uint8), s128)
    ss = np.asarray(ss)
    assert ss[4:8].tolist() == s128[32].tolist()   # shuffled row 32 = row 32 (block 1, j = 0)
    assert ss[16:20].tolist() == s128[4].tolist()  # shuffled row 1 = row 4
    # gated: [up; gate] interleaved to up_0, gate_0, ... before the 32-row shuffle
    assert q.shuffle_rows(64, gated=True)[:9].tolist() == [0, 2, 4, 6, 8, 10, 12, 14, 32]
    # K_sf = 5 pads to 8: k = 4 starts the second 512-byte k-tile
    off = q.sf_offsets(32, 5)
    assert off.shape == (128, 8) and off[0, 4] == 512 and off[1, 5] == 512 + 16 + 1
    with pytest.raises(ValueError):
        q.shuffle_rows(48)


def test_jitted_jnp_matches_numpy_bitwise():
    """Under jit too (XLA's CPU flushes subnormal arithmetic; the jnp path does none)."""
    import jax

    x = _wide(np.random.default_rng(3), (4, 96)) * np.float32(1e-30)
    p, s = q.quantize(x)
    pj, sj = jax.jit(q.quantize_jnp)(x)
    np.testing.assert_array_equal(np.asarray(pj), p)
    np.testing.assert_array_equal(np.asarray(sj), s)
    np.testing.assert_array_equal(_bits(jax.jit(q.dequantize_jnp)(p, s)), _bits(q.dequantize(p, s)))


@pytest.mark.parametrize("gated,dims", [(True, (3, 128, 64)), (False, (2, 96, 256)),
                                        (True, (1, 64, 32)), (False, (2, 160, 96)),
                                        (True, (2, 320, 224))])
def test_the_ffi_shuffle_is_the_reference_bitwise(gated, dims):
    """csrc/mxfp4_shuffle.{cc,cu} (the CPU handler here, the CUDA one on a GPU) against
    `mxfp4.shuffle`: random bytes (any code, NaN scales included), rows and blocks that need
    padding, batched experts."""
    from kernjax.kernels import ffi
    e, m, k = dims
    rng = np.random.default_rng(m + k)
    packed = rng.integers(0, 256, (e, m, k // 2), dtype=np.uint8)
    scales = rng.integers(0, 256, (e, m, k // 32), dtype=np.uint8)
    want = q.shuffle(packed, scales, gated=gated)
    got = jax.jit(ffi.mxfp4_shuffle, static_argnames="gated")(packed, scales, gated=gated)
    for w, g in zip(want, got):
        assert g.shape == w.shape and np.asarray(g).tobytes() == np.asarray(w).tobytes()


def test_the_ffi_shuffle_refuses_bad_shapes():
    from kernjax.kernels import ffi
    with pytest.raises(ValueError, match="multiple of 64"):
        ffi.mxfp4_shuffle(np.zeros((96, 16), np.uint8), np.zeros((96, 1), np.uint8), gated=True)
    with pytest.raises(ValueError, match="do not match"):
        ffi.mxfp4_shuffle(np.zeros((64, 16), np.uint8), np.zeros((64, 2), np.uint8))
    with pytest.raises(TypeError, match="uint8"):
        ffi.mxfp4_shuffle(np.zeros((64, 16), np.int8), np.zeros((64, 1), np.uint8))
