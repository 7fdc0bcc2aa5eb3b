// A dense layer's small bf16 calls as kernels of kernjax's own (kernjax/kernels/dense_cuda.py, roadmap K14):
//   kj_qk_rope   q_norm, k_norm, rope and kv_write as one: qkv's q heads normed and roped into q,
//                its k heads normed and roped and its v heads into the paged KV state at `slots`
//   kj_head_norm q_norm or k_norm alone (a cut after it): heads of qkv's columns from `col`, normed
//   kj_rope      rope alone: q and k roped
//   kj_kv_write  kv_write alone: k and qkv's v heads into the state
//   kj_add_norm  the residual add and the next RMSNorm: (rms(h + y) * w, h + y)
//
// One block a row. The first four run one device code per head (HeadStep, compiled for each job):
// where a cut falls inside the group, the calls apart give the group's bits, since each rounds to
// bf16 where its call's result would and every sum has one fixed order (lane by lane, then a
// butterfly whose two sides add the same two numbers); no contraction but the sums' explicit FMAs.
// The math is models/qwen3.py's: RMSNorm in float32 cast to bf16 before the weight, NeoX RoPE with
// cos and sin cast to bf16, each product and sum of two bf16 rounded once to bf16 (bf16x2 .rn), as
// XLA's float32 route rounds it (a product of two bf16 is exact in float32, a sum exact or rounded
// where its bf16 rounding cannot move).

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kD = 128;     // head_dim: 16 lanes a head, 8 elements a lane
constexpr int kWarps = 8;   // warps a row (kj_qk_rope and its calls): a head pair a step each
constexpr int kPer = 4;     // steps a warp, at most: 64 head pairs a row

using B2 = __nv_bfloat162;

__device__ __forceinline__ void Unpack(uint4 v, float* x) {
  const auto* b = reinterpret_cast<const B2*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(b[i]);
    x[2 * i] = f.x, x[2 * i + 1] = f.y;
  }
}

// bf16(w · bf16(x · r)) for 8 elements: the norm's last steps as models/qwen3.py's rms rounds
// them (a product of two bf16 rounded once is mul.rn.bf16x2's result).
__device__ __forceinline__ uint4 Scale(const float* x, float r, uint4 w) {
  uint4 out;
  auto* o = reinterpret_cast<B2*>(&out);
  const auto* g = reinterpret_cast<const B2*>(&w);
#pragma unroll
  for (int i = 0; i < 4; ++i)
    o[i] = __hmul2_rn(g[i], __floats2bfloat162_rn(__fmul_rn(x[2 * i], r), __fmul_rn(x[2 * i + 1], r)));
  return out;
}

// A lane's 8 elements (into x) and the sum of all their squares over `kLanes` lanes: each lane's in
// order, then a butterfly (both sides of each step add the same two numbers: every lane agrees).
template <int kLanes>
__device__ __forceinline__ float SumSquares(uint4 v, float* x) {
  float ss = 0.f;
  Unpack(v, x);
#pragma unroll
  for (int t = 0; t < 8; ++t) ss = __fmaf_rn(x[t], x[t], ss);
#pragma unroll
  for (int m = kLanes / 2; m >= 1; m >>= 1) ss = __fadd_rn(ss, __shfl_xor_sync(~0u, ss, m));
  return ss;
}

__device__ __forceinline__ uint4 Shfl(uint4 v, int m) {
  return make_uint4(__shfl_xor_sync(~0u, v.x, m), __shfl_xor_sync(~0u, v.y, m),
                    __shfl_xor_sync(~0u, v.z, m), __shfl_xor_sync(~0u, v.w, m));
}

// One class of heads of a row: read from `src` (row stride, first column), normed by `w` unless
// null, roped if `rope`, written to `dst` unless null and to the state's half `half` (0: k, 1: v)
// unless -1.
struct Part {
  const __nv_bfloat16* src;
  long long src_stride, src_col;
  const __nv_bfloat16* w;
  bool rope;
  __nv_bfloat16* dst;
  long long dst_stride;
  int half, heads;
};

struct Job {
  Part part[3];
  int parts, rows, kv_heads;
  float eps;
  const int32_t* positions;
  const float* inv_freq;  // [64]
  __nv_bfloat16* state;   // [state_rows, 2, kv_heads, 128]
  const int32_t* slots;
  long long state_rows;
};

// A lane's 8 elements of a head, normed, roped and written as its part's flags kP say (1 a norm
// weight, 2 rope, 4 dst, 8 the state). cs, sn: cos and sin at the lane's 8 frequencies, sn negated
// for the first half (rope's -x2). The norm's sum: lane by lane, then a butterfly over 16 lanes.
template <unsigned kP>
__device__ __forceinline__ void HeadStep(const Job& j, const Part& p, uint4 v, int head, int sub,
                                         long long row, long long slot, uint4 cs, uint4 sn) {
  if (kP & 1) {
    float x[8], ss = SumSquares<16>(v, x);
    v = Scale(x, rsqrtf(__fadd_rn(__fmul_rn(ss, 1.f / kD), j.eps)), reinterpret_cast<const uint4*>(p.w)[sub]);
  }
  if (kP & 2) {  // x·cos + rot·sin, rot the other half's element (from lane ^ 8)
    const uint4 o = Shfl(v, 8);
    auto* x = reinterpret_cast<B2*>(&v);
    const auto *y = reinterpret_cast<const B2*>(&o), *c = reinterpret_cast<const B2*>(&cs),
               *s = reinterpret_cast<const B2*>(&sn);
#pragma unroll
    for (int i = 0; i < 4; ++i) x[i] = __hadd2_rn(__hmul2_rn(x[i], c[i]), __hmul2_rn(y[i], s[i]));
  }
  const long long at = head * kD + sub * 8;  // __stwb: one 16-byte store (a plain one was four)
  if (kP & 4) __stwb(reinterpret_cast<uint4*>(p.dst + row * p.dst_stride + at), v);
  if ((kP & 8) && slot >= 0)
    __stwb(reinterpret_cast<uint4*>(j.state + (slot * 2 + p.half) * j.kv_heads * kD + at), v);
}

// A kernel for each job's flags (kF: a part's four bits from the low ones), every field read at a
// fixed offset. 6 blocks an SM (40 registers): kj_qk_rope 0.0540 ms at 8192 rows against 0.0615 for
// one kernel of every job that read its parts by a run-time index (experiments/heads_bench.cu).
template <unsigned kF>
__global__ void __launch_bounds__(32 * kWarps, 6) HeadsKernel(Job j) {
  constexpr unsigned k0 = kF & 15, k1 = kF >> 4 & 15, k2 = kF >> 8 & 15;
  const int row = blockIdx.x, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int sub = lane % 16, pair = lane / 16;
  __shared__ __align__(16) __nv_bfloat16 cos_s[64], sin_s[64];
  long long slot = -1;
  if ((k0 | k1 | k2) & 8) {  // jnp's .at[slot]: a negative slot counts from the end; out of range drops
    long long s = j.slots[row];
    s += s < 0 ? j.state_rows : 0;
    slot = s >= 0 && s < j.state_rows ? s : -1;
  }
  const int e0 = j.part[0].heads / 2, e1 = e0 + (k1 ? j.part[1].heads / 2 : 0),
            e2 = e1 + (k2 ? j.part[2].heads / 2 : 0);  // the parts' pairs end there
  uint4 v[kPer];
#pragma unroll
  for (int b = 0; b < kPer; ++b) {  // the warp's head pairs: all loads first (then the barrier)
    const int g = warp + b * kWarps, t = g < e0 ? 0 : g < e1 ? 1 : 2;
    const int h = 2 * (g - (t == 0 ? 0 : t == 1 ? e0 : e1)) + pair;
    const __nv_bfloat16* src = t == 0 ? j.part[0].src : t == 1 ? j.part[1].src : j.part[2].src;
    const long long stride = t == 0 ? j.part[0].src_stride : t == 1 ? j.part[1].src_stride : j.part[2].src_stride;
    const long long col = t == 0 ? j.part[0].src_col : t == 1 ? j.part[1].src_col : j.part[2].src_col;
    if (g < e2) v[b] = *reinterpret_cast<const uint4*>(src + row * stride + col + h * kD + sub * 8);
  }
  uint4 cs{}, sn{};
  if ((k0 | k1 | k2) & 2) {  // the row's 64 frequencies, once
    if (threadIdx.x < 64) {
      const float a = __fmul_rn(float(j.positions[row]), j.inv_freq[threadIdx.x]);
      cos_s[threadIdx.x] = __float2bfloat16_rn(cosf(a));
      sin_s[threadIdx.x] = __float2bfloat16_rn(sinf(a));
    }
    __syncthreads();
    cs = reinterpret_cast<const uint4*>(cos_s)[sub % 8];
    sn = reinterpret_cast<const uint4*>(sin_s)[sub % 8];
    if (sub < 8) sn.x ^= 0x80008000u, sn.y ^= 0x80008000u, sn.z ^= 0x80008000u, sn.w ^= 0x80008000u;
  }
#pragma unroll
  for (int b = 0; b < kPer; ++b) {
    const int g = warp + b * kWarps;
    if (g < e0) HeadStep<k0>(j, j.part[0], v[b], 2 * g + pair, sub, row, slot, cs, sn);
    else if (k1 && g < e1) HeadStep<k1>(j, j.part[1], v[b], 2 * (g - e0) + pair, sub, row, slot, cs, sn);
    else if (k2 && g < e2) HeadStep<k2>(j, j.part[2], v[b], 2 * (g - e1) + pair, sub, row, slot, cs, sn);
  }
}

// h + y, then its RMSNorm times w: one block a row, a thread 8 columns (hidden / 8 threads).
// The sum: each thread's 8 in order, a butterfly over the warp, then the warps' in order.
__global__ void __launch_bounds__(1024) AddNormKernel(
    const __nv_bfloat16* y, const __nv_bfloat16* h, const __nv_bfloat16* w, __nv_bfloat16* out,
    __nv_bfloat16* hout, int hidden, float eps) {
  __shared__ float part[32];
  const long long at = (long long)blockIdx.x * hidden + threadIdx.x * 8;
  const uint4 hv = *reinterpret_cast<const uint4*>(h + at), yv = *reinterpret_cast<const uint4*>(y + at);
  const uint4 wv = reinterpret_cast<const uint4*>(w)[threadIdx.x];
  uint4 sum;
  auto* s2 = reinterpret_cast<B2*>(&sum);
#pragma unroll
  for (int i = 0; i < 4; ++i)
    s2[i] = __hadd2_rn(reinterpret_cast<const B2*>(&hv)[i], reinterpret_cast<const B2*>(&yv)[i]);
  *reinterpret_cast<uint4*>(hout + at) = sum;
  float x[8];
  float ss = SumSquares<32>(sum, x);
  if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = ss;
  __syncthreads();
  ss = 0.f;
  for (int i = 0; i < blockDim.x / 32; ++i) ss = __fadd_rn(ss, part[i]);
  const float r = rsqrtf(__fadd_rn(__fdiv_rn(ss, float(hidden)), eps));
  *reinterpret_cast<uint4*>(out + at) = Scale(x, r, wv);
}

using Bf16 = ffi::Buffer<ffi::BF16>;
using Out = ffi::Result<Bf16>;

template <typename B>
auto* Data(B& b) { return reinterpret_cast<__nv_bfloat16*>(b.untyped_data()); }
template <typename B>
const auto* In(const B& b) { return reinterpret_cast<const __nv_bfloat16*>(b.untyped_data()); }

long long Rows(const Bf16& x) { return x.dimensions()[0]; }
long long Width(const Bf16& x) { return x.element_count() / Rows(x); }

ffi::Error Launch(cudaStream_t stream, Job j) {
  int pairs = 0, f = 0;  // f: the job's flags (the four handlers below build four kinds)
  for (int k = 0; k < j.parts; ++k) {
    const Part& p = j.part[k];
    pairs += p.heads / 2, f |= (!!p.w | p.rope << 1 | !!p.dst << 2 | (p.half >= 0) << 3) << 4 * k;
  }
  if (pairs > kWarps * kPer) return ffi::Error::InvalidArgument("dense.cu: more than 128 heads a row");
  auto* kernel = f == 0x8B7 ? HeadsKernel<0x8B7> : f == 0x5 ? HeadsKernel<0x5>
               : f == 0x66 ? HeadsKernel<0x66> : f == 0x88 ? HeadsKernel<0x88> : nullptr;
  if (!kernel) return ffi::Error::Internal("dense.cu: no kernel for this job's parts");
  if (j.rows > 0) kernel<<<j.rows, 32 * kWarps, 0, stream>>>(j);
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? ffi::Error::Success() : ffi::Error::Internal(cudaGetErrorString(e));
}

Job Rope(Job j, ffi::Buffer<ffi::S32> positions, ffi::Buffer<ffi::F32> inv_freq) {
  j.positions = positions.typed_data(), j.inv_freq = inv_freq.typed_data();
  return j;
}

Job State(Job j, Bf16& state, ffi::Buffer<ffi::S32> slots, int kv_heads) {
  j.state = Data(state), j.slots = slots.typed_data(), j.kv_heads = kv_heads;
  j.state_rows = state.element_count() / (2LL * kv_heads * kD);
  return j;
}

ffi::Error QkRope(cudaStream_t stream, Bf16 qkv, Bf16 wq, Bf16 wk, ffi::Buffer<ffi::S32> positions,
                  ffi::Buffer<ffi::F32> inv_freq, Bf16 kv, ffi::Buffer<ffi::S32> slots,
                  int64_t heads, int64_t kv_heads, float eps, Out q, Out kv_out) {
  const long long W = Width(qkv);
  Job j{};
  j.part[0] = {In(qkv), W, 0, In(wq), true, Data(*q), heads * kD, -1, int(heads)};
  j.part[1] = {In(qkv), W, heads * kD, In(wk), true, nullptr, 0, 0, int(kv_heads)};
  j.part[2] = {In(qkv), W, (heads + kv_heads) * kD, nullptr, false, nullptr, 0, 1, int(kv_heads)};
  j.parts = 3, j.rows = int(Rows(qkv)), j.eps = eps;
  return Launch(stream, State(Rope(j, positions, inv_freq), *kv_out, slots, int(kv_heads)));
}

ffi::Error HeadNorm(cudaStream_t stream, Bf16 qkv, Bf16 w, int64_t col, int64_t heads, float eps,
                    Out out) {
  Job j{};
  j.part[0] = {In(qkv), Width(qkv), col, In(w), false, Data(*out), heads * kD, -1, int(heads)};
  j.parts = 1, j.rows = int(Rows(qkv)), j.eps = eps;
  return Launch(stream, j);
}

ffi::Error RopeOnly(cudaStream_t stream, Bf16 q, Bf16 k, ffi::Buffer<ffi::S32> positions,
                    ffi::Buffer<ffi::F32> inv_freq, Out qo, Out ko) {
  Job j{};
  const long long hq = Width(q) / kD, hk = Width(k) / kD;
  j.part[0] = {In(q), hq * kD, 0, nullptr, true, Data(*qo), hq * kD, -1, int(hq)};
  j.part[1] = {In(k), hk * kD, 0, nullptr, true, Data(*ko), hk * kD, -1, int(hk)};
  j.parts = 2, j.rows = int(Rows(q));
  return Launch(stream, Rope(j, positions, inv_freq));
}

ffi::Error KvWrite(cudaStream_t stream, Bf16 kv, Bf16 k, Bf16 qkv, ffi::Buffer<ffi::S32> slots,
                   int64_t v_col, Out kv_out) {
  Job j{};
  const long long hk = Width(k) / kD;
  j.part[0] = {In(k), hk * kD, 0, nullptr, false, nullptr, 0, 0, int(hk)};
  j.part[1] = {In(qkv), Width(qkv), v_col, nullptr, false, nullptr, 0, 1, int(hk)};
  j.parts = 2, j.rows = int(Rows(k));
  return Launch(stream, State(j, *kv_out, slots, int(hk)));
}

ffi::Error AddNorm(cudaStream_t stream, Bf16 y, Bf16 h, Bf16 w, float eps, Out out, Out hout) {
  const long long rows = Rows(h), hidden = Width(h);
  if (hidden % 256 || hidden > 8192)
    return ffi::Error::InvalidArgument("kj_add_norm: hidden must be a multiple of 256, <= 8192");
  if (rows > 0)
    AddNormKernel<<<rows, hidden / 8, 0, stream>>>(In(y), In(h), In(w), Data(*out), Data(*hout),
                                                  int(hidden), eps);
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? ffi::Error::Success() : ffi::Error::Internal(cudaGetErrorString(e));
}

auto OnStream() { return ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>(); }

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(KjQkRopeCuda, QkRope,
                              OnStream().Arg<Bf16>().Arg<Bf16>().Arg<Bf16>()
                                  .Arg<ffi::Buffer<ffi::S32>>().Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<Bf16>().Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("heads").Attr<int64_t>("kv_heads")
                                  .Attr<float>("eps").Ret<Bf16>().Ret<Bf16>(),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(KjHeadNormCuda, HeadNorm,
                              OnStream().Arg<Bf16>().Arg<Bf16>().Attr<int64_t>("col")
                                  .Attr<int64_t>("heads").Attr<float>("eps").Ret<Bf16>(),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(KjRopeCuda, RopeOnly,
                              OnStream().Arg<Bf16>().Arg<Bf16>().Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>().Ret<Bf16>().Ret<Bf16>(),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(KjKvWriteCuda, KvWrite,
                              OnStream().Arg<Bf16>().Arg<Bf16>().Arg<Bf16>()
                                  .Arg<ffi::Buffer<ffi::S32>>().Attr<int64_t>("v_col")
                                  .Ret<Bf16>(),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(KjAddNormCuda, AddNorm,
                              OnStream().Arg<Bf16>().Arg<Bf16>().Arg<Bf16>().Attr<float>("eps")
                                  .Ret<Bf16>().Ret<Bf16>(),
                              {ffi::Traits::kCmdBufferCompatible});
