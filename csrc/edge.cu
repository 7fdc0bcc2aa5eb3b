// The edge ops on CUDA (edge.h; their CPU twins and the bindings are in edge.cc), all enqueued on
// XLA's stream, none synchronizing:
//   kj_hold  a one-thread kernel spins on the edge's word (mapped pinned memory) with
//            __nanosleep until it reaches the target, then an acquire fence; after
//            HoldTimeout() seconds of globaltimer it traps, so a dead neighbour ends the
//            stage with a CUDA error instead of a hang. No driver call waits: the host thread
//            that issued the program goes on.
//   kj_recv  a copy kernel from the item's slot (IPC-mapped device memory, or mapped host
//            memory) into the output;
//   kj_push  a copy kernel from the departure into the item's slot;
// The slot is picked on the device from the item's sequence number (an operand in device
// memory): reading it on the host would wait for the stream, behind a hold.
//   kj_post  a one-thread kernel: a system fence, then the store of the value into the word.
// On an edge bound to NCCL (nccl.cc) recv and push are ncclRecv and ncclSend, hold passes, and
// post marks the item done in this process's own word.

#include <cuda_runtime_api.h>

#include <algorithm>
#include <string>

#include "edge.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

__global__ void HoldKernel(const int32_t* target, int32_t less, const volatile int32_t* word,
                           const int32_t* tok, int32_t* out, unsigned long long timeout_ns) {
  const int32_t want = *target - less;
  unsigned long long start, now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  while (*word < want) {
    __nanosleep(256);
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    if (now - start > timeout_ns) __trap();
  }
  __threadfence_system();
  *out = *tok;
}

__global__ void PostKernel(const int32_t* value, volatile int32_t* word, const int32_t* tok,
                           int32_t* out) {
  __threadfence_system();
  *word = *value;
  *out = *tok;
}

// dst/src are slot 0's address plus the departure's offset when `slotted` is 1 or 2 (the slot of
// item *seq is added to dst or to src); 16 bytes a thread where both are 16-byte aligned.
__global__ void CopyKernel(char* dst, const char* src, unsigned long long bytes, const int32_t* seq,
                           long long stride, int nslots, int slotted, const int32_t* tok,
                           int32_t* out) {
  long long slot = static_cast<long long>(*seq % nslots) * stride;
  if (slotted == 1) dst += slot;
  if (slotted == 2) src += slot;
  unsigned long long i = blockIdx.x * blockDim.x + threadIdx.x, step = gridDim.x * blockDim.x;
  unsigned long long vec = ((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src))
                            % 16) ? 0 : bytes / 16;
  for (unsigned long long j = i; j < vec; j += step)
    reinterpret_cast<uint4*>(dst)[j] = reinterpret_cast<const uint4*>(src)[j];
  for (unsigned long long j = vec * 16 + i; j < bytes; j += step) dst[j] = src[j];
  // A push's bytes go to another GPU or to the host, which learn of them from the post's word
  // (a later kernel): each writer fences its own stores at system scope before it ends.
  if (slotted == 1) __threadfence_system();
  if (i == 0) *out = *tok;
}

ffi::Error Fail(const char* op, const std::string& what) {
  return ffi::Error::Internal(std::string(op) + " (cuda): " + what);
}

ffi::Error Check(const char* op, cudaError_t err) {
  if (err == cudaSuccess) return ffi::Error::Success();
  return Fail(op, std::string(cudaGetErrorName(err)) + ": " + cudaGetErrorString(err));
}

// The device's view of an edge's arrived (0) or taken (1) word, or of its slot 0 (2), looked up
// once per binding: host memory (shared memory, registered and mapped) through its device pointer,
// device memory (CUDA IPC slots) as it is; 0 where the device cannot reach it.
uint64_t DeviceView(const kj::Edge& e, int which) {
  if (!e.dev[which]) {
    uint64_t host = which == 2 ? e.base : kj::Word(e, which);
    cudaPointerAttributes attr;
    uint64_t dev = 0;
    if (cudaPointerGetAttributes(&attr, reinterpret_cast<void*>(host)) == cudaSuccess)
      dev = attr.type == cudaMemoryTypeDevice ? host
            : attr.type == cudaMemoryTypeUnregistered ? 0
            : reinterpret_cast<uint64_t>(attr.devicePointer);
    cudaGetLastError();  // an unregistered pointer's query leaves an error behind: clear it
    e.dev[which] = dev;
  }
  return e.dev[which];
}

ffi::Error DeviceWord(const char* op, const kj::Edge& e, int64_t word, int32_t** dev) {
  *dev = reinterpret_cast<int32_t*>(DeviceView(e, static_cast<int>(word)));
  if (*dev == nullptr)
    return Fail(op, "the edge's words must be pinned host memory mapped into the device");
  return ffi::Error::Success();
}

ffi::Error Copy(const char* op, cudaStream_t stream, const kj::Edge& e, int64_t edge,
                int64_t index, uint64_t bytes, void* local, const int32_t* seq, bool to_slot,
                const int32_t* tok, int32_t* out) {
  uint64_t addr = 0;
  std::string err = kj::Place(e, index, 0, bytes, &addr);  // slot 0: the kernel adds the item's
  if (!err.empty()) return Fail(op, "edge " + std::to_string(edge) + ": " + err);
  char* slot = reinterpret_cast<char*>(DeviceView(e, 2) + (addr - e.base));
  int blocks = static_cast<int>(std::min<uint64_t>(264, (bytes / 16 + 255) / 256 + 1));
  CopyKernel<<<blocks, 256, 0, stream>>>(to_slot ? slot : static_cast<char*>(local),
                                         to_slot ? static_cast<const char*>(local) : slot, bytes,
                                         seq, e.stride, e.nslots, to_slot ? 1 : 2, tok, out);
  return Check(op, cudaGetLastError());
}

kj::Edge* Find(int64_t edge, std::string* err) { return kj::FindEdge(edge, err); }

// An NCCL edge (nccl.cc): no slots and no shared words; the token passes on after the send or
// receive, in stream order.
ffi::Error PassOn(const char* op, cudaStream_t stream, const int32_t* tok, int32_t* out) {
  if (out != tok) cudaMemcpyAsync(out, tok, 4, cudaMemcpyDeviceToDevice, stream);
  return Check(op, cudaGetLastError());
}

ffi::Error Nccl(const char* op, cudaStream_t stream, const kj::Edge& e, bool send, void* buf,
                uint64_t bytes, int64_t index, const int32_t* tok, int32_t* out) {
  if (index < 0 || index >= static_cast<int64_t>(e.sizes.size()) ||
      static_cast<int64_t>(bytes) != e.sizes[index])
    return Fail(op, "departure " + std::to_string(index) + " does not match the edge");
  std::string err = kj::NcclMove(e, send, buf, bytes, stream);
  if (!err.empty()) return Fail(op, err);
  return PassOn(op, stream, tok, out);
}

ffi::Error HoldImpl(cudaStream_t stream, ffi::Buffer<ffi::S32> tok, ffi::Buffer<ffi::S32> target,
                    ffi::RemainingArgs, int64_t edge, int64_t word,
                    ffi::Result<ffi::Buffer<ffi::S32>> out) {
  std::string err;
  kj::Edge* e = Find(edge, &err);
  if (!e) return Fail("kj_hold", err);
  if (e->comm) return PassOn("kj_hold", stream, tok.typed_data(), out->typed_data());
  int32_t* w = nullptr;
  if (auto r = DeviceWord("kj_hold", *e, word, &w); r.failure()) return r;
  // the kernel reads the item on the device: want = item - less
  HoldKernel<<<1, 1, 0, stream>>>(target.typed_data(), -kj::Want(*e, word, 0), w,
                                  tok.typed_data(), out->typed_data(),
                                  static_cast<unsigned long long>(kj::HoldTimeout() * 1e9));
  return Check("kj_hold", cudaGetLastError());
}

ffi::Error RecvImpl(cudaStream_t stream, ffi::Buffer<ffi::S32> tok, ffi::Buffer<ffi::S32> seq,
                    int64_t edge, int64_t index, ffi::Result<ffi::AnyBuffer> x,
                    ffi::Result<ffi::Buffer<ffi::S32>> out) {
  std::string err;
  kj::Edge* e = Find(edge, &err);
  if (!e) return Fail("kj_recv", err);
  if (e->comm)
    return Nccl("kj_recv", stream, *e, false, x->untyped_data(), x->size_bytes(), index,
                tok.typed_data(), out->typed_data());
  return Copy("kj_recv", stream, *e, edge, index, x->size_bytes(), x->untyped_data(),
              seq.typed_data(), false, tok.typed_data(), out->typed_data());
}

ffi::Error PushImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> tok,
                    ffi::Buffer<ffi::S32> seq, int64_t edge, int64_t index,
                    ffi::Result<ffi::Buffer<ffi::S32>> out) {
  std::string err;
  kj::Edge* e = Find(edge, &err);
  if (!e) return Fail("kj_push", err);
  if (e->comm)
    return Nccl("kj_push", stream, *e, true, x.untyped_data(), x.size_bytes(), index,
                tok.typed_data(), out->typed_data());
  return Copy("kj_push", stream, *e, edge, index, x.size_bytes(), x.untyped_data(),
              seq.typed_data(), true, tok.typed_data(), out->typed_data());
}

ffi::Error PostImpl(cudaStream_t stream, ffi::Buffer<ffi::S32> tok, ffi::Buffer<ffi::S32> value,
                    int64_t edge, int64_t word, ffi::Result<ffi::Buffer<ffi::S32>> out) {
  std::string err;
  kj::Edge* e = Find(edge, &err);
  if (!e) return Fail("kj_post", err);
  int32_t* w = nullptr;
  if (auto r = DeviceWord("kj_post", *e, word, &w); r.failure()) return r;
  PostKernel<<<1, 1, 0, stream>>>(value.typed_data(), w, tok.typed_data(), out->typed_data());
  return Check("kj_post", cudaGetLastError());
}

}  // namespace

namespace {
auto OnStream() { return ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>(); }
}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(KjHoldCuda, HoldImpl, kj::BindHold(OnStream()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(KjRecvCuda, RecvImpl, kj::BindRecv(OnStream()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(KjPushCuda, PushImpl, kj::BindPush(OnStream()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(KjPostCuda, PostImpl, kj::BindPost(OnStream()));
