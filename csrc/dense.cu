// A dense layer's small bf16 calls as kernels of kernjax's own (models/dense_cuda.py, roadmap K14):
//
//   kj_qk_rope   q_norm, k_norm, rope and kv_write as one: qkv's q heads normed and roped into q,
//                its k heads normed and roped and its v heads into the paged KV state at `slots`
//   kj_head_norm q_norm or k_norm alone (a cut after it): heads of qkv's columns from `col`, normed
//   kj_rope      rope alone: q and k roped
//   kj_kv_write  kv_write alone: k and qkv's v heads into the state
//   kj_add_norm  the residual add and the next RMSNorm: (rms(h + y) * w, h + y)
//
// One warp a row. The first four run one device code for every head (HeadStep): where a cut falls
// inside the group, the calls apart give the bits of the group, since each rounds to bf16 where
// its call's result would and every sum has one fixed order (lane by lane, then a butterfly over
// the lanes, whose two sides add the same two numbers). No FMA contraction (__fmul_rn/__fadd_rn).
// The math is models/qwen3.py's: RMSNorm in float32 cast to bf16 before the weight, NeoX RoPE with
// cos and sin cast to bf16, each product and sum of bf16 rounded as XLA rounds it.

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kD = 128;      // head_dim: 16 lanes a head, 8 elements a lane
constexpr int kRows = 4;     // rows (warps) a block
constexpr int kBatch = 4;    // head pairs loaded before any is worked on: loads in flight

__device__ __forceinline__ float Bf(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }

__device__ __forceinline__ void Unpack(uint4 v, float* x) {
  const auto* b = reinterpret_cast<const __nv_bfloat16*>(&v);
#pragma unroll
  for (int t = 0; t < 8; ++t) x[t] = __bfloat162float(b[t]);
}

__device__ __forceinline__ uint4 Pack(const float* x) {
  uint4 v;
  auto* b = reinterpret_cast<__nv_bfloat16*>(&v);
#pragma unroll
  for (int t = 0; t < 8; ++t) b[t] = __float2bfloat16_rn(x[t]);
  return v;
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

// x: a lane's 8 elements of a head; cs, sn: cos and sin at its 8 frequencies (bf16 values).
__device__ __forceinline__ void HeadStep(float* x, const Part& p, const float* w, const float* cs,
                                         const float* sn, float eps, int sub) {
  if (p.w) {
    float ss = 0.f;
#pragma unroll
    for (int t = 0; t < 8; ++t) ss = __fadd_rn(ss, __fmul_rn(x[t], x[t]));
#pragma unroll
    for (int m = 8; m >= 1; m >>= 1) ss = __fadd_rn(ss, __shfl_xor_sync(0xffffffffu, ss, m));
    const float r = rsqrtf(__fadd_rn(__fdiv_rn(ss, float(kD)), eps));
#pragma unroll
    for (int t = 0; t < 8; ++t) x[t] = Bf(__fmul_rn(w[t], Bf(__fmul_rn(x[t], r))));
  }
  if (p.rope) {
    float o[8];
#pragma unroll
    for (int t = 0; t < 8; ++t) {  // the other half's element: -x2 for the first half, x1 after
      const float y = __shfl_xor_sync(0xffffffffu, x[t], 8);
      o[t] = Bf(__fadd_rn(Bf(__fmul_rn(x[t], cs[t])), Bf(__fmul_rn(sub < 8 ? -y : y, sn[t]))));
    }
#pragma unroll
    for (int t = 0; t < 8; ++t) x[t] = o[t];
  }
}

__global__ void __launch_bounds__(32 * kRows) HeadsKernel(Job j) {
  const int row = blockIdx.x * kRows + threadIdx.x / 32;
  if (row >= j.rows) return;  // a whole warp: the shuffles stay full
  const int lane = threadIdx.x % 32, sub = lane % 16, pair = lane / 16;
  float cs[8], sn[8];
  bool rope = false;
  for (int k = 0; k < j.parts; ++k) rope |= j.part[k].rope;
  if (rope) {
    const float pos = float(j.positions[row]);
#pragma unroll
    for (int t = 0; t < 8; ++t) {
      const float a = __fmul_rn(pos, j.inv_freq[(sub % 8) * 8 + t]);
      cs[t] = Bf(cosf(a));
      sn[t] = Bf(sinf(a));
    }
  }
  long long slot = -1;
  if (j.state) {  // jnp's .at[slot]: a negative slot counts from the end; out of range drops
    long long s = j.slots[row];
    s += s < 0 ? j.state_rows : 0;
    slot = s >= 0 && s < j.state_rows ? s : -1;
  }
  for (int k = 0; k < j.parts; ++k) {
    const Part& p = j.part[k];
    float w[8];
    if (p.w) Unpack(*reinterpret_cast<const uint4*>(p.w + sub * 8), w);
    const __nv_bfloat16* src = p.src + row * p.src_stride + p.src_col + sub * 8;
    for (int h0 = 0; h0 < p.heads; h0 += 2 * kBatch) {
      uint4 v[kBatch];
#pragma unroll
      for (int b = 0; b < kBatch; ++b)
        if (h0 + 2 * b < p.heads) v[b] = *reinterpret_cast<const uint4*>(src + (h0 + 2 * b + pair) * kD);
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        const int head = h0 + 2 * b + pair;
        if (h0 + 2 * b >= p.heads) break;
        float x[8];
        Unpack(v[b], x);
        HeadStep(x, p, w, cs, sn, j.eps, sub);
        const uint4 out = Pack(x);
        if (p.dst)
          *reinterpret_cast<uint4*>(p.dst + row * p.dst_stride + head * kD + sub * 8) = out;
        if (p.half >= 0 && slot >= 0)
          *reinterpret_cast<uint4*>(j.state + ((slot * 2 + p.half) * j.kv_heads + head) * kD +
                                    sub * 8) = out;
      }
    }
  }
}

// h + y, then its RMSNorm times w; `steps` 256-element pieces a row (hidden = 256 steps), at most 16.
__global__ void __launch_bounds__(32 * kRows) AddNormKernel(
    const __nv_bfloat16* y, const __nv_bfloat16* h, const __nv_bfloat16* w, __nv_bfloat16* out,
    __nv_bfloat16* hout, int rows, int steps, float eps) {
  const int row = blockIdx.x * kRows + threadIdx.x / 32;
  if (row >= rows) return;
  const int lane = threadIdx.x % 32, hidden = steps * 256;
  const long long base = (long long)row * hidden + lane * 8;
  uint4 hv[16], yv[16];
#pragma unroll
  for (int s = 0; s < 16; ++s)
    if (s < steps) {
      hv[s] = *reinterpret_cast<const uint4*>(h + base + s * 256);
      yv[s] = *reinterpret_cast<const uint4*>(y + base + s * 256);
    }
  float ss = 0.f;
#pragma unroll
  for (int s = 0; s < 16; ++s)
    if (s < steps) {
      float a[8], b[8];
      Unpack(hv[s], a);
      Unpack(yv[s], b);
#pragma unroll
      for (int t = 0; t < 8; ++t) {
        a[t] = Bf(__fadd_rn(a[t], b[t]));
        ss = __fadd_rn(ss, __fmul_rn(a[t], a[t]));
      }
      hv[s] = Pack(a);
      *reinterpret_cast<uint4*>(hout + base + s * 256) = hv[s];
    }
#pragma unroll
  for (int m = 16; m >= 1; m >>= 1) ss = __fadd_rn(ss, __shfl_xor_sync(0xffffffffu, ss, m));
  const float r = rsqrtf(__fadd_rn(__fdiv_rn(ss, float(hidden)), eps));
#pragma unroll
  for (int s = 0; s < 16; ++s)
    if (s < steps) {
      float a[8], g[8];
      Unpack(hv[s], a);
      Unpack(*reinterpret_cast<const uint4*>(w + lane * 8 + s * 256), g);
#pragma unroll
      for (int t = 0; t < 8; ++t) a[t] = Bf(__fmul_rn(g[t], Bf(__fmul_rn(a[t], r))));
      *reinterpret_cast<uint4*>(out + base + s * 256) = Pack(a);
    }
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
  if (j.rows > 0) HeadsKernel<<<(j.rows + kRows - 1) / kRows, 32 * kRows, 0, stream>>>(j);
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? ffi::Error::Success() : ffi::Error::Internal(cudaGetErrorString(e));
}

Job Rope(Job j, ffi::Buffer<ffi::S32> positions, ffi::Buffer<ffi::F32> inv_freq) {
  j.positions = positions.typed_data();
  j.inv_freq = inv_freq.typed_data();
  return j;
}

Job State(Job j, Bf16& state, ffi::Buffer<ffi::S32> slots, int kv_heads) {
  j.state = Data(state);
  j.slots = slots.typed_data();
  j.kv_heads = kv_heads;
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
  if (hidden % 256 || hidden > 16 * 256)
    return ffi::Error::InvalidArgument("kj_add_norm: hidden must be a multiple of 256, <= 4096");
  if (rows > 0)
    AddNormKernel<<<(rows + kRows - 1) / kRows, 32 * kRows, 0, stream>>>(
        In(y), In(h), In(w), Data(*out), Data(*hout), int(rows), int(hidden / 256), eps);
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
