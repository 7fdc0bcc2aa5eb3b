// kernjax's bf16 attention on CUDA GPUs (head_dim 128) runs FlashAttention-3's forward, a public
// library this repository does not hold: scripts/fa3 builds csrc/fa3/glue.cu against a
// flash-attention checkout into build/fa3/libkj_fa3.so, and csrc/fa3.cu's handler calls it
// through this one entry point, loaded with dlopen (kernjax/ffi.py says where from).
#pragma once

#include <cstdint>

#define KJ_FA3_VERSION 1
#define KJ_FA3_SYMBOL "kj_fa3_varlen_paged"

// One attention call: an item's rows (`cu_seqlens`), keys and values read through each
// sequence's page table from kv [pages, 16, 2, kv_heads, 128], causal aligned bottom-right to
// each sequence's `seqused_k` keys. `meta` is FlashAttention's scheduler scratch (KjFa3MetaInts).
struct KjFa3Args {
  int version;
  const void* kv;
  const void* q;
  void* o;
  float* lse;
  const int32_t* cu_seqlens;
  const int32_t* seqused_k;
  const int32_t* page_table;
  int32_t* meta;
  int rows, seqs, width, pages, heads, kv_heads, num_sm;
  float scale;
  void* stream;
};

typedef int (*KjFa3Fn)(const KjFa3Args*);

inline int KjFa3MetaInts(int seqs) { return 4 * ((seqs + 3) / 4) + 1; }
