// kj_fa3, CUDA: the bf16 attention call through FlashAttention-3 (fa3.h), on XLA's stream:
//   1. Fa3Offsets (one block, a scan): each sequence's key count (its last row's position + 1; 0 for an
//      empty one) and, for pages of 16, where its keys start in `keys` (whole blocks of 128 rows);
//   2. pages of 16: Fa3Gather copies each sequence's pages there in order, rows past its keys
//      zeroed, and zeroes the item's padding rows past cu_seqlens[seqs] in the output
//      (FlashAttention does not write them); pages of 128: Fa3Padding zeroes those rows only;
//   3. the library's forward over the keys (TMA): contiguous, or the pages of 128 in place.
// The library is loaded by Fa3Load (kernjax/kernels/ffi.py); a program run without it fails with a
// message that says why it is missing and how to build it.

#include <dlfcn.h>

#include <cstdint>
#include <cstdio>
#include <mutex>
#include <string>

#include <cuda_runtime_api.h>
#include <cub/block/block_scan.cuh>

#include "fa3.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

KjFa3Fn g_fa3 = nullptr;
std::string g_fa3_error = "kernjax.kernels.ffi has not tried to load it";
std::mutex g_fa3_mu;

constexpr int kPage = 16;       // pages gathered into contiguous keys
constexpr int kPageTma = 128;   // pages read in place: one FlashAttention key block each

constexpr int kScan = 256;

// used[s], cu_keys[0..seqs] (rows, multiples of 128), one block scanning kScan sequences at a
// time. Traps (after saying why) on a position past the page table or keys past the scratch:
// an item built wrong, or sequences that share pages.
__global__ void Fa3Offsets(const int32_t* __restrict__ positions, const int32_t* __restrict__ cu,
                           int seqs, int width, int page, int32_t* __restrict__ used,
                           int32_t* __restrict__ cu_keys, int64_t key_rows) {
  using Scan = cub::BlockScan<int64_t, kScan>;
  __shared__ typename Scan::TempStorage scan;
  __shared__ int64_t carry;
  if (threadIdx.x == 0) carry = 0;
  __syncthreads();
  for (int s0 = 0; s0 < seqs; s0 += kScan) {
    const int s = s0 + int(threadIdx.x);
    int64_t n = 0;
    if (s < seqs && cu[s + 1] > cu[s]) n = int64_t(positions[cu[s + 1] - 1]) + 1;
    if (n > int64_t(width) * page) {
      printf("kj_fa3: sequence %d reaches key %lld, past its page table's %lld\n", s,
             (long long)n, (long long)width * page);
      __trap();
    }
    int64_t at, total;
    Scan(scan).ExclusiveSum((n + 127) / 128 * 128, at, total);
    if (s < seqs) {
      used[s] = int32_t(n);
      cu_keys[s] = int32_t(carry + at);
    }
    __syncthreads();  // every thread has read carry
    if (threadIdx.x == 0) carry += total;
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    cu_keys[seqs] = int32_t(carry);
    if (carry > key_rows) {
      printf("kj_fa3: the item's keys take %lld rows, past the %lld its pages allow: two of its "
             "sequences share pages\n", (long long)carry, (long long)key_rows);
      __trap();
    }
  }
}

// The item's padding rows of the output, past cu_seqlens[seqs], zeroed by the grid's threads.
__device__ void ZeroPadding(const int32_t* __restrict__ cu, int seqs, uint4* __restrict__ o,
                            int64_t o_row_vecs, int64_t rows) {
  const int64_t step = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(cu[seqs]) * o_row_vecs + blockIdx.x * int64_t(blockDim.x) +
                   threadIdx.x; i < rows * o_row_vecs; i += step)
    o[i] = make_uint4(0, 0, 0, 0);
}

// Block b fills 16-row slots b, b + grid, .. of `keys` (each one's sequence found by bisection
// over cu_keys); a row is 2 * kv_heads * 128 bf16 (`row_vecs` uint4). Each thread loads its column of all 16
// rows before it stores any (16 loads in flight: a copy bound by memory, not by latency). Then
// every block zeroes its share of the output's padding rows.
__global__ void Fa3Gather(const uint4* __restrict__ kv, const int32_t* __restrict__ page_table,
                          int width, const int32_t* __restrict__ used,
                          const int32_t* __restrict__ cu_keys, int seqs, uint4* __restrict__ keys,
                          int64_t row_vecs, const int32_t* __restrict__ cu,
                          uint4* __restrict__ o, int64_t o_row_vecs, int64_t rows) {
  for (int64_t first = int64_t(blockIdx.x) * kPage; first < cu_keys[seqs];
       first += int64_t(gridDim.x) * kPage) {
    int lo = 0, hi = seqs - 1;  // the last s with cu_keys[s] <= first
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (cu_keys[mid] <= first) lo = mid; else hi = mid - 1;
    }
    const int64_t j = (first - cu_keys[lo]) / kPage;  // the sequence's page
    const int keys_here = used[lo] - int(j) * kPage;  // rows of this slot that hold keys
    const uint4* src = kv + int64_t(keys_here > 0 ? page_table[int64_t(lo) * width + j] : 0) *
                                kPage * row_vecs;
    uint4* dst = keys + first * row_vecs;
    for (int64_t c = threadIdx.x; c < row_vecs; c += blockDim.x) {
      uint4 v[kPage];
#pragma unroll
      for (int r = 0; r < kPage; ++r)
        v[r] = r < keys_here ? src[r * row_vecs + c] : make_uint4(0, 0, 0, 0);
#pragma unroll
      for (int r = 0; r < kPage; ++r) dst[r * row_vecs + c] = v[r];
    }
  }
  ZeroPadding(cu, seqs, o, o_row_vecs, rows);
}

// The output's padding rows (past cu_seqlens[seqs]) zeroed, where nothing is gathered.
__global__ void Fa3Padding(const int32_t* __restrict__ cu, int seqs, uint4* __restrict__ o,
                           int64_t o_row_vecs, int64_t rows) {
  ZeroPadding(cu, seqs, o, o_row_vecs, rows);
}

ffi::Error Fa3Impl(cudaStream_t stream, ffi::AnyBuffer kv, ffi::AnyBuffer q,
                   ffi::Buffer<ffi::S32> positions, ffi::Buffer<ffi::S32> cu,
                   ffi::Buffer<ffi::S32> page_table, ffi::Result<ffi::AnyBuffer> o,
                   ffi::ResultBuffer<ffi::F32> lse, ffi::ResultBuffer<ffi::S32> meta,
                   ffi::Result<ffi::AnyBuffer> keys, float scale) {
  if (!g_fa3)
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      "kj_fa3: bf16 attention with head_dim 128 runs FlashAttention-3 on CUDA "
                      "GPUs, and it is not loaded (" + g_fa3_error + "): build it with `bash "
                      "scripts/fa3` (README, \"On a GPU\"), or set KERNJAX_FA3_LIB to a "
                      "libkj_fa3.so built so");
  auto qd = q.dimensions(), kd = kv.dimensions(), pd = page_table.dimensions();
  if (q.element_type() != ffi::BF16 || kv.element_type() != ffi::BF16 || qd.size() != 3 ||
      qd[2] != 128 || kd.size() != 5 || (kd[1] != kPage && kd[1] != kPageTma) || kd[2] != 2 ||
      kd[4] != 128 || pd.size() != 2 || qd[1] % kd[3] != 0 || cu.element_count() != pd[0] + 1)
    return ffi::Error::InvalidArgument(
        "kj_fa3: takes bf16 q [rows, heads, 128], kv [pages, 16 or 128, 2, kv_heads, 128], "
        "page_table [seqs, width], cu_seqlens [seqs + 1]");
  const int seqs = int(pd[0]), width = int(pd[1]), page = int(kd[1]);
  const bool in_place = page == kPageTma;
  const int64_t key_rows = in_place ? 0 : KjFa3KeyRows(seqs, width, kd[0]);
  const int64_t row_vecs = 2 * kd[3] * 128 * 2 / 16, o_row_vecs = qd[1] * 128 * 2 / 16;
  if (positions.element_count() != qd[0] || o->element_count() != q.element_count() ||
      o->element_type() != ffi::BF16 || lse->element_count() != qd[0] * qd[1] ||
      meta->element_count() != KjFa3MetaInts(seqs) + 2 * seqs + 1 ||
      keys->size_bytes() != size_t(key_rows * row_vecs * 16))
    return ffi::Error::InvalidArgument("kj_fa3: operands or scratch of the wrong size");
  if (qd[0] == 0) return ffi::Error::Success();
  if (seqs == 0 || width == 0) {  // no keys: every row is padding
    cudaError_t err = cudaMemsetAsync(o->untyped_data(), 0, o->size_bytes(), stream);
    return err == cudaSuccess ? ffi::Error::Success()
                              : ffi::Error::Internal(std::string("kj_fa3: ") +
                                                     cudaGetErrorString(err));
  }
  int device = 0, sms = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  int32_t* used = meta->typed_data() + KjFa3MetaInts(seqs);
  int32_t* cu_keys = used + seqs;
  Fa3Offsets<<<1, kScan, 0, stream>>>(positions.typed_data(), cu.typed_data(), seqs, width, page,
                                      used, cu_keys, in_place ? INT64_MAX : key_rows);
  auto* out = static_cast<uint4*>(o->untyped_data());
  if (in_place) {
    const int64_t vecs = qd[0] * o_row_vecs, blocks = (vecs + 255) / 256;
    Fa3Padding<<<int(blocks < 2 * sms ? blocks : 2 * sms), 256, 0, stream>>>(
        cu.typed_data(), seqs, out, o_row_vecs, qd[0]);
  } else {
    const int64_t slots = key_rows / kPage;
    Fa3Gather<<<int(slots < 8 * sms ? slots : 8 * sms), 256, 0, stream>>>(
        static_cast<const uint4*>(kv.untyped_data()), page_table.typed_data(), width, used,
        cu_keys, seqs, static_cast<uint4*>(keys->untyped_data()), row_vecs, cu.typed_data(), out,
        o_row_vecs, qd[0]);
  }
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess)
    return ffi::Error::Internal(std::string("kj_fa3: ") + cudaGetErrorString(err));
  KjFa3Args a{KJ_FA3_VERSION,
              in_place ? kv.untyped_data() : keys->untyped_data(),
              in_place ? page_table.typed_data() : nullptr, page, width, int(kd[0]),
              q.untyped_data(), o->untyped_data(), lse->typed_data(), cu.typed_data(), cu_keys,
              used, meta->typed_data(), int(qd[0]), seqs, width * page,
              int(in_place ? kd[0] * page : key_rows), int(qd[1]), int(kd[3]), sms, scale,
              stream};
  const int rc = g_fa3(&a);
  if (rc != 0)
    return ffi::Error::Internal("kj_fa3: FlashAttention-3 returned " + std::to_string(rc) +
                                (rc == 3 ? " (a libkj_fa3.so of another kernjax: rebuild it)"
                                         : ""));
  return ffi::Error::Success();
}

auto BindFa3() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<cudaStream_t>>()
      .Arg<ffi::AnyBuffer>()          // kv
      .Arg<ffi::AnyBuffer>()          // q
      .Arg<ffi::Buffer<ffi::S32>>()   // positions
      .Arg<ffi::Buffer<ffi::S32>>()   // cu_seqlens
      .Arg<ffi::Buffer<ffi::S32>>()   // page_table
      .Ret<ffi::AnyBuffer>()          // o
      .Ret<ffi::Buffer<ffi::F32>>()   // lse (scratch)
      .Ret<ffi::Buffer<ffi::S32>>()   // scheduler metadata, offsets
      .Ret<ffi::AnyBuffer>()          // the keys gathered (scratch; empty for pages of 128)
      .Attr<float>("scale");
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(KjFa3Cuda, Fa3Impl, BindFa3());
XLA_FFI_DEFINE_HANDLER_SYMBOL(KjFa3CudaGraph, Fa3Impl, BindFa3(),
                              {ffi::Traits::kCmdBufferCompatible});
