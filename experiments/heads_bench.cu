// HeadsKernel (csrc/dense.cu's kj_qk_rope) alone on the GPU, at qwen3-4b's shapes, with no JAX:
// a variant of dense.cu is compiled in by -DKJ_DENSE='"path/dense.cu"' (experiments/heads_variants.py
// makes them), timed with CUDA events over back-to-back launches, and the bytes it wrote (q and
// the KV state) hashed so that variants can be compared bit for bit.
//
//   nvcc -arch=sm_90 -O3 -std=c++17 -I<jaxlib>/include -DKJ_DENSE='"csrc/dense.cu"' \
//        experiments/heads_bench.cu -o heads_bench && ./heads_bench 8192 200 [qk|norm|rope|kv]
//
// The job (third argument) is built as dense.cu's handler for it builds it: qk (kj_qk_rope, the
// default), norm (kj_head_norm of the q heads), rope (kj_rope of q and k), kv (kj_kv_write).

#include KJ_DENSE
#ifndef KJ_BENCH_FN  // the kernel the qk_rope job runs (a variant may name another)
#define KJ_BENCH_FN HeadsKernel<0x8B7>
#endif

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#define CK(x)                                                                          \
  do {                                                                                 \
    cudaError_t e_ = (x);                                                              \
    if (e_ != cudaSuccess) {                                                           \
      std::fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e_));                    \
      std::exit(1);                                                                    \
    }                                                                                  \
  } while (0)

static uint64_t Fnv(const std::vector<uint16_t>& v) {
  uint64_t h = 1469598103934665603ull;
  for (uint16_t x : v) h = (h ^ x) * 1099511628211ull;
  return h;
}

int main(int argc, char** argv) {
  const int rows = argc > 1 ? std::atoi(argv[1]) : 8192, iters = argc > 2 ? std::atoi(argv[2]) : 200;
  const std::string job = argc > 3 ? argv[3] : "qk";
  const int heads = 32, kv_heads = 8, W = (heads + 2 * kv_heads) * kD;
  std::vector<uint16_t> qkv(size_t(rows) * W), wq(kD), wk(kD);
  uint32_t s = 12345;
  auto bf = [&](float lo, float hi) {  // a random bf16 in [lo, hi)
    s = s * 1664525u + 1013904223u;
    const float f = lo + (hi - lo) * float(s >> 8) / float(1 << 24);
    uint32_t u;
    std::memcpy(&u, &f, 4);
    return uint16_t(u >> 16);
  };
  for (auto& x : qkv) x = bf(-3.f, 3.f);
  for (auto& x : wq) x = bf(0.5f, 1.5f);
  for (auto& x : wk) x = bf(0.5f, 1.5f);
  std::vector<int32_t> pos(rows), slots(rows);
  for (int i = 0; i < rows; ++i) pos[i] = i, slots[i] = i;
  std::vector<float> inv(64);
  for (int i = 0; i < 64; ++i) inv[i] = float(1.0 / std::pow(1000000.0, i / 64.0));
  const long long state_rows = (rows + 15) / 16 * 16 + 64;
  __nv_bfloat16 *d_qkv, *d_wq, *d_wk, *d_q, *d_k, *d_kv;
  int32_t *d_pos, *d_slots;
  float* d_inv;
  CK(cudaMalloc(&d_qkv, qkv.size() * 2));
  CK(cudaMalloc(&d_wq, kD * 2));
  CK(cudaMalloc(&d_wk, kD * 2));
  CK(cudaMalloc(&d_q, size_t(rows) * heads * kD * 2));
  CK(cudaMalloc(&d_k, size_t(rows) * kv_heads * kD * 2));
  CK(cudaMemset(d_q, 0, size_t(rows) * heads * kD * 2));
  CK(cudaMemset(d_k, 0, size_t(rows) * kv_heads * kD * 2));
  CK(cudaMalloc(&d_kv, size_t(state_rows) * 2 * kv_heads * kD * 2));
  CK(cudaMalloc(&d_pos, rows * 4));
  CK(cudaMalloc(&d_slots, rows * 4));
  CK(cudaMalloc(&d_inv, 64 * 4));
  CK(cudaMemcpy(d_qkv, qkv.data(), qkv.size() * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(d_wq, wq.data(), kD * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(d_wk, wk.data(), kD * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(d_pos, pos.data(), rows * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(d_slots, slots.data(), rows * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(d_inv, inv.data(), 64 * 4, cudaMemcpyHostToDevice));
  CK(cudaMemset(d_kv, 0, size_t(state_rows) * 2 * kv_heads * kD * 2));
  Job j{};  // as QkRope, HeadNorm, RopeOnly or KvWrite builds it
  const long long kc = heads * kD, vc = (heads + kv_heads) * kD;
  if (job == "qk") {
    j.part[0] = {d_qkv, W, 0, d_wq, true, d_q, heads * kD, -1, heads};
    j.part[1] = {d_qkv, W, kc, d_wk, true, nullptr, 0, 0, kv_heads};
    j.part[2] = {d_qkv, W, vc, nullptr, false, nullptr, 0, 1, kv_heads};
    j.parts = 3;
  } else if (job == "norm") {
    j.part[0] = {d_qkv, W, 0, d_wq, false, d_q, heads * kD, -1, heads};
    j.parts = 1;
  } else if (job == "rope") {
    j.part[0] = {d_qkv, W, 0, nullptr, true, d_q, heads * kD, -1, heads};
    j.part[1] = {d_qkv, W, kc, nullptr, true, d_k, kv_heads * kD, -1, kv_heads};
    j.parts = 2;
  } else if (job == "kv") {
    j.part[0] = {d_qkv, W, kc, nullptr, false, nullptr, 0, 0, kv_heads};
    j.part[1] = {d_qkv, W, vc, nullptr, false, nullptr, 0, 1, kv_heads};
    j.parts = 2;
  } else {
    std::fprintf(stderr, "job: qk, norm, rope or kv, not %s\n", job.c_str());
    return 2;
  }
  j.rows = rows, j.eps = 1e-6f;
  j.positions = d_pos, j.inv_freq = d_inv, j.state = d_kv, j.slots = d_slots;
  j.kv_heads = kv_heads, j.state_rows = state_rows;
  cudaStream_t stream;
  CK(cudaStreamCreate(&stream));
  for (int i = 0; i < 20; ++i) Launch(stream, j);
  CK(cudaStreamSynchronize(stream));
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  float best = 1e9f, total = 0.f;
  const int rounds = 5;
  for (int r = 0; r < rounds; ++r) {
    CK(cudaEventRecord(a, stream));
    for (int i = 0; i < iters; ++i) Launch(stream, j);
    CK(cudaEventRecord(b, stream));
    CK(cudaEventSynchronize(b));
    float ms;
    CK(cudaEventElapsedTime(&ms, a, b));
    ms /= iters;
    best = ms < best ? ms : best;
    total += ms;
  }
  CK(cudaGetLastError());
  std::vector<uint16_t> q(size_t(rows) * heads * kD), k(size_t(rows) * kv_heads * kD),
      kv(size_t(state_rows) * 2 * kv_heads * kD);
  CK(cudaMemcpy(q.data(), d_q, q.size() * 2, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(k.data(), d_k, k.size() * 2, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(kv.data(), d_kv, kv.size() * 2, cudaMemcpyDeviceToHost));
  cudaFuncAttributes fa;
  CK(cudaFuncGetAttributes(&fa, KJ_BENCH_FN));
  int blocks = 0;
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, KJ_BENCH_FN, 32 * kWarps, 0));
  const int moved = job == "qk" ? heads + 2 * kv_heads : job == "norm" ? heads
                  : job == "rope" ? heads + kv_heads : 2 * kv_heads;  // heads read and written
  const double bytes = double(rows) * 2 * moved * kD * 2;
  std::printf("%s rows %d  best %.4f ms  mean %.4f ms  %.2f TB/s  regs %d  local %zu B  blocks/SM %d"
              "  q %016llx  k %016llx  kv %016llx\n", job.c_str(), rows, best, total / rounds,
              bytes / best / 1e9, fa.numRegs, fa.localSizeBytes, blocks, (unsigned long long)Fnv(q),
              (unsigned long long)Fnv(k), (unsigned long long)Fnv(kv));
  return 0;
}
