// kj_mark, CPU: an identity op on one buffer that also publishes a per-step
// sequence number, and values with it, into a host slot.
//
// The Python wrapper (kernjax/kernels/ffi.py: mark) aliases the output to the input, so normally no
// bytes move; when XLA hands us distinct buffers we copy. `seq` is an operand (int32 [1 + n]:
// the number, then n values, e.g. a run's tokens) because it changes every step; the slot (an
// address, or an id bound by bind_slot, kj.h) and `ring` are attributes, fixed for the
// program's life. With ring > 1 the slot is entry seq[0] mod ring of a ring of them, each
// MarkStride(1 + n) bytes (kernjax/runtime/tokens.py).

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#include "kj.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Copies `bytes` from `src` to `dst` unless they are the same buffer, then
// writes seq[1..k) and last seq[0] into the int32 host slot at address `slot`
// (0 = no slot), entry seq[0] mod ring. seq[0]'s store is a release store, so
// a thread polling the slot that sees it also sees everything written before.
void MarkCompute(const void* src, void* dst, size_t bytes, const int32_t* seq,
                 int64_t k, uint64_t slot, int64_t ring) {
  if (dst != src && bytes > 0) {
    std::memcpy(dst, src, bytes);
  }
  if (slot != 0) {
    auto* w = reinterpret_cast<int32_t*>(slot + ((seq[0] % ring + ring) % ring) * MarkStride(k));
    std::memcpy(w + 1, seq + 1, (k - 1) * sizeof(int32_t));
    __atomic_store_n(w, seq[0], __ATOMIC_RELEASE);
  }
}

ffi::Error MarkImpl(ffi::AnyBuffer x, ffi::Buffer<ffi::S32> seq, uint64_t slot,
                    int64_t ring, ffi::Result<ffi::AnyBuffer> y) {
  if (y->element_type() != x.element_type() ||
      y->size_bytes() != x.size_bytes()) {
    return ffi::Error::InvalidArgument(
        "kj_mark: output must have the same dtype and size as the input");
  }
  if (seq.element_count() < 1 || ring < 1) {
    return ffi::Error::InvalidArgument("kj_mark: seq needs an element and ring one entry");
  }
  slot = BoundSlot(slot);
  if (slot % alignof(int32_t) != 0) {
    return ffi::Error::InvalidArgument(
        "kj_mark: slot address must be 4-byte aligned");
  }
  MarkCompute(x.untyped_data(), y->untyped_data(), x.size_bytes(),
              seq.typed_data(), seq.element_count(), slot, ring);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(KjMarkCpu, MarkImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()       // x
                                  .Arg<ffi::Buffer<ffi::S32>>()  // seq
                                  .Attr<uint64_t>("slot")  // host slot address
                                  .Attr<int64_t>("ring")   // entries at slot
                                  .Ret<ffi::AnyBuffer>()  // y (aliases x)
);
