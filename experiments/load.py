"""Load benchmark: the whole program against a 2-stage pipeline, both served on loopback.

Cuts `--model` once at `--at`, then for each configuration (`whole`, `2 stages`, the latter with
`--transport` and `--edge_slots`; `--configs` picks them) starts the server processes on free 127.0.0.1 ports, waits for /health, warms up, and for each concurrency
level sends `--requests` completions (`max_tokens` 1, prompts of uniform random length in
`--prompt_len`, seeded, the same prompts for both configurations) with at most that many in
flight. With one output token, a request's latency is its client-side time to first token. The
cut has the decode buckets of `--decode` (none by default: a prompt's last chunk samples its
first token, as kern's prefill does; with buckets, the first token is a step of its own).

Prints and saves (`README.md`, `results.json`, with the run's record) a table of requests/s, prompt tokens/s and TTFT
p50/p99 per configuration and level, checks every answer is 200 and that both configurations give
the same token for each prompt, and runs `kernjax timeline` on the 2-stage logs
(`timeline.txt`/`.png` over the whole run, `timeline-cN.txt`/`.png` over the highest level's
items only). Logs (`whole.log`, `stage0.log`, `stage1.log`, `metrics-*.txt`) are trimmed to the
first lines, the `pp item` lines and any error lines, at most ~200 KB each, and have local paths
replaced by placeholders. The servers are stopped at the end, also on error or Ctrl-C.

    python -m experiments.load --requests 200 --concurrency 1,4,16,64 --out results/load
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import numpy as np

from experiments import harness
from kernjax.runtime.edge import TRANSPORTS

CONFIGS = ("whole", "2 stages")
LOG_BYTES = 200_000
HEAD_LINES = 50
_ITEM = re.compile(r"\bpp item stage=(\d+) item=(\d+) ")
_ERROR = re.compile(r"error|exception|traceback|fatal|timed? ?out|refus|fail", re.I)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """The processes of one configuration; `stop` ends them (SIGTERM, then SIGKILL)."""

    def __init__(self, cut: Path, logs: Path, stages: int, stage_timeout: float,
                 gpus: list[str] | None = None, edges: tuple = (), trace: str = ""):
        self.port = _port()
        self.gpus, self.trace = gpus or [], trace
        self.url = f"http://127.0.0.1:{self.port}"
        self.procs: list[tuple[subprocess.Popen, Path]] = []
        if stages == 1:
            self._start(["--stage_dir", str(cut / "whole"), "--port", str(self.port)],
                        logs / "whole.log", 0)
        else:
            pp = f"127.0.0.1:{_port()}"
            self._start(["--stage_dir", str(cut / "stage0"), "--pp_listen", pp,
                         "--port", str(self.port), "--stage_timeout", str(stage_timeout), *edges],
                        logs / "stage0.log", 0)
            for s in range(1, stages):
                self._start(["--stage_dir", str(cut / f"stage{s}"), "--pp_head", pp, *edges],
                            logs / f"stage{s}.log", s)

    def _start(self, args, log: Path, index: int):
        env = harness.child_env()
        if self.gpus:  # stage s on GPU gpus[s]: one process per GPU
            env["CUDA_VISIBLE_DEVICES"] = self.gpus[index % len(self.gpus)]
        serve = ["-m", "kernjax", "serve"]
        if self.trace:  # experiments/traced.py: kernjax.serve recording items FIRST.. in a profile
            env["KERNJAX_TRACE"] = f"{log.with_suffix('.trace')}:{self.trace}"
            serve = ["-m", "experiments.traced"]
        with log.open("w") as f:
            p = subprocess.Popen([sys.executable, *serve, "--host", "127.0.0.1", *args],
                                 stdout=f, stderr=subprocess.STDOUT, env=env)
        self.procs.append((p, log))

    def dead(self) -> list[str]:
        return [f"{log.name} exited with {p.returncode}" for p, log in self.procs
                if p.poll() is not None]

    async def ready(self, timeout: float):
        deadline = time.monotonic() + timeout
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as s:
            while time.monotonic() < deadline:
                if self.dead():
                    raise RuntimeError("server died while starting: " + "; ".join(self.dead()))
                try:
                    async with s.get(self.url + "/health") as r:
                        if r.status == 200:
                            return (await r.json())
                except (aiohttp.ClientError, asyncio.TimeoutError):
                    pass
                await asyncio.sleep(0.5)
        raise RuntimeError(f"server not ready after {timeout:.0f} s")

    def stop(self):
        for p, _ in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        for p, _ in self.procs:
            try:
                p.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


async def _one(session, url, model, prompt):
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    t = time.perf_counter()
    try:
        async with session.post(url + "/v1/completions", json=body) as r:
            data = await r.json(content_type=None)
            dt = time.perf_counter() - t
            if r.status != 200:
                return r.status, None, dt, json.dumps(data)[:300]
            return 200, data["choices"][0]["token_ids"][0], dt, None
    except Exception as e:  # noqa: BLE001 (a benchmark records every failure and goes on)
        return -1, None, time.perf_counter() - t, f"{type(e).__name__}: {e}"[:300]


async def run_level(url, model, prompts, concurrency, request_timeout, level_timeout):
    """Sends `prompts` with at most `concurrency` in flight; returns (results, wall seconds)."""
    sem = asyncio.Semaphore(concurrency)
    conn = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=conn,
                                     timeout=aiohttp.ClientTimeout(total=request_timeout)) as s:
        async def bounded(p):
            async with sem:
                return await _one(s, url, model, p)
        tasks = [asyncio.ensure_future(bounded(p)) for p in prompts]
        t = time.perf_counter()
        done, pending = await asyncio.wait(tasks, timeout=level_timeout)
        wall = time.perf_counter() - t
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    results = [task.result() if task in done else (-2, None, wall, "level timeout")
               for task in tasks]
    return results, wall


def summarize(prompts, results, wall):
    ok = [(len(p), r) for p, r in zip(prompts, results) if r[0] == 200]
    lat = np.asarray([r[2] for _, r in ok]) * 1e3
    return {"requests": len(prompts), "ok": len(ok), "wall_s": wall,
            "req_s": len(ok) / wall, "prompt_tok_s": sum(n for n, _ in ok) / wall,
            "ttft_p50_ms": float(np.percentile(lat, 50)) if len(lat) else float("nan"),
            "ttft_p99_ms": float(np.percentile(lat, 99)) if len(lat) else float("nan"),
            "ttft_mean_ms": float(lat.mean()) if len(lat) else float("nan")}


def table(rows) -> str:
    out = ["| config | concurrency | req/s | prompt tok/s | TTFT p50 ms | TTFT p99 ms |",
           "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        out.append(f"| {r['config']} | {r['concurrency']} | {r['req_s']:.1f} | "
                   f"{r['prompt_tok_s']:.0f} | {r['ttft_p50_ms']:.1f} | {r['ttft_p99_ms']:.1f} |")
    return "\n".join(out)


def _scrub(text: str, paths) -> str:
    for p, name in paths:
        if p:
            text = text.replace(p, name)
    return text


def trim(src: Path, dst: Path, paths):
    """Copies a log keeping its first lines, its `pp item` lines and error lines, ~LOG_BYTES."""
    lines = src.read_text(errors="replace").splitlines(keepends=True)
    kept, size, dropped = [], 0, 0
    for i, line in enumerate(lines):
        if i < HEAD_LINES or _ITEM.search(line) or _ERROR.search(line):
            if size + len(line) > LOG_BYTES:
                dropped += 1
                continue
            kept.append(line)
            size += len(line)
        else:
            dropped += 1
    if dropped:
        kept.append(f"[load.py: {dropped} of {len(lines)} lines left out]\n")
    dst.write_text(_scrub("".join(kept), paths))


def item_max(log: Path) -> int:
    """The highest item number stage 0 has logged so far (-1 if none)."""
    ks = [int(m.group(2)) for m in map(_ITEM.search, log.read_text(errors="replace").splitlines())
          if m]
    return max(ks, default=-1)


def timeline(logs, png: Path, txt: Path, cwd: Path, extra=()):
    p = subprocess.run([sys.executable, "-m", "kernjax", "timeline", *[str(x.name) for x in logs],
                        "--png", str(png.resolve()), *extra], cwd=cwd, capture_output=True,
                       text=True, timeout=300)
    text = p.stdout + (f"\n[exit {p.returncode}]\n{p.stderr[-3000:]}" if p.returncode else "")
    text = text.replace(str(png.resolve()), png.name)
    txt.write_text(text)
    return text


def traces(dirs, count: int, txt: Path) -> None:
    """Each process's recorded items, kernel by kernel (experiments/gpuprofile.py): the GPU's busy
    time against the span from the first kernel to the last, per item, and the top kernels."""
    from experiments import gpuprofile

    lines = []
    for d in dirs:
        name = f"{d.parent.name}/{d.stem}"
        try:
            p = gpuprofile.summarize(str(d), [])
        except Exception as e:  # noqa: BLE001 (a benchmark reports a missing trace and goes on)
            lines.append(f"{name}: no profile ({type(e).__name__}: {e})")
            continue
        lines.append(f"{name}: {count} items, kernels busy {p['busy_ms']:.2f} ms of a "
                     f"{p['span_ms']:.2f} ms span ({p['busy_ms'] / count:.2f} busy, "
                     f"{p['span_ms'] / count:.2f} span per item); {p['kernels']} kernels")
        lines.append(f"    per item: work {p['work_ms'] / count:.2f} ms, hold {p['hold_ms'] / count:.2f}"
                     f" ms, idle {p['idle_ms'] / count:.2f} ms ({p['gaps']} gaps of 50 us or more,"
                     f" {p['gaps_ms']:.2f} ms)")
        issue = Path(f"{d}.issue.json")
        if issue.exists():
            ms = sorted(json.loads(issue.read_text())["issue_ms"])
            if ms:
                lines.append(f"    host issue per item: p50 {ms[len(ms) // 2]:.2f} ms, p90 "
                             f"{ms[int(0.9 * (len(ms) - 1))]:.2f} ms, max {ms[-1]:.2f} ms "
                             f"({len(ms)} issues)")
        lines += [f"    {k['ms']:9.3f} ms {k['n']:6d}x  {k['kernel']}" for k in p["top_kernels"][:8]]
        lines += [f"    host {h['ms']:9.3f} ms {h['n']:6d}x  [{h['thread']}] {h['event']}"
                  for h in gpuprofile.host_events(str(d), top=16)]
    txt.write_text("\n".join(lines) + "\n")
    print(txt.read_text(), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3-tiny")
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--seqs", type=int, default=4)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--pages", type=int, default=0, help="pages per KV state (kernjax cut "
                    "--pages; 0: its default, seqs full contexts): --seqs 1 with the pages of "
                    "--seqs 16 keeps 16 sequences live, one per item")
    ap.add_argument("--at", default="1")
    ap.add_argument("--decode", default="", help="the cut's decode buckets (kernjax cut --decode); "
                    "empty: none, the last chunk samples the first token")
    ap.add_argument("--requests", type=int, default=200, help="requests per concurrency level")
    ap.add_argument("--concurrency", default="1,4,16,64")
    ap.add_argument("--prompt_len", default="16,256", help="MIN,MAX tokens (inclusive)")
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--request_timeout", type=float, default=120.0)
    ap.add_argument("--level_timeout", type=float, default=600.0)
    ap.add_argument("--startup_timeout", type=float, default=300.0)
    ap.add_argument("--gpus", default="", help="GPU ids, e.g. 0,1: stage s (and whole) runs on "
                    "the s-th (CUDA_VISIBLE_DEVICES); empty: every process sees every device")
    ap.add_argument("--transport", default="host", choices=TRANSPORTS,
                    help="how the 2-stage pipeline moves activations (serve --transport; ipc "
                    "and nccl on GPUs only)")
    ap.add_argument("--edge_slots", type=int, default=2,
                    help="slots per edge (every transport but host)")
    ap.add_argument("--trace", default="", help="FIRST:COUNT: each process records a JAX profile "
                    "of items FIRST..FIRST+COUNT-1 (experiments/traced.py); its kernels are "
                    "summed into trace.txt (busy against span, the top kernels)")
    ap.add_argument("--configs", default=",".join(CONFIGS),
                    help=f"which of {', '.join(CONFIGS)} to serve, comma-separated")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    configs = a.configs.split(",")
    if not a.configs or set(configs) - set(CONFIGS):
        ap.error(f"--configs takes some of {', '.join(CONFIGS)}, not {a.configs!r}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so `finally` stops the servers
    levels = [int(c) for c in a.concurrency.split(",")]
    lo, hi = map(int, a.prompt_len.split(","))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)

    from kernjax import models
    _, cfg = models.named(a.model)
    rng = np.random.default_rng(a.seed)
    def prompts(n):  # noqa: E306
        return [rng.integers(0, cfg.vocab, int(k)).tolist() for k in rng.integers(lo, hi + 1, n)]
    warm = prompts(a.warmup)
    load = {c: prompts(a.requests) for c in levels}

    tmp = Path(tempfile.mkdtemp(prefix="kernjax-load-"))
    paths = [(str(tmp), "<tmp>"), (os.environ.get("KERNJAX_CACHE", ""), "<KERNJAX_CACHE>"),
             (str(Path.cwd()), "<repo>"), (sys.prefix, "<venv>"), (str(Path.home()), "<home>")]
    servers: list[Server] = []
    rows, tokens, failures, ranges = [], {}, [], {}
    try:
        t = time.time()
        p = subprocess.run([sys.executable, "-m", "kernjax", "cut", "--model", a.model, "--at", a.at,
                            "--chunk", str(a.chunk), "--seqs", str(a.seqs), "--context",
                            str(a.context), "--decode", a.decode, "--out", str(tmp / "cut")]
                           + (["--pages", str(a.pages)] if a.pages else []),
                           capture_output=True, text=True, timeout=600)
        if p.returncode:
            raise RuntimeError("cut failed:\n" + p.stderr)
        (out / "cut.txt").write_text(_scrub(p.stdout + p.stderr, paths))
        print(f"cut in {time.time() - t:.1f} s", flush=True)
        for config in configs:
            stages = 1 if config == "whole" else 2
            logs = tmp / config.replace(" ", "")
            logs.mkdir()
            t = time.time()
            srv = Server(tmp / "cut", logs, stages, stage_timeout=a.request_timeout,
                         gpus=[g for g in a.gpus.split(",") if g],
                         edges=("--transport", a.transport, "--edge_slots", str(a.edge_slots)),
                         trace=a.trace)
            servers.append(srv)
            health = asyncio.run(srv.ready(a.startup_timeout))
            print(f"{config}: ready in {time.time() - t:.1f} s ({health})", flush=True)
            res, _ = asyncio.run(run_level(srv.url, a.model, warm, a.warmup, a.request_timeout,
                                           a.level_timeout))
            tokens[(config, "warm")] = [r[1] for r in res]
            failures += [(config, "warm", i, r[0], r[3]) for i, r in enumerate(res) if r[0] != 200]
            head_log = srv.procs[0][1]
            for c in levels:
                first = item_max(head_log) + 1
                res, wall = asyncio.run(run_level(srv.url, a.model, load[c], c,
                                                  a.request_timeout, a.level_timeout))
                ranges[(config, c)] = (first, item_max(head_log))
                tokens[(config, c)] = [r[1] for r in res]
                failures += [(config, c, i, r[0], r[3]) for i, r in enumerate(res)
                             if r[0] != 200]
                row = {"config": config, "concurrency": c, **summarize(load[c], res, wall),
                       "items": ranges[(config, c)]}
                rows.append(row)
                print(f"{config} c={c}: {row['ok']}/{row['requests']} ok in {wall:.1f} s, "
                      f"{row['req_s']:.1f} req/s, p50 {row['ttft_p50_ms']:.0f} ms, "
                      f"p99 {row['ttft_p99_ms']:.0f} ms, items {ranges[(config, c)]}", flush=True)
                if srv.dead():
                    raise RuntimeError(f"{config}: " + "; ".join(srv.dead()))
            try:
                async def scrape(url=srv.url):
                    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
                        async with s.get(url + "/metrics") as r:
                            return await r.text()
                (out / f"metrics-{config.replace(' ', '')}.txt").write_text(asyncio.run(scrape()))
            except Exception as e:  # noqa: BLE001
                print(f"{config}: /metrics failed: {e}", flush=True)
            srv.stop()
    finally:
        for srv in servers:
            srv.stop()
        for log in sorted(tmp.glob("*/*.log")):
            trim(log, out / log.name, paths)

    mismatches = []
    for key in ["warm", *levels]:
        a_, b_ = tokens.get(("whole", key)), tokens.get(("2 stages", key))
        if a_ is None or b_ is None:
            continue
        ps = warm if key == "warm" else load[key]
        mismatches += [{"level": key, "index": i, "prompt_len": len(ps[i]), "whole": x,
                        "2 stages": y} for i, (x, y) in enumerate(zip(a_, b_))
                       if x is not None and y is not None and x != y]

    if a.trace:
        traces(sorted(tmp.glob("*/*.trace")), int(a.trace.split(":")[1]), out / "trace.txt")
    two, tl, tl_top = tmp / "2stages", "", ""
    if two.is_dir():  # the 2-stage pipeline ran: its timeline
        stage_logs = [two / "stage0.log", two / "stage1.log"]
        tl = timeline(stage_logs, out / "timeline.png", out / "timeline.txt", two)
        top = max(levels)
        f, l = ranges.get(("2 stages", top), (0, -1))
        if l >= f:
            # the top level's items only, so the gantt shows the loaded pipeline, not the warm-up
            sl = two / f"c{top}"
            sl.mkdir(exist_ok=True)
            for log in stage_logs:
                keep = [ln for ln in log.read_text(errors="replace").splitlines(keepends=True)
                        if (m := _ITEM.search(ln)) and f <= int(m.group(2)) <= l]
                (sl / log.name).write_text("".join(keep))
            tl_top = timeline([sl / x.name for x in stage_logs], out / f"timeline-c{top}.png",
                              out / f"timeline-c{top}.txt", sl, extra=["--first", str(f + 1)])

    md = table(rows)
    import jax
    meta = {"argv": [_scrub(x, paths) for x in sys.argv[1:]], "python": platform.python_version(), "jax": jax.__version__,
            "cpus": os.cpu_count(), "date_unix": int(time.time()), "transport": a.transport,
            "edge_slots": a.edge_slots if a.transport in ("shm", "ipc") else None}
    rec = harness.record(gpu="", argv=meta["argv"])
    readme = [f"# Load: {a.model} served whole and in 2 stages, transport {a.transport}", "",
              *harness.record_lines(rec), "", md, "",
              f"- failed requests: {len(failures)}; token mismatches whole vs 2 stages: "
              f"{len(mismatches)}"]
    harness.write(out, {"meta": meta, "record": rec, "rows": rows, "failures": failures,
                        "mismatches": mismatches}, "\n".join(readme) + "\n")
    print()
    print(md)
    print(f"\nfailed requests: {len(failures)}")
    for x in failures[:20]:
        print("  ", x)
    both = set(configs) == set(CONFIGS)
    print(f"token mismatches whole vs 2 stages: {len(mismatches) if both else 'not compared'}")
    for x in mismatches[:20]:
        print("  ", x)
    if tl:
        print("\n== timeline, whole 2-stage run ==\n" + tl)
    if tl_top:
        print(f"== timeline, concurrency {top} only ==\n" + tl_top)
    shutil.rmtree(tmp, ignore_errors=True)
    return 1 if failures or mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
