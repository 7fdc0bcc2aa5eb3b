// kj_mxfp4_shuffle, CUDA: the CPU handler's gathers (mxfp4_shuffle.cc) as two
// kernels on XLA's stream: one thread per output byte of the packed rows, one
// per output byte of the flat scales (padding included, written as zero).
// Byte gathers, no arithmetic on values: bitwise the JAX reference.

#include <cstdint>
#include <string>

#include <cuda_runtime_api.h>

#include "mxfp4_shuffle.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

__global__ void PackedKernel(const uint8_t* p, uint8_t* po, int64_t batch,
                             int64_t m, int64_t kb, bool gated) {
  const int64_t n = batch * m * kb;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t c = i % kb, r = (i / kb) % m, e = i / (kb * m);
    po[i] = p[(e * m + kj::ShuffledRow(r, m, gated)) * kb + c];
  }
}

// Output byte i of one matrix's flat scales: find its (row, block) by
// inverting ScaleOffset over the [Mp/128, Kp/4, 32, 4, 4] order.
__global__ void ScalesKernel(const uint8_t* s, uint8_t* so, int64_t batch,
                             int64_t m, int64_t ks, int64_t mp, int64_t kp,
                             bool gated) {
  const int64_t per = mp * kp, n = batch * per;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t e = i / per, o = i % per;
    const int64_t tile = o / 512, in = o % 512;
    const int64_t row = (tile / (kp / 4)) * 128 + (in / 16) + ((in % 16) / 4) * 32;
    const int64_t k = (tile % (kp / 4)) * 4 + in % 4;
    uint8_t v = 0;
    if (row < m && k < ks) v = s[(e * m + kj::ShuffledRow(row, m, gated)) * ks + k];
    so[i] = v;
  }
}

int Blocks(int64_t n) {
  int64_t b = (n + 255) / 256;
  return static_cast<int>(b < 65535 ? (b > 0 ? b : 1) : 65535);
}

ffi::Error ShuffleImpl(cudaStream_t stream, ffi::Buffer<ffi::U8> packed,
                       ffi::Buffer<ffi::U8> scales, bool gated,
                       ffi::ResultBuffer<ffi::U8> packed_out,
                       ffi::ResultBuffer<ffi::U8> scales_out) {
  kj::Dims d;
  ffi::Error check = kj::CheckDims(packed, scales, gated, scales_out->element_count(),
                                   &d, "kj_mxfp4_shuffle (cuda)");
  if (check.failure()) return check;
  const int64_t batch = d.batch, m = d.m, kb = d.kb, ks = d.ks, mp = d.mp, kp = d.kp;
  PackedKernel<<<Blocks(batch * m * kb), 256, 0, stream>>>(
      packed.typed_data(), packed_out->typed_data(), batch, m, kb, gated);
  ScalesKernel<<<Blocks(batch * mp * kp), 256, 0, stream>>>(
      scales.typed_data(), scales_out->typed_data(), batch, m, ks, mp, kp, gated);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    return ffi::Error::Internal(std::string("kj_mxfp4_shuffle (cuda): launch: ") +
                                cudaGetErrorName(err));
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(KjMxfp4ShuffleCuda, ShuffleImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()  // packed
                                  .Arg<ffi::Buffer<ffi::U8>>()  // scales
                                  .Attr<bool>("gated")
                                  .Ret<ffi::Buffer<ffi::U8>>()  // packed, shuffled
                                  .Ret<ffi::Buffer<ffi::U8>>()  // scales, flat
);
