#!/usr/bin/env bash
# The GPU gates and benchmarks in one device call. Steps, in the order given:
#
#   gates      issue 6's gates in one call: `chain` beside `tests` in three groups (all the GPU
#              tests), each under $OUT/chains and $OUT/tests; 379 s on a fresh machine
#              (`48136a2`, 2026-12-03; the test groups 183, 115 and 328 s beside the chains)
#   tests      the GPU tests ($TESTS, default: attention kernel, cut, parity, FFI, whole vs stages in separate processes)
#              or $TEST_GROUPS, groups of files split by ';', each its own pytest, all at once
#              (the command below: every GPU test in 202-221 s, `7af7c58`)
#   attention  experiments/attention.py: the chunk-attention kernel's TFLOP/s
#   ncu        Nsight Compute's full set on one launch of the Hopper kernel ($NCU_KERNEL, default
#              hopper; 8192 rows, 8192 keys), or with NCU_TARGET=mlp of the fused gate/up GEMM
#              (8192 rows, tiling $NCU_TILES: fused_mlp.py --tiles, default model), where it stalls; the report in logs/attention.ncu-rep (mlp.ncu-rep),
#              as text in ncu-details.txt, the stall samples per SASS instruction in ncu-source.csv
#   variant    experimental: variants of the Hopper kernel ($VARIANT, experiments/attention.py
#              kernels, comma-separated; default hopper-mbarrier: the turns at a shared-memory
#              mbarrier, the default before `3775424`) timed beside the default (and alone
#              at $VARIANT_CONFIG, default 64,64,3; none if set empty; $VARIANT_ROUNDS rounds, 4,
#              the order reversed every other round), then the GPU
#              tests $VARIANT_TESTS selects (tests/test_attention_pallas.py, KERNJAX_TRY_VARIANTS),
#              each under a timeout, in a call of its own
#   dump       Mosaic GPU's PTX, ptxas report and SASS of each kernel of $DUMP_KERNELS (default
#              hopper; experiments/attention.py names) in logs/dump/<kernel>/
#   bounds     experiments/boundaries.py: bounded vs unconstrained qwen3-4b, $ROWS (512 2048) rows
#   chain      the chain gate: qwen3-4b bf16 cut at 18, c226, c227 (between gate_up and silu_mul:
#              K13) and 12,24, at each of $CHUNKS, 7 prompts
#   k3         the chain gate on k3-mini-gpu (bf16) cut at 4 and at 2,6, at each of $CHUNKS
#   k3serve    (nvidia-h200-x2) experiments/load.py: k3-mini-gpu served whole on GPU 0 vs 2 stages on
#              GPUs 0 and 1, packed prefill of 4.5k-9.5k-token prompts at concurrency 4 and 16
#   serve2     (nvidia-h200-x2) experiments/load.py: qwen3-4b served whole on GPU 0 vs cut at 18 on
#              GPUs 0 and 1, for each of $TRANSPORTS (default ipc; also shm, host): 4.5k-9.5k-token
#              prompts at concurrency 4 and 16 packed and unpacked (--seqs 1), one 8193-token prompt
#              at a time ($TTFT_REQUESTS, 6), under each of XLA's CUDA-graph modes $SERVE_MODES
#              (default); experiments/serve_summary.py makes issue 8's results.json of them
#   pack1      experiments/load.py on GPU 0: qwen3-4b whole, packed against one sequence an item with
#              the same pool, at $PACK_CHUNK (8192) rows: a one-GPU preview of packed_gain
#   transfer   (nvidia-h200-x2) experiments/transfer.py: time per item over an edge, GPU 0 to GPU 1,
#              for each of $TRANSPORTS (ipc nccl shm), against bytes / 338 GB/s
#   autotune   experiments/autotune.py: the kernels XLA picks for qwen3-4b's GEMMs and their times,
#              a fresh process for each of $AUTOTUNE_SETS (default: XLA's timed choice, then
#              kernjax's flags, untimed, twice: do two processes pick alike?), at $AUTOTUNE_ROWS
#              (512,8192), on weights laid out as $AUTOTUNE_LAYOUTS (oi: [out, in]; io: [in, out])
#   fusedmlp   experiments/fused_mlp.py: gate/up with silu·mul in a Mosaic GPU GEMM's epilogue
#              against the model's two calls and against the same GEMM and a silu·mul kernel
#              apart, at $FUSED_ROWS (512,2048,8192), tilings $FUSED_TILES (its default): roadmap K13;
#              $FUSED_EPILOGUES (of exact,mul,bare,approx,tanh): the epilogue's cost (roadmap K15)
#   dense      experiments/dense_calls.py: q_norm, k_norm, rope and kv_write as csrc/dense.cu's one
#              kernel and apart, and add_norm's kernel, against XLA's, at $DENSE_ROWS: roadmap K14
#   addnorm    experiments/add_norm.py: the residual add and the next RMSNorm as one Pallas Triton
#              kernel against XLA's two, at $ADDNORM_ROWS (512,2048,8192)
#   gemms      experiments/gemms.py: a layer's GEMMs as today against merged (q/k/v, gate/up, silu·mul
#              into down), at 512, 2048 and 8192 rows: what issue 6's 65 % could get from them;
#              with $GEMM_SETS (XLA's GEMM routes: default cublaslt tritonws cudnn notriton) the
#              model's GEMM calls at $GEMM_ROWS (8192) under each instead, and JAX's Mosaic GPU
#              matmul beside the first
#   peritem    experiments/peritem.py --stages: qwen3-4b's whole program timed per item at 16 x 16k
#              and 1 x 8k, and the state copies in every program, the stages' edged ones too
#   issue      experiments/peritem.py --issue: qwen3-4b's whole program (16 x 16k) issued item after
#              item as served, the host's time per call, under each of $ISSUE_MODES: XLA's CUDA
#              graphs as they are (default), off (nocb), updated only where addresses moved over
#              profiled runs (skip_profiled), temporaries at fixed virtual addresses (skip_temp)
#   dispatch   experiments/dispatch.py: the host's time to issue a program while the GPU runs the
#              last, with numpy or device operands, jit or compiled, with and without a side effect
#   ipcbw      (nvidia-h200-x2) experiments/ipc_bandwidth.py: GB/s of one process writing into the
#              other GPU's memory through CUDA IPC, each seeing one GPU against both seeing both
#   calls      experiments/calls.py: qwen3-4b call by call, 512 and 2048 rows at the end of 8192 tokens
#   clocks     experiments/clocks.py: the SM clock, power and clock-event reasons (nvidia-smi, read
#              only) under 8192^3 GEMMs of random and of zero operands, qwen3-4b's gate GEMM, the
#              8k prefill in one chunk back to back and after 3 s idle, and the attention kernel
#              alone ($CLOCK_SECONDS per phase, 8; 14 took 134 s): MFU's 989 TFLOP/s is the
#              peak at 1830 MHz, and a GPU at its power limit runs lower
#   ab         experiments/prefill.py's 8k row in one chunk (kernjax, 15 runs) under each value of
#              $AB_VAR (e.g. KERNJAX_MLP_ACROSS) in $AB_VALUES (e.g. "0 1"), both required, $AB_ROUNDS (3) rounds
#              alternated on one machine; each run's README under $OUT/ab/<value><round>/
#   (chain: $ATS picks cut points, default "18 c221 c226 c227 12,24": c221 inside K14's group; $CHUNKS the chunk sizes)
#   prefill    experiments/prefill.py: the prefill benchmark (results under $OUT/prefill/), the
#              rows of $PROFILE (8192; empty: none) profiled and their kernjax programs compiled
#              again by a second process ($SECOND_START, 8192); the profiles in logs/profiles/;
#              the JAX systems interleaved at each row (--interleave; INTERLEAVE= runs them one
#              after another): the 1k-32k rows of four JAX systems took 180 + 138 s (2026-12-03)
#
#   KERNJAX_COMMIT=$(git rev-parse --short HEAD) OUT=out bash experiments/gpu_gate.sh tests attention bounds chain prefill k3
#
# A device call may run 10 minutes; a session has 30 and each call's build takes ~40 s. Measured
# on one H200 (2026-11-30, `d91317b`): `variant` (then `overlap`) 242 s; tests A + the 3 chains
# at 512, 394 s (371 s at `614aef7`); `issue` 165 s;
# tests B + the chains at 64, 271 s; the whole prefill table without profiles, 495 s (32k in one
# chunk included); the k3 chains at 64 and 512, 160 s (`2a8776d`). Issue 6's gates, in two calls:
#   A="tests/test_attention_hopper.py tests/test_attention.py tests/test_processes.py tests/test_cut.py tests/test_parity.py tests/test_ffi.py"
#   B="tests/test_attention_pallas.py tests/test_mxfp4.py tests/test_kda.py tests/test_edge.py"
#   TEST_SECONDS=240 TESTS="$A" CHUNKS=512 gpu_gate.sh tests chain
#   TEST_SECONDS=240 TESTS="$B" CHUNKS=64 gpu_gate.sh tests chain       (+ prefill of 8k: 438 s)
#   PROFILE= PREFILL_FLAGS="--max_seconds 420" gpu_gate.sh prefill     (no profiles: the whole table)
# Thirty-sixth session: the table with `--min_row_s 2` (12 runs at 8k, 4 at the default 0.5;
# `--max_seconds` only stops rows from starting) took 380 s with the build on a fresh machine;
# `gates` with TEST_SECONDS=465, 433 s with the build.
# With FlashAttention-3 (seventeenth session, `769e5a4`) the test files take longer: A with
# test_attention_pallas.py ran 97 of its 116 tests in 200 s; test_attention_pallas.py and
# test_serve.py together ~280 s. Next: A (without pallas) ~170 s + the chains at 512 ~150 s in one
# call; test_attention_pallas.py test_serve_link.py test_http.py test_edge.py test_kda.py
# test_mxfp4.py (TEST_SECONDS=420, unmeasured as a group) + the chains at 64 ~130 s in another;
# test_serve.py (~190 s) where room is left. Each chain ~25-35 s after the first (~100 s).
# Measured at `9782455` (eighteenth session): test_parity, test_processes, test_cut, test_ffi and
# test_attention reached 74 of ~80 tests in 140 s; test_serve, test_serve_link, test_http,
# test_edge, test_kda, test_mxfp4, test_attention_hopper and 20 of test_attention_pallas's 30
# took 500 s (164 tests). The GPU tests in full need ~700 s in sequence. Nineteenth session (one
# H200, `7af7c58`): all of them and the six chains in one call of 328 s, the chains beside the
# tests (239 passed, 14 skipped; 77 / 48 / 114 in 202 / 221 / 208 s; chains 271 s): the build
# alone (`bash gpu_gate.sh`, no step), then `OUT=$OUT/c SKIP_BUILD=1 bash gpu_gate.sh chain &`,
# then `OUT=$OUT/t SKIP_BUILD=1` with the line below, then `wait`:
#   TEST_SECONDS=420 TEST_GROUPS="tests/test_serve.py tests/test_serve_link.py tests/test_http.py;
#     tests/test_attention_pallas.py tests/test_attention.py tests/test_attention_hopper.py;
#     tests/test_parity.py tests/test_processes.py tests/test_cut.py tests/test_ffi.py tests/test_edge.py
#     tests/test_kda.py tests/test_mxfp4.py" gpu_gate.sh tests
# Twentieth session (`47eaeed`): the same in 305 s (240 passed; 192 / 199 / 191 s); the whole table
# (`--max_seconds 400`) plus the 8k idle rows of four systems (`--iters 7 --max_seconds 140`) in one
# call of 517 s. The device brings back 8 files: each gate run leaves gate.log and logs.tgz, a
# prefill run also $OUT/prefill/{README.md,results.json,mfu.png}; remove extras by exact path
# (`rm $OUT/prefill/mfu.png`), or the table's results.json may be the one left out.
# Twenty-first (`9dfdfe5`): the third group with tests/test_chain.py too (the token's publication
# on the GPU): 264 passed (78 / 48 / 138 in 203 / 180 / 284 s), after an 8k A/B, in a call of
# 477 s; `cd $OUT && tar czf /tmp/all.tgz . && rm -rf $OUT/* && mv /tmp/all.tgz $OUT/` at the
# end brings back everything as one file.
# Twenty-second (`0c428ad`, `ad14d0b`): that call (build, chains beside the three groups) 367 and
# 383 s; the whole table (`PROFILE= PREFILL_FLAGS="--max_seconds 400"`) 365 s on the warm machine;
# 8k in chunks of 512 and one chunk after idle for 3 systems with the second start, 223 s warm.
# They passed at `d91317b`, at `4273ad2` (GPU 0 of nvidia-h200-x2), at `614aef7`, at `322ffd3`
# (experiments/results/2026-12-01-h200-322ffd3-gates/: A 339 s, B 303 s) and at `6cb5e73`
# (one H200, 2026-12-01, experiments/results/2026-12-01-h200-6cb5e73/: A 386 s, B with the 8k
# prefill rows 438 s, `variant` 283-293 s); rerun them after any change to models/,
# kernjax/ or csrc/ (for the Mosaic kernels alone, attention and MLP, `python experiments/same_kernel.py REV` says
# whether the tree compiles the same Mosaic module as REV did). Attention schedules tried against
# the default (`pingpong`, the turns one way at named barriers since `6cb5e73`), all slower, each
# beside it in one call (experiments/results/2026-12-01-h200-kernel-variants/): queue (P_t V_t
# and Q K_{t+1} back to back; +1..-6 %, ptxas C7519), late_sum, local_sum (FlashAttention-3's
# per-thread row sums; -2..-8 %): removed in `820279e`; overlap with the turns one way
# (FlashAttention-3's pair): 35-40 % slower while ptxas serialized every wgmma (C7513, fixed in
# `71df809`), still 2-8 % slower after: ptxas waits for O before the softmax (docs/lessons.md).
# `gemms` (`7eb1c64`): merged GEMMs would buy ~2.4 ms of the 133.7 at 8k in one chunk (61 % at
# best): 65 % needs a faster attention kernel. `issue` (`614aef7`): XLA's default CUDA-graph mode
# issues the served whole program fastest (6.6 ms an item; 8.9 without graphs, 10-12 with
# SKIP_PROFILED). `dump` + `variant` of one or two kernels: 116-250 s; `ncu`: ~30 s.
# Why ptxas waited for O before the softmax (found on the CPU, eleventh session): it hoists the
# wait unless a shared-memory access that depends on the softmax lies between; with one
# (`2cd4fee`) the softmax ran beside O and the kernel was 9-15 % slower than the default still
# (experiments/results/2026-12-01-h200-kernel-variants/call7-2cd4fee-anchor/). Exponentials
# partly on the FMA pipes (`fma_exp`, call8-283f2d9-fma-exp/): correct, 1-10 % slower.
# Twelfth session: Q's tile and its staging in one buffer (`union`) no faster in both orders
# (call10-787b65a-union-both-orders/: in-call noise is up to 8 %, time A/B both ways); 192-key
# steps spill. XLA's GEMM routes and Mosaic GPU's matmul within 0.6 % (`gemms`, GEMM_SETS).
# Issue 8 on nvidia-h200-x2 (experiments/results/2026-11-30-h200x2-serve/, `3d9104a`): 1.92x one
# GPU's throughput at c16 (goal met), TTFT 0.559 ipc / 0.548 nccl (goal 0.545), packed_gain -0.026
# at chunk 512. Eleventh session (experiments/results/2026-12-01-h200x2/): XLA's SKIP_TEMP cut the
# host's issue 7.42 -> 3.65 ms and TTFT to 0.5470 (ipc); serving runs it since `2318f39`, with the
# partial-item rule that no longer drains the pipeline before a prompt's last chunk (unmeasured).
# Next on nvidia-h200-x2, each a call (the first ~450 s on a fresh machine):
#   RUNS=ttft TRANSPORTS="ipc nccl" TTFT_REQUESTS=8 LOAD_SECONDS=200 gpu_gate.sh serve2
#   TRANSPORTS="ipc nccl" PINGPONG=1 TRANSFER_SECONDS=60 gpu_gate.sh transfer, then
#     RUNS="throughput unpacked" LOAD_SECONDS=300 LOAD_FLAGS="--chunk 8192 --concurrency 16 --requests 32" gpu_gate.sh serve2
#       (packed_gain where kern measured it: items as large as a prompt)
#   TEST_SECONDS=240 TESTS="tests/test_edge.py tests/test_serve.py" gpu_gate.sh tests k3serve
#       (issue 8's GPU tests at the final tree; issue 9's tok/s, whole vs 2 stages)
# If x2 is lent for one call only, the most of issue 8 in one (~400 s estimated on a fresh machine):
#   RUNS=ttft TRANSPORTS=ipc TTFT_REQUESTS=8 LOAD_SECONDS=200 PINGPONG=1 TRANSFER_SECONDS=40 \
#     bash experiments/gpu_gate.sh serve2 transfer && OUT=$OUT/pack SKIP_BUILD=1 \
#     RUNS="throughput unpacked" LOAD_SECONDS=200 TRANSPORTS=ipc \
#     LOAD_FLAGS="--chunk 8192 --concurrency 16 --requests 32" bash experiments/gpu_gate.sh serve2
# serve_summary.py --run ... makes results.json.
# A summary goes to $OUT/gate.log and stdout; every step's full output to $OUT/logs/, packed into
# $OUT/logs.tgz at the end (the device tool brings back few files). Random weights are cached
# under .kjcache/ (git-ignored), XLA's autotune and compilation caches under .kjcache/xla/.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
mkdir -p "$OUT/logs"
export PYTHONUNBUFFERED=1 KERNJAX_CACHE=$PWD/.kjcache XLA_PYTHON_CLIENT_PREALLOCATE=false
export NCCL_NVLS_ENABLE=0  # the two-GPU machine: NVLink multicast stays off
# The device copy's git may name an older commit than the tree it holds: pass KERNJAX_COMMIT.
export KERNJAX_COMMIT=${KERNJAX_COMMIT:-}
CHUNKS=${CHUNKS:-"512 64"}
# qwen3-4b serving runs: context 16384 (128 pages of 128, qwen3-4b's page), room for 16 sequences
# + page 0; the unpacked runs (--seqs 1) get the same pool, so packing is all that differs
CONTEXT=16384; POOL=$((16 * CONTEXT / 128 + 1))
log() { echo "== $(date -u +%FT%TZ) $*" | tee -a "$OUT/gate.log"; }
say() { tee -a "$OUT/gate.log"; }
# The device tool brings back 8 files: the logs travel packed, and only the packed copy stays.
pack() { tar -C "$OUT" -czf "$OUT/logs.tgz" logs && rm -rf "$OUT/logs"; }
trap pack EXIT
# XLA's CUDA-graph modes by name (`issue`, and `serve2`'s $SERVE_MODES): as kernjax leaves them
# (serving: skip_temp, kernjax/runtime/xla.py; else XLA's own), XLA's own (every moved node updated), off,
# updated only where addresses moved over profiled runs, temporaries at fixed addresses
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

log "machine, commit ${KERNJAX_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)$(git diff --quiet 2>/dev/null || echo +changes)}"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader
  python -c 'import jax, jaxlib; print("jax", jax.__version__, "jaxlib", jaxlib.__version__, jax.devices())'
  nvcc --version | tail -1
} 2>&1 | say

if [ -z "${SKIP_BUILD:-}" ]; then  # SKIP_BUILD=1: a second run in the same call, built already
  log "build"
  python -m pip install -q --no-build-isolation --no-deps -e . > "$OUT/logs/build.log" 2>&1 \
    || { tail -20 "$OUT/logs/build.log"; exit 1; }
fi
python -c 'import kernjax.kernels.ffi as f; f.register(); print("extension cuda:", f.has_cuda(),
  "| FlashAttention-3:", f._extension().fa3_loaded() and f.fa3_path())' 2>&1 | say
# bf16 attention runs FlashAttention-3 (scripts/fa3 builds it here; no network there): carry it
# with `run`'s carry=["build/fa3/libkj_fa3.so"]. Without it every bf16 qwen3 program fails, so
# the call stops here rather than spend its minutes on failures (NO_FA3=1 goes on regardless).
if [ -z "${NO_FA3:-}" ] && ! python -c 'import kernjax.kernels.ffi as f; f.register(); assert f._extension().fa3_loaded()' 2>/dev/null; then
  echo "FlashAttention-3 is not loaded: build it with scripts/fa3 and carry build/fa3/libkj_fa3.so" | say
  exit 1
fi

for step in "$@"; do
  case $step in
  tests)
    log "tests on the GPU"
    # $TEST_GROUPS: test files in groups split by ';', one pytest each, all at once (the GPU has
    # room and 16 cores; a group per log, tests.log, tests1.log, ...); else $TESTS in one.
    # SIGINT at the limit: pytest then prints the failures so far (TERM lost them once). The
    # tests keep their checkpoints in a cache of their own (tests/conftest.py) but share the
    # machine's XLA cache, as before conftest set one per run (with one per run the groups took
    # 218-374 s against 206-342 s, under a 400 s limit; the machine's part in that not separated).
    IFS=';' read -ra groups <<< "${TEST_GROUPS:-${TESTS:-tests/test_attention_pallas.py tests/test_attention_hopper.py tests/test_attention.py tests/test_cut.py \
      tests/test_processes.py tests/test_ffi.py tests/test_mxfp4.py tests/test_kda.py tests/test_parity.py tests/test_edge.py \
      tests/test_dense_cuda.py}}"
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
    # issue 6's gates in one call: the chains ($ATS at $CHUNKS) beside the GPU tests in three
    # groups ($TEST_GROUPS, default all the GPU tests; TEST_SECONDS, default 420). 379 s on a
    # fresh machine, which first writes the random qwen3-4b checkpoint (~75 s): give the call 600.
    log "gates: the chains beside the GPU tests"
    OUT=$OUT/chains SKIP_BUILD=1 bash experiments/gpu_gate.sh chain > /dev/null 2>&1 &
    OUT=$OUT/tests SKIP_BUILD=1 TEST_SECONDS=${TEST_SECONDS:-420} TEST_GROUPS="${TEST_GROUPS:-\
tests/test_serve.py tests/test_serve_link.py tests/test_http.py;\
tests/test_attention_pallas.py tests/test_attention.py tests/test_attention_hopper.py;\
tests/test_mlp_hopper.py tests/test_dense_cuda.py tests/test_processes.py tests/test_parity.py tests/test_cut.py tests/test_ffi.py \
tests/test_edge.py tests/test_kda.py tests/test_mxfp4.py tests/test_chain.py}" \
      bash experiments/gpu_gate.sh tests > /dev/null 2>&1
    wait
    grep -hE "^cut |PASS|FAIL|differ|exited|passed|failed|stopped|Error" "$OUT/chains/gate.log" \
      "$OUT/tests/gate.log" | say ;;
  variant)
    # experimental, in a call of its own: a kernel that deadlocks must not take the gates along
    v=${VARIANT:-hopper-mbarrier}
    log "experiment: the Hopper kernel's variant $v (kernjax/kernels/attention_hopper.py)"
    # timings first: they say in a minute whether the correctness run is worth its four
    runs=("hopper,$v")
    [ -n "${VARIANT_CONFIG-64,64,3}" ] && runs+=("$v --config ${VARIANT_CONFIG-64,64,3}")
    for run in "${runs[@]}"; do
      timeout 120 python experiments/attention.py --kernel $run --rounds "${VARIANT_ROUNDS:-4}" \
        --cases 512:8192,2048:8192,8192:8192 > "$OUT/logs/variant-${run%% *}.log" 2>&1
      echo "attention.py --kernel $run: exit $?" | say
      grep -E "^\| +[0-9]" "$OUT/logs/variant-${run%% *}.log" | say
    done
    KERNJAX_TRY_VARIANTS=1 timeout ${TEST_SECONDS:-240} python -m pytest -q tests/test_attention_pallas.py \
      -k "${VARIANT_TESTS:-gpu and hopper}" > "$OUT/logs/variant-tests.log" 2>&1
    echo "tests: exit $?" | say
    grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/logs/variant-tests.log" | tail -12 | say ;;
  ncu)
    # where a kernel's warps stall: Nsight Compute's full set on one launch, of the attention
    # kernel (square 8k) or, with NCU_TARGET=mlp, of the fused gate/up GEMM at 8192 rows (its first
    # launch after fused_mlp.py's silu·mul kernel apart, the other kernel named `body`)
    n=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    if [ "${NCU_TARGET:-attention}" = mlp ]; then
      log "a profile of the fused gate/up GEMM (Nsight Compute), 8192 rows"
      target=(--kernel-name regex:"^body" --launch-skip 1 --launch-count 1)
      cmd=(python experiments/fused_mlp.py --rows 8192 --tiles "${NCU_TILES:-model}" --iters 1)
    else
      log "a profile of the attention kernel (Nsight Compute), 8192 rows on 8192 keys"
      target=(--kernel-name regex:"mosaic|attention" --launch-skip 2 --launch-count 1)
      cmd=(python experiments/attention.py --kernel "${NCU_KERNEL:-hopper}" --cases 8192:8192
           --reps 1 --inner 1 --sets 1)
    fi
    if [ -z "$n" ]; then echo "ncu: not on this machine" | say; else
      timeout "${NCU_SECONDS:-300}" "$n" "${target[@]}" --set full -f -o "$OUT/logs/${NCU_TARGET:-attention}" "${cmd[@]}" \
        > "$OUT/logs/ncu.log" 2>&1
      echo "ncu: exit $?" | say
      "$n" --import "$OUT/logs/${NCU_TARGET:-attention}.ncu-rep" --page details > "$OUT/logs/ncu-details.txt" 2>&1
      grep -E "Duration|Registers Per|Achieved Occupancy|Issue Slots Busy|Executed Ipc A|No Eligible|Warp Cycles Per Issued|Compute \(SM\) Throughput|Memory Throughput|Local Memory|Stall|Tensor" \
        "$OUT/logs/ncu-details.txt" | head -40 | say
      "$n" --import "$OUT/logs/${NCU_TARGET:-attention}.ncu-rep" --page raw > "$OUT/logs/ncu-raw.txt" 2>&1
      grep -E "issue_stalled_[a-z_]+_per_warp_active.pct|inst_executed_pipe_[a-z_]+.avg.pct|pipe_tensor.*pct" \
        "$OUT/logs/ncu-raw.txt" | awk '$NF+0 > 0.5' | head -50 | say
      # per SASS instruction, its stall samples: where in the loop the warps wait
      "$n" --import "$OUT/logs/${NCU_TARGET:-attention}.ncu-rep" --page source --print-source sass --csv \
        > "$OUT/logs/ncu-source.csv" 2>&1
      echo "ncu source page: $(wc -l < "$OUT/logs/ncu-source.csv") lines in logs/ncu-source.csv" | say
      python experiments/ncu_stalls.py "$OUT/logs/ncu-source.csv" > "$OUT/logs/ncu-stalls.md" 2>&1
      head -12 "$OUT/logs/ncu-stalls.md" | say
      tail -5 "$OUT/logs/ncu.log" | say
    fi ;;
  dump)
    # what Mosaic GPU hands ptxas and what comes out, per kernel ($DUMP_KERNELS): PTX, ptxas's
    # report (registers, spills, wgmma serialized), SASS; each in a process and a cache of its own
    # (a cached kernel is not compiled, so not dumped; the kernels share one module name)
    for k in ${DUMP_KERNELS:-hopper}; do
      mkdir -p "$OUT/logs/dump/$k"
      MOSAIC_GPU_DUMP_PTX=1 MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_SASS=1 \
        MOSAIC_GPU_DUMP_TO="$OUT/logs/dump/$k" JAX_COMPILATION_CACHE_DIR="$(mktemp -d)" \
        timeout 120 python experiments/attention.py --kernel "$k" --cases 2048:8192 --reps 1 \
        --inner 1 --sets 1 > "$OUT/logs/dump/$k/run.log" 2>&1
      echo "dump $k: exit $?, $(ls "$OUT/logs/dump/$k" | tr '\n' ' ')" | say
      # a dump directory gets the MLIR of every pass too (tens of MB, binaries inlined): dropped
      find "$OUT/logs/dump/$k" -type f ! -iname "*ptx*" ! -iname "*sass*" ! -name run.log -delete
      grep -ahiE "registers|spill|serializ|warning" "$OUT/logs/dump/$k"/*ptxas* "$OUT/logs/dump/$k/run.log" 2>/dev/null \
        | sort | uniq -c | head -12 | say
    done ;;
  attention)
    log "attention kernel"
    python experiments/attention.py --out "$OUT/logs/attention.json" ${ATTN_FLAGS:-} \
      > "$OUT/logs/attention.log" 2>&1
    tail -14 "$OUT/logs/attention.log" | say ;;
  bounds)
    log "boundary cost"
    for r in ${ROWS:-512 2048}; do
      python experiments/boundaries.py --model qwen3-4b --rows "$r" --context 8192 \
        > "$OUT/logs/bounds-$r.log" 2>&1
      tail -1 "$OUT/logs/bounds-$r.log" | say
    done ;;
  chain)
    for c in $CHUNKS; do
      python experiments/prompts.py --chunk "$c" --vocab 151936 > "$OUT/logs/prompts$c.txt"
      for at in ${ATS:-18 c221 c226 c227 12,24}; do
        log "chain qwen3-4b --at $at --chunk $c"
        rm -rf "cuts/$at-$c"
        kernjax cut --model qwen3-4b --at "$at" --chunk "$c" --seqs 1 --out "cuts/$at-$c" \
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
      python experiments/prompts.py --chunk "$c" --vocab 32768 > "$OUT/logs/k3prompts$c.txt"
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
  k3serve)
    log "k3-mini-gpu served: whole vs 2 stages on two GPUs"
    python experiments/load.py --model k3-mini-gpu --at 4 --chunk 512 --seqs 16 --context 16384 \
      --gpus 0,1 --prompt_len 4500,9500 --concurrency 4,16 --requests 48 --warmup 4 \
      --out "$OUT/k3serve" > "$OUT/logs/k3serve.log" 2>&1
    grep -E "^\|" "$OUT/logs/k3serve.log" | tail -8 | say ;;
  serve2)
    # one transport takes ~8 min (3 load runs of qwen3-4b): give each its own call
    # SERVE_MODES: XLA's CUDA-graph modes to serve under (graph_mode), each a run of its own
    for t in ${TRANSPORTS:-ipc}; do for m in ${SERVE_MODES:-default}; do
      sfx=$t; [ "$m" = default ] || sfx=$t-$m
      load() {  # NAME then load.py flags
        local name=$1; shift
        # each run under its own limit: a hung pipeline must leave the other runs their time
        XLA_FLAGS="${XLA_FLAGS:-} $(graph_mode "$m")" timeout "${LOAD_SECONDS:-240}" python experiments/load.py --model qwen3-4b --at 18 \
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
      runs=() want=" ${RUNS:-ttft throughput unpacked} "  # RUNS="ttft": that run alone
      case $want in *" throughput "*)
        load "serve2-$sfx" --seqs 16 --prompt_len 4500,9500 --concurrency 4,16 --requests 48
        runs+=(--run "throughput=$OUT/logs/serve2-$sfx") ;; esac
      case $want in *" unpacked "*)
        # one sequence per item, with the packed run's pool ($POOL): as many prompts live at
        # once, so the pipeline need not drain between prompts (before the twelfth session it did)
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
      python experiments/serve_summary.py "${runs[@]}" \
        --gpu "$(nvidia-smi --query-gpu=name --format=csv,noheader | sort | uniq -c | xargs)" \
        --out "$OUT/logs/h200x2-serve-$sfx" 2>&1 | grep -E "^\|" | say
      kill $smi $apps 2>/dev/null
      echo "GPU utilization (%) while serving, by GPU: $(awk -F', ' '$3+0 > 0 {n[$2]++; u[$2]+=$3}
        END {for (g in n) printf "GPU %s mean %.0f over %d busy samples; ", g, u[g]/n[g], n[g]}' \
        "$OUT/logs/smi-gpus-$sfx.csv")" | say
      echo "processes by GPU bus: $(cut -d, -f3 "$OUT/logs/smi-apps-$sfx.csv" | sort | uniq -c | xargs)" | say
    done; done ;;
  pack1)
    # one GPU: what packing buys the whole program at 8192-row items, beside one sequence per
    # item with the same pool (a preview of serve2's packed_gain, which is 2 stages on two GPUs)
    c=${PACK_CHUNK:-8192}
    log "qwen3-4b whole on GPU 0, chunk $c: packed (16 sequences an item) against one an item"
    for seqs in 16 1; do
      timeout "${LOAD_SECONDS:-300}" python experiments/load.py --model qwen3-4b --at 18 --configs whole \
        --chunk "$c" --context $CONTEXT --seqs $seqs --pages $POOL --gpus 0 --prompt_len 4500,9500 \
        --concurrency 4,16 --requests 32 --warmup 4 --out "$OUT/logs/pack1-$c-seqs$seqs" \
        > "$OUT/logs/pack1-$c-seqs$seqs.log" 2>&1
      echo "seqs $seqs: exit $?" | say
      grep -E "^\| whole|failed requests" "$OUT/logs/pack1-$c-seqs$seqs.log" | say
    done ;;
  transfer)
    for t in ${TRANSPORTS:-ipc nccl shm}; do
      log "transfer per item, two 512x2560 bf16 departures, GPU 0 to GPU 1, transport $t"
      timeout "${TRANSFER_SECONDS:-120}" python experiments/transfer.py --transport "$t" \
        --gpus 0,1 --items 500 ${TRACE:+--trace} ${PINGPONG:+--pingpong} --out "$OUT/logs/transfer-$t.json" \
        > "$OUT/logs/transfer-$t.log" 2>&1
      echo "transfer $t: exit $?" | say
      tail -14 "$OUT/logs/transfer-$t.log" | say
    done ;;
  autotune)
    log "qwen3-4b's GEMMs: kernels XLA picks, autotuned or not"
    python experiments/autotune.py --rows "${AUTOTUNE_ROWS:-512,8192}" --layouts "${AUTOTUNE_LAYOUTS:-oi}" \
      --sets "${AUTOTUNE_SETS:-timed,kernjax,kernjax-again}" > "$OUT/logs/autotune.log" 2>&1
    grep -vE "^\|---" "$OUT/logs/autotune.log" | say ;;
  fusedmlp)
    log "gate/up with silu·mul in a GEMM's epilogue, against the calls and apart (roadmap K13)"
    python experiments/fused_mlp.py --rows "${FUSED_ROWS:-512,2048,8192}" ${FUSED_TILES:+--tiles "$FUSED_TILES"} \
      ${FUSED_EPILOGUES:+--epilogues "$FUSED_EPILOGUES"} \
      > "$OUT/logs/fused_mlp.log" 2>&1 || echo "fused_mlp.py: exit $?" >> "$OUT/logs/fused_mlp.log"
    grep -E "^\||exit" "$OUT/logs/fused_mlp.log" | say ;;
  dense)
    log "a dense layer's small calls as csrc/dense.cu's kernels, against XLA's (roadmap K14)"
    python experiments/dense_calls.py --rows "${DENSE_ROWS:-512,2048,8192}" \
      > "$OUT/logs/dense_calls.log" 2>&1 || echo "dense_calls.py: exit $?" >> "$OUT/logs/dense_calls.log"
    grep -E "^\||exit|Error" "$OUT/logs/dense_calls.log" | say ;;
  addnorm)
    log "the residual add and the next RMSNorm as one kernel, against XLA's"
    python experiments/add_norm.py --rows "${ADDNORM_ROWS:-512,2048,8192}" \
      > "$OUT/logs/add_norm.log" 2>&1 || echo "add_norm.py: exit $?" >> "$OUT/logs/add_norm.log"
    grep -E "^\||exit" "$OUT/logs/add_norm.log" | say ;;
  gemms)
    if [ -z "${GEMM_SETS:-}" ]; then
      log "a layer's GEMMs, separate and merged"
      python experiments/gemms.py --rows 512,2048,8192 > "$OUT/logs/gemms.log" 2>&1
      grep -E "^\|" "$OUT/logs/gemms.log" | say
    fi
    # the model's GEMM calls under each of XLA's GEMM routes $GEMM_SETS, each autotuned afresh
    # (a cache of its own), JAX's Mosaic GPU matmul beside the first
    pallas=--pallas
    for g in ${GEMM_SETS:-}; do
      case $g in
        default) f= ;;
        cublaslt) f=--xla_gpu_enable_cublaslt=true ;;
        tritonws) f=--xla_gpu_experimental_enable_triton_warp_specialization=true ;;
        cudnn) f=--xla_gpu_cudnn_gemm_fusion_level=2 ;;
        notriton) f=--xla_gpu_enable_triton_gemm=false ;;
        *) echo "unknown GEMM route $g (default, cublaslt, tritonws, cudnn, notriton)" | say; continue ;;
      esac
      log "the model's GEMMs, XLA's route $g ${pallas:+(and the Mosaic GPU matmul)}"
      XLA_FLAGS="${XLA_FLAGS:-} $f" KERNJAX_XLA_CACHE=$PWD/.kjcache/xla-gemms-$g timeout 240 \
        python experiments/gemms.py --layer $pallas --rows "${GEMM_ROWS:-8192}" \
        > "$OUT/logs/gemms-$g.log" 2>&1
      echo "gemms.py ($g): exit $?" | say
      grep -E "^\||^XLA_FLAGS" "$OUT/logs/gemms-$g.log" | say
      pallas=
    done ;;
  peritem)
    log "an item's cost against the pool, and the state copies of every program"
    timeout 300 python experiments/peritem.py --model qwen3-4b --configs 16:16384,1:8192 \
      --iters 5 --stages > "$OUT/logs/peritem.log" 2>&1
    echo "peritem.py: exit $?" | say
    grep -E "^\||state copies" "$OUT/logs/peritem.log" | say ;;
  issue)
    log "the whole program's host issue per item, under each of XLA's CUDA-graph modes"
    for mode in ${ISSUE_MODES:-default nocb skip_profiled skip_temp}; do
      XLA_FLAGS="${XLA_FLAGS:-} $(graph_mode $mode)" timeout 200 python experiments/peritem.py --model qwen3-4b \
        --configs 16:16384 --iters 3 --issue 40 >> "$OUT/logs/issue.log" 2>&1
      echo "peritem.py --issue ($mode): exit $?" | say
    done
    grep -E "^\| [0-9]|issue," "$OUT/logs/issue.log" | say ;;
  dispatch)
    log "the host's time to issue an item while the GPU is busy"
    timeout 300 python experiments/dispatch.py --out "$OUT/logs/dispatch.json" ${DISPATCH_FLAGS:-} \
      > "$OUT/logs/dispatch.log" 2>&1
    echo "dispatch.py: exit $?" | say
    grep -E "^\||GEMMs" "$OUT/logs/dispatch.log" | say ;;
  ipcbw)
    log "CUDA IPC write bandwidth, GPU 0 into GPU 1, one GPU visible per process against both"
    timeout 120 python experiments/ipc_bandwidth.py --gpus 0,1 > "$OUT/logs/ipcbw.log" 2>&1
    echo "ipc_bandwidth.py: exit $?" | say
    tail -6 "$OUT/logs/ipcbw.log" | say ;;
  calls)
    log "time per call"
    for r in 512 2048; do
      timeout "${CALLS_SECONDS:-300}" python experiments/calls.py --model qwen3-4b --rows "$r" --context 8192 \
        --out "$OUT/logs/calls-$r.json" > "$OUT/logs/calls-$r.log" 2>&1
      tail -22 "$OUT/logs/calls-$r.log" | say
      kernjax cut --model qwen3-4b --chunk "$r" --context 8192 --seqs 1 --at auto \
        --profile "$OUT/logs/calls-$r.json" --out "cuts/auto-$r" 2>&1 | grep -E "auto:|error" | say
      python -c 'import json, sys; c = json.load(open(sys.argv[1]))["calls"]; a = sum(x["ms"] for x in c[:218]); b = sum(x["ms"] for x in c[218:]); print(f"--at 18 by the same profile: {a:.3f}, {b:.3f} ms, the longest {2 * max(a, b) / (a + b):.3f} of even")' "$OUT/logs/calls-$r.json" | say
      rm -rf "cuts/auto-$r"
    done ;;
  clocks)
    log "SM clock and power under GEMMs, the 8k prefill and attention"
    timeout 300 python experiments/clocks.py --seconds "${CLOCK_SECONDS:-8}" --out "$OUT/clocks.json" \
      > "$OUT/logs/clocks.log" 2>&1
    echo "clocks.py: exit $?" | say
    tail -10 "$OUT/logs/clocks.log" | say ;;
  prefill)
    log "prefill benchmark"
    python experiments/prefill.py --out "$OUT/prefill" --profile "${PROFILE-8192}" \
      --second_start "${SECOND_START-8192}" ${INTERLEAVE-"--interleave"} ${PREFILL_FLAGS:-} \
      > "$OUT/logs/prefill.log" 2>&1
    mkdir -p "$OUT/logs/profiles" && mv "$OUT"/prefill/profile-*.json "$OUT/logs/profiles/" 2>/dev/null
    tail -40 "$OUT/logs/prefill.log" | say ;;
  ab)
    # one environment variable's values in the program, alternated on one machine (the rule of
    # docs/lessons.md for a compute-bound change): 8k in one chunk, kernjax alone, 15 runs each
    if [ -z "${AB_VAR:-}" ] || [ -z "${AB_VALUES:-}" ]; then
      echo "ab: set AB_VAR (an environment variable) and AB_VALUES (its values, space-separated)" | say
      continue
    fi
    for r in $(seq 1 "${AB_ROUNDS:-3}"); do
      for v in $AB_VALUES; do
        env "$AB_VAR=$v" python experiments/prefill.py --out "$OUT/ab/$v$r" \
          --profile '' --second_start '' --systems kernjax --prompts 8192 --chunks whole --iters 15 \
          > "$OUT/logs/ab-$v$r.log" 2>&1 || echo "prefill.py: exit $?" >> "$OUT/logs/ab-$v$r.log"
        echo "$AB_VAR=$v round $r: $(grep -E '^\| kernjax \| 8192' "$OUT/ab/$v$r/README.md" | head -1)" | say
      done
    done ;;
  *) echo "unknown step $step" | say ;;
  esac
done
log "done"
