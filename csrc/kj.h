// What every kernjax FFI handler shares: KJ_HD marks index math that both the
// CPU (g++) and CUDA (nvcc) handlers compile.
#pragma once

#ifdef __CUDACC__
#define KJ_HD __host__ __device__ inline
#else
#define KJ_HD inline
#endif

// Bytes between the entries of kj_mark's ring, each k int32: whole 64-byte lines.
KJ_HD long long MarkStride(long long k) { return (k * 4 + 63) / 64 * 64; }

// kj_mark's slots by id (bind_slot): the same HLO, a persistent-cache hit, in every process.
inline unsigned long long kj_slots[64];
inline unsigned long long BoundSlot(unsigned long long s) { return s && s < 64 ? kj_slots[s] : s; }
