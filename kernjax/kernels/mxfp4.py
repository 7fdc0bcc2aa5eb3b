"""MXFP4 (OCP MX v1.0): E2M1 values, two per byte, one E8M0 scale per 32 values; and the GEMM
shuffle layout of FlashInfer / TRT-LLM-gen `trtllm_fp4_block_scale_moe` (`models.md` §4).

**Storage** (§4.1, §4.2; the compressed-tensors `weight_packed`/`weight_scale` layout, which is
gpt-oss's `_blocks`/`_scales` with the last two dims flattened): for `x` [..., n], n % 32 == 0,
- `packed` uint8 [..., n/2]: byte j holds element 2j in its LOW nibble and element 2j+1 in its HIGH
  nibble. A nibble is an E2M1 code: bit 3 sign, codes 0..7 = +{0, .5, 1, 1.5, 2, 3, 4, 6}, 8..15
  the same negated (8 = -0).
- `scales` uint8 [..., n/32]: E8M0, value 2^(s-127), 0xFF = NaN; block b covers elements
  32b .. 32b+31 (the reduction axis K is the last one).

**Quantisation rule** (the OCP MX spec's, not triton_kernels' ROUND_UP of §4.1): shared exponent
`floor(log2(amax)) - 2` (2 = emax of E2M1), clamped below to -127, the smallest E8M0; so the
scale code is `max(exponent field of amax - 2, 0)`. Each value divided by the scale is rounded to
the nearest E2M1 value, ties to the even code, and saturated at 6 (x/scale lies in [4, 8) for the
block's largest, so values over 6 clip). The sign is kept, so a negative value that rounds to 0
is code 8 (-0). Inputs must be finite.

Both directions exist in numpy (`quantize`, `dequantize`: host side, checkpoint writers) and jnp
(`quantize_jnp`, `dequantize_jnp`: what a MoE reads at run time), bitwise equal. The jnp versions
never do float arithmetic on subnormals (XLA's CPU flushes them to zero): quantisation compares
magnitude bits against exact threshold bits, dequantisation reads a 256×16 table of exact values.

**GEMM layout** (§4.3), per expert matrix `packed` [M, K/2], `scales` [M, K/32] (leading dims
are batch, e.g. experts):
1. gated GEMM1 only (`gated=True`, rows `[w3 (up); w1 (gate)]`, M = 2I): interleave the halves,
   `new[2j] = old[j]`, `new[2j+1] = old[I+j]` (up_0, gate_0, up_1, gate_1, ...).
2. `shuffle_matrix_a(epilogue_tile_m=128)`: within each 32-row block,
   `out[32b + j] = in[32b + (j % 8)*4 + j // 8]` (M % 32 == 0). Bytes along K are untouched.
   Steps 1 and 2 compose to one row gather `rows = perm0[perm1]` (`shuffle_rows`).
3. scales: the same row gather, then pad M to a multiple of 128 and K/32 to a multiple of 4 with
   zeros and store flat (`block_scale_interleave`, the 128×4 swizzle):
   `off(m, k) = (m//128)*(ceil(K_sf/4)*512) + (k//4)*512 + (m%32)*16 + ((m%128)//32)*4 + k%4`,
   i.e. the [M/128, K_sf/4, 32, 4(m), 4(k)] order.
`shuffle` returns `(packed [..., M, K/2], scales [..., Mp*Kp] flat)`; `unshuffle` inverts it.
Both are pure gathers (exact), written in jnp as the reference for a GPU kernel.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

BLOCK = 32
EMAX = 2  # emax of E2M1: 6 = 1.5 * 2^2
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float64)

# Rounding thresholds in units of the scale: value > t (strict) or >= t moves up one code;
# strict where the lower neighbour has the even code (ties to even).
_T = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
_STRICT = np.array([True, False, True, False, True, False, True])
# _TH[c, i]: float32 bits of _T[i] * 2^(c-127), exact (three significant bits, >= 2^-129).
# Codes above 252 need amax >= 2^126 * 8; quantisation never makes them, their rows saturate.
_TH = np.array([[np.float32(np.ldexp(t, c - 127)).view(np.uint32) if c <= 252 else 0x7F800000
                 for t in _T] for c in range(256)], np.uint32)


def _scale_values(s: np.ndarray) -> np.ndarray:
    """E8M0 code -> float64 value (0xFF -> NaN)."""
    s = np.asarray(s, np.int64)
    return np.where(s == 255, np.nan, np.ldexp(1.0, s - 127))


# _DQ[16*s + code]: the float32 value of E2M1 `code` at scale `s` (exact or inf: 6*2^127 overflows).
with np.errstate(over="ignore"):
    _DQ = (np.concatenate([E2M1, -E2M1])[None, :] * _scale_values(np.arange(256))[:, None]
           ).astype(np.float32).reshape(-1)


def _check(n: int) -> None:
    if n % BLOCK:
        raise ValueError(f"MXFP4 needs the last dim to be a multiple of {BLOCK}, got {n}")


# ---- numpy ---------------------------------------------------------------------------------

def quantize(x) -> tuple[np.ndarray, np.ndarray]:
    """x [..., n] float -> (packed uint8 [..., n/2], scales uint8 [..., n/32]); see the doc."""
    x = np.ascontiguousarray(x, np.float32)
    _check(x.shape[-1])
    bits = x.view(np.uint32)
    mag = (bits & 0x7FFFFFFF).reshape(*x.shape[:-1], -1, BLOCK)
    scales = np.maximum((mag.max(-1) >> 23).astype(np.int32) - EMAX, 0).astype(np.uint8)
    # float64 is exact here: |x| * 2^(127-s) with s in 0..252.
    inv = np.ldexp(1.0, 127 - scales.astype(np.int64))[..., None]
    y = mag.view(np.float32).astype(np.float64) * inv
    codes = np.where(_STRICT, y[..., None] > _T, y[..., None] >= _T).sum(-1).astype(np.uint8)
    codes = codes.reshape(x.shape) | ((bits >> 31).astype(np.uint8) << 3)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), scales


def dequantize(packed, scales) -> np.ndarray:
    """(packed uint8 [..., n/2], scales uint8 [..., n/32]) -> float32 [..., n]."""
    packed, scales = np.asarray(packed, np.uint8), np.asarray(scales, np.uint8)
    codes = np.stack([packed & 0xF, packed >> 4], -1).reshape(*packed.shape[:-1], -1)
    _check(codes.shape[-1])
    val = np.where(codes & 8, -E2M1[codes & 7], E2M1[codes & 7])
    val = val.reshape(*scales.shape, BLOCK) * _scale_values(scales)[..., None]
    with np.errstate(over="ignore"):  # scale codes 253, 254 can overflow float32, like _DQ
        return val.reshape(codes.shape).astype(np.float32)


# ---- jnp -----------------------------------------------------------------------------------

def quantize_jnp(x) -> tuple[jnp.ndarray, jnp.ndarray]:
    """`quantize` in jnp, bitwise equal to it (integer compares on float32 bits)."""
    x = jnp.asarray(x, jnp.float32)
    _check(x.shape[-1])
    bits = lax.bitcast_convert_type(x, jnp.uint32)
    mag = (bits & 0x7FFFFFFF).reshape(*x.shape[:-1], -1, BLOCK)
    scales = jnp.maximum((mag.max(-1) >> 23).astype(jnp.int32) - EMAX, 0).astype(jnp.uint8)
    th = jnp.asarray(_TH)[scales.astype(jnp.int32)][..., None, :]  # [..., nb, 1, 7]
    m = mag[..., None]
    codes = jnp.where(_STRICT, m > th, m >= th).sum(-1).astype(jnp.uint8)
    codes = codes.reshape(x.shape) | ((bits >> 31).astype(jnp.uint8) << 3)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), scales


def dequantize_jnp(packed, scales) -> jnp.ndarray:
    """`dequantize` in jnp, bitwise equal to it (a table read, no float arithmetic)."""
    packed, scales = jnp.asarray(packed, jnp.uint8), jnp.asarray(scales, jnp.uint8)
    codes = jnp.stack([packed & 0xF, packed >> 4], -1).reshape(*packed.shape[:-1], -1)
    _check(codes.shape[-1])
    idx = scales.astype(jnp.int32)[..., None] * 16 + codes.reshape(*scales.shape, BLOCK)
    return jnp.asarray(_DQ)[idx].reshape(codes.shape)


# ---- GEMM shuffle layout (models.md §4.3) ---------------------------------------------------

def shuffle_rows(m: int, gated: bool = False) -> np.ndarray:
    """Row gather of steps 1-2: shuffled row `r` is original row `rows[r]`."""
    if m % 32:
        raise ValueError(f"the GEMM shuffle needs M % 32 == 0, got M = {m}")
    j = np.arange(m)
    rows = j // 32 * 32 + (j % 8) * 4 + (j % 32) // 8
    if gated:  # [up; gate] -> up_0, gate_0, up_1, ...
        perm0 = np.arange(m).reshape(2, m // 2).T.reshape(-1)
        rows = perm0[rows]
    return rows


def _pad(n: int, to: int) -> int:
    return -(-n // to) * to


def sf_offsets(m: int, k_sf: int) -> np.ndarray:
    """[Mp, Kp] int: the 128×4 swizzle's byte offset of padded scale (m, k)."""
    mp, kp = _pad(m, 128), _pad(k_sf, 4)
    r, k = np.arange(mp)[:, None], np.arange(kp)[None, :]
    return r // 128 * (kp // 4 * 512) + k // 4 * 512 + r % 32 * 16 + r % 128 // 32 * 4 + k % 4


def _dims(packed, scales=None) -> tuple[int, int]:
    m, k_sf = packed.shape[-2], packed.shape[-1] // 16
    if packed.shape[-1] % 16 or (scales is not None and scales.shape[-2:] != (m, k_sf)):
        got = None if scales is None else scales.shape
        raise ValueError(f"packed {packed.shape} and scales {got} are not [M, K/2] and "
                         "[M, K/32] with K % 32 == 0")
    return m, k_sf


def shuffle(packed, scales, gated: bool = False) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Checkpoint layout -> GEMM layout: (packed [..., M, K/2], scales flat [..., Mp*Kp])."""
    packed, scales = jnp.asarray(packed), jnp.asarray(scales)
    m, k_sf = _dims(packed, scales)
    rows = shuffle_rows(m, gated)
    off = sf_offsets(m, k_sf)
    src = np.empty(off.size, np.int64)
    src[off.reshape(-1)] = np.arange(off.size)  # src[offset] = flat index into padded [Mp, Kp]
    s = jnp.take(scales, rows, axis=-2)
    s = jnp.pad(s, [(0, 0)] * (s.ndim - 2) + [(0, off.shape[0] - m), (0, off.shape[1] - k_sf)])
    return jnp.take(packed, rows, axis=-2), s.reshape(*s.shape[:-2], -1)[..., src]


def unshuffle(packed, scales, gated: bool = False) -> tuple[jnp.ndarray, jnp.ndarray]:
    """The inverse of `shuffle`: GEMM layout -> (packed [..., M, K/2], scales [..., M, K/32])."""
    packed, scales = jnp.asarray(packed), jnp.asarray(scales)
    m, k_sf = _dims(packed)
    inv = np.argsort(shuffle_rows(m, gated))
    off = sf_offsets(m, k_sf)
    if scales.shape[-1] != off.size:
        raise ValueError(f"shuffled scales {scales.shape} should end in {off.size} = Mp*Kp")
    s = scales[..., off.reshape(-1)].reshape(*scales.shape[:-1], *off.shape)[..., :m, :k_sf]
    return jnp.take(packed, inv, axis=-2), jnp.take(s, inv, axis=-2)
