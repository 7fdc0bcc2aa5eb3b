#!/usr/bin/env bash
# The GPU gates in one device call: build kernjax with nvcc, run the tests on the GPU, cut a
# random-weight qwen3-4b (bf16) at layer 18 and at a mid-layer call, run the chain gate at the
# given chunk sizes, and measure what the call boundaries cost. Everything lands under $OUT.
#
#   bash experiments/gpu_gate.sh "512 64" tests bench
#
# First argument: chunk sizes; then any of `tests` and `bench`. Random weights are cached under
# .kjcache/ (git-ignored), which a warm device machine keeps between calls.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 KERNJAX_CACHE=$PWD/.kjcache XLA_PYTHON_CLIENT_PREALLOCATE=false
chunks=${1:-"512 64"}
shift || true
log() { echo "== $(date -u +%FT%TZ) $*" | tee -a "$OUT/gate.log"; }

{
  log "machine"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python -c 'import jax, jaxlib; print("jax", jax.__version__, "jaxlib", jaxlib.__version__, jax.devices())'
  nvcc --version | tail -1
} 2>&1 | tee -a "$OUT/gate.log"

log "build"
python -m pip install -q --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1 || { tail -20 "$OUT/build.log"; exit 1; }
python -c 'import kernjax.ffi as f; print("extension cuda:", f.has_cuda())' | tee -a "$OUT/gate.log"

for arg in "$@"; do
  if [ "$arg" = tests ]; then
    log "tests on the GPU"
    python -m pytest -q tests/test_ffi.py tests/test_parity.py tests/test_cut.py 2>&1 | tail -5 | tee -a "$OUT/gate.log"
  fi
done

for c in $chunks; do
  python experiments/prompts.py --chunk "$c" --vocab 151936 > "$OUT/prompts$c.txt"
  for at in 18 c226; do
    log "cut qwen3-4b --at $at --chunk $c"
    python -m kernjax.cut --model qwen3-4b --at "$at" --chunk "$c" --seqs 1 --out "cuts/$at-$c" \
      > "$OUT/cut-$at-$c.txt" 2>&1 || { tail "$OUT/cut-$at-$c.txt"; exit 1; }
    tail -3 "$OUT/cut-$at-$c.txt" | tee -a "$OUT/gate.log"
    log "chain --at $at --chunk $c"
    python -m kernjax.chain --stages "cuts/$at-$c" --prompts "$OUT/prompts$c.txt" --chunk "$c" \
      2>&1 | grep -v "^loading weights" | tee -a "$OUT/gate.log"
    rm -rf "cuts/$at-$c"
  done
done

for arg in "$@"; do
  if [ "$arg" = bench ]; then
    log "boundary cost"
    for r in ${BENCH_ROWS:-512 2048}; do
      python experiments/boundaries.py --model qwen3-4b --rows "$r" --context 4096 2>&1 | tail -1 | tee -a "$OUT/gate.log"
    done
  fi
done
log "done"
