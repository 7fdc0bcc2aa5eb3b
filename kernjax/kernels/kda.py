"""Kimi Delta Attention (KDA), the gated delta rule with per-channel decay, varlen over cu_seqlens.

Notation and equations are `../shared/reference/models.md` §2. Per head, the state S is a K×V
matrix; q is pre-multiplied by `scale` (K^-0.5 unless given); g is the log-decay (≤ 0), per channel:

    S ← S ⊙ exp(g_t)[:, None]              # decay row d of S by exp(g_t[d])
    S ← S + (β_t k_t) ⊗ (v_t − Sᵀ k_t)     # delta rule
    o_t = Sᵀ q_t                           # read after the update

i.e. `S_t = (I − β_t k_t k_tᵀ) Diag(exp g_t) S_{t−1} + β_t k_t v_tᵀ`, `o_t = S_tᵀ q_t` (§2.2).

Shapes: q, k, g `[T, H, K]`, v `[T, H, V]`, beta `[T, H]`, `cu_seqlens` `[N+1]` int, and
`initial_state` `[N, H, K, V]` (zeros when None). Rows cu[s]..cu[s+1]-1 are sequence s; it starts
from `initial_state[s]` and its state after its last row is `final_state[s]` (an empty sequence
returns its initial state). Rows past cu[-1] are padding: they touch no state and their output is 0.
Both functions return `(o [T, H, V] in v's dtype, final_state [N, H, K, V] float32)`, compute in
float32, and are jittable (static shapes; `chunk` is a Python int). The oracle of §2.3 — the
recurrence run on each slice separately — is what both reproduce.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

F32 = jnp.float32
HI = jax.lax.Precision.HIGHEST  # float32 products stay float32 (not TF32/bf16 passes) on GPUs


def _prepare(q, k, v, g, beta, cu_seqlens, initial_state, scale):
    T, H, K = q.shape
    N = cu_seqlens.shape[0] - 1
    scale = K ** -0.5 if scale is None else scale
    h0 = (jnp.zeros((N, H, K, v.shape[-1]), F32) if initial_state is None
          else initial_state.astype(F32))
    f = lambda x: x.astype(F32)  # noqa: E731
    return f(q) * scale, f(k), f(v), f(g), f(beta), cu_seqlens.astype(jnp.int32), h0


def _rows(cu, T):
    """Per row: its sequence (clamped to N-1 for padding) and whether it is a real row."""
    N = cu.shape[0] - 1
    seq = jnp.searchsorted(cu[1:], jnp.arange(T), side="right")  # skips empty sequences
    return jnp.minimum(seq, N - 1), seq < N


def naive(q, k, v, g, beta, cu_seqlens, initial_state=None, *, scale=None):
    """The float32 recurrent reference (fla `naive_recurrent_kda`, §2.2), a `lax.scan` step per row.

    The carry is the running state and the table of final states. A sequence's first row loads
    its initial state, its last row stores the final state; padding rows leave both untouched.
    """
    q, k, v, g, beta, cu, h0 = _prepare(q, k, v, g, beta, cu_seqlens, initial_state, scale)
    T = q.shape[0]
    seq, real = _rows(cu, T)
    r = jnp.arange(T)
    first, last = real & (r == cu[seq]), real & (r == cu[seq + 1] - 1)

    def step(carry, x):
        S, final = carry
        qt, kt, vt, gt, bt, s, ok, fst, lst = x
        S0 = jnp.where(fst, h0[s], S)
        S1 = S0 * jnp.exp(gt)[:, :, None]                                    # [H, K, V]
        pred = jnp.einsum("hkv,hk->hv", S1, kt, precision=HI)                # Sᵀ k_t
        S1 = S1 + (bt[:, None] * kt)[:, :, None] * (vt - pred)[:, None, :]
        o = jnp.einsum("hkv,hk->hv", S1, qt, precision=HI)                   # Sᵀ q_t
        S = jnp.where(ok, S1, S)
        final = final.at[s].set(jnp.where(lst, S, final[s]))
        return (S, final), jnp.where(ok, o, 0.0)

    init = (jnp.zeros(h0.shape[1:], F32), h0)
    (_, final), o = jax.lax.scan(step, init, (q, k, v, g, beta, seq, real, first, last))
    return o, final  # float32, as `chunked` returns it


def chunked(q, k, v, g, beta, cu_seqlens, initial_state=None, *, scale=None, chunk=64):
    """The chunked WY/UT form (fla `naive_chunk_kda`, §2.4), same arguments and results as `naive`.

    Varlen by gather: sequence s owns ceil(len_s / C) chunk *slots*, aligned to its own first row,
    so no chunk straddles a boundary (§2.3). With static shapes there are M = ceil(T/C) + N - 1
    slots (enough for any `cu_seqlens`, since Σ ceil(len_s/C) < T/C + N); rows of a slot past its
    sequence's end, and unused slots, are filled with k = v = q = 0, g = 0, β = 0, which makes them
    exact no-ops: a zero row of L, W, U and V_new, a decay of exp(0) = 1, and no state update, so
    Γ_last equals Γ at the sequence's last real row. The output is gathered back per row.

    Per slot, in parallel (Γ = in-chunk cumsum of g; pairwise decays exp(Γ_i − Γ_j) are computed
    from the difference, with j > i masked to −inf before exp, never as exp(Γ_i)·exp(−Γ_j)):
      L[i, j] = β_i Σ_d k_i[d] k_j[d] exp(Γ_i[d] − Γ_j[d])  (i > j),  A = (I + L)⁻¹ Diag(β)
      W = A (exp Γ ⊙ k),  U = A v,  Aqk[i, j] = Σ_d q_i[d] k_j[d] exp(Γ_i[d] − Γ_j[d])  (j ≤ i)
    then sequentially over slots, a sequence's first slot loading its initial state:
      V_new = U − W S,  O = (q ⊙ exp Γ) S + Aqk V_new,
      S ← Diag(exp Γ_last) S + (exp(Γ_last − Γ) ⊙ k)ᵀ V_new
    The intra-chunk tensors are [M, C, C, H, K]: fine for a reference, not a kernel.
    """
    q, k, v, g, beta, cu, h0 = _prepare(q, k, v, g, beta, cu_seqlens, initial_state, scale)
    T, N, C = q.shape[0], cu.shape[0] - 1, chunk
    M = max(-(-T // C) + N - 1, 1)
    nch = (cu[1:] - cu[:-1] + C - 1) // C                                  # chunks per sequence
    cs = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(nch)])       # first slot of each

    # Slot m holds chunk j of sequence s: rows cu[s] + j*C + i, i < C, those below cu[s+1] real.
    m = jnp.arange(M)
    s_raw = jnp.searchsorted(cs[1:], m, side="right")
    used, s = s_raw < N, jnp.minimum(s_raw, N - 1)
    j = m - cs[s]
    rows = (cu[s] + j * C)[:, None] + jnp.arange(C)[None, :]               # [M, C]
    ok = used[:, None] & (rows < cu[s + 1][:, None])
    idx = jnp.where(ok, rows, 0)
    take = lambda x: jnp.where(ok.reshape(M, C, *(1,) * (x.ndim - 1)), x[idx], 0.0)  # noqa: E731
    qc, kc, vc, gc, bc = (take(x) for x in (q, k, v, g, beta))            # [M, C, H, ·]

    gam = jnp.cumsum(gc, axis=1)                                           # Γ, [M, C, H, K]
    tri = jnp.arange(C)[:, None] >= jnp.arange(C)[None, :]                 # j ≤ i
    diff = gam[:, :, None] - gam[:, None, :]                               # Γ_i − Γ_j
    dec = jnp.exp(jnp.where(tri[None, :, :, None, None], diff, -jnp.inf))
    kk = jnp.einsum("mihd,mjhd,mijhd->mhij", kc, kc, dec, precision=HI)
    L = jnp.where(tri & ~jnp.eye(C, dtype=bool), bc.transpose(0, 2, 1)[..., None] * kk, 0.0)
    eye = jnp.eye(C, dtype=F32)
    A = jax.scipy.linalg.solve_triangular(eye + L, eye * bc.transpose(0, 2, 1)[..., None, :],
                                          lower=True, unit_diagonal=True)  # (I + L)⁻¹ Diag(β)
    W = jnp.einsum("mhij,mjhd->mhid", A, jnp.exp(gam) * kc, precision=HI)
    U = jnp.einsum("mhij,mjhv->mhiv", A, vc, precision=HI)
    Aqk = jnp.einsum("mihd,mjhd,mijhd->mhij", qc, kc, dec, precision=HI)
    qg = qc * jnp.exp(gam)
    glast = gam[:, -1]                                                     # [M, H, K]
    kd = jnp.exp(glast[:, None] - gam) * kc                                # exp(Γ_last − Γ) ⊙ k

    first, last = used & (j == 0), used & (j == nch[s] - 1)

    def step(carry, x):
        S, final = carry
        W_, U_, Aqk_, qg_, kd_, gl, s_, u, fst, lst = x
        S = jnp.where(fst, h0[s_], S)
        vnew = U_ - jnp.einsum("hid,hdv->hiv", W_, S, precision=HI)
        o = (jnp.einsum("ihd,hdv->ihv", qg_, S, precision=HI)
             + jnp.einsum("hij,hjv->ihv", Aqk_, vnew, precision=HI))
        S1 = jnp.exp(gl)[:, :, None] * S + jnp.einsum("ihd,hiv->hdv", kd_, vnew, precision=HI)
        S = jnp.where(u, S1, S)
        final = final.at[s_].set(jnp.where(lst, S, final[s_]))
        return (S, final), o

    init = (jnp.zeros(h0.shape[1:], F32), h0)
    xs = (W, U, Aqk, qg, kd, glast, s, used, first, last)
    (_, final), oc = jax.lax.scan(step, init, xs)                          # oc [M, C, H, V]

    seq, real = _rows(cu, T)
    local = jnp.arange(T) - cu[seq]
    o = oc[cs[seq] + local // C, local % C]
    return jnp.where(real[:, None, None], o, 0.0).astype(v.dtype), final


def flash(q, k, v, g, beta, cu_seqlens, initial_state=None, *, scale=None):
    """The chunked form as one custom op, `kj_kda` (csrc/kda.{h,cc,cu}: chunk 16, one block per
    sequence and head, no atomics), on the CPU and on CUDA GPUs; same arguments and results as
    `naive` and `chunked`, K = V (FlashKDA's shape), K at least 16. Runs only where the extension
    is built; traces anywhere (a program whose CPU route is `chunked` carries it for CUDA)."""
    from kernjax.kernels import ffi

    q, k, v32, g, beta, cu, h0 = _prepare(q, k, v, g, beta, cu_seqlens, initial_state, scale)
    T, H, K = q.shape
    if v32.shape != (T, H, K) or K < 16:
        raise ValueError(f"kj_kda takes K = V >= 16: q {q.shape}, v {v.shape}")
    try:
        ffi.register()
    except ffi.ExtensionError:
        pass  # lowering for a platform that runs it says so, naming kj_kda
    o, final = jax.ffi.ffi_call("kj_kda", (jax.ShapeDtypeStruct((T, H, K), F32),
                                           jax.ShapeDtypeStruct(h0.shape, F32)))(
        q, k, v32, g, beta, cu, h0)
    return o, final  # float32, as `chunked` returns it
