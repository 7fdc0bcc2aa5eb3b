// The one FlashAttention-3 instantiation kernjax runs (csrc/fa3.h): forward, sm90, bf16, head_dim
// 128, causal, varlen queries, keys contiguous or in pages of 128 rows (both read with TMA: the
// page table is a runtime argument of the same kernel), no split of the keys (a row's
// bits do not depend on the item), one query head per tile, and the persistent scheduler's
// metadata prepared on the device. Compiled only by scripts/fa3, against a flash-attention
// checkout; never by setup.py. FlashAttention's own checks end the process (exit(1)) on a CUDA
// error; the return codes are for what is left.
#include "flash_fwd_launch_template.h"

// Without it CUTLASS compiles the main kernel's wait for the prepare kernel (launched after it
// with programmatic dependent launch) to nothing: the scheduler could read its metadata unwritten.
#ifndef CUTLASS_ENABLE_GDC_FOR_SM90
#error "build with -DCUTLASS_ENABLE_GDC_FOR_SM90 (scripts/fa3 does)"
#endif

#include "../fa3.h"

extern "C" __attribute__((visibility("default"))) int kj_fa3_varlen(const KjFa3Args* a) {
  if (a->version != KJ_FA3_VERSION) return 3;
  constexpr int D = 128;
  Flash_fwd_params p = {};
  p.is_bf16 = true;
  p.q_ptr = const_cast<void*>(a->q);
  p.k_ptr = const_cast<void*>(a->keys);
  p.v_ptr = static_cast<char*>(const_cast<void*>(a->keys)) + a->kv_heads * D * 2;  // bf16
  p.q_row_stride = a->heads * D;
  p.q_head_stride = D;
  p.k_row_stride = p.v_row_stride = 2 * a->kv_heads * D;
  p.k_head_stride = p.v_head_stride = D;
  p.v_dim_stride = 1;
  p.o_ptr = a->o;
  p.o_row_stride = a->heads * D;
  p.o_head_stride = D;
  p.softmax_lse_ptr = a->lse;
  p.cu_seqlens_q = const_cast<int*>(a->cu_seqlens);
  p.seqused_k = const_cast<int*>(a->seqused_k);
  if (a->page_table) {  // in place: shape_K [page, D, kv_heads, num_pages], pages by the table
    p.page_table = const_cast<int*>(a->page_table);
    p.page_table_batch_stride = a->width;
    p.page_size = a->page;
    p.num_pages = a->num_pages;
    p.k_batch_stride = p.v_batch_stride = int64_t(a->page) * 2 * a->kv_heads * D;
  } else {
    p.cu_seqlens_k = const_cast<int*>(a->cu_keys);
    p.page_size = 1;
  }
  p.b = p.b_k = a->seqs;
  p.h = a->heads;
  p.h_k = a->kv_heads;
  p.seqlen_q = p.total_q = a->rows;
  p.seqlen_k = a->max_keys;
  p.total_k = a->key_rows;
  p.seqlen_q_rounded = (a->rows + 127) / 128 * 128;
  p.seqlen_k_rounded = (p.seqlen_k + 127) / 128 * 128;
  p.d = p.d_rounded = p.dv = p.dv_rounded = D;
  p.scale_softmax = a->scale;
  p.p_dropout = p.rp_dropout = 1.f;
  p.p_dropout_in_uint8_t = 255;
  p.is_causal = true;
  p.window_size_left = p.seqlen_k - 1;
  p.window_size_right = 0;
  p.num_splits = 1;
  p.pack_gqa = false;
  p.arch = 90;
  p.num_sm = a->num_sm;
  p.prepare_varlen_pdl = a->seqs <= 992;  // flash_api.cpp's PREPARE_VARLEN_MAX_BATCHES_1CTA
  p.varlen_sort_batches = true;
  p.head_swizzle = true;
  int const b4 = (a->seqs + 3) / 4 * 4;  // the layout of flash_api.cpp's scheduler metadata
  p.num_splits_dynamic_ptr = a->meta;
  p.num_m_blocks_ptr = a->meta + b4;
  p.varlen_batch_idx_ptr = a->meta + 2 * b4;
  p.num_nheads_in_l2_ptr = a->meta + 3 * b4;
  p.tile_count_semaphore = a->meta + 4 * b4;
  p.tile_count_semaphore_offset = 4 * b4;
  run_flash_fwd<90, D, D, 1, cutlass::bfloat16_t, cutlass::bfloat16_t, /*Is_causal=*/true,
                /*Is_local=*/false, /*Has_softcap=*/false, /*Varlen=*/true,
                /*PagedKVNonTMA=*/false, /*AppendKV=*/false, /*HasQv=*/false, /*PackGQA=*/false,
                /*Split=*/false, /*V_colmajor=*/false>(p, static_cast<cudaStream_t>(a->stream));
  return cudaGetLastError() == cudaSuccess ? 0 : 2;
}
