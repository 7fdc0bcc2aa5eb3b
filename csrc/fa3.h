// kernjax's bf16 attention on CUDA GPUs (head_dim 128) runs FlashAttention-3's forward, a public
// library this repository does not hold: scripts/fa3 builds csrc/fa3/glue.cu against a
// flash-attention checkout into build/fa3/libkj_fa3.so, and csrc/fa3.cu's handler calls it
// through this one entry point, loaded with dlopen (kernjax/kernels/ffi.py says where from).
//
// Pages of 128 rows (a whole key block) FlashAttention reads in place with TMA, through the page
// table. Pages of 16 rows it could only gather row by row, ~20 % slower on an H200; for those the
// handler first copies each sequence's pages, in order, into one contiguous buffer (`keys`, the
// pages of sequence s from page `cu_keys[s] / 16` on).
#pragma once

#include <cstdint>

#define KJ_FA3_VERSION 3
#define KJ_FA3_SYMBOL "kj_fa3_varlen"

// One attention call: an item's rows (`cu_seqlens`), each sequence's first seqused_k[s] keys and
// values, causal aligned bottom-right to them. With `page_table` set, they are read in place:
// pages of `page` rows of keys [num_pages, page, 2, kv_heads, 128], sequence s's in
// page_table[s * width ..]; else at rows cu_keys[s] .. of keys [.., 2, kv_heads, 128]
// (contiguous). `meta` is FlashAttention's scheduler scratch (KjFa3MetaInts ints).
struct KjFa3Args {
  int version;
  const void* keys;
  const int32_t* page_table;  // null: keys contiguous
  int page, width, num_pages;
  const void* q;
  void* o;
  float* lse;
  const int32_t* cu_seqlens;
  const int32_t* cu_keys;
  const int32_t* seqused_k;
  int32_t* meta;
  int rows, seqs, max_keys, key_rows, heads, kv_heads, num_sm;
  float scale;
  void* stream;
};

typedef int (*KjFa3Fn)(const KjFa3Args*);

// flash_api.cpp's layout: four vectors of round_up(seqs, 4) ints, then the tile semaphore.
inline int KjFa3MetaInts(int seqs) { return 4 * ((seqs + 3) / 4 * 4) + 1; }

// Each sequence's keys take whole blocks of 128 rows in `keys` (FlashAttention's key block), the
// rows past its last key zeroed, so no block reads another sequence's keys or stale memory. With
// an item's pages distinct (kernjax's pool never shares one), this many rows hold them all.
inline int64_t KjFa3KeyRows(int64_t seqs, int64_t width, int64_t pages) {
  const int64_t per_seq = (width * 16 + 127) / 128 * 128;
  const int64_t by_pages = pages * 16 + 128 * seqs;
  return seqs * per_seq < by_pages ? seqs * per_seq : by_pages;
}
