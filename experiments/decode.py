"""Scoring against prefill, and decode speed, program by program and served.

Part 1, in one process (`Runner`): each program of a whole cut timed alone on a full item: the
prefill chunk and the score chunk (rows/s, and what XLA's memory analysis says each holds at
once: the extra is the score head's vocabulary slice), and each decode bucket (tokens/s = B over
one step's time).

Part 2, served (`kernjax serve` processes on loopback): the whole program and a 2-stage cut, B
concurrent requests of `--new` greedy tokens each (B = `--batches`), generated tokens per second
of wall time, every 2-stage answer checked equal to the whole's and every whole answer to its
prompt's served alone, token for token and logprob for logprob; under the head's batch-invariant
policy (the default) and `--nobatch_invariant` (what invariance costs).

  python -m experiments.decode --model qwen3-tiny --out OUT
  python -m experiments.decode --model qwen3-4b --chunk 512 --at 18 --out OUT   # a GPU
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from experiments import harness


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def profile(r, name: str, item, out: Path | None, runs: int = 3) -> dict:
    """`runs` more runs of program `name` back to back under `jax.profiler.trace`: GPU time by call
    and kind, the GPU's idle time inside the span, and the host's issue by event
    (experiments/gpuprofile.py); printed, and written to `out/profile-<name>.json`."""
    import shutil

    import jax

    from experiments import gpuprofile
    tmp = tempfile.mkdtemp(prefix="decode-trace-")
    try:
        jax.block_until_ready(r.run(item, program=name)[1])
        with jax.profiler.trace(tmp):
            t = time.perf_counter()
            for _ in range(runs):
                o = r.run(item, program=name)[1]
            jax.block_until_ready(o)
            wall = (time.perf_counter() - t) * 1e3 / runs
        prof = {"program": name, "runs": runs, "wall_ms": wall,
                **gpuprofile.summarize(tmp, [r.compiled(name).as_text()])}
        for key, outer in (("host_execute", "RawLoadedExecutable::Execute"),
                           ("host_inside", "ExecuteThunks")):
            try:
                prof[key] = gpuprofile.host_inside(tmp, outer, 12)
            except Exception as e:  # noqa: BLE001  (the GPU's side stands without the host's)
                prof[key] = {"error": f"{type(e).__name__}: {e}"}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"profile of {name} ({runs} runs back to back; per-run wall {wall:.3f} ms):\n"
          + gpuprofile.table(prof), flush=True)
    if out:
        out.mkdir(parents=True, exist_ok=True)
        (out / f"profile-{name}.json").write_text(json.dumps(prof, indent=1) + "\n")
    return prof


def programs_alone(cut: Path, rep: harness.Report, iters: int, profiled=(),
                   out: Path | None = None) -> dict:
    import numpy as np

    from kernjax import artifact
    from kernjax.core.item import Piece, make_item
    from kernjax.runtime.runner import Runner, checkpoint_dir, load_weights

    art = artifact.read(cut / "whole")
    r = Runner(art, load_weights(art, checkpoint_dir(art.manifest["checkpoint"])))
    rows = {}
    rep.table("program", "rows", "sequences", "ms a run", "rows/s", "held at once (MiB)",
              right="lrrrrr")
    for name, p in art.programs.items():
        sh = p.item
        n = sh.rows // sh.seqs
        pieces = [Piece(np.arange(1, n + 1, dtype=np.int32) % 200, 0,
                        tuple(range(1 + i * (-(-n // sh.page)), 1 + (i + 1) * (-(-n // sh.page)))),
                        targets=np.arange(2, n + 2, dtype=np.int32) % 200)
                  for i in range(sh.seqs)]
        item = make_item(pieces, sh)
        ms = harness.timed(lambda: r.run(item, program=name)[1], (), iters)
        m = r.compiled(name).memory_analysis()
        held = (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
                + m.temp_size_in_bytes) / 2**20
        rows[name] = {"rows": sh.rows, "seqs": sh.seqs, "ms": ms, "rows_per_s": sh.rows / ms * 1e3,
                      "held_mib": held, "temp_mib": m.temp_size_in_bytes / 2**20}
        rep.row(name, sh.rows, sh.seqs, f"{ms:.3f}", f"{sh.rows / ms * 1e3:.0f}", f"{held:.1f}")
        if name in profiled:
            p = profile(r, name, item, out)
            rows[name].update(busy_ms=p["busy_ms"], span_ms=p["span_ms"], kernels=p["kernels"])
    if "score" in rows:
        s, p = rows["score"], rows["prefill"]
        rep.note(f"score / prefill rows/s: {s['rows_per_s'] / p['rows_per_s']:.3f}; the score "
                 f"program holds {s['held_mib'] - p['held_mib']:.2f} MiB more at once")
    return rows


async def _burst(port: int, prompts, new: int) -> tuple[list, float]:
    import aiohttp
    body = {"max_tokens": new, "temperature": 0, "ignore_eos": True, "logprobs": 0}
    async with aiohttp.ClientSession() as s:
        async def one(p):
            async with s.post(f"http://127.0.0.1:{port}/v1/completions",
                              json={**body, "prompt": p}) as r:
                return await r.json()
        t0 = time.perf_counter()
        out = await asyncio.gather(*(one(p) for p in prompts))
        return out, time.perf_counter() - t0


def _serve(cut: Path, dirs, tmp: Path, flags) -> tuple[int, list]:
    """`kernjax serve` of `dirs` (whole, or the stages) with `flags`; its HTTP port once healthy
    and warm, and the processes."""
    port, pp = _port(), _port()
    procs = []
    for k, d in enumerate(dirs):
        args = ["--stage_dir", str(cut / d), "--log_file", str(tmp / f"{d}.log")]
        args += (["--port", str(port), *flags] + (["--pp_listen", f"127.0.0.1:{pp}"]
                                                   if len(dirs) > 1 else []) if k == 0 else
                 ["--pp_head", f"127.0.0.1:{pp}"])
        procs.append(subprocess.Popen([sys.executable, "-m", "kernjax", "serve", *args],
                                      stderr=subprocess.DEVNULL))
    if not harness.healthy(f"http://127.0.0.1:{port}"):
        for p in procs:
            p.kill()
        raise SystemExit(f"`kernjax serve` of {', '.join(dirs)} did not start (logs in {tmp})")
    asyncio.run(_burst(port, [[1, 2, 3]], 2))  # compiled and warm
    return port, procs


POLICIES = {"invariant": [], "mixed": ["--nobatch_invariant"]}


def served(cut: Path, rep: harness.Report, batches, new: int, tmp: Path) -> dict:
    """Each policy (batch-invariant, the default; `--nobatch_invariant`, steps in the smallest
    bucket or beside prompt rows) whole and in 2 stages: B concurrent requests' tokens/s, and
    whether each answer equals the whole program's in the same burst and, served whole, the
    answer its prompt gets alone."""
    import numpy as np
    got: dict = {}
    rep.table("policy", "system", "batch", "tokens", "seconds", "tokens/s", "same as whole",
              "same as alone", right="llrrrrll")
    for policy, flags in POLICIES.items():
        for system, dirs in (("whole", ["whole"]), ("2 stages", ["stage0", "stage1"])):
            port, procs = _serve(cut, dirs, tmp, flags)
            try:
                for b in batches:  # the same prompts for every system and policy
                    rng = np.random.default_rng(b)
                    prompts = [rng.integers(1, 200, 16).tolist() for _ in range(b)]
                    out, secs = asyncio.run(_burst(port, prompts, new))
                    n = sum(r["usage"]["completion_tokens"] for r in out)
                    answers = [(r["choices"][0]["token_ids"], r["choices"][0]["logprobs"])
                               for r in out]
                    alone = ""
                    if system == "whole":
                        one = [asyncio.run(_burst(port, [p], new))[0][0] for p in prompts]
                        alone = str(answers == [(r["choices"][0]["token_ids"],
                                                 r["choices"][0]["logprobs"]) for r in one])
                    same = "" if system == "whole" else str(answers == got[(policy, "whole", b)])
                    got[(policy, system, b)] = answers
                    rep.row(policy, system, b, n, f"{secs:.2f}", f"{n / secs:.1f}", same, alone)
            finally:
                for p in procs:
                    p.kill()
                    p.wait()
    return {f"{p}|{s}|{b}": len(v) for (p, s, b), v in got.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3-tiny")
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--new", type=int, default=32, help="tokens each request generates")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--at", default=None, help="the 2-stage cut (default: half the layers)")
    ap.add_argument("--profile", default="",
                    help="programs to profile after timing them (comma-separated, e.g. "
                    "decode1,decode64,score,prefill; `all`): GPU time by call, idle time, and the "
                    "host's issue, into OUT/profile-<program>.json")
    ap.add_argument("--noserve", action="store_true", help="the programs alone, no serving")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    rep = harness.Report(f"Scoring and decode, {args.model}",
                         "What does scoring cost against prefill, and how many tokens a second "
                         "does decode make at each batch, whole and in 2 stages?")
    from kernjax import models
    fam, cfg = models.named(args.model)
    pages = max(batches) * -(-(16 + args.new) // fam.page(cfg)) + 1
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        subprocess.run([sys.executable, "-m", "kernjax", "cut", "--model", args.model, "--at",
                        args.at or str(cfg.layers // 2), "--chunk", str(args.chunk), "--seqs", "4", "--context", "1024",
                        "--pages", str(max(pages, 4 * -(-1024 // fam.page(cfg)) + 1)),
                        "--decode", ",".join(str(b) for b in sorted({1, *batches})),
                        "--out", str(tmp / "cut")], check=True, stdout=subprocess.DEVNULL)
        out = harness.out_dir("decode", args.out)
        profiled = {p for p in args.profile.split(",") if p}
        if "all" in profiled:
            profiled = {"prefill", "score", *(f"decode{b}" for b in {1, *batches})}
        alone = programs_alone(tmp / "cut", rep, args.iters, profiled, out)
        serve = {} if args.noserve else served(tmp / "cut", rep, batches, args.new, tmp)
    rep.write(out, programs=alone, served=serve,
              model=args.model, new=args.new)


if __name__ == "__main__":
    main()
