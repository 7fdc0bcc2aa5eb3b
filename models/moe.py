"""Kimi / DeepSeek-V3 MoE: sigmoid router with correction bias, top-k, renormalised and scaled,
routed experts in MXFP4 read from the GEMM shuffle layout, plus one dense shared expert
(`models.md` §3.3, §4.3; issue 9 items 1 and 6).

**Router** (`route`, float32 throughout): `s = sigmoid(x Wgᵀ)`; experts are chosen by top-k of
`s + bias` (the correction bias moves selection only); the weights are the *unbiased* `s` at the
chosen experts divided by their sum (+1e-20) times `routed_scaling_factor`. `lax.top_k` is stable,
so equal selection scores go to the lower expert index first, and the ids come out in descending
selection score.

**Experts** (`moe`): GEMM1 is the gated `[w3 (up); w1 (gate)]` [2I, H] and GEMM2 the down `w2`
[H, I], each as `mxfp4.shuffle` returns it: `packed` uint8 [E, M, K/2] with rows in the shuffled
order `rows = mxfp4.shuffle_rows(M, gated)` (shuffled row r is logical row rows[r]) and `scales`
flat uint8 [E, Mp*Kp] in the 128×4 swizzle. `gemm_layout` builds that pair from checkpoint
(packed, scales) of w1, w3, w2.

How the layout is read (no un-shuffle of the weights): the scale of shuffled row r, k-block c is
the byte at `sf_offsets(M, K_sf)[r, c]` of the flat buffer (one static gather of M*K_sf bytes per
expert); the packed rows are dequantised as they lie, giving W_s = W[rows] (the rows permuted).
Then `x W_sᵀ` is `x Wᵀ` with its output columns permuted, so one static gather of the *outputs*
by `argsort(rows)` puts them back: per expert on GEMM1's [T, 2I] output (up = the first I, gate =
the last I; the intermediate must be in logical order because it is GEMM2's K, which the shuffle
leaves alone), and once per call on the summed GEMM2 output (every expert's w2 has the same row
permutation, so the [T, H] accumulator stays in shuffled column order until the end). A column
gather of the outputs is O(T·M) per expert instead of O(M·K) to permute weight rows back.

**Schedule** (the simplest correct one for CPU sizes): `lax.scan` over the E experts; step e
dequantises expert e from the shuffled bytes (so one expert's float weights are live at a time),
runs it densely on all T tokens, and adds `w[t, e]·y_e[t]` where token t chose e (`where`, so an
unchosen expert's output never enters, even if it were inf/NaN). Cost: E·T·3·I·H multiply-adds
(E/top_k times what the chosen experts need: 4× for 8 experts, top 2) and E·3·I·H dequantised
values per call, memory O(T·(2I + H) + 3·I·H). Nothing depends on other tokens' values (no
capacity, no dropping, no sort of tokens), so a token's output has the same bits whatever the
other rows hold at the same shapes. A grouped GEMM over tokens sorted by expert is the GPU form.

**Dtypes:** activations in the input dtype (weights are dequantised to float32, exact, and cast
to the input dtype: E2M1·2^k fits bf16 exactly), products accumulated in float32
(`preferred_element_type`), the SiLU(gate)·up in float32 then cast to the input dtype for GEMM2,
routed and shared outputs combined in float32, the result cast to the input dtype.

`moe_reference` is the float32 numpy oracle: per token, per chosen expert, from logical
(unshuffled) dequantised weights.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kernjax.kernels import mxfp4

F32 = jnp.float32
HI = lax.Precision.HIGHEST  # float32 stays float32 on GPUs (no TF32 passes)


def route(x, w_router, bias, *, top_k: int, scale: float):
    """x [T, H], w_router [E, H], bias [E] -> (ids [T, top_k] int32, weights [T, top_k] float32)."""
    s = jax.nn.sigmoid(jnp.dot(jnp.asarray(x, F32), jnp.asarray(w_router, F32).T, precision=HI))
    _, ids = lax.top_k(s + jnp.asarray(bias, F32), top_k)  # stable: ties -> lower index first
    w = jnp.take_along_axis(s, ids, axis=-1)
    w = w / (w.sum(-1, keepdims=True) + 1e-20) * jnp.float32(scale)
    return ids.astype(jnp.int32), w


def gemm_layout(w1, w3, w2):
    """Checkpoint MXFP4 experts -> the GEMM layout `moe` reads. Each argument is (packed, scales)
    from `mxfp4.quantize`: w1 (gate) and w3 (up) [E, I, H/2], [E, I, H/32]; w2 (down)
    [E, H, I/2], [E, H, I/32]. Returns (gemm1, gemm2), each `mxfp4.shuffle`'s (packed, flat
    scales); GEMM1's logical rows are [w3; w1] (M = 2I, gated), GEMM2's are w2 (M = H)."""
    p1 = jnp.concatenate([jnp.asarray(w3[0]), jnp.asarray(w1[0])], axis=-2)
    s1 = jnp.concatenate([jnp.asarray(w3[1]), jnp.asarray(w1[1])], axis=-2)
    return mxfp4.shuffle(p1, s1, gated=True), mxfp4.shuffle(w2[0], w2[1], gated=False)


def _read_expert(packed, flat_scales):
    """One expert in the GEMM layout -> float32 [M, K], rows in the *shuffled* order."""
    m, k_sf = packed.shape[-2], packed.shape[-1] // 16
    off = mxfp4.sf_offsets(m, k_sf)[:m, :k_sf]  # static: scale (shuffled row r, block c)
    return mxfp4.dequantize_jnp(packed, flat_scales[off])


def _dot(a, b_t, dtype):
    """a [T, K] @ b_t[N, K]ᵀ in `dtype`, accumulated in float32."""
    return lax.dot_general(a.astype(dtype), b_t.astype(dtype), (((1,), (1,)), ((), ())),
                           precision=HI, preferred_element_type=F32)


def moe(x, w_router, bias, gemm1, gemm2, shared, *, top_k: int, scale: float):
    """x [T, H] (float32 or bf16); w_router [E, H]; bias [E]; gemm1 = (packed [E, 2I, H/2] uint8,
    scales [E, Mp*Kp] uint8) and gemm2 = (packed [E, H, I/2], scales flat) as `mxfp4.shuffle`
    makes them (GEMM1 gated); shared = (gate [Is, H], up [Is, H], down [H, Is]) dense.
    Returns [T, H] in x's dtype. Jittable (top_k, scale static)."""
    x = jnp.asarray(x)
    dt = x.dtype
    t, h = x.shape
    p1, s1 = (jnp.asarray(a) for a in gemm1)
    p2, s2 = (jnp.asarray(a) for a in gemm2)
    e, m1 = p1.shape[0], p1.shape[1]
    i = m1 // 2
    if p1.shape[2] * 2 != h or p2.shape != (e, h, i // 2):
        raise ValueError(f"gemm1 {p1.shape} / gemm2 {p2.shape} do not fit H = {h}, I = {i}")
    inv1 = np.argsort(mxfp4.shuffle_rows(m1, gated=True))  # shuffled column -> logical [up; gate]
    inv2 = np.argsort(mxfp4.shuffle_rows(h, gated=False))

    ids, w = route(x, w_router, bias, top_k=top_k, scale=scale)
    # dense [T, E] routing weight, and whether t chose e (top_k ids are distinct)
    hit = ids[:, :, None] == jnp.arange(e, dtype=jnp.int32)  # [T, k, E]
    chose = hit.any(1)
    wte = jnp.where(hit, w[:, :, None], 0.0).sum(1)  # exact: one nonzero term per (t, e)

    def step(acc, xs):
        pk1, sc1, pk2, sc2, c, we = xs
        g1 = _dot(x, _read_expert(pk1, sc1), dt)[:, inv1]  # [T, 2I] logical: [up | gate]
        a = (jax.nn.silu(g1[:, i:]) * g1[:, :i]).astype(dt)
        y = _dot(a, _read_expert(pk2, sc2), dt)  # [T, H], columns in w2's shuffled row order
        return acc + jnp.where(c[:, None], we[:, None] * y, 0.0), None

    acc, _ = lax.scan(step, jnp.zeros((t, h), F32), (p1, s1, p2, s2, chose.T, wte.T))
    routed = acc[:, inv2]

    sg, su, sd = (jnp.asarray(a) for a in shared)
    a = (jax.nn.silu(_dot(x, sg, dt)) * _dot(x, su, dt)).astype(dt)
    return (routed + _dot(a, sd, dt)).astype(dt)


def moe_reference(x, w_router, bias, w1, w3, w2, shared, *, top_k: int, scale: float):
    """Float32 numpy oracle: per token, its top_k experts from logical weights. x [T, H];
    w1 (gate), w3 (up) [E, I, H]; w2 [E, H, I] (dequantised, checkpoint order); shared =
    (gate, up, down) dense. Routing recomputed here in numpy (stable argsort: ties -> lower id)."""
    f = lambda a: np.asarray(jnp.asarray(a, F32))  # noqa: E731  (bf16 -> float32, exactly)
    x, wr, b, w1, w3, w2 = map(f, (x, w_router, bias, w1, w3, w2))
    sg, su, sd = map(f, shared)
    silu = lambda v: v / (np.float32(1) + np.exp(-v))  # noqa: E731
    out = np.zeros(x.shape, np.float32)
    for t in range(x.shape[0]):
        s = np.float32(1) / (np.float32(1) + np.exp(-(wr @ x[t])))
        ids = np.argsort(-(s + b), kind="stable")[:top_k]
        wt = s[ids] / (s[ids].sum() + np.float32(1e-20)) * np.float32(scale)
        y = np.zeros(x.shape[1], np.float32)
        for j, ex in enumerate(ids):
            y += wt[j] * (w2[ex] @ (silu(w1[ex] @ x[t]) * (w3[ex] @ x[t])))
        out[t] = y + sd @ (silu(sg @ x[t]) * (su @ x[t]))
    return out
