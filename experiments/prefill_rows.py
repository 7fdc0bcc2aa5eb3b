"""How the prefill benchmark times its rows (`experiments/prefill.py`): one system after another
(`run_system`), or the JAX systems by turns at each row (`run_interleaved`).

A row is (S, chunk label, rows a chunk): its programs built (`prepare`) and warmed up once,
untimed, then timed prefills from zeroed states, at least `--iters` and, for a short row, enough
to fill `--min_row_s`, at most 25; its time is their median. Each row's last logits are checked
against jax-plain's at S and against the same system's first chunk setting at S; with
`--profile`, one more prefill of the row is profiled by call (experiments/gpuprofile.py). A row
that fails is recorded and the run goes on. A chunk setting that gives the rows of one already
measured at S is that measurement again (`same_as`).
"""

from __future__ import annotations

import gc
import json
import math
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from experiments.harness import one_line, say
from experiments.prefill_report import Results
from experiments.systems import Handle
from kernjax.core.item import chunks


def grid(args, prompts):
    """`(S, label, rows)` of every row, S ascending, chunks in the given order."""
    return [(s, label, s if label == "whole" or label >= s else label)
            for s in prompts for label in args.chunks]


def share_weight(system_name, args, prompts):
    """A system's claim on `--max_seconds`: its distinct rows, and two more for each program it
    compiles (a compile, ~10 s for qwen3-4b on an H200, costs as much as running a few rows):
    jax-plain runs few rows but compiles one program for each of them."""
    g = grid(args, prompts)
    if system_name == "jax-plain":
        g = [x for x in g if x[2] == x[0]]
    programs = 0 if system_name == "transformers" else \
        len({rows if rows < s else ("one pass", s) for s, _, rows in g})
    return max(1, len({(s, rows) for s, _, rows in g}) + 2 * programs)


def skip_why(o, args, s, label, rows) -> str | None:
    """Why system `o` does not run this row (its own reason, or --skip), or None."""
    why = o.rows_ok(s, rows)
    if why is None and f"{o.name}:{s}:{label}" in args.skip:
        why = "skipped by --skip"
    return why


def logit_checks(o, s, label, lg, ref_logits, own) -> tuple:
    """`(diff, self_diff)` of a row's last logits: against jax-plain's at S (which its own first
    row sets), and against the system's first row at S (`own[(system, S)]`, set here)."""
    diff = self_diff = None
    if o.name == "jax-plain" and s not in ref_logits:
        ref_logits[s] = lg
    elif not o.torch and s in ref_logits and ref_logits[s].shape == lg.shape:
        diff = float(np.max(np.abs(lg - ref_logits[s])))
    if (o.name, s) in own:
        self_diff = {"chunk": own[(o.name, s)][0],
                     "max_abs": float(np.max(np.abs(lg - own[(o.name, s)][1])))}
    else:
        own[(o.name, s)] = (label, lg)
    return diff, self_diff


def row_detail(s, label, rows, times, first, token, checks, window, issue) -> dict:
    """A timed row's record: its runs, warm-up, token, logit checks, window and host issue."""
    detail = {"rows": rows, "chunks": len(chunks(s, rows)), "iters": len(times),
              "times_ms": [round(x * 1e3, 3) for x in times],
              "first_prefill_s": round(first, 3), "token": token, "logits_diff": checks[0],
              "self_diff": checks[1], "chunk_first": label, "window": window}
    if issue:  # the host's time to issue every program, median (the GPU runs meanwhile)
        detail["issue_ms"] = round(statistics.median(issue) * 1e3, 3)
    return detail


def warm_up(o, res: Results, s, rows, h, info) -> float:
    """The row's untimed first prefill, after which its compile (if it built one) is recorded,
    with the cut's points and plain JAX's attention: its seconds."""
    o.reset(h)
    t = time.perf_counter()
    o.prefill(h)
    first = time.perf_counter() - t
    if info is not None:
        res.add_compile(o.name, s, rows, o.context(s, rows), info, first)
        if isinstance(h, Handle) and "points" in h.extra:
            res.data["cut_points"] = h.extra["points"]
        if "attention" in info:
            res.data["plain_attention"] = info["attention"]
    return first


def timed_prefill(o, h, idle: float) -> tuple:
    """One timed prefill from zeroed states after `idle` s: (seconds, the host's seconds to
    issue every program or None, token, logits)."""
    o.reset(h)
    time.sleep(idle)
    o.done = o.issued = None
    t = time.perf_counter()
    token, logits = o.prefill(h)
    done = (o.done or time.perf_counter()) - t
    return done, (o.issued - t if o.issued else None), token, logits


def predicted_miss(o, s, label, rows, history, worst_compile, left) -> str | None:
    """Why a row is not started within the time `left` (None: it is): the longest compile so far
    if it needs a program, + 2 x the last prefill of its chunk setting scaled by (S/S_prev)^2."""
    if left <= 0:
        return "not started: this system's share of --max_seconds is used"
    kind = "one pass" if rows == s else label
    prev = [(ps, t) for ps, pk, t in history if pk == kind]
    need = 0.0 if o.has(s, rows) else worst_compile
    if prev:
        ps, t = prev[-1]
        need += 2 * t * (s / ps) ** 2
    if need > left:
        return (f"not started: predicted {need:.0f} s (compile + warm-up + 1 iter) > "
                f"{max(left, 0):.0f} s left for this system")
    return None


def run_system(o, args, res: Results, prompts, clock, share_end: float, ref_logits):
    """One system's rows, one after another, each timed `--iters` times (or more) back to back."""
    name = o.name
    measured: dict = {}  # (S, rows) -> (ms, detail)
    history: list = []  # (S, chunk label or "one pass", prefill seconds)
    own: dict = {}  # (system, S) -> (chunk label, last row's logits) of its first row at S
    failed: dict = {}  # (S, rows) -> the chunk label whose row failed
    worst_compile = 0.0
    for s, label, rows in grid(args, prompts):
        tag = f"[{name}] S={s} chunk={label}"
        why = skip_why(o, args, s, label, rows)
        if why is None and (s, rows) in failed:
            why = f"same program and rows as chunk {failed[(s, rows)]}, which failed"
        if why:
            res.skip(name, s, label, why)
            say(f"{tag}: skipped ({why})")
            continue
        if (s, rows) in measured:
            ms, detail = measured[(s, rows)]
            res.add_row(name, s, label, ms, {**detail, "same_as": detail["chunk_first"]})
            say(f"{tag}: rows {rows}, same program as chunk {detail['chunk_first']}: "
                f"{ms:.2f} ms")
            res.write()
            continue
        if clock.left() <= 0:
            why = "not started: --max_seconds reached"
        else:
            why = predicted_miss(o, s, label, rows, history, worst_compile,
                                 min(clock.left(), share_end - time.time()))
        if why:
            res.skip(name, s, label, why)
            say(f"{tag}: {why}")
            continue
        h = None
        try:
            h, info = o.prepare(s, rows)
            if args.compile_only:
                if info is not None:
                    res.add_compile(name, s, rows, o.context(s, rows), info, 0.0)
                    say(f"{tag}: compiled in {res.data['compile'][-1]['total_s']:.1f} s")
                continue
            first = warm_up(o, res, s, rows, h, info)
            if info is not None:
                worst_compile = max(worst_compile, res.data["compile"][-1]["total_s"])
            left = min(clock.left(), share_end - time.time())
            # a short row gets more runs: --min_row_s of them and their idle, at most 25
            per_run = max(first + args.idle, 1e-9)
            iters = max(args.iters, min(25, math.ceil(args.min_row_s / per_run)))
            if math.isfinite(left):
                iters = max(1, min(iters, int(left // per_run)))
            times, spans, issue = [], [], []
            for _ in range(iters):
                wall = time.time()
                sec, issued, token, logits = timed_prefill(o, h, args.idle)
                times.append(sec)
                issue += [issued] * (issued is not None)
                spans.append((wall, time.time()))
            ms = statistics.median(times) * 1e3
            diff, self_diff = logit_checks(o, s, label, o.to_numpy(logits), ref_logits, own)
            del logits
            detail = row_detail(s, label, rows, times, first, token, (diff, self_diff),
                                [spans[0][0], spans[-1][1]], issue)
            if s in args.profile and not o.torch:
                detail["profile"] = profile_row(o, h, res.out, f"{name}-{s}-{label}", tag)
            measured[(s, rows)] = (ms, detail)
            history.append((s, "one pass" if rows == s else label, statistics.median(times)))
            res.add_row(name, s, label, ms, detail)
            r = res.data["rows"][-1]
            comp = (f"compile {res.data['compile'][-1]['total_s']:.1f} s, "
                    if info is not None else "")
            say(f"{tag}: rows {rows} x {detail['chunks']}, {comp}first prefill {first:.2f} s, "
                f"{ms:.2f} ms median of {iters}, {r['tok_s']:.0f} tok/s, MFU "
                f"{100 * r['mfu']:.2f}%, token {token}"
                + ("" if diff is None else f", max|dlogits| vs jax-plain {diff:.4g}")
                + ("" if self_diff is None else
                   f", vs its chunk {self_diff['chunk']} {self_diff['max_abs']:.4g}"))
        except Exception as e:  # noqa: BLE001  (one row failing never stops the run)
            res.fail(name, s, label, one_line(e))
            failed[(s, rows)] = label
            say(f"{tag}: FAILED {one_line(e)}")
        finally:
            if isinstance(h, Handle):
                h.states.clear()
                h.items.clear()
            h = None
            gc.collect()
        res.write()


def run_interleaved(objs, args, res: Results, prompts, clock, ref_logits) -> None:
    """`--interleave`: each row's JAX systems take turns, one timed prefill each per round, the
    order rotated every round, so that a ratio between them is read under the same clocks and
    power (back to back, a GPU at its power limit drifts by 2-3 % within a call, and a system
    timed minutes after another sees another GPU). Each system's row is the median of its own
    runs, as in the sequential order; compile and warm-up as there, before the first round."""
    measured: dict = {}  # (S, rows) -> {system: (ms, detail)}
    own: dict = {}  # (system, S) -> (chunk label, last row's logits) of its first row at S
    waiting: list = []  # (S, recorded detail, logits): rows run before jax-plain's at S
    for s, label, rows in grid(args, prompts):
        if (s, rows) in measured:
            for name, (ms, detail) in measured[(s, rows)].items():
                res.add_row(name, s, label, ms, {**detail, "same_as": detail["chunk_first"]})
            continue
        members, handles, firsts = [], {}, {}
        for o in objs:
            tag = f"[{o.name}] S={s} chunk={label}"
            why = skip_why(o, args, s, label, rows)
            if why is None and clock.left() <= 0:
                why = "not started: --max_seconds reached"
            if why:
                res.skip(o.name, s, label, why)
                say(f"{tag}: skipped ({why})")
                continue
            try:
                h, info = o.prepare(s, rows)
                firsts[o.name] = warm_up(o, res, s, rows, h, info)
                members.append(o)
                handles[o.name] = h
            except Exception as e:  # noqa: BLE001  (one system failing never stops the row)
                res.fail(o.name, s, label, one_line(e))
                say(f"{tag}: FAILED {one_line(e)}")
        if not members:
            continue
        per_round = sum(firsts[o.name] + args.idle for o in members)
        rounds = max(args.iters, min(25, math.ceil(args.min_row_s * len(members) / per_round)))
        if math.isfinite(clock.left()):
            rounds = max(1, min(rounds, int(clock.left() // per_round)))
        times = {o.name: [] for o in members}
        issue = {o.name: [] for o in members}
        logits, tokens, failed = {}, {}, set()
        start = time.time()
        for r in range(rounds):
            for o in members[r % len(members):] + members[:r % len(members)]:
                if o.name in failed:
                    continue
                try:
                    sec, issued, tokens[o.name], logits[o.name] = timed_prefill(
                        o, handles[o.name], args.idle)
                    times[o.name].append(sec)
                    issue[o.name] += [issued] * (issued is not None)
                except Exception as e:  # noqa: BLE001
                    failed.add(o.name)
                    res.fail(o.name, s, label, one_line(e))
                    say(f"[{o.name}] S={s} chunk={label}: FAILED {one_line(e)}")
        window = [start, time.time()]
        measured[(s, rows)] = {}
        for o in members:
            if o.name in failed or not times[o.name]:
                continue
            lg = o.to_numpy(logits.pop(o.name))
            diff, self_diff = logit_checks(o, s, label, lg, ref_logits, own)
            ms = statistics.median(times[o.name]) * 1e3
            detail = row_detail(s, label, rows, times[o.name], firsts[o.name], tokens[o.name],
                                (diff, self_diff), window, issue[o.name])
            detail["interleaved"] = [m.name for m in members]
            if s in args.profile:
                detail["profile"] = profile_row(o, handles[o.name], res.out,
                                                f"{o.name}-{s}-{label}", f"[{o.name}] S={s}")
            measured[(s, rows)][o.name] = (ms, detail)
            res.add_row(o.name, s, label, ms, detail)
            if diff is None and o.name != "jax-plain":  # jax-plain's row may come later
                waiting.append((s, res.data["details"][-1], lg))
            r_ = res.data["rows"][-1]
            say(f"[{o.name}] S={s} chunk={label}: rows {rows}, {ms:.2f} ms median of "
                f"{len(times[o.name])} (interleaved with {len(members) - 1}), MFU "
                f"{100 * r_['mfu']:.2f}%, token {tokens[o.name]}"
                + ("" if diff is None else f", max|dlogits| vs jax-plain {diff:.4g}"))
        for x in [w for w in waiting if w[0] in ref_logits]:  # jax-plain's logits, now there
            waiting.remove(x)
            if ref_logits[x[0]].shape == x[2].shape:
                x[1]["logits_diff"] = float(np.max(np.abs(x[2] - ref_logits[x[0]])))
        for o in members:
            handles[o.name].states.clear()
            handles[o.name].items.clear()
        handles.clear()
        gc.collect()
        res.write()


def profile_row(o, h, out: Path, stem: str, tag: str) -> dict | None:
    """One more prefill of the row under `jax.profiler.trace`: its GPU time by call
    (experiments/gpuprofile.py), printed, and written to `out/profile-<stem>.json`."""
    from experiments import gpuprofile

    tmp = tempfile.mkdtemp(prefix="prefill-trace-")
    try:
        o.reset(h)
        with jax.profiler.trace(tmp):
            o.done = None
            t = time.perf_counter()
            o.prefill(h)  # the run's own clock, as timed runs take it: not their span
            wall = ((o.done or time.perf_counter()) - t) * 1e3
        texts = [getattr(p, "fn", p).as_text() for p in h.parts]  # jax-plain's is the Compiled
        prof = {"wall_ms": wall, **gpuprofile.summarize(tmp, texts, h.extra.get("jaxprs", ()))}
        try:  # the host beside the GPU: a late copy or launch at the end is in the wall clock
            prof["host"] = gpuprofile.host_timeline(tmp, gpuprofile.kernels(tmp))
        except Exception as e:  # noqa: BLE001
            prof["host"] = {"error": one_line(e)}
        try:  # the host's issue of each program, step by step
            prof["host_inside"] = gpuprofile.host_inside(tmp)
            prof["host_execute"] = gpuprofile.host_inside(tmp, "RawLoadedExecutable::Execute", 6, 10)
        except Exception as e:  # noqa: BLE001
            prof["host_inside"] = {"error": one_line(e)}
    except Exception as e:  # noqa: BLE001  (a profile is extra: the row stands without it)
        say(f"{tag}: profile failed: {one_line(e)}")
        return None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    (out / f"profile-{stem}.json").write_text(json.dumps(prof, indent=1) + "\n")
    say(f"{tag}: profile\n{gpuprofile.table(prof)}")
    return {k: v for k, v in prof.items() if k != "top_kernels"}
