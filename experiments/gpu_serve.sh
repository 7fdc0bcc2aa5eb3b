#!/usr/bin/env bash
# Serving on one GPU: the multi-process serving tests (2- and 3-stage qwen3-tiny pipelines against
# the single-process server, packing, 100 concurrent requests, a killed stage) with every process
# on the GPU and the host transport between them. Output under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 KERNJAX_CACHE=$PWD/.kjcache XLA_PYTHON_CLIENT_PREALLOCATE=false
{
  date -u +%FT%TZ
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python -c 'import jax; print("jax", jax.__version__, jax.devices())'
} 2>&1 | tee "$OUT/serve.log"
KERNJAX_NO_CUDA=1 python -m pip install -q --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1 \
  || { tail -20 "$OUT/build.log"; exit 1; }
python -c 'import aiohttp, prometheus_client' 2>&1 | tee -a "$OUT/serve.log"
python -m pytest -q -x tests/test_serve.py -k "single_process or packed or 100 or killed" 2>&1 \
  | tail -15 | tee -a "$OUT/serve.log"
