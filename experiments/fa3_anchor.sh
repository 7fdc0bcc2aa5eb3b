#!/usr/bin/env bash
# Builds the FlashAttention-3 anchor of `experiments/attention.py --kernel fa3`: its forward for
# hdim 128, bf16, causal, one dense sequence (`experiments/fa3_anchor.cu`), as
# build/fa3/libkj_fa3.so. Nothing of FlashAttention is kept in this repository: point FA at a
# checkout of github.com/Dao-AILab/flash-attention and CUTLASS at the CUTLASS its csrc/cutlass
# submodule names (both public). ~1.5 min on 2 cores with nvcc 13.0; the library carries its
# CUDA runtime, so the GPU machine needs only the file (`run`'s carry: build/fa3).
#
#   FA=../flash-attention CUTLASS=../cutlass bash experiments/fa3_anchor.sh
set -euo pipefail
: "${FA:?set FA to a flash-attention checkout}" "${CUTLASS:?set CUTLASS to a CUTLASS checkout}"
cd "$(dirname "$0")/.."
mkdir -p build/fa3
nvcc -O3 -std=c++17 --use_fast_math -DCUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED \
  -DCUTLASS_ENABLE_GDC_FOR_SM90 -DCUTLASS_DEBUG_TRACE_LEVEL=0 -DNDEBUG \
  -DFLASHATTENTION_DISABLE_SM8x -gencode arch=compute_90a,code=sm_90a \
  --expt-relaxed-constexpr --expt-extended-lambda -Xcompiler -fPIC -shared --resource-usage \
  -I "$FA/hopper" -I "$CUTLASS/include" -I "$CUTLASS/tools/util/include" \
  experiments/fa3_anchor.cu "$FA/hopper/flash_prepare_scheduler.cu" -o build/fa3/libkj_fa3.so \
  2> build/fa3/build.log
grep -A2 "FlashAttnFwdSm90" build/fa3/build.log | grep -m2 -E "registers|spill" || true
echo "built build/fa3/libkj_fa3.so (FlashAttention $(git -C "$FA" rev-parse --short HEAD 2>/dev/null || echo '?'))"
