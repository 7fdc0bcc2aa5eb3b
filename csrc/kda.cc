// kj_kda, CPU: the phases of kda.h run lane by lane (see there), one
// (sequence, head) at a time. Operands: q (pre-scaled), k, g [T, H, K], v
// [T, H, V = K], beta [T, H] float32, cu_seqlens [N+1] int32, initial state
// [N, H, K, K] float32. Results: o [T, H, K] (rows past cu_seqlens[N] zero)
// and the final states [N, H, K, K].

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kda.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using F32 = ffi::Buffer<ffi::F32>;

namespace {

ffi::Error KdaImpl(F32 q, F32 k, F32 v, F32 g, F32 beta,
                   ffi::Buffer<ffi::S32> cu, F32 h0, ffi::ResultBuffer<ffi::F32> o,
                   ffi::ResultBuffer<ffi::F32> final_state) {
  int64_t T;
  int H, K, N;
  ffi::Error bad = kj::KdaDims(q, cu, &T, &H, &K, &N, "kj_kda");
  if (bad.failure()) return bad;
  const int32_t* c = cu.typed_data();
  float* out = o->typed_data();
  std::vector<float> buf(kj::KdaFloats(K));
  kj::KdaBlock s(buf.data(), K);
  for (int n = 0; n < N; ++n) {
    for (int h = 0; h < H; ++h) {
      const float* init = h0.typed_data() + (int64_t(n) * H + h) * K * K;
      std::memcpy(s.S, init, sizeof(float) * K * K);
      for (int64_t t0 = c[n]; t0 < c[n + 1]; t0 += kj::kKdaChunk) {
        const int rows = int(std::min<int64_t>(kj::kKdaChunk, c[n + 1] - t0));
        for (int l = 0; l < K; ++l)
          kj::KdaLoad(s, l, q.typed_data(), k.typed_data(), g.typed_data(),
                      v.typed_data(), beta.typed_data(), t0, rows, h, H);
        for (int l = 0; l < K; ++l) kj::KdaPairs(s, l, K);
        for (int i = 0; i < kj::kKdaChunk; ++i)
          for (int l = 0; l < K; ++l) kj::KdaSolveRow(s, i, l);
        for (int l = 0; l < K; ++l) kj::KdaWU(s, l);
        for (int l = 0; l < K; ++l) kj::KdaStep(s, l, out, t0, rows, h, H);
      }
      std::memcpy(final_state->typed_data() + (int64_t(n) * H + h) * K * K, s.S,
                  sizeof(float) * K * K);
    }
  }
  const int64_t done = c[N] < T ? c[N] : T;
  std::memset(out + done * H * K, 0, sizeof(float) * (T - done) * H * K);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(KjKdaCpu, KdaImpl,
                              ffi::Ffi::Bind()
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
