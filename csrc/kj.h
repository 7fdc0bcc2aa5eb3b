// What every kernjax FFI handler shares: KJ_HD marks index math that both the
// CPU (g++) and CUDA (nvcc) handlers compile.
#pragma once

#ifdef __CUDACC__
#define KJ_HD __host__ __device__ inline
#else
#define KJ_HD inline
#endif
