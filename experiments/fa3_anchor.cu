// An anchor, not part of kernjax: FlashAttention-3's forward (hdim 128, bf16, causal, dense,
// one sequence) behind a C entry point that experiments/attention.py calls through ctypes.
// Built into build/fa3/libkj_fa3.so by scripts/fa3, against a flash-attention checkout.
#include "flash_fwd_launch_template.h"

extern "C" __attribute__((visibility("default"))) int kj_fa3_fwd(void* q, void* k, void* v, void* o, void* lse, void* semaphore,
                          int sq, int sk, int h, int hk, float scale, int num_sm, void* stream) {
  Flash_fwd_params p = {};
  p.is_bf16 = true;
  p.q_ptr = q; p.k_ptr = k; p.v_ptr = v; p.o_ptr = o;
  p.q_row_stride = h * 128; p.q_head_stride = 128; p.q_batch_stride = (int64_t)sq * h * 128;
  p.k_row_stride = hk * 128; p.k_head_stride = 128; p.k_batch_stride = (int64_t)sk * hk * 128;
  p.v_row_stride = hk * 128; p.v_head_stride = 128; p.v_batch_stride = (int64_t)sk * hk * 128;
  p.v_dim_stride = 1;
  p.o_row_stride = h * 128; p.o_head_stride = 128; p.o_batch_stride = (int64_t)sq * h * 128;
  p.softmax_lse_ptr = lse;
  p.b = 1; p.b_k = 1; p.h = h; p.h_k = hk;
  p.seqlen_q = sq; p.seqlen_k = sk; p.total_q = sq; p.total_k = sk;
  p.seqlen_q_rounded = (sq + 127) / 128 * 128; p.seqlen_k_rounded = (sk + 127) / 128 * 128;
  p.d = 128; p.d_rounded = 128; p.dv = 128; p.dv_rounded = 128;
  p.scale_softmax = scale; p.softcap = 0.f;
  p.p_dropout = 1.f; p.rp_dropout = 1.f; p.p_dropout_in_uint8_t = 255;
  p.is_causal = true; p.is_local = false;
  p.window_size_left = sk - 1; p.window_size_right = 0; p.attention_chunk = 0;
  p.num_splits = 1; p.pack_gqa = false; p.page_size = 1;
  p.arch = 90; p.num_sm = num_sm;
  p.tile_count_semaphore = static_cast<int*>(semaphore);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (cudaMemsetAsync(semaphore, 0, sizeof(int), s) != cudaSuccess) return 1;
  run_flash_fwd<90, 128, 128, 1, cutlass::bfloat16_t, cutlass::bfloat16_t, true, false, false,
                false, false, false, false, false, false, false>(p, s);
  return cudaGetLastError() == cudaSuccess ? 0 : 2;
}
