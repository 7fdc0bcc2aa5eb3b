"""Prefill of one prompt on one GPU: kernjax (whole, 2 stages, unconstrained) against plain JAX
and Hugging Face transformers, at several prompt lengths and chunk sizes.

For each system (`experiments/systems.py`, `experiments/peers/`), prompt length S (`--prompts`)
and chunk setting (`--chunks`; `whole` is the whole prompt in one chunk, and a chunk >= S is S):
one untimed warm-up prefill of the whole prompt (after compiling, which is timed on its own),
then `--iters` timed prefills of all S tokens (more for a short row: `--min_row_s` of them and
their idle by the warm-up's time, at most 25), chunk after chunk, states zeroed between prefills
(outside the clock) but never recompiled; the clock stops when the host has the token: for the
JAX systems, read from the ring their program published it into after all its work
(`kernjax.runtime.tokens`, as kernjax's runner reads it; `--publish 0`: after
`block_until_ready` of every output), for transformers after `torch.cuda.synchronize()`. The
median is the time to first token.

Programs are compiled once per (system, rows, context) and reused. A chunk program (rows < S) is
compiled once with the largest context and serves every prompt: attention
(kernjax/kernels/attention.py) visits only the key blocks the item's sequences reach, so the
page table's width adds no work. A one-pass program (rows = S) has context S. `--exact_context`
compiles every program with context = S instead (more compiles). `--lowering` sets kernjax's
kernel knobs (`kernjax.core.lowering.Lowering`, as `kernjax cut`'s options: `--lowering
mlp_tile=64x256,dense_cuda=false`): the A/B of a kernel choice in the program.

Writes `results.json`, `README.md` (after every row) and `mfu.png` (after every system) to
`--out` (default `<UTC date>-h200-prefill/` under `$OUT` when set, else experiments/results/;
`--replot DIR` rewrites README.md and mfu.png from DIR/results.json; experiments/prefill_report.py),
prints a progress line per row and the table at the end. A failing row prints one line and the
run goes on. `--max_seconds` stops starting rows after that many seconds: each system gets a
share of the time left in proportion to its rows and programs (`share_weight`), and a row
predicted not to fit is skipped (said in the README). The timed prefills run back to back;
`--idle S` lets the GPU idle S seconds before each (one prompt's time to first token on a quiet
server: a GPU at its power limit runs a burst faster). Each row records the SM clock it ran at.
`--interleave` runs the JAX systems by turns at each row (one prefill each per round, the order
rotated every round), so that the ratios between them are read under the same clocks and power.

    python -m experiments.prefill --max_seconds 480                        # H200, qwen3-4b
    python -m experiments.prefill --model qwen3-tiny --prompts 64,128 --chunks 32,whole --iters 1
"""

from __future__ import annotations

import os
import tempfile

# Before jax starts: JAX and torch share the GPU, so JAX allocates as it goes and leaves room.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75")
# kernjax keeps compiled programs in a cache (kernjax/runtime/xla.py); a fresh
# one per run, unless the caller names one, so that compile times are those of a cold machine.
_OWN_CACHE = not os.environ.get("KERNJAX_XLA_CACHE")
if _OWN_CACHE:
    os.environ["KERNJAX_XLA_CACHE"] = tempfile.mkdtemp(prefix="prefill-xla-")

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

import kernjax  # noqa: E402,F401  (its XLA flags and caches before jax starts)
import jax  # noqa: E402
import numpy as np  # noqa: E402

from experiments import harness  # noqa: E402
from experiments.harness import one_line, say  # noqa: E402
from experiments.prefill_report import Results, replot  # noqa: E402
from experiments.prefill_rows import grid, run_interleaved, run_system, share_weight  # noqa: E402
from experiments.systems import (RUN_ORDER, SYSTEMS, Settings, default_at, flop_terms,  # noqa: E402
                                 make, random_weights)
from kernjax import models  # noqa: E402

warnings.filterwarnings("ignore", message="Some donated buffers were not usable")


def second_start(args, res: Results) -> None:
    """Compiles the kernjax and kernjax-2stages programs of `--second_start`'s prompts again in a
    new process with this run's cache (JAX's persistent compilation cache): what a restarted
    stage pays. Recorded as `compile_second`."""
    systems = [x for x in ("kernjax", "kernjax-2stages") if x in args.systems]
    if not systems:
        return
    out = Path(tempfile.mkdtemp(prefix="prefill-second-"))
    cmd = [*harness.module("prefill"), "--compile_only", "--model", args.model,
           "--dtype", args.dtype, "--prompts", ",".join(map(str, args.second_start)),
           "--chunks", ",".join(map(str, args.chunks)), "--systems", ",".join(systems),
           "--max_seconds", "0", "--out", str(out), "--page", str(args.page),
           "--lowering", args.lowering_text,
           # the chunk programs this run compiled, not ones sized for the second start's prompts
           "--shared_context", str(args.shared_context or max(args.prompts))]
    if args.at:
        cmd += ["--at", args.at]
    if args.exact_context:
        cmd.append("--exact_context")
    say(f"second start: {' '.join(cmd[3:])}")
    t = time.time()
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=harness.child_env(
            KERNJAX_XLA_CACHE=os.environ["KERNJAX_XLA_CACHE"]))
        if r.returncode:
            raise RuntimeError(f"exit {r.returncode}: {r.stderr.strip()[-300:]}")
        res.data["compile_second"] = json.loads((out / "results.json").read_text())["compile"]
        say(f"second start: {len(res.data['compile_second'])} programs in {time.time() - t:.0f} s")
    except Exception as e:  # noqa: BLE001  (an extra measurement: the run stands without it)
        res.data["notes"].append(f"second start failed: {one_line(e)}")
        say(f"second start failed: {one_line(e)}")
    finally:
        shutil.rmtree(out, ignore_errors=True)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-4b")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--prompts", default="1024,4096,8192,32768", help="prompt lengths S")
    ap.add_argument("--chunks", default="512,2048,whole", help="chunk sizes; `whole` = S")
    ap.add_argument("--systems", default="all", help=f"comma-separated of {','.join(SYSTEMS)}")
    ap.add_argument("--iters", type=int, default=3, help="timed prefills per row (median)")
    ap.add_argument("--min_row_s", type=float, default=0.5, help="a row whose warm-up took t "
                    "seconds gets at least min_row_s / (t + idle) timed prefills (at most 25): a "
                    "15 ms row's median of 3 moved by 5 %% between tables")
    ap.add_argument("--page", type=int, default=0, help="rows a KV page holds in kernjax's "
                    "programs (default: the model's, `page(cfg)`: 128 for qwen3-4b); 16 for an "
                    "A/B against pages gathered before FlashAttention-3")
    ap.add_argument("--publish", type=int, default=1, help="1: every JAX system's program "
                    "publishes its token to the host itself, as kernjax's runner does "
                    "(`kernjax.runtime.tokens`), and a row's time ends when the host has it; 0: the "
                    "token through PjRt, its time ending when every output is ready (the A/B)")
    ap.add_argument("--lowering", default="", help="kernjax's kernel knobs for its programs, "
                    "KNOB=VALUE,... of kernjax.core.lowering.Lowering (dense_cuda, mlp_tile, "
                    "mlp_across, graph_cuts, fa3_graphs; `kernjax cut`'s options); default: "
                    "its defaults")
    ap.add_argument("--idle", type=float, default=0.0,
                    help="seconds the GPU idles before each timed prefill: one prompt's time to "
                    "first token on a quiet server (a GPU at its power limit runs a burst "
                    "faster than back to back; experiments/results/2026-12-01-h200-clocks/)")
    ap.add_argument("--interleave", action="store_true",
                    help="the JAX systems take turns at each row, one timed prefill each per "
                    "round, the order rotated every round (ratios between them read under the "
                    "same clocks; --min_row_s counts per system); transformers after them, alone")
    ap.add_argument("--out", default=None,
                    help="default <UTC date>-h200-prefill/ in $OUT when set (the device "
                    "machine's), else in experiments/results/")
    ap.add_argument("--max_seconds", type=float, default=480,
                    help="start no row after this many seconds (0: no limit)")
    ap.add_argument("--at", default=None, help="the 2-stage cut (`kernjax cut --at`: 18, c218, "
                    "...); default 18, or the middle layer of a model with fewer layers")
    ap.add_argument("--skip", default="", help="rows to skip: system:S:chunk,...")
    ap.add_argument("--exact_context", action="store_true",
                    help="context = S for every program (default: chunk programs are compiled "
                    "once with the largest prompt's context and shared by all prompts)")
    ap.add_argument("--shared_context", type=int, default=0,
                    help="the context of the shared chunk programs (default 0: the largest "
                    "prompt); --second_start passes this run's")
    ap.add_argument("--plain_attention", default="auto",
                    help="jax-plain's implementation: auto (cudnn, xla on the CPU), cudnn, xla")
    ap.add_argument("--profile", nargs="?", const="all", default="",
                    help="after each JAX row of these prompt lengths (comma-separated; alone: "
                    "every row), one more prefill under jax.profiler.trace: GPU time by call "
                    "(experiments/gpuprofile.py), printed and in profile-*.json")
    ap.add_argument("--second_start", default="",
                    help="prompt lengths (comma-separated) whose kernjax and kernjax-2stages "
                    "programs a second process compiles again at the end, with this run's "
                    "caches: the compile time of a restarted stage")
    ap.add_argument("--compile_only", action="store_true",
                    help="build (trace, export, compile) every row's program, run nothing: "
                    "what --second_start's process does")
    ap.add_argument("--peak", type=float, default=harness.PEAK, help="peak FLOP/s for MFU")
    ap.add_argument("--xla_flags", default="", help="appended to XLA_FLAGS after kernjax's own")
    ap.add_argument("--replot", metavar="DIR", help="only rewrite DIR's README.md and mfu.png from "
                    "its results.json (alone, no other flag)")
    a = ap.parse_args(argv)
    a.prompts = sorted({int(x) for x in a.prompts.split(",") if x.strip()})
    a.chunks = [x.strip() if x.strip() == "whole" else int(x) for x in a.chunks.split(",")
                if x.strip()]
    a.systems = list(SYSTEMS) if a.systems == "all" else [x.strip() for x in a.systems.split(",")]
    bad = [x for x in a.systems if x not in SYSTEMS]
    if bad:
        ap.error(f"unknown systems {bad}; known: {', '.join(SYSTEMS)}")
    a.systems = [x for x in RUN_ORDER if x in a.systems]
    a.skip = {x.strip() for x in a.skip.split(",") if x.strip()}
    a.profile = set(a.prompts) if a.profile == "all" else \
        {int(x) for x in a.profile.split(",") if x.strip()}
    a.second_start = sorted({int(x) for x in a.second_start.split(",") if x.strip()})
    if a.shared_context and a.shared_context < max(a.prompts):
        ap.error(f"--shared_context {a.shared_context} is shorter than the longest prompt "
                 f"{max(a.prompts)}: give at least that, or 0 for the longest prompt")
    if a.page not in (0, 16, 128):
        ap.error(f"--page {a.page}: FlashAttention-3 (kj_fa3) takes pages of 16 (gathered) or "
                 "128 (read in place); give one of those, or 0 for the model's")
    if a.plain_attention == "xla":
        a.plain_attention = None
    a.lowering_text = a.lowering
    try:
        a.lowering = harness.lowering(a.lowering)
    except ValueError as e:
        ap.error(str(e))
    return a


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "--replot":
        return replot(Path(sys.argv[2]))
    args = parse_args()
    if args.xla_flags:
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {args.xla_flags}".strip()
    fam, cfg = models.named(args.model)
    args.cut_at = args.at or default_at(cfg)
    settings = Settings(dtype=args.dtype, context=args.shared_context or max(args.prompts),
                        exact_context=args.exact_context, page=args.page, at=args.cut_at,
                        plain_attention=args.plain_attention, publish=bool(args.publish),
                        lowering=args.lowering)
    out = harness.out_dir("h200-prefill", args.out)
    clock = harness.Deadline(args.max_seconds)
    t_start = time.time()

    def on_term(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)

    res = Results(args, cfg, out, args.page or fam.page(cfg))
    smi_file = Path(tempfile.mkdtemp()) / "smi.csv"  # each row's SM clock and power, read only
    smi = harness.sample(smi_file, every_ms=100)
    a_, b_, c_ = flop_terms(cfg)
    say(f"{cfg.name} {args.dtype} on {res.data['gpu']} ({jax.default_backend()}), jax "
        f"{jax.__version__}; prompts {args.prompts}, chunks {args.chunks}, systems "
        f"{args.systems}, iters {args.iters}, max_seconds {args.max_seconds or 'off'}; out {out}")
    say(f"FLOPs(S) = {a_:.4g} S + {b_:.6g} S^2 + {c_:.4g}"
        + (f" (qwen3-4b constants: 7.267e9, 294912, 0.778e9; ratios {a_ / 7.267e9:.4f}, "
           f"{b_ / 294912:.4f}, {c_ / 0.778e9:.4f})" if cfg.name == "qwen3-4b" else ""))
    say(f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')}; lowering {args.lowering}")
    for s in args.prompts:
        if s > cfg.max_positions:
            res.data["notes"].append(f"S={s} is past max_position_embeddings "
                                     f"{cfg.max_positions}; its rows will fail")
    res.write()

    rng = np.random.default_rng(0)
    tokens = {s: rng.integers(0, cfg.vocab, s).astype(np.int32) for s in args.prompts}
    jax_systems = [x for x in args.systems if x != "transformers"]
    weights = None
    ref_logits: dict = {}
    left_rows = {x: share_weight(x, args, args.prompts) for x in args.systems}
    try:
        if jax_systems and not args.compile_only:
            t = time.perf_counter()
            weights = random_weights(fam, cfg, args.dtype)
            nbytes = sum(x.nbytes for x in weights.values())
            say(f"random weights on {jax.devices()[0]}: {len(weights)} tensors, "
                f"{nbytes / 2**30:.2f} GiB in {time.perf_counter() - t:.1f} s")
        if args.interleave and jax_systems and not args.compile_only:
            objs = []
            try:
                objs = [make(x, fam, cfg, settings, weights, tokens) for x in jax_systems]
                # the JAX systems' share of --max_seconds, as they would have one after another
                sub = harness.Deadline(0)
                if math.isfinite(clock.left()):
                    share = clock.left() * sum(left_rows[x] for x in jax_systems) / sum(
                        left_rows.values())
                    sub.end = time.time() + share
                say(f"interleaved: {', '.join(jax_systems)}" + (
                    f", {sub.left():.0f} s of {clock.left():.0f} s left"
                    if math.isfinite(sub.left()) else ""))
                run_interleaved(objs, args, res, args.prompts, sub, ref_logits)
                for o in objs:
                    res.data["notes"] += o.notes
            finally:
                for o in objs:
                    o.close()
                objs = None
                gc.collect()
                res.write(plot=True)
            for x in jax_systems:
                left_rows.pop(x, None)
        for name in [x for x in args.systems if x in left_rows]:
            total = sum(left_rows[x] for x in args.systems if x in left_rows)
            share = clock.left() * left_rows[name] / total if math.isfinite(clock.left()) \
                else math.inf
            share_end = time.time() + share
            left_rows.pop(name)
            if clock.left() <= 0:
                for s, label, _ in grid(args, args.prompts):
                    res.skip(name, s, label, "not started: --max_seconds reached")
                say(f"[{name}] not started: --max_seconds reached")
                res.write()
                continue
            say(f"[{name}] start" + (f", {share:.0f} s of {clock.left():.0f} s left"
                                     if math.isfinite(share) else ""))
            o = None
            try:
                if name == "transformers":
                    if weights is not None:  # JAX keeps its pool; at least drop our arrays
                        weights.clear()
                        weights = None
                        gc.collect()
                    try:
                        o = make(name, fam, cfg, settings, weights, tokens)
                    except ImportError as e:
                        note = f"transformers skipped: {one_line(e)}"
                        res.data["notes"].append(note)
                        say(f"[{name}] {note}")
                        continue
                    res.data.update(torch=o.versions["torch"],
                                    transformers=o.versions["transformers"],
                                    transformers_attn=o.versions["attn_implementation"],
                                    transformers_logits=o.versions["logits_arg"])
                else:
                    o = make(name, fam, cfg, settings, weights, tokens)
                run_system(o, args, res, args.prompts, clock, share_end, ref_logits)
                res.data["notes"] += getattr(o, "notes", [])
            except Exception as e:  # noqa: BLE001  (a system failing never loses the others)
                res.fail(name, None, None, one_line(e))
                say(f"[{name}] FAILED {one_line(e)}")
            finally:
                if o is not None:
                    try:
                        o.close()
                    except Exception as e:  # noqa: BLE001
                        say(f"[{name}] close failed: {one_line(e)}")
                o = None
                gc.collect()
                res.write(plot=True)
    except KeyboardInterrupt as e:
        res.data["notes"].append(f"interrupted ({e}); rows after it were not run")
        say(f"interrupted ({e}); writing what there is")
    finally:
        if args.second_start and not args.compile_only:
            second_start(args, res)
        res.data["wall_s"] = round(time.time() - t_start, 1)
        if smi:  # nvidia-smi writes its file in blocks: read once it has ended
            smi.terminate()
            smi.wait()
            samples = harness.read_samples(smi_file)
            for x in res.data["details"]:
                x["clock"] = harness.during(samples, [x["window"]]) if "window" in x else None
        res.write(plot=True)
        say(f"\nwrote {out}/results.json, README.md, mfu.png in {res.data['wall_s']:.0f} s")
        say(f"{cfg.name} {args.dtype} on {res.data['gpu']}; median ms of `runs`, "
            f"MFU of {args.peak / 1e12:.0f} TFLOP/s")
        say(res.table())
        if res.data["errors"]:
            say(f"{len(res.data['errors'])} failed: " + "; ".join(
                f"{x['system']} S={x['prompt']} chunk={x['chunk']}" for x in res.data["errors"]))
        if res.data["skipped"]:
            say(f"{len(res.data['skipped'])} skipped (README lists why)")
        if _OWN_CACHE:
            shutil.rmtree(os.environ["KERNJAX_XLA_CACHE"], ignore_errors=True)


if __name__ == "__main__":
    main()
