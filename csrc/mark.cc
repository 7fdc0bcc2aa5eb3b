// kj_mark, CPU: an identity op on one buffer that also publishes a per-step
// sequence number into a host slot.
//
// The Python wrapper (kernjax/ffi.py: mark) aliases the output to the input
// (input_output_aliases={0: 0}), so normally no bytes move; when XLA does hand
// us distinct buffers we copy. The sequence number is an operand (a 1-element
// int32 array) because it changes every step; the slot address is an
// attribute because it is fixed for the life of the compiled program.

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Copies `bytes` from `src` to `dst` unless they are the same buffer, then
// stores `seq` into the int32 host slot at address `slot` (0 = no slot). The
// store is a release store, so a thread polling the slot that sees `seq` also
// sees everything this step wrote before it.
void MarkCompute(const void* src, void* dst, size_t bytes, int32_t seq,
                 uint64_t slot) {
  if (dst != src && bytes > 0) {
    std::memcpy(dst, src, bytes);
  }
  if (slot != 0) {
    __atomic_store_n(reinterpret_cast<int32_t*>(slot), seq, __ATOMIC_RELEASE);
  }
}

ffi::Error MarkImpl(ffi::AnyBuffer x, ffi::Buffer<ffi::S32> seq, uint64_t slot,
                    ffi::Result<ffi::AnyBuffer> y) {
  if (y->element_type() != x.element_type() ||
      y->size_bytes() != x.size_bytes()) {
    return ffi::Error::InvalidArgument(
        "kj_mark: output must have the same dtype and size as the input");
  }
  if (seq.element_count() != 1) {
    return ffi::Error::InvalidArgument(
        "kj_mark: seq must have exactly one int32 element, got " +
        std::to_string(seq.element_count()));
  }
  if (slot % alignof(int32_t) != 0) {
    return ffi::Error::InvalidArgument(
        "kj_mark: slot address must be 4-byte aligned");
  }
  MarkCompute(x.untyped_data(), y->untyped_data(), x.size_bytes(),
              seq.typed_data()[0], slot);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(KjMarkCpu, MarkImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()       // x
                                  .Arg<ffi::Buffer<ffi::S32>>()  // seq
                                  .Attr<uint64_t>("slot")  // host slot address
                                  .Ret<ffi::AnyBuffer>()  // y (aliases x)
);
