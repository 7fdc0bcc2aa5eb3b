// kj_mxfp4_shuffle, CPU: MXFP4 experts from the checkpoint layout into the
// GEMM layout (index math in mxfp4_shuffle.h). Pure byte gathers, so the
// result is bitwise the JAX reference (kernjax/kernels/mxfp4.py: shuffle).
//
// Operands: packed u8[..., M, K/2], scales u8[..., M, K/32]; leading dims are
// a batch (experts). Results: packed u8[..., M, K/2] (rows shuffled) and
// scales u8[..., Mp * Kp] (flat, swizzled, zero padded). Attribute `gated`:
// M is a GEMM1 [up; gate] whose halves are interleaved first.

#include <cstdint>
#include <cstring>

#include "mxfp4_shuffle.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error ShuffleImpl(ffi::Buffer<ffi::U8> packed, ffi::Buffer<ffi::U8> scales,
                       bool gated, ffi::ResultBuffer<ffi::U8> packed_out,
                       ffi::ResultBuffer<ffi::U8> scales_out) {
  kj::Dims d;
  ffi::Error err = kj::CheckDims(packed, scales, gated, scales_out->element_count(),
                                 &d, "kj_mxfp4_shuffle");
  if (err.failure()) return err;
  const int64_t batch = d.batch, m = d.m, kb = d.kb, ks = d.ks, mp = d.mp, kp = d.kp;
  const uint8_t* p = packed.typed_data();
  const uint8_t* s = scales.typed_data();
  uint8_t* po = packed_out->typed_data();
  uint8_t* so = scales_out->typed_data();
  std::memset(so, 0, batch * mp * kp);
  for (int64_t e = 0; e < batch; ++e) {
    for (int64_t r = 0; r < m; ++r) {
      const int64_t src = kj::ShuffledRow(r, m, gated);
      std::memcpy(po + (e * m + r) * kb, p + (e * m + src) * kb, kb);
      for (int64_t k = 0; k < ks; ++k) {
        so[e * mp * kp + kj::ScaleOffset(r, k, kp)] = s[(e * m + src) * ks + k];
      }
    }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(KjMxfp4ShuffleCpu, ShuffleImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::U8>>()  // packed
                                  .Arg<ffi::Buffer<ffi::U8>>()  // scales
                                  .Attr<bool>("gated")
                                  .Ret<ffi::Buffer<ffi::U8>>()  // packed, shuffled
                                  .Ret<ffi::Buffer<ffi::U8>>()  // scales, flat
);
