// kj_fa3, CUDA: the bf16 attention call through FlashAttention-3 (fa3.h). A small kernel first
// writes each sequence's key count (its last row's position + 1; 0 for an empty sequence) and
// zeroes the padding rows past cu_seqlens[seqs], which FlashAttention does not write; then the
// library's forward, on XLA's stream. The library is loaded by Fa3Load (kernjax/ffi.py); a
// program run without it fails with a message that says how to build it.

#include <dlfcn.h>

#include <cstdint>
#include <mutex>
#include <string>

#include <cuda_runtime_api.h>

#include "fa3.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

KjFa3Fn g_fa3 = nullptr;
std::string g_fa3_error = "no library was named";
std::mutex g_fa3_mu;

__global__ void Fa3Prologue(const int32_t* positions, const int32_t* cu, int seqs, int32_t* used,
                            uint4* o, int64_t row_vecs, int64_t rows) {
  const int64_t tid = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  const int64_t step = int64_t(gridDim.x) * blockDim.x;
  for (int64_t s = tid; s < seqs; s += step)
    used[s] = cu[s + 1] > cu[s] ? positions[cu[s + 1] - 1] + 1 : 0;
  for (int64_t i = int64_t(cu[seqs]) * row_vecs + tid; i < rows * row_vecs; i += step)
    o[i] = make_uint4(0, 0, 0, 0);
}

ffi::Error Fa3Impl(cudaStream_t stream, ffi::AnyBuffer kv, ffi::AnyBuffer q,
                   ffi::Buffer<ffi::S32> positions, ffi::Buffer<ffi::S32> cu,
                   ffi::Buffer<ffi::S32> page_table, ffi::Result<ffi::AnyBuffer> o,
                   ffi::ResultBuffer<ffi::F32> lse, ffi::ResultBuffer<ffi::S32> meta,
                   float scale) {
  if (!g_fa3)
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      "kj_fa3: bf16 attention with head_dim 128 runs FlashAttention-3 on CUDA "
                      "GPUs, and it is not loaded (" + g_fa3_error + "): build it with `bash "
                      "scripts/fa3` (README, \"On a GPU\"), or set KERNJAX_FA3_LIB to a "
                      "libkj_fa3.so built so");
  auto qd = q.dimensions(), kd = kv.dimensions(), pd = page_table.dimensions();
  if (q.element_type() != ffi::BF16 || kv.element_type() != ffi::BF16 || qd.size() != 3 ||
      qd[2] != 128 || kd.size() != 5 || kd[1] != 16 || kd[2] != 2 || kd[4] != 128 ||
      pd.size() != 2 || qd[1] % kd[3] != 0 || cu.element_count() != pd[0] + 1)
    return ffi::Error::InvalidArgument(
        "kj_fa3: takes bf16 q [rows, heads, 128], kv [pages, 16, 2, kv_heads, 128], "
        "page_table [seqs, width], cu_seqlens [seqs + 1]");
  const int seqs = int(pd[0]);
  if (meta->element_count() != KjFa3MetaInts(seqs) + seqs)
    return ffi::Error::InvalidArgument("kj_fa3: scratch of the wrong size");
  int device = 0, sms = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  int32_t* used = meta->typed_data() + KjFa3MetaInts(seqs);
  const int64_t row_vecs = qd[1] * qd[2] * 2 / 16;
  Fa3Prologue<<<64, 256, 0, stream>>>(positions.typed_data(), cu.typed_data(), seqs, used,
                                      static_cast<uint4*>(o->untyped_data()), row_vecs, qd[0]);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess)
    return ffi::Error::Internal(std::string("kj_fa3: ") + cudaGetErrorString(err));
  KjFa3Args a{KJ_FA3_VERSION, kv.untyped_data(), q.untyped_data(), o->untyped_data(),
              lse->typed_data(), cu.typed_data(), used, page_table.typed_data(),
              meta->typed_data(), int(qd[0]), seqs, int(pd[1]), int(kd[0]), int(qd[1]),
              int(kd[3]), sms, scale, stream};
  const int rc = g_fa3(&a);
  if (rc != 0)
    return ffi::Error::Internal("kj_fa3: FlashAttention-3 returned " + std::to_string(rc) +
                                (rc == 3 ? " (a libkj_fa3.so of another kernjax: rebuild it)"
                                         : ""));
  return ffi::Error::Success();
}

}  // namespace

namespace kj {

// Loads build/fa3/libkj_fa3.so (scripts/fa3) or another path. Returns "" or what went wrong,
// which kj_fa3 also says when a program needs the library.
std::string Fa3Load(const std::string& path) {
  std::lock_guard<std::mutex> lock(g_fa3_mu);
  void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!lib) return g_fa3_error = std::string("cannot load ") + path + ": " + dlerror();
  auto fn = reinterpret_cast<KjFa3Fn>(dlsym(lib, KJ_FA3_SYMBOL));
  if (!fn) return g_fa3_error = path + " has no " KJ_FA3_SYMBOL ": rebuild it";
  g_fa3 = fn;
  return g_fa3_error = "";
}

bool Fa3Loaded() { return g_fa3 != nullptr; }

}  // namespace kj

XLA_FFI_DEFINE_HANDLER_SYMBOL(KjFa3Cuda, Fa3Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()          // kv
                                  .Arg<ffi::AnyBuffer>()          // q
                                  .Arg<ffi::Buffer<ffi::S32>>()   // positions
                                  .Arg<ffi::Buffer<ffi::S32>>()   // cu_seqlens
                                  .Arg<ffi::Buffer<ffi::S32>>()   // page_table
                                  .Ret<ffi::AnyBuffer>()          // o
                                  .Ret<ffi::Buffer<ffi::F32>>()   // lse (scratch)
                                  .Ret<ffi::Buffer<ffi::S32>>()   // scheduler metadata, key counts
                                  .Attr<float>("scale"));
