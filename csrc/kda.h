// kj_kda: the KDA gated delta rule, chunked (WY/UT form, chunk 16), varlen over
// cu_seqlens, one state per sequence; kernjax/kernels/kda.py: chunked is the reference
// and documents the math. One *block* per (sequence, head) walks the
// sequence's chunks in order; its `lanes` (= K = V) threads own the columns of
// the K x V state. No atomics, no split of a sequence: results repeat bit for
// bit. The phases below are the kernel's code for both handlers: kda.cu runs
// lane `l` of a phase on thread l with __syncthreads() between phases, kda.cc
// runs every lane of a phase in turn; a phase reads only what earlier phases
// wrote, so the two agree.
#pragma once

#include "kj.h"

#include <cmath>
#include <cstdint>
#include <string>

#include "xla/ffi/api/ffi.h"


namespace kj {

constexpr int kKdaChunk = 16;

// Shared memory of one block, carved from one float buffer of KdaFloats(K).
struct KdaBlock {
  float *S, *q, *k, *G, *v, *ek, *kd, *W, *U, *L, *Aqk, *X, *b;
  int K;
  KJ_HD KdaBlock(float* base, int K_) : K(K_) {
    const int C = kKdaChunk;
    S = base;
    q = S + K * K;
    k = q + C * K;
    G = k + C * K;
    v = G + C * K;
    ek = v + C * K;
    kd = ek + C * K;
    W = kd + C * K;
    U = W + C * K;
    L = U + C * K;
    Aqk = L + C * C;
    X = Aqk + C * C;
    b = X + C * C;
  }
};

KJ_HD int64_t KdaFloats(int K) {
  const int C = kKdaChunk;
  return int64_t(K) * K + 8 * C * K + 3 * C * C + C;
}

// Row r of [T, H, width] at head h.
KJ_HD int64_t At(int64_t r, int h, int H, int width) { return (r * H + h) * width; }

// Phase 1, lane d: the chunk's rows t0 .. t0+c-1 of q (pre-scaled), k, g, v and
// beta; rows past c are zeros (exact no-ops). Then G = the in-chunk cumsum of g.
KJ_HD void KdaLoad(KdaBlock& s, int d, const float* q, const float* k,
                   const float* g, const float* v, const float* beta,
                   int64_t t0, int c, int h, int H) {
  const int K = s.K, C = kKdaChunk;
  float run = 0.f;
  for (int i = 0; i < C; ++i) {
    const bool real = i < c;
    const int64_t a = At(t0 + i, h, H, K) + d;
    s.q[i * K + d] = real ? q[a] : 0.f;
    s.k[i * K + d] = real ? k[a] : 0.f;
    s.v[i * K + d] = real ? v[a] : 0.f;
    run += real ? g[a] : 0.f;
    s.G[i * K + d] = run;
  }
  if (d < C) s.b[d] = d < c ? beta[(t0 + d) * H + h] : 0.f;
}

// Phase 2, lane l of `lanes`: L[i][j] (i > j) and Aqk[i][j] (j <= i) for the
// pairs l, l + lanes, ...; and for channel d = l, exp(G) * k and
// exp(G_last - G) * k. Pairwise decays come from the difference G_i - G_j.
KJ_HD void KdaPairs(KdaBlock& s, int l, int lanes) {
  const int K = s.K, C = kKdaChunk;
  for (int p = l; p < C * C; p += lanes) {
    const int i = p / C, j = p % C;
    float kk = 0.f, qk = 0.f;
    if (j <= i) {
      for (int d = 0; d < K; ++d) {
        const float e = expf(s.G[i * K + d] - s.G[j * K + d]);
        kk += s.k[i * K + d] * s.k[j * K + d] * e;
        qk += s.q[i * K + d] * s.k[j * K + d] * e;
      }
    }
    s.L[p] = j < i ? s.b[i] * kk : 0.f;
    s.Aqk[p] = j <= i ? qk : 0.f;
  }
  if (l < K) {
    const float last = s.G[(C - 1) * K + l];
    for (int i = 0; i < C; ++i) {
      s.ek[i * K + l] = expf(s.G[i * K + l]) * s.k[i * K + l];
      s.kd[i * K + l] = expf(last - s.G[i * K + l]) * s.k[i * K + l];
    }
  }
}

// Phase 3, row i, lane j: X = (I + L)^-1 Diag(beta) by forward substitution,
// one row per phase (row i reads rows < i).
KJ_HD void KdaSolveRow(KdaBlock& s, int i, int j) {
  const int C = kKdaChunk;
  if (j >= C) return;
  float x = i == j ? s.b[i] : 0.f;
  for (int m = 0; m < i; ++m) x -= s.L[i * C + m] * s.X[m * C + j];
  s.X[i * C + j] = x;
}

// Phase 4, lane d: W = X (exp(G) * k), U = X v; and q <- q * exp(G).
KJ_HD void KdaWU(KdaBlock& s, int d) {
  const int K = s.K, C = kKdaChunk;
  for (int i = 0; i < C; ++i) {
    float w = 0.f, u = 0.f;
    for (int j = 0; j < C; ++j) {
      w += s.X[i * C + j] * s.ek[j * K + d];
      u += s.X[i * C + j] * s.v[j * K + d];
    }
    s.W[i * K + d] = w;
    s.U[i * K + d] = u;
    s.q[i * K + d] *= expf(s.G[i * K + d]);
  }
}

// Phase 5, lane t (a value column): V_new = U - W S, the rows' outputs
// O = (q exp G) S + Aqk V_new, then S <- Diag(exp G_last) S + kd^T V_new.
KJ_HD void KdaStep(KdaBlock& s, int t, float* o, int64_t t0, int c, int h, int H) {
  const int K = s.K, C = kKdaChunk;
  for (int i = 0; i < C; ++i) {
    float x = s.U[i * K + t];
    for (int d = 0; d < K; ++d) x -= s.W[i * K + d] * s.S[d * K + t];
    s.U[i * K + t] = x;  // V_new, in U's place: column t is this lane's alone
  }
  for (int i = 0; i < c; ++i) {
    float x = 0.f;
    for (int d = 0; d < K; ++d) x += s.q[i * K + d] * s.S[d * K + t];
    for (int j = 0; j <= i; ++j) x += s.Aqk[i * C + j] * s.U[j * K + t];
    o[At(t0 + i, h, H, K) + t] = x;
  }
  for (int d = 0; d < K; ++d) {
    float x = expf(s.G[(C - 1) * K + d]) * s.S[d * K + t];
    for (int i = 0; i < C; ++i) x += s.kd[i * K + d] * s.U[i * K + t];
    s.S[d * K + t] = x;
  }
}

// T, H, K = V and N from the operands (q [T, H, K], cu_seqlens [N+1]), or why not.
inline xla::ffi::Error KdaDims(const xla::ffi::Buffer<xla::ffi::F32>& q,
                               const xla::ffi::Buffer<xla::ffi::S32>& cu, int64_t* T, int* H,
                               int* K, int* N, const char* who) {
  auto d = q.dimensions();
  if (d.size() != 3 || cu.element_count() < 2 || d[2] < kKdaChunk) {
    return xla::ffi::Error::InvalidArgument(
        std::string(who) + ": q must be [T, H, K] with K >= 16, cu_seqlens [N+1]");
  }
  *T = d[0], *H = int(d[1]), *K = int(d[2]), *N = int(cu.element_count()) - 1;
  return xla::ffi::Error::Success();
}

}  // namespace kj
