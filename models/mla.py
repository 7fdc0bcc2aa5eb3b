"""MLA as Kimi Linear uses it (`../shared/reference/models.md` §3.2, "MLA as used (NoPE)"), for
chunked prefill over a paged *latent* state.

The layer (per token x; Hh heads, `nope` + `rope` query/key dims, `v` value dims, `kv_lora` latent):

    q            = q_proj(x)                       [Hh, nope+rope]   (no q-LoRA: q_lora_rank null)
    q_nope, q_pe = q[:, :nope], q[:, nope:]
    c            = kv_a_proj_with_mqa(x)           [kv_lora+rope]
    c_kv, k_pe   = RMSNorm_kv_lora(c[:kv_lora]), c[kv_lora:]      (k_pe shared by all heads)
    k_nope, v    = split(kv_b_proj(c_kv))          [Hh, nope], [Hh, v]
    k            = [k_nope | broadcast(k_pe)]      NO rotation of q_pe or k_pe (NoPE)
    o            = causal softmax(q·kᵀ · (nope+rope)^-1/2) · v      then o_proj (not here)

The paged state keeps, per token, the *normalized* latent and the shared pe slice,
`state [pages, 16, kv_lora + rope] = [c_kv | k_pe]`, written by `write` at the item's `slots`
(padding slots are out of range and dropped, as in qwen3's `kv_write`).

`attend` uses the **absorbed** form (the DeepSeek-V3 "absorb" path of §3.2). With `kv_b_proj`'s
weight viewed as `[Hh, nope+v, kv_lora]`, `W_UK[h] = w[h, :nope]`, `W_UV[h] = w[h, nope:]`:

    q̃[h]      = q_nope[h] · W_UK[h]                                       [kv_lora]
    score[h,t] = (q̃[h]·c_kv[t] + q_pe[h]·k_pe[t]) · scale = [q̃|q_pe][h] · state[t] · scale
    o_lat[h]   = Σ_t softmax(score[h])_t · c_kv[t]                          [kv_lora]
    o[h]       = o_lat[h] · W_UV[h]ᵀ                                         [v]

which is exactly the naive form (q_nope·k_nope = q_nope·W_UK·c_kv; P·v = (P·c_kv)·W_UVᵀ). It is
MQA with a single key/value head over the latent: every head reads the same `[c_kv | k_pe]` rows,
so a key block is read once for all heads, and nothing is up-projected per key: the naive form
would up-project every key block (of every sequence slot in the item, since a row *selects* its
own sequence) through `kv_b_proj` on every visit, `Hh·(nope+v)·kv_lora` flops per key per chunk,
and it would materialise per-head keys and values; the absorbed form pays `Hh·nope·kv_lora` per
*row* once (q̃) and `Hh·v·kv_lora` per row once (W_UV). `form="naive"` is kept as a cross-check.

Both follow `kernjax/kernels/attention.py: blockwise`'s rules: key blocks aligned to key 0, visited in
order with an online softmax, the loop stops at the last block any row needs, a block past a row's
position is an exact no-op for it, the row's own sequence is *selected* (never summed over) so
its bits do not depend on its slot, float32 scores and softmax, probabilities cast to the input
dtype before they meet the values, padding rows written as zeros.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernjax.kernels.attention import NEG, exact, item_rows
from kernjax.kernels.reduce import rowmean, rowsum

PAGE = 16  # rows a page of the latent state holds (models/k3.py's)


def softmax_scale(nope: int, rope: int) -> float:
    """`(nope + rope)^-1/2`: §3.2 step 5 (192^-1/2 for Kimi Linear's 128 + 64)."""
    return float(nope + rope) ** -0.5


def latent(c, norm_w, *, kv_lora: int, eps: float):
    """Splits `kv_a_proj_with_mqa(x)` `[T, kv_lora+rope]` into the RMS-normed latent `c_kv` and
    the shared `k_pe` (§3.2 steps 2–3; the norm computed in float32, as qwen3's `_rms`)."""
    ckv, k_pe = c[..., :kv_lora], c[..., kv_lora:]
    x32 = ckv.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(rowmean(x32 * x32, keepdims=True) + eps)
    return norm_w * x32.astype(c.dtype), k_pe


def write(state, c_kv, k_pe, slots):
    """Stores `[c_kv | k_pe]` of each row at `slots` (`page * 16 + offset`) of
    `state [pages, 16, kv_lora + rope]`; out-of-range slots (padding) write nothing."""
    pages = state.shape[0]
    flat = state.reshape(pages * PAGE, state.shape[-1])
    row = jnp.concatenate([c_kv, k_pe], axis=-1).astype(state.dtype)
    # distinct slots (kernjax.core.item): a plain store per row on a GPU
    return flat.at[slots].set(row, mode="drop", unique_indices=True).reshape(state.shape)


def _split_w(w_kv_b, heads: int, nope: int, kv_lora: int):
    """`kv_b_proj.weight` `[Hh·(nope+v), kv_lora]` (or already `[Hh, nope+v, kv_lora]`) ->
    `W_UK [Hh, nope, kv_lora]`, `W_UV [Hh, v, kv_lora]`."""
    w = w_kv_b.reshape(heads, -1, kv_lora)
    return w[:, :nope], w[:, nope:]


def attend(state, q_nope, q_pe, w_kv_b, positions, cu_seqlens, page_table, *, scale: float,
           block: int = 128, form: str = "absorbed"):
    """`[rows, heads, v]` MLA output (before o_proj) over the paged latent `state`.

    `q_nope [rows, Hh, nope]`, `q_pe [rows, Hh, rope]` (unrotated), `w_kv_b` as `_split_w`;
    the item (`positions`, `cu_seqlens`, `page_table`) as in `kernjax/kernels/attention.py`.
    """
    rows, heads, nope = q_nope.shape
    rope = q_pe.shape[-1]
    kv_lora = state.shape[-1] - rope
    dtype = q_nope.dtype
    w_uk, w_uv = _split_w(w_kv_b.astype(dtype), heads, nope, kv_lora)
    vd = w_uv.shape[1]
    seqs = page_table.shape[0]
    per = block // PAGE
    table, own, valid, needed = item_rows(positions, cu_seqlens, page_table, page=PAGE,
                                          block=block, own_at=(None, slice(None), None, None))
    f32 = jnp.float32
    prec = exact(dtype)
    key0 = jnp.arange(block)

    def masked(b, s):
        mask = valid[:, None] & ((b * block + key0)[None, :] <= positions[:, None])
        return mask, jnp.where(mask, s * scale, NEG)

    if form == "absorbed":
        # head-major: a bf16 x bf16 -> f32 batched dot must have its batch dim leading on the CPU
        qt = jnp.einsum("hrn,hnl->hrl", q_nope.transpose(1, 0, 2), w_uk,
                        preferred_element_type=f32, precision=prec).astype(dtype)
        qc = jnp.concatenate([qt, q_pe.astype(dtype).transpose(1, 0, 2)], axis=-1)
        # qc: [Hh, rows, kv_lora + rope], against the state rows [c_kv | k_pe]
        d_acc = kv_lora
    elif form == "naive":
        d_acc = vd
    else:
        raise ValueError(f"unknown MLA form `{form}`")

    def step(b, carry):
        m, l, acc = carry
        pages = jax.lax.dynamic_slice_in_dim(table, b * per, per, axis=1)
        blk = state[pages].reshape(seqs, block, kv_lora + rope).astype(dtype)
        if form == "absorbed":
            s = jnp.einsum("hrc,sbc->hrsb", qc, blk, preferred_element_type=f32, precision=prec)
            vals = blk[..., :kv_lora]  # [seqs, block, kv_lora], shared by the heads
        else:  # up-project this block of every slot: k_nope, v per head, in the input dtype
            k_nope = jnp.einsum("sbl,hnl->sbhn", blk[..., :kv_lora], w_uk,
                                preferred_element_type=f32, precision=prec).astype(dtype)
            vals = jnp.einsum("sbl,hvl->sbhv", blk[..., :kv_lora], w_uv,
                              preferred_element_type=f32, precision=prec).astype(dtype)
            s = (jnp.einsum("rhn,sbhn->hrsb", q_nope, k_nope, preferred_element_type=f32,
                            precision=prec)
                 + jnp.einsum("rhp,sbp->hrsb", q_pe.astype(dtype), blk[..., kv_lora:],
                              preferred_element_type=f32, precision=prec))
        s = jnp.take_along_axis(s, own, axis=2)[:, :, 0]  # [Hh, rows, block]
        mask, s = masked(b, s)
        m_new = jnp.maximum(m, s.max(-1))
        p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
        alpha = jnp.exp(m - m_new)
        if form == "absorbed":
            pv = jnp.einsum("hrb,sbl->hrsl", p.astype(dtype), vals, preferred_element_type=f32,
                            precision=prec)
        else:
            pv = jnp.einsum("hrb,sbhv->hrsv", p.astype(dtype), vals, preferred_element_type=f32,
                            precision=prec)
        pv = jnp.take_along_axis(pv, own, axis=2)[:, :, 0]
        return m_new, l * alpha + rowsum(p), acc * alpha[..., None] + pv

    init = (jnp.full((heads, rows), NEG, f32), jnp.zeros((heads, rows), f32),
            jnp.zeros((heads, rows, d_acc), f32))
    _, l, acc = jax.lax.fori_loop(0, needed, step, init)
    o = acc / jnp.where(l > 0, l, 1.0)[..., None]  # [Hh, rows, d_acc]
    if form == "absorbed":  # W_UV after the softmax: o_lat [kv_lora] -> v per head
        o = jnp.einsum("hrl,hvl->hrv", o.astype(dtype), w_uv, preferred_element_type=f32,
                       precision=prec)
    o = jnp.where(valid[None, :, None], o, 0.0).astype(dtype)
    return o.transpose(1, 0, 2)


def reference(state, q_nope, q_pe, w_kv_b, positions, cu_seqlens, page_table, *, scale: float):
    """The naive form in float32 with the whole score matrix, each row gathering its sequence's
    keys: k = [W_UK·c_kv | k_pe], v = W_UV·c_kv. For tests: slow, obviously right."""
    rows, heads, nope = q_nope.shape
    rope = q_pe.shape[-1]
    kv_lora = state.shape[-1] - rope
    seqs, width = page_table.shape
    f32, hi = jnp.float32, jax.lax.Precision.HIGHEST
    w_uk, w_uv = _split_w(w_kv_b.astype(f32), heads, nope, kv_lora)
    ctx = state[page_table.reshape(-1)].reshape(seqs, width * PAGE, -1).astype(f32)
    k_nope = jnp.einsum("stl,hnl->sthn", ctx[..., :kv_lora], w_uk, precision=hi)
    k = jnp.concatenate([k_nope, jnp.broadcast_to(ctx[:, :, None, kv_lora:],
                                                  k_nope.shape[:3] + (rope,))], axis=-1)
    v = jnp.einsum("stl,hvl->sthv", ctx[..., :kv_lora], w_uv, precision=hi)
    seq = jnp.searchsorted(cu_seqlens[1:], jnp.arange(rows), side="right")
    valid = seq < seqs
    own = jnp.minimum(seq, seqs - 1)
    q = jnp.concatenate([q_nope, q_pe], axis=-1).astype(f32)
    s = jnp.einsum("rhd,rthd->rht", q, k[own], precision=hi) * scale
    mask = valid[:, None] & (jnp.arange(width * PAGE)[None, :] <= positions[:, None])
    p = jax.nn.softmax(jnp.where(mask[:, None], s, -jnp.inf), axis=-1)
    o = jnp.einsum("rht,rthv->rhv", p, v[own], precision=hi)
    return jnp.where(valid[:, None, None], o, 0.0)
