// The MXFP4 GEMM shuffle's index math, shared by the CPU and CUDA handlers
// (kj_mxfp4_shuffle; the JAX reference and the layout's description are
// kernjax/kernels/mxfp4.py: shuffle, after FlashInfer / TRT-LLM-gen's layout).
//
// Per matrix of M rows: packed [M, K/2] bytes and scales [M, K/32] E8M0 bytes.
//   rows: shuffled row r holds logical row Row(r): within each 32-row block,
//     r = 32b + j reads 32b + (j % 8) * 4 + j / 8 (shuffle_matrix_a), and a
//     gated GEMM1 ([up; gate], M = 2I) first interleaves its halves, so that
//     row t of the interleaved matrix is t / 2 (t even) or I + t / 2 (t odd).
//   scales: the same row gather, padded with zeros to Mp = ceil(M/128)*128
//     rows and Kp = ceil(K/32 / 4)*4 blocks, stored flat in the 128x4
//     swizzle: byte ScaleOffset(m, k).
#pragma once

#include "kj.h"

#include <cstdint>
#include <string>

#include "xla/ffi/api/ffi.h"


namespace kj {

KJ_HD int64_t ShuffledRow(int64_t r, int64_t m, bool gated) {
  int64_t j = r % 32;
  int64_t t = r - j + (j % 8) * 4 + j / 8;
  if (!gated) return t;
  return (t % 2 == 0) ? t / 2 : m / 2 + t / 2;
}

KJ_HD int64_t ScaleOffset(int64_t row, int64_t k, int64_t kp) {
  return (row / 128) * (kp / 4 * 512) + (k / 4) * 512 + (row % 32) * 16 +
         ((row % 128) / 32) * 4 + k % 4;
}

KJ_HD int64_t PadTo(int64_t n, int64_t to) { return (n + to - 1) / to * to; }

struct Dims {
  int64_t batch, m, kb, ks, mp, kp;
};

// Checks the operands (packed [.., M, K/2], scales [.., M, K/32]) and the scales
// result's size, and fills `d`; `who` names the handler in the message.
inline xla::ffi::Error CheckDims(const xla::ffi::Buffer<xla::ffi::U8>& packed,
                                 const xla::ffi::Buffer<xla::ffi::U8>& scales,
                                 bool gated, int64_t scales_out, Dims* d,
                                 const char* who) {
  auto pd = packed.dimensions();
  auto sd = scales.dimensions();
  const size_t n = pd.size();
  if (n < 2 || sd.size() != n || sd[n - 2] != pd[n - 2] ||
      pd[n - 1] * 2 != sd[n - 1] * 32 || pd[n - 2] % (gated ? 64 : 32) != 0) {
    return xla::ffi::Error::InvalidArgument(
        std::string(who) + ": needs packed [.., M, K/2], scales [.., M, K/32], "
        "M % 32 == 0 (M % 64 when gated)");
  }
  d->m = pd[n - 2], d->kb = pd[n - 1], d->ks = sd[n - 1];
  d->batch = packed.element_count() / (d->m * d->kb);
  d->mp = PadTo(d->m, 128), d->kp = PadTo(d->ks, 4);
  if (scales_out != d->batch * d->mp * d->kp) {
    return xla::ffi::Error::InvalidArgument(std::string(who) + ": scales result size");
  }
  return xla::ffi::Error::Success();
}

}  // namespace kj
