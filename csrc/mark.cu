// kj_mark, CUDA: an identity op on one buffer that also publishes a per-step
// sequence number, and values with it (mark.cc), into a mapped host slot, in
// stream order.
//
// Everything is enqueued on XLA's stream; nothing here synchronizes. When the output aliases
// the input (the normal case, kernjax/kernels/ffi.py: mark) no bytes move; otherwise a device-to-device
// cudaMemcpyAsync copies them. If a slot is given, a kernel fences (__threadfence_system) and
// writes seq into it, the values first, so a host thread that polls the slot and sees seq[0]
// knows that all work enqueued before this op on the stream has completed.
//
// The slot must be pinned host memory mapped into the device (cudaHostAlloc or
// cudaHostRegister, mapped); a pointer the runtime does not know is refused, not faulted on.

#include <cstddef>
#include <cstdint>
#include <string>

#include <cuda_runtime_api.h>

#include "kj.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

__global__ void PublishSeqKernel(const int32_t* seq, int32_t k, int64_t ring, char* base) {
  const int32_t value = seq[0];
  volatile int32_t* slot = reinterpret_cast<volatile int32_t*>(
      base + ((value % ring + ring) % ring) * MarkStride(k));
  for (int32_t i = 1 + threadIdx.x; i < k; i += blockDim.x) slot[i] = seq[i];
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x == 0) *slot = value;
}

ffi::Error CudaError(const char* what, cudaError_t err) {
  return ffi::Error::Internal(std::string("kj_mark (cuda): ") + what + ": " +
                              cudaGetErrorName(err) + ": " +
                              cudaGetErrorString(err));
}

// Enqueues the copy (if needed) and the slot write (if any) on `stream`.
ffi::Error MarkCompute(cudaStream_t stream, const void* src, void* dst,
                       size_t bytes, const int32_t* seq, int64_t k, uint64_t slot,
                       int64_t ring) {
  if (dst != src && bytes > 0) {
    cudaError_t err =
        cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream);
    if (err != cudaSuccess) return CudaError("cudaMemcpyAsync", err);
  }
  if (slot != 0) {
    void* host = reinterpret_cast<void*>(slot);
    cudaPointerAttributes attr;
    cudaError_t err = cudaPointerGetAttributes(&attr, host);
    if (err != cudaSuccess) return CudaError("cudaPointerGetAttributes", err);
    if ((attr.type != cudaMemoryTypeHost &&
         attr.type != cudaMemoryTypeManaged) ||
        attr.devicePointer == nullptr) {
      return ffi::Error::InvalidArgument(
          "kj_mark (cuda): slot must be pinned host memory mapped into the "
          "device (cudaHostAlloc with cudaHostAllocMapped)");
    }
    PublishSeqKernel<<<1, k > 1 ? 128 : 1, 0, stream>>>(
        seq, static_cast<int32_t>(k), ring, static_cast<char*>(attr.devicePointer));
  }
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return CudaError("launch", err);
  return ffi::Error::Success();
}

ffi::Error MarkImpl(cudaStream_t stream, ffi::AnyBuffer x,
                    ffi::Buffer<ffi::S32> seq, uint64_t slot, int64_t ring,
                    ffi::Result<ffi::AnyBuffer> y) {
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
  return MarkCompute(stream, x.untyped_data(), y->untyped_data(),
                     x.size_bytes(), seq.typed_data(), seq.element_count(), slot, ring);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    KjMarkCuda, MarkImpl,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()  // XLA's compute stream
        .Arg<ffi::AnyBuffer>()                     // x
        .Arg<ffi::Buffer<ffi::S32>>()              // seq (device, 1 element)
        .Attr<uint64_t>("slot")                    // mapped host slot address
        .Attr<int64_t>("ring")                     // entries at slot
        .Ret<ffi::AnyBuffer>()                     // y (aliases x)
);
