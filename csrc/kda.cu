// kj_kda, CUDA: one block of K threads per (sequence, head), its state and the
// chunk's tensors in shared memory; the phases of kda.h with __syncthreads()
// between them. A second kernel zeroes the padding rows past cu_seqlens[N].
// Everything on XLA's stream; no atomics.

#include <cstdint>
#include <string>

#include <cuda_runtime_api.h>

#include "kda.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using F32 = ffi::Buffer<ffi::F32>;

namespace {

__global__ void KdaKernel(const float* q, const float* k, const float* v, const float* g,
                          const float* beta, const int32_t* cu, const float* h0, float* o,
                          float* final_state, int H, int K) {
  extern __shared__ float smem[];
  kj::KdaBlock s(smem, K);
  const int n = blockIdx.x, h = blockIdx.y, l = threadIdx.x;
  const int64_t base = (int64_t(n) * H + h) * K * K;
  for (int d = 0; d < K; ++d) s.S[d * K + l] = h0[base + d * K + l];
  const int64_t end = cu[n + 1];
  for (int64_t t0 = cu[n]; t0 < end; t0 += kj::kKdaChunk) {
    const int rows = int(end - t0 < kj::kKdaChunk ? end - t0 : kj::kKdaChunk);
    __syncthreads();
    kj::KdaLoad(s, l, q, k, g, v, beta, t0, rows, h, H);
    __syncthreads();
    kj::KdaPairs(s, l, K);
    __syncthreads();
    for (int i = 0; i < kj::kKdaChunk; ++i) {
      kj::KdaSolveRow(s, i, l);
      __syncthreads();
    }
    kj::KdaWU(s, l);
    __syncthreads();
    kj::KdaStep(s, l, o, t0, rows, h, H);
  }
  for (int d = 0; d < K; ++d) final_state[base + d * K + l] = s.S[d * K + l];
}

__global__ void ZeroPadding(float* o, const int32_t* cu, int N, int64_t T, int64_t width) {
  const int64_t from = int64_t(cu[N]) * width, to = T * width;
  for (int64_t i = from + blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < to;
       i += int64_t(gridDim.x) * blockDim.x)
    o[i] = 0.f;
}

ffi::Error KdaImpl(cudaStream_t stream, F32 q, F32 k, F32 v, F32 g, F32 beta,
                   ffi::Buffer<ffi::S32> cu, F32 h0, ffi::ResultBuffer<ffi::F32> o,
                   ffi::ResultBuffer<ffi::F32> final_state) {
  int64_t T;
  int H, K, N;
  ffi::Error bad = kj::KdaDims(q, cu, &T, &H, &K, &N, "kj_kda (cuda)");
  if (bad.failure()) return bad;
  const size_t bytes = sizeof(float) * kj::KdaFloats(K);
  cudaError_t err = cudaFuncSetAttribute(KdaKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         int(bytes));
  if (err == cudaSuccess) {
    KdaKernel<<<dim3(N, H), K, bytes, stream>>>(
        q.typed_data(), k.typed_data(), v.typed_data(), g.typed_data(), beta.typed_data(),
        cu.typed_data(), h0.typed_data(), o->typed_data(), final_state->typed_data(), H, K);
    ZeroPadding<<<256, 256, 0, stream>>>(o->typed_data(), cu.typed_data(), N, T,
                                         int64_t(H) * K);
    err = cudaGetLastError();
  }
  if (err != cudaSuccess) {
    return ffi::Error::Internal(std::string("kj_kda (cuda): ") + cudaGetErrorName(err) +
                                ": " + cudaGetErrorString(err));
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(KjKdaCuda, KdaImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<F32>()                     // q, pre-scaled
                                  .Arg<F32>()                     // k
                                  .Arg<F32>()                     // v
                                  .Arg<F32>()                     // g
                                  .Arg<F32>()                     // beta
                                  .Arg<ffi::Buffer<ffi::S32>>()   // cu_seqlens
                                  .Arg<F32>()                     // initial state
                                  .Ret<F32>()                     // o
                                  .Ret<F32>()                     // final state
);
