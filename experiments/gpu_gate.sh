#!/usr/bin/env bash
# The GPU gates and benchmarks in one device call: `bash experiments/gpu_gate.sh STEP...`, the
# steps in the order given. It builds the tree first (pip install -e .; SKIP_BUILD=1: built
# already) and stops unless FlashAttention-3 loads (carry build/fa3/libkj_fa3.so, made by
# scripts/fa3; NO_FA3=1 goes on without it). A summary goes to $OUT/gate.log and stdout, each
# step's output to $OUT/logs/, packed into $OUT/logs.tgz at the end.
#
# Steps and their knobs (environment variables; defaults in parentheses):
#   tests      the GPU tests: $TESTS (files), or $TEST_GROUPS (groups split by ';', one pytest
#              each, all at once); each stopped after $TEST_SECONDS (900)
#   gates      `chain` beside `tests` in three groups ($TEST_GROUPS; $TEST_SECONDS 420)
#   chain      qwen3-4b bf16 cut at each of $ATS ("18 c221 c226 c227 12,24") and chained on the
#              7 prompts at each of $CHUNKS ("512 64"): whole = stages, bit for bit, in prefill,
#              scoring and decode steps in the largest of $CHAIN_DECODE's (64) buckets, the
#              one the head serves
#   k3         the same for k3-mini-gpu, cut at 4 and 2,6, at each of $CHUNKS
#   prefill    experiments.prefill into $OUT/prefill: the rows of $PROFILE (8192) profiled,
#              $SECOND_START (8192) compiled again by a second process, $INTERLEAVE
#              ("--interleave"; empty: one system after another), $PREFILL_FLAGS
#   ab         the 8k row in one chunk, kernjax alone, $AB_ITERS (15) runs, under each of
#              $AB_LOWERINGS (each a --lowering value, e.g. "mlp_tile=128x128 mlp_tile=64x256"),
#              $AB_ROUNDS (3) rounds alternated; $AB_FLAGS go to each run
#   baseline   an older kernjax tree at $BASELINE_DIR (inside the repository, no .git:
#              `mkdir baseline && git archive REV -- . ':!experiments/results' | tar -x -C
#              baseline`) against this one: its experiments/prefill.py and this tree's
#              experiments.prefill on the 8k rows (chunks 512 and whole, kernjax), alternated,
#              $BASELINE_ROUNDS (3) rounds; $BASELINE_COMMIT names it (baseline),
#              $BASELINE_FLAGS go to both
#   calls      experiments.calls at 512 and 2048 rows, then `kernjax cut --at auto` by each
#              profile; $CALLS_SECONDS (300)
#   decode     experiments.decode: each program of a whole cut alone (prefill, score, decode
#              buckets), each profiled ($DECODE_PROFILE: all; empty: none), then served whole
#              and in 2 stages at $DECODE_BATCHES (1,16,64), batch-invariant and not;
#              $DECODE_MODEL (qwen3-4b), $DECODE_CHUNK (512), $DECODE_FLAGS (--noserve: no serving)
#   topk       experiments.topk: the head's top-20 as one lax.top_k against steps of 16, at
#              $TOPK_ROWS (2,64,512) rows, alone and in the score head of $DECODE_MODEL
#   invariance experiments.invariance --locate: a decode step alone against beside others in every
#              program, and the first call that differs, under each of $INV_SETS (default;
#              the routes of `gemms`)
#   clocks     experiments.clocks, $CLOCK_SECONDS (8) a phase
#   attention  experiments.attention; $ATTN_FLAGS
#   bounds     experiments.boundaries at each of $ROWS ("512 2048")
#   fusedmlp   experiments.fused_mlp at $FUSED_ROWS (512,2048,8192); $FUSED_TILES,
#              $FUSED_EPILOGUES, $FUSED_LOWERING (a --lowering value)
#   dense      experiments.dense_calls at $DENSE_ROWS (512,2048,8192)
#   addnorm    experiments.add_norm at $ADDNORM_ROWS (512,2048,8192)
#   gemms      experiments.gemms; with $GEMM_SETS (XLA's GEMM routes: default cublaslt tritonws
#              cudnn notriton) the model's GEMM calls at $GEMM_ROWS (8192) under each
#   autotune   experiments.autotune: $AUTOTUNE_SETS, $AUTOTUNE_ROWS, $AUTOTUNE_LAYOUTS
#   peritem    experiments.peritem --stages: qwen3-4b at 16 x 16k and 1 x 8k
#   issue      experiments.peritem --issue under each of $ISSUE_MODES (XLA's CUDA-graph modes:
#              default nocb skip_profiled skip_temp always)
#   dispatch   experiments.dispatch; $DISPATCH_FLAGS
#   pack1      experiments.load on GPU 0, qwen3-4b whole, 16 sequences an item against one, at
#              $PACK_CHUNK (8192) rows; $LOAD_SECONDS
#   variant    Hopper attention variants $VARIANT (hopper-mbarrier) timed beside the default
#              ($VARIANT_CONFIG, $VARIANT_ROUNDS), then their tests ($VARIANT_TESTS)
#   ncu        Nsight Compute on one launch of $NCU_TARGET (attention: $NCU_KERNEL; mlp:
#              $NCU_TILES); $NCU_SECONDS
#   dump       PTX, ptxas report and SASS of each of $DUMP_KERNELS (hopper)
#   Two GPUs (nvidia-h100-x2 or nvidia-h200-x2; each refuses on one):
#   serve2     experiments.load: qwen3-4b whole on GPU 0 against cut at 18 on GPUs 0 and 1, per
#              $TRANSPORTS (ipc) and $SERVE_MODES (default): $RUNS ("ttft throughput unpacked"),
#              $TTFT_REQUESTS (6), $LOAD_SECONDS (240), $LOAD_FLAGS, $ONE_SLOT, $TRACE;
#              experiments.serve_summary of them
#   ttft2      the two-GPU time to first token: one 8193-token prompt at a time, whole on GPU 0
#              against 2 stages on GPUs 0 and 1, per $TRANSPORTS (ipc); $TTFT_REQUESTS (8),
#              $LOAD_SECONDS (240)
#   k3serve    experiments.load: k3-mini-gpu whole against 2 stages on GPUs 0 and 1
#   transfer   experiments.transfer GPU 0 to GPU 1 per $TRANSPORTS ("ipc nccl shm");
#              $TRANSFER_SECONDS (120), $PINGPONG, $TRACE
#   ipcbw      experiments.ipc_bandwidth, GPU 0 into GPU 1
# Everywhere: $OUT (out), $KERNJAX_COMMIT (the tree's commit: a copied tree's git may name
# another), $SKIP_BUILD, $NO_FA3. Random weights are cached in .kjcache/, XLA's caches in
# .kjcache/xla/.
#
#   KERNJAX_COMMIT=$(git rev-parse --short HEAD) OUT=out bash experiments/gpu_gate.sh tests chain prefill
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
mkdir -p "$OUT/logs"
export PYTHONUNBUFFERED=1 KERNJAX_CACHE=$PWD/.kjcache XLA_PYTHON_CLIENT_PREALLOCATE=false
export NCCL_NVLS_ENABLE=0  # the two-GPU machine: NVLink multicast stays off
export KERNJAX_COMMIT=${KERNJAX_COMMIT:-}
CHUNKS=${CHUNKS:-"512 64"}
# qwen3-4b serving runs: context 16384 (128 pages of 128, qwen3-4b's page), room for 16 sequences
# + page 0; the unpacked runs (--seqs 1) get the same pool, so packing is all that differs
CONTEXT=16384; POOL=$((16 * CONTEXT / 128 + 1))
log() { echo "== $(date -u +%FT%TZ) $*" | tee -a "$OUT/gate.log"; }
say() { tee -a "$OUT/gate.log"; }
# The device tool brings back few files: the logs travel packed, and only the packed copy stays.
pack() { tar -C "$OUT" -czf "$OUT/logs.tgz" logs && rm -rf "$OUT/logs"; }
trap pack EXIT
# XLA's CUDA-graph modes by name (`issue`, and `serve2`'s $SERVE_MODES): as kernjax leaves them
# (serving: skip_temp, kernjax/runtime/xla.py; else XLA's own), XLA's own (every moved node
# updated), off, updated only where addresses moved over profiled runs, temporaries at fixed
# addresses
graph_mode() {
  case $1 in
    default) ;;
    always) echo --xla_gpu_command_buffer_update_mode=ALWAYS_UPDATE ;;
    nocb) echo --xla_gpu_enable_command_buffer= ;;
    skip_profiled) echo --xla_gpu_command_buffer_update_mode=SKIP_PROFILED ;;
    skip_temp) echo --xla_gpu_command_buffer_update_mode=SKIP_TEMP ;;
    *) echo "unknown CUDA-graph mode $1 (default, always, nocb, skip_profiled, skip_temp)" >&2; exit 2 ;;
  esac
}
for m in ${ISSUE_MODES:-} ${SERVE_MODES:-}; do graph_mode "$m" > /dev/null || exit 2; done
# XLA's GEMM routes by name (`gemms`' $GEMM_SETS, `invariance`'s $INV_SETS): the flag of each
gemm_route() {
  case $1 in
    default) ;;
    cublaslt) echo --xla_gpu_enable_cublaslt=true ;;
    tritonws) echo --xla_gpu_experimental_enable_triton_warp_specialization=true ;;
    cudnn) echo --xla_gpu_cudnn_gemm_fusion_level=2 ;;
    notriton) echo --xla_gpu_enable_triton_gemm=false ;;
    *) echo "unknown GEMM route $1 (default, cublaslt, tritonws, cudnn, notriton)" >&2; exit 2 ;;
  esac
}
for g in ${GEMM_SETS:-} ${INV_SETS:-}; do gemm_route "$g" > /dev/null || exit 2; done
# two_gpus STEP: true with two GPUs or more, else says the step needs them
two_gpus() {
  local n; n=$(nvidia-smi -L 2>/dev/null | wc -l)
  [ "$n" -ge 2 ] || { echo "$1: needs two GPUs (nvidia-h100-x2 or nvidia-h200-x2); this machine has $n" | say; return 1; }
}
# kernjax_row DIR: the kernjax rows at 8192 tokens of experiments.prefill's table in DIR/README.md
kernjax_row() {
  awk '/^\| system \| prompt \| chunk \| ms \|/ {t = 1; next} t && /^$/ {exit}
       t && /^\| kernjax \| 8192 \|/ {print; n++} END {if (!n) print "(no row: see its log)"}' \
    "$1/README.md" 2>/dev/null || echo "(no README: see its log)"
}
# medians DIR LABEL...: each label's kernjax rows over its rounds (DIR/<label>/<round>/), the
# median ms side by side with the first label's and the ratio to it
medians() {
  python - "$@" <<'PY'
import json, pathlib, statistics, sys
root, labels = pathlib.Path(sys.argv[1]), sys.argv[2:]
ms = {}
for label in labels:
    for d in sorted((root / label).glob("*")):
        try:
            rows = json.loads((d / "results.json").read_text())["rows"]
        except (OSError, ValueError, KeyError):
            continue
        for r in rows:
            if r["system"] == "kernjax":
                ms.setdefault((r["prompt"], str(r["chunk"])), {}).setdefault(label, []).append(r["ms"])
for (p, c), by in sorted(ms.items()):
    base = statistics.median(by[labels[0]]) if by.get(labels[0]) else None
    cells = [f"{lab} {statistics.median(v):.2f} ms (n={len(v)})" + (
        f", {statistics.median(v) / base:.4f}x" if base and lab != labels[0] else "")
        for lab, v in ((lab, by.get(lab, [])) for lab in labels) if v]
    print(f"kernjax {p} chunk {c}: " + "; ".join(cells))
PY
}

log "machine, commit ${KERNJAX_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)$(git diff --quiet 2>/dev/null || echo +changes)}"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader
  python -c 'import jax, jaxlib; print("jax", jax.__version__, "jaxlib", jaxlib.__version__, jax.devices())'
  nvcc --version | tail -1
} 2>&1 | say

if [ -z "${SKIP_BUILD:-}" ]; then
  log "build"
  python -m pip install -q --no-build-isolation --no-deps -e . > "$OUT/logs/build.log" 2>&1 \
    || { tail -20 "$OUT/logs/build.log"; exit 1; }
fi
python -c 'import kernjax.kernels.ffi as f; f.register(); print("extension cuda:", f.has_cuda(),
  "| FlashAttention-3:", f._extension().fa3_loaded() and f.fa3_path())' 2>&1 | say
# Without FlashAttention-3 every bf16 qwen3 program fails: stop rather than spend the call on it.
if [ -z "${NO_FA3:-}" ] && ! python -c 'import kernjax.kernels.ffi as f; f.register(); assert f._extension().fa3_loaded()' 2>/dev/null; then
  echo "FlashAttention-3 is not loaded: build it with scripts/fa3 and carry build/fa3/libkj_fa3.so" | say
  exit 1
fi

for step in "$@"; do
  case $step in
  tests)
    log "tests on the GPU"
    # SIGINT at the limit: pytest then prints the failures so far. The groups share the
    # machine's XLA cache; each keeps its checkpoints in its own (tests/conftest.py).
    IFS=';' read -ra groups <<< "${TEST_GROUPS:-${TESTS:-tests/test_attention_pallas.py tests/test_attention_hopper.py tests/test_attention.py tests/test_cut.py \
      tests/test_processes.py tests/test_ffi.py tests/test_mxfp4.py tests/test_kda.py tests/test_parity.py tests/test_edge.py \
      tests/test_dense_cuda.py tests/test_generate.py}}"
    pids=()
    for g in "${!groups[@]}"; do
      KERNJAX_XLA_CACHE=$KERNJAX_CACHE/xla timeout -s INT -k 60 "${TEST_SECONDS:-900}" \
        python -m pytest -q -rfEsx -p no:cacheprovider \
        --basetemp="/tmp/kj-tests$g" ${groups[$g]} > "$OUT/logs/tests${g/#0/}.log" 2>&1 &
      pids+=($!)
    done
    for g in "${!pids[@]}"; do
      wait "${pids[$g]}"; rc=$?
      grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/logs/tests${g/#0/}.log" | tail -8 | say
      [ $rc = 124 ] && echo "tests (group $g): stopped after ${TEST_SECONDS:-900} s (the failures so far are in its log)" | say
    done ;;
  gates)
    # the chains beside the GPU tests in three groups; a fresh machine first writes the random
    # qwen3-4b checkpoint: give the call 600 s
    log "gates: the chains beside the GPU tests"
    OUT=$OUT/chains SKIP_BUILD=1 bash experiments/gpu_gate.sh chain > /dev/null 2>&1 &
    OUT=$OUT/tests SKIP_BUILD=1 TEST_SECONDS=${TEST_SECONDS:-420} TEST_GROUPS="${TEST_GROUPS:-\
tests/test_serve.py tests/test_serve_link.py tests/test_http.py;\
tests/test_attention_pallas.py tests/test_attention.py tests/test_attention_hopper.py;\
tests/test_mlp_hopper.py tests/test_dense_cuda.py tests/test_processes.py tests/test_parity.py tests/test_cut.py tests/test_ffi.py \
tests/test_edge.py tests/test_kda.py tests/test_mxfp4.py tests/test_chain.py tests/test_generate.py}" \
      bash experiments/gpu_gate.sh tests > /dev/null 2>&1
    wait
    grep -hE "^cut |PASS|FAIL|differ|exited|passed|failed|stopped|Error" "$OUT/chains/gate.log" \
      "$OUT/tests/gate.log" | say ;;
  chain)
    for c in $CHUNKS; do
      python -m experiments.prompts --chunk "$c" --vocab 151936 > "$OUT/logs/prompts$c.txt"
      for at in ${ATS:-18 c221 c226 c227 12,24}; do
        log "chain qwen3-4b --at $at --chunk $c"
        rm -rf "cuts/$at-$c"
        kernjax cut --model qwen3-4b --at "$at" --chunk "$c" --seqs 1 --decode "${CHAIN_DECODE:-64}" --out "cuts/$at-$c" \
          > "$OUT/logs/cut-$at-$c.txt" 2>&1 || { tail -5 "$OUT/logs/cut-$at-$c.txt" | say; continue; }
        grep -E "^cut " "$OUT/logs/cut-$at-$c.txt" | say
        kernjax chain --stages "cuts/$at-$c" --prompts "$OUT/logs/prompts$c.txt" --chunk "$c" \
          > "$OUT/logs/chain-$at-$c.log" 2>&1 || echo "kernjax chain exited $?" >> "$OUT/logs/chain-$at-$c.log"
        grep -vE "^loading weights" "$OUT/logs/chain-$at-$c.log" | tail -8 | say
        rm -rf "cuts/$at-$c"
      done
    done ;;
  k3)
    for c in $CHUNKS; do
      python -m experiments.prompts --chunk "$c" --vocab 32768 > "$OUT/logs/k3prompts$c.txt"
      for at in 4 2,6; do
        log "chain k3-mini-gpu --at $at --chunk $c"
        rm -rf "cuts/k3-$at-$c"
        kernjax cut --model k3-mini-gpu --at "$at" --chunk "$c" --seqs 1 \
          --out "cuts/k3-$at-$c" > "$OUT/logs/k3cut-$at-$c.txt" 2>&1 \
          || { tail -5 "$OUT/logs/k3cut-$at-$c.txt" | say; continue; }
        grep -E "^cut " "$OUT/logs/k3cut-$at-$c.txt" | say
        kernjax chain --stages "cuts/k3-$at-$c" --prompts "$OUT/logs/k3prompts$c.txt" \
          --chunk "$c" > "$OUT/logs/k3chain-$at-$c.log" 2>&1 \
          || echo "kernjax chain exited $?" >> "$OUT/logs/k3chain-$at-$c.log"
        grep -vE "^loading weights" "$OUT/logs/k3chain-$at-$c.log" | tail -8 | say
        rm -rf "cuts/k3-$at-$c"
      done
    done ;;
  prefill)
    log "prefill benchmark"
    python -m experiments.prefill --out "$OUT/prefill" --profile "${PROFILE-8192}" \
      --second_start "${SECOND_START-8192}" ${INTERLEAVE-"--interleave"} ${PREFILL_FLAGS:-} \
      > "$OUT/logs/prefill.log" 2>&1
    mkdir -p "$OUT/logs/profiles" && mv "$OUT"/prefill/profile-*.json "$OUT/logs/profiles/" 2>/dev/null
    tail -40 "$OUT/logs/prefill.log" | say ;;
  ab)
    # kernel knobs of the program alternated on one machine (docs/lessons.md: a compute-bound
    # change is read both ways): 8k in one chunk, kernjax alone
    read -ra lowerings <<< "${AB_LOWERINGS:-}"
    if [ "${#lowerings[@]}" -lt 2 ]; then
      echo "ab: set AB_LOWERINGS to two or more --lowering values, e.g. \"mlp_tile=128x128 mlp_tile=64x256\"" | say
      continue
    fi
    log "A/B of ${AB_LOWERINGS}, ${AB_ROUNDS:-3} rounds"
    for r in $(seq 1 "${AB_ROUNDS:-3}"); do
      for i in "${!lowerings[@]}"; do
        python -m experiments.prefill --out "$OUT/ab/v$i/$r" --lowering "${lowerings[$i]}" \
          --profile '' --second_start '' --systems kernjax --prompts 8192 --chunks whole \
          --iters "${AB_ITERS:-15}" ${AB_FLAGS:-} > "$OUT/logs/ab-v$i-$r.log" 2>&1 \
          || echo "experiments.prefill: exit $?" >> "$OUT/logs/ab-v$i-$r.log"
        echo "--lowering ${lowerings[$i]} round $r: $(kernjax_row "$OUT/ab/v$i/$r")" | say
      done
    done
    medians "$OUT/ab" $(for i in "${!lowerings[@]}"; do echo "v$i"; done) | say
    for i in "${!lowerings[@]}"; do echo "v$i: --lowering ${lowerings[$i]}"; done | say ;;
  baseline)
    b=${BASELINE_DIR:-}
    if [ -z "$b" ] || [ ! -f "$b/experiments/prefill.py" ] || [ ! -f "$b/setup.py" ]; then
      echo "baseline: set BASELINE_DIR to an older kernjax tree inside the repository (its experiments/prefill.py and setup.py)" | say
      continue
    fi
    b=$(cd "$b" && pwd)
    log "baseline: ${BASELINE_COMMIT:-baseline} ($b) against this tree, the 8k rows, ${BASELINE_ROUNDS:-3} rounds"
    # the old tree runs in place: its extension built there, kernjax.models found as its
    # setup.py would map it, FlashAttention-3 its own library or else this tree's
    [ -e "$b/kernjax/models" ] || ln -s ../models "$b/kernjax/models"
    (cd "$b" && python setup.py build_ext --inplace) > "$OUT/logs/baseline-build.log" 2>&1 \
      || { echo "baseline: its build failed" | say; tail -20 "$OUT/logs/baseline-build.log" | say; continue; }
    fa3=$b/build/fa3/libkj_fa3.so; [ -f "$fa3" ] || fa3=$PWD/build/fa3/libkj_fa3.so
    rows=(--prompts 8192 --chunks 512,whole --systems kernjax ${BASELINE_FLAGS:-})
    for r in $(seq 1 "${BASELINE_ROUNDS:-3}"); do
      order="old new"; [ $((r % 2)) = 0 ] && order="new old"
      for side in $order; do
        if [ "$side" = old ]; then
          (cd "$b" && PYTHONPATH=$b KERNJAX_FA3_LIB=$fa3 KERNJAX_COMMIT=${BASELINE_COMMIT:-baseline} \
            python experiments/prefill.py "${rows[@]}" --out "$OUT/baseline/old/$r")
        else
          python -m experiments.prefill "${rows[@]}" --out "$OUT/baseline/new/$r"
        fi > "$OUT/logs/baseline-$side$r.log" 2>&1 || echo "exit $?" >> "$OUT/logs/baseline-$side$r.log"
      done
      for side in old new; do
        kernjax_row "$OUT/baseline/$side/$r" | sed "s/^/$side round $r: /" | say
      done
    done
    medians "$OUT/baseline" old new | say ;;
  calls)
    log "time per call"
    for r in 512 2048; do
      timeout "${CALLS_SECONDS:-300}" python -m experiments.calls --model qwen3-4b --rows "$r" --context 8192 \
        --out "$OUT/logs/calls-$r.json" > "$OUT/logs/calls-$r.log" 2>&1
      tail -22 "$OUT/logs/calls-$r.log" | say
      kernjax cut --model qwen3-4b --chunk "$r" --context 8192 --seqs 1 --at auto \
        --profile "$OUT/logs/calls-$r.json" --out "cuts/auto-$r" 2>&1 | grep -E "auto:|error" | say
      python -c 'import json, sys; c = json.load(open(sys.argv[1]))["calls"]; a = sum(x["ms"] for x in c[:218]); b = sum(x["ms"] for x in c[218:]); print(f"--at 18 by the same profile: {a:.3f}, {b:.3f} ms, the longest {2 * max(a, b) / (a + b):.3f} of even")' "$OUT/logs/calls-$r.json" | say
      rm -rf "cuts/auto-$r"
    done ;;
  decode)
    log "scoring against prefill and decode, program by program and served"
    python -m experiments.decode --model "${DECODE_MODEL:-qwen3-4b}" --chunk "${DECODE_CHUNK:-512}" \
      --batches "${DECODE_BATCHES:-1,16,64}" --profile "${DECODE_PROFILE-all}" ${DECODE_FLAGS:-} \
      --out "$OUT/decode" > "$OUT/logs/decode.log" 2>&1 \
      || echo "experiments.decode: exit $?" >> "$OUT/logs/decode.log"
    grep -E "^\||exit|score /|^profile of|^kernels |^kinds" "$OUT/logs/decode.log" | say ;;
  topk)
    log "the head's top-20: one lax.top_k against steps of 16"
    python -m experiments.topk --model "${DECODE_MODEL:-qwen3-4b}" --rows "${TOPK_ROWS:-2,64,512}" \
      --out "$OUT/topk" > "$OUT/logs/topk.log" 2>&1 || echo "experiments.topk: exit $?" >> "$OUT/logs/topk.log"
    grep -E "^\||exit|Error" "$OUT/logs/topk.log" | say ;;
  invariance)
    # a decode step alone against beside others, in every decode bucket, the prefill chunk and
    # the score chunk, under each of XLA's GEMM routes in $INV_SETS (as for `gemms`)
    for g in ${INV_SETS:-default}; do
      f=$(gemm_route "$g")
      log "batch invariance of a decode step, XLA's GEMM route $g"
      XLA_FLAGS="${XLA_FLAGS:-} $f" python -m experiments.invariance --model "${DECODE_MODEL:-qwen3-4b}" \
        --chunk "${DECODE_CHUNK:-512}" --locate --out "$OUT/invariance-$g" > "$OUT/logs/invariance-$g.log" 2>&1 \
        || echo "experiments.invariance: exit $?" >> "$OUT/logs/invariance-$g.log"
      grep -E "^\||exit|PASS|FAIL|Error" "$OUT/logs/invariance-$g.log" | say
    done ;;
  clocks)
    log "SM clock and power under GEMMs, the 8k prefill and attention"
    timeout 300 python -m experiments.clocks --seconds "${CLOCK_SECONDS:-8}" --out "$OUT/clocks" \
      > "$OUT/logs/clocks.log" 2>&1
    echo "experiments.clocks: exit $?" | say
    tail -10 "$OUT/logs/clocks.log" | say ;;
  attention)
    log "attention kernel"
    python -m experiments.attention --out "$OUT/logs/attention.json" ${ATTN_FLAGS:-} \
      > "$OUT/logs/attention.log" 2>&1
    tail -14 "$OUT/logs/attention.log" | say ;;
  bounds)
    log "boundary cost"
    for r in ${ROWS:-512 2048}; do
      python -m experiments.boundaries --model qwen3-4b --rows "$r" --context 8192 \
        > "$OUT/logs/bounds-$r.log" 2>&1
      tail -1 "$OUT/logs/bounds-$r.log" | say
    done ;;
  fusedmlp)
    log "gate/up with silu·mul in a GEMM's epilogue, against the calls and apart (roadmap K13)"
    python -m experiments.fused_mlp --rows "${FUSED_ROWS:-512,2048,8192}" ${FUSED_TILES:+--tiles "$FUSED_TILES"} \
      ${FUSED_EPILOGUES:+--epilogues "$FUSED_EPILOGUES"} ${FUSED_LOWERING:+--lowering "$FUSED_LOWERING"} \
      > "$OUT/logs/fused_mlp.log" 2>&1 || echo "experiments.fused_mlp: exit $?" >> "$OUT/logs/fused_mlp.log"
    grep -E "^\||exit" "$OUT/logs/fused_mlp.log" | say ;;
  dense)
    log "a dense layer's small calls as csrc/dense.cu's kernels, against XLA's (roadmap K14)"
    python -m experiments.dense_calls --rows "${DENSE_ROWS:-512,2048,8192}" \
      > "$OUT/logs/dense_calls.log" 2>&1 || echo "experiments.dense_calls: exit $?" >> "$OUT/logs/dense_calls.log"
    grep -E "^\||exit|Error" "$OUT/logs/dense_calls.log" | say ;;
  addnorm)
    log "the residual add and the next RMSNorm as one kernel, against XLA's"
    python -m experiments.add_norm --rows "${ADDNORM_ROWS:-512,2048,8192}" \
      > "$OUT/logs/add_norm.log" 2>&1 || echo "experiments.add_norm: exit $?" >> "$OUT/logs/add_norm.log"
    grep -E "^\||exit" "$OUT/logs/add_norm.log" | say ;;
  gemms)
    if [ -z "${GEMM_SETS:-}" ]; then
      log "a layer's GEMMs, separate and merged"
      python -m experiments.gemms --rows 512,2048,8192 > "$OUT/logs/gemms.log" 2>&1
      grep -E "^\|" "$OUT/logs/gemms.log" | say
    fi
    # the model's GEMM calls under each of XLA's GEMM routes, each autotuned afresh (a cache of
    # its own), JAX's Mosaic GPU matmul beside the first
    pallas=--pallas
    for g in ${GEMM_SETS:-}; do
      f=$(gemm_route "$g")
      log "the model's GEMMs, XLA's route $g ${pallas:+(and the Mosaic GPU matmul)}"
      XLA_FLAGS="${XLA_FLAGS:-} $f" KERNJAX_XLA_CACHE=$PWD/.kjcache/xla-gemms-$g timeout 240 \
        python -m experiments.gemms --layer $pallas --rows "${GEMM_ROWS:-8192}" \
        > "$OUT/logs/gemms-$g.log" 2>&1
      echo "experiments.gemms ($g): exit $?" | say
      grep -E "^\||^XLA_FLAGS" "$OUT/logs/gemms-$g.log" | say
      pallas=
    done ;;
  autotune)
    log "qwen3-4b's GEMMs: kernels XLA picks, autotuned or not"
    python -m experiments.autotune --rows "${AUTOTUNE_ROWS:-512,8192}" --layouts "${AUTOTUNE_LAYOUTS:-oi}" \
      --sets "${AUTOTUNE_SETS:-timed,kernjax,kernjax-again}" > "$OUT/logs/autotune.log" 2>&1
    grep -vE "^\|---" "$OUT/logs/autotune.log" | say ;;
  peritem)
    log "an item's cost against the pool, and the state copies of every program"
    timeout 300 python -m experiments.peritem --model qwen3-4b --configs 16:16384,1:8192 \
      --iters 5 --stages > "$OUT/logs/peritem.log" 2>&1
    echo "experiments.peritem: exit $?" | say
    grep -E "^\||state copies" "$OUT/logs/peritem.log" | say ;;
  issue)
    log "the whole program's host issue per item, under each of XLA's CUDA-graph modes"
    for mode in ${ISSUE_MODES:-default nocb skip_profiled skip_temp}; do
      XLA_FLAGS="${XLA_FLAGS:-} $(graph_mode $mode)" timeout 200 python -m experiments.peritem --model qwen3-4b \
        --configs 16:16384 --iters 3 --issue 40 >> "$OUT/logs/issue.log" 2>&1
      echo "experiments.peritem --issue ($mode): exit $?" | say
    done
    grep -E "^\| [0-9]|issue," "$OUT/logs/issue.log" | say ;;
  dispatch)
    log "the host's time to issue an item while the GPU is busy"
    timeout 300 python -m experiments.dispatch --out "$OUT/logs/dispatch.json" ${DISPATCH_FLAGS:-} \
      > "$OUT/logs/dispatch.log" 2>&1
    echo "experiments.dispatch: exit $?" | say
    grep -E "^\||GEMMs" "$OUT/logs/dispatch.log" | say ;;
  pack1)
    # one GPU: what packing buys the whole program at large items, beside one sequence an item
    # with the same pool
    c=${PACK_CHUNK:-8192}
    log "qwen3-4b whole on GPU 0, chunk $c: packed (16 sequences an item) against one an item"
    for seqs in 16 1; do
      timeout "${LOAD_SECONDS:-300}" python -m experiments.load --model qwen3-4b --at 18 --configs whole \
        --chunk "$c" --context $CONTEXT --seqs $seqs --pages $POOL --gpus 0 --prompt_len 4500,9500 \
        --concurrency 4,16 --requests 32 --warmup 4 --out "$OUT/logs/pack1-$c-seqs$seqs" \
        > "$OUT/logs/pack1-$c-seqs$seqs.log" 2>&1
      echo "seqs $seqs: exit $?" | say
      grep -E "^\| whole|failed requests" "$OUT/logs/pack1-$c-seqs$seqs.log" | say
    done ;;
  variant)
    # experimental, in a call of its own: a kernel that deadlocks must not take the gates along
    v=${VARIANT:-hopper-mbarrier}
    log "experiment: the Hopper kernel's variant $v (kernjax/kernels/attention_hopper.py)"
    runs=("hopper,$v")
    [ -n "${VARIANT_CONFIG-64,64,3}" ] && runs+=("$v --config ${VARIANT_CONFIG-64,64,3}")
    for run in "${runs[@]}"; do
      timeout 120 python -m experiments.attention --kernel $run --rounds "${VARIANT_ROUNDS:-4}" \
        --cases 512:8192,2048:8192,8192:8192 > "$OUT/logs/variant-${run%% *}.log" 2>&1
      echo "experiments.attention --kernel $run: exit $?" | say
      grep -E "^\| +[0-9]" "$OUT/logs/variant-${run%% *}.log" | say
    done
    KERNJAX_TRY_VARIANTS=1 timeout ${TEST_SECONDS:-240} python -m pytest -q tests/test_attention_pallas.py \
      -k "${VARIANT_TESTS:-gpu and hopper}" > "$OUT/logs/variant-tests.log" 2>&1
    echo "tests: exit $?" | say
    grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/logs/variant-tests.log" | tail -12 | say ;;
  ncu)
    # where a kernel's warps stall: Nsight Compute's full set on one launch, of the attention
    # kernel (square 8k) or, with NCU_TARGET=mlp, of the fused gate/up GEMM at 8192 rows (its
    # first launch after fused_mlp's silu·mul kernel apart, the other kernel named `body`)
    n=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    if [ "${NCU_TARGET:-attention}" = mlp ]; then
      log "a profile of the fused gate/up GEMM (Nsight Compute), 8192 rows"
      target=(--kernel-name regex:"^body" --launch-skip 1 --launch-count 1)
      cmd=(python -m experiments.fused_mlp --rows 8192 --tiles "${NCU_TILES:-model}" --iters 1)
    else
      log "a profile of the attention kernel (Nsight Compute), 8192 rows on 8192 keys"
      target=(--kernel-name regex:"mosaic|attention" --launch-skip 2 --launch-count 1)
      cmd=(python -m experiments.attention --kernel "${NCU_KERNEL:-hopper}" --cases 8192:8192
           --reps 1 --inner 1 --sets 1)
    fi
    if [ -z "$n" ]; then echo "ncu: not on this machine" | say; else
      rep=$OUT/logs/${NCU_TARGET:-attention}
      timeout "${NCU_SECONDS:-300}" "$n" "${target[@]}" --set full -f -o "$rep" "${cmd[@]}" \
        > "$OUT/logs/ncu.log" 2>&1
      echo "ncu: exit $?" | say
      "$n" --import "$rep.ncu-rep" --page details > "$OUT/logs/ncu-details.txt" 2>&1
      grep -E "Duration|Registers Per|Achieved Occupancy|Issue Slots Busy|Executed Ipc A|No Eligible|Warp Cycles Per Issued|Compute \(SM\) Throughput|Memory Throughput|Local Memory|Stall|Tensor" \
        "$OUT/logs/ncu-details.txt" | head -40 | say
      "$n" --import "$rep.ncu-rep" --page raw > "$OUT/logs/ncu-raw.txt" 2>&1
      grep -E "issue_stalled_[a-z_]+_per_warp_active.pct|inst_executed_pipe_[a-z_]+.avg.pct|pipe_tensor.*pct" \
        "$OUT/logs/ncu-raw.txt" | awk '$NF+0 > 0.5' | head -50 | say
      # per SASS instruction, its stall samples: where in the loop the warps wait
      "$n" --import "$rep.ncu-rep" --page source --print-source sass --csv \
        > "$OUT/logs/ncu-source.csv" 2>&1
      echo "ncu source page: $(wc -l < "$OUT/logs/ncu-source.csv") lines in logs/ncu-source.csv" | say
      python -m experiments.ncu_stalls "$OUT/logs/ncu-source.csv" > "$OUT/logs/ncu-stalls.md" 2>&1
      head -12 "$OUT/logs/ncu-stalls.md" | say
      tail -5 "$OUT/logs/ncu.log" | say
    fi ;;
  dump)
    # what Mosaic GPU hands ptxas and what comes out, per kernel: PTX, ptxas's report (registers,
    # spills, wgmma serialized), SASS; each in a process and a cache of its own (a cached kernel
    # is not compiled, so not dumped; the kernels share one module name)
    for k in ${DUMP_KERNELS:-hopper}; do
      mkdir -p "$OUT/logs/dump/$k"
      MOSAIC_GPU_DUMP_PTX=1 MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_SASS=1 \
        MOSAIC_GPU_DUMP_TO="$OUT/logs/dump/$k" JAX_COMPILATION_CACHE_DIR="$(mktemp -d)" \
        timeout 120 python -m experiments.attention --kernel "$k" --cases 2048:8192 --reps 1 \
        --inner 1 --sets 1 > "$OUT/logs/dump/$k/run.log" 2>&1
      echo "dump $k: exit $?, $(ls "$OUT/logs/dump/$k" | tr '\n' ' ')" | say
      # a dump directory gets the MLIR of every pass too (tens of MB, binaries inlined): dropped
      find "$OUT/logs/dump/$k" -type f ! -iname "*ptx*" ! -iname "*sass*" ! -name run.log -delete
      grep -ahiE "registers|spill|serializ|warning" "$OUT/logs/dump/$k"/*ptxas* "$OUT/logs/dump/$k/run.log" 2>/dev/null \
        | sort | uniq -c | head -12 | say
    done ;;
  serve2)
    two_gpus serve2 || continue
    # one transport takes ~8 min (3 load runs of qwen3-4b): give each its own call
    for t in ${TRANSPORTS:-ipc}; do for m in ${SERVE_MODES:-default}; do
      sfx=$t; [ "$m" = default ] || sfx=$t-$m
      load() {  # NAME then experiments.load flags
        local name=$1; shift
        # each run under its own limit: a hung pipeline must leave the other runs their time
        XLA_FLAGS="${XLA_FLAGS:-} $(graph_mode "$m")" timeout "${LOAD_SECONDS:-240}" python -m experiments.load --model qwen3-4b --at 18 \
          --chunk 512 --context $CONTEXT --gpus 0,1 --transport "$t" --warmup 4 \
          --out "$OUT/logs/$name" ${TRACE:+--trace "$TRACE"} "$@" ${LOAD_FLAGS:-} > "$OUT/logs/$name.log" 2>&1
        local rc=$?
        grep -E "^\||mismatch|failed requests|items, kernels busy|per item:|host issue|^ +[0-9.]+ ms" "$OUT/logs/$name.log" \
          | tail -"$([ -n "${TRACE:-}" ] && echo 50 || echo 9)" | say
        [ $rc = 0 ] || echo "$name: exit $rc$([ $rc = 124 ] && echo ", killed after ${LOAD_SECONDS:-240} s")" | say
      }
      log "qwen3-4b whole vs 2 stages on two GPUs, transport $t, CUDA graphs $m: packed, unpacked, one at a time"
      # which GPU each process holds and how busy each GPU is, every half second
      nvidia-smi --query-gpu=timestamp,index,utilization.gpu,memory.used --format=csv,noheader \
        -lms 500 > "$OUT/logs/smi-gpus-$sfx.csv" 2>&1 & smi=$!
      nvidia-smi --query-compute-apps=timestamp,pid,gpu_bus_id,used_memory --format=csv,noheader \
        -l 2 > "$OUT/logs/smi-apps-$sfx.csv" 2>&1 & apps=$!
      runs=() want=" ${RUNS:-ttft throughput unpacked} "
      case $want in *" throughput "*)
        load "serve2-$sfx" --seqs 16 --prompt_len 4500,9500 --concurrency 4,16 --requests 48
        runs+=(--run "throughput=$OUT/logs/serve2-$sfx") ;; esac
      case $want in *" unpacked "*)
        # one sequence per item, with the packed run's pool: as many prompts live at once
        load "serve2-$sfx-seqs1" --seqs 1 --pages $POOL \
          --prompt_len 4500,9500 --concurrency 4,16 --requests 48
        runs+=(--run "unpacked=$OUT/logs/serve2-$sfx-seqs1") ;; esac
      case $want in *" ttft "*)
        load "ttft-$sfx" --seqs 16 --prompt_len 8193,8193 --concurrency 1 --requests ${TTFT_REQUESTS:-6}
        runs+=(--run "ttft=$OUT/logs/ttft-$sfx") ;; esac
      # ONE_SLOT=1: what a second slot per edge buys (slot_gain); nccl has no slots
      if [ -n "${ONE_SLOT:-}" ] && [ "$t" != nccl ]; then
        load "serve2-$sfx-slot1" --seqs 16 --prompt_len 4500,9500 --concurrency 16 --requests 32 \
          --edge_slots 1
        runs+=(--run "one_slot=$OUT/logs/serve2-$sfx-slot1")
      fi
      python -m experiments.serve_summary "${runs[@]}" \
        --gpu "$(nvidia-smi --query-gpu=name --format=csv,noheader | sort | uniq -c | xargs)" \
        --out "$OUT/logs/h200x2-serve-$sfx" 2>&1 | grep -E "^\|" | say
      kill $smi $apps 2>/dev/null
      echo "GPU utilization (%) while serving, by GPU: $(awk -F', ' '$3+0 > 0 {n[$2]++; u[$2]+=$3}
        END {for (g in n) printf "GPU %s mean %.0f over %d busy samples; ", g, u[g]/n[g], n[g]}' \
        "$OUT/logs/smi-gpus-$sfx.csv")" | say
      echo "processes by GPU bus: $(cut -d, -f3 "$OUT/logs/smi-apps-$sfx.csv" | sort | uniq -c | xargs)" | say
    done; done ;;
  ttft2)
    # two GPUs: one 8193-token prompt at a time, qwen3-4b whole on GPU 0 against cut at 18 on
    # GPUs 0 and 1 (ttft_ratio: the 2-stage median time to first token over the whole's)
    two_gpus ttft2 || continue
    for t in ${TRANSPORTS:-ipc}; do
      log "two-GPU TTFT: qwen3-4b whole vs 2 stages, transport $t, ${TTFT_REQUESTS:-8} requests"
      timeout "${LOAD_SECONDS:-240}" python -m experiments.load --model qwen3-4b --at 18 --chunk 512 \
        --context $CONTEXT --seqs 16 --gpus 0,1 --transport "$t" --warmup 4 --prompt_len 8193,8193 \
        --concurrency 1 --requests "${TTFT_REQUESTS:-8}" --out "$OUT/ttft2/$t" > "$OUT/logs/ttft2-$t.log" 2>&1
      echo "experiments.load ($t): exit $?" | say
      grep -E "^\||mismatch|failed requests" "$OUT/logs/ttft2-$t.log" | tail -6 | say
      python -m experiments.serve_summary --run "ttft=$OUT/ttft2/$t" \
        --gpu "$(nvidia-smi --query-gpu=name --format=csv,noheader | sort | uniq -c | xargs)" \
        --out "$OUT/ttft2/$t-summary" 2>&1 | grep -E "^\|" | say
    done ;;
  k3serve)
    two_gpus k3serve || continue
    log "k3-mini-gpu served: whole vs 2 stages on two GPUs"
    python -m experiments.load --model k3-mini-gpu --at 4 --chunk 512 --seqs 16 --context 16384 \
      --gpus 0,1 --prompt_len 4500,9500 --concurrency 4,16 --requests 48 --warmup 4 \
      --out "$OUT/k3serve" > "$OUT/logs/k3serve.log" 2>&1
    grep -E "^\|" "$OUT/logs/k3serve.log" | tail -8 | say ;;
  transfer)
    two_gpus transfer || continue
    for t in ${TRANSPORTS:-ipc nccl shm}; do
      log "transfer per item, two 512x2560 bf16 departures, GPU 0 to GPU 1, transport $t"
      timeout "${TRANSFER_SECONDS:-120}" python -m experiments.transfer --transport "$t" \
        --gpus 0,1 --items 500 ${TRACE:+--trace} ${PINGPONG:+--pingpong} --out "$OUT/logs/transfer-$t.json" \
        > "$OUT/logs/transfer-$t.log" 2>&1
      echo "experiments.transfer $t: exit $?" | say
      tail -14 "$OUT/logs/transfer-$t.log" | say
    done ;;
  ipcbw)
    two_gpus ipcbw || continue
    log "CUDA IPC write bandwidth, GPU 0 into GPU 1, one GPU visible per process against both"
    timeout 120 python -m experiments.ipc_bandwidth --gpus 0,1 --out "$OUT/logs/ipcbw.json" \
      > "$OUT/logs/ipcbw.log" 2>&1
    echo "experiments.ipc_bandwidth: exit $?" | say
    tail -6 "$OUT/logs/ipcbw.log" | say ;;
  *) echo "unknown step $step" | say ;;
  esac
done
log "done"
