"""Where a compiled program's GPU time goes: kernel by kernel from a JAX profile, grouped by call.

`experiments/prefill.py --profile` runs one more prefill of a row under `jax.profiler.trace` and
hands the trace and the compiled parts to `summarize`:

- every kernel the GPU ran (CUPTI, the device planes of the trace's xplane), with the HLO
  instruction that launched it (the `hlo_op` stat, or the kernel's own name, which XLA takes from
  its fusion);
- an instruction's call is read from the optimized HLO (`compiled.as_text()`): its metadata
  `op_name` holds the name stack, in which a kernjax call is `jit(<call name>)`;
- grouped by the call's name without its layer (`l7.gate_up` -> `gate_up`), with the GEMM FLOPs
  of that kind of call (from the jaxpr's `dot_general`s) when the program is a kernjax program,
  so a call's TFLOP/s is on the table;
- and the timeline: the span from the first kernel's start to the last one's end against the sum
  of kernel times, so idle GPU time (launches, host waits) shows as the difference.

Kernels are also grouped by kind (`gemm` for cuBLAS/CUTLASS, `attention` for the attention
kernels, `fusion` for XLA's own, `copy`/`memset`, `other`).
"""

from __future__ import annotations

import collections
import functools
import glob
import os
import re

_CALL = re.compile(r"jit\(((?:l\d+\.)?[A-Za-z_][\w.]*)\)")
_INSTR = re.compile(r"^\s+(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_COMP = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_OPNAME = re.compile(r"op_name=\"([^\"]*)\"")
_TO_APPLY = re.compile(r"to_apply=%?([\w.\-]+)")
_LAYER = re.compile(r"^l\d+\.")


def kind_of(kernel: str) -> str:
    k = kernel.lower()
    if any(s in k for s in ("gemm", "xmma", "cutlass", "cublas", "sm90_", "nvjet", "wgmma_")):
        return "gemm"
    if any(s in k for s in ("attention", "attn", "mosaic", "flash", "fmha")):
        return "attention"
    if "memcpy" in k or "copy" in k:
        return "copy"
    if "memset" in k:
        return "memset"
    if "fusion" in k or k.startswith(("loop_", "input_", "wrapped_", "triton")):
        return "fusion"
    return "other"


def _xplane(trace_dir: str):
    """The newest xplane under `trace_dir`, read."""
    files = sorted(glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True))
    if not files:
        raise FileNotFoundError(f"no .xplane.pb under {trace_dir}")
    return _read(files[-1], os.stat(files[-1]).st_mtime_ns)


@functools.lru_cache(maxsize=1)
def _read(path: str, mtime_ns: int):
    """One trace read once for the several summaries a profile makes of it."""
    from jax._src.lib import _profile_data

    return _profile_data.ProfileData.from_file(path)


def kernels(trace_dir: str) -> list[dict]:
    """The GPU kernels of the newest xplane under `trace_dir`: name, hlo_op, start, duration
    (on the CPU backend, where there is no device plane, the thunks XLA ran)."""
    data = _xplane(trace_dir)
    planes = [p for p in data.planes if p.name.startswith("/device:GPU")]
    host = not planes  # the CPU backend: its thunks, the events with an `hlo_op`
    out = []
    for plane in planes or data.planes:
        for line in plane.lines:
            for e in line.events:
                st = dict(e.stats)
                if host and "hlo_op" not in st:
                    continue
                out.append({"name": e.name, "hlo_op": st.get("hlo_op"), "plane": plane.name,
                            "stream": line.name, "start_ns": e.start_ns, "ns": e.duration_ns})
    return out


def host_events(trace_dir: str, top: int = 12) -> list[dict]:
    """The host's busiest events in the newest xplane under `trace_dir`, by total time: Python
    functions (`$file:line name`, with the Python tracer on) and PjRt's own (dispatch, waits),
    per thread line. Nested events each count, so a caller includes its callees."""
    data = _xplane(trace_dir)
    tot: dict = collections.defaultdict(lambda: [0, 0])
    for plane in data.planes:
        if not plane.name.startswith("/host:CPU"):
            continue
        for line in plane.lines:
            for e in line.events:
                if "profiler.py" in e.name or "contextlib.py" in e.name:
                    continue
                t = tot[(line.name[:24], e.name[:90])]
                t[0] += e.duration_ns
                t[1] += 1
    return [{"thread": k[0], "event": k[1], "ms": v[0] / 1e6, "n": v[1]}
            for k, v in sorted(tot.items(), key=lambda kv: -kv[1][0])[:top]]


def host_inside(trace_dir: str, outer: str = "ExecuteThunks", top: int = 12,
                first: int = 6) -> dict:
    """What the host does inside each `outer` event (XLA:GPU's issue of a program's thunks): the
    events nested in it on the same thread, by name (digits dropped, so `fusion_12` and
    `fusion_7` are one), with their count and total ms, and the outer events' own count and
    total; and the `first` events nested in each outer event, ms from its start (what the host
    does before a program's first launch). Where the issue of one program takes longer per
    kernel than another's, this says which step does."""
    data = _xplane(trace_dir)
    outs, tot = [0, 0], collections.defaultdict(lambda: [0, 0])
    starts = []  # each outer event's first nested events: (outer's start, [(name, start, ns)])
    for plane in data.planes:
        if plane.name.startswith("/device"):
            continue
        for line in plane.lines:
            evs = sorted(line.events, key=lambda e: e.start_ns)
            spans = [(e.start_ns, e.start_ns + e.duration_ns) for e in evs if outer in e.name]
            if not spans:
                continue
            outs[0] += len(spans)
            outs[1] += sum(b - a for a, b in spans)
            starts += [(a, [(e.name, e.start_ns, e.duration_ns) for e in evs
                            if a < e.start_ns < b and outer not in e.name][:first])
                       for a, b in spans]
            for e in evs:
                if outer in e.name or not any(a <= e.start_ns < b for a, b in spans):
                    continue
                t = tot[re.sub(r"\d+", "#", e.name)[:70]]
                t[0] += e.duration_ns
                t[1] += 1
    starts.sort()
    return {"outer": outer, "n": outs[0], "ms": outs[1] / 1e6,
            "first": [[{"event": n[:70], "at_ms": round((t - a) / 1e6, 3),
                        "dur_ms": round(d / 1e6, 3)} for n, t, d in evs] for a, evs in starts],
            "inside": [{"event": k, "ms": v[0] / 1e6, "n": v[1]}
                       for k, v in sorted(tot.items(), key=lambda kv: -kv[1][0])[:top]]}


_HOSTCALL = re.compile(r"^cu[A-Z]|^cuda|Execute|BlockHostUntil|Await|ToLiteral|CopyToHost")


def host_timeline(trace_dir: str, ks: list[dict], first: int = 4, last: int = 16) -> dict:
    """The host's CUDA API calls and PjRt's own events (execute, waits, copies to the host) on
    the GPU's clock (ms from the first kernel's start; the GPU's last kernel ends at `gpu_end_ms`):
    the first `first` and the last `last` of them, and the busiest by name. Says whether the GPU
    waited for the host at the end (a late copy or launch) or the host for the GPU."""
    data = _xplane(trace_dir)
    t0 = min(k["start_ns"] for k in ks)
    evs, tot = [], collections.defaultdict(lambda: [0, 0])
    for plane in data.planes:
        if plane.name.startswith("/device"):
            continue
        for line in plane.lines:
            for e in line.events:
                if _HOSTCALL.search(e.name):
                    evs.append({"event": e.name[:60], "thread": line.name[:24],
                                "ms": round((e.start_ns - t0) / 1e6, 3),
                                "dur_ms": round(e.duration_ns / 1e6, 3)})
                    tot[e.name[:60]][0] += e.duration_ns
                    tot[e.name[:60]][1] += 1
    evs.sort(key=lambda e: e["ms"])
    end = max(k["start_ns"] + k["ns"] for k in ks)
    return {"gpu_end_ms": round((end - t0) / 1e6, 3), "events": len(evs),
            "first": evs[:first], "last": evs[-last:],
            "busiest": [{"event": k, "ms": v[0] / 1e6, "n": v[1]} for k, v in
                        sorted(tot.items(), key=lambda kv: -kv[1][0])[:8]]}


def call_of_ops(hlo_texts, names=()) -> tuple[dict, list]:
    """`(ops, order)`: HLO instruction name -> (its kernjax call or `-`, whether it sits in the
    entry computation); and per module, its entry's instructions in schedule order as
    `(name, call, launch)` (`launch`: `call` for a custom call, such as a cuBLAS GEMM or a
    Mosaic or Triton kernel, whose kernel is not named after it; `fusion` for XLA's own kernels;
    `""` for what launches nothing).

    On a GPU a call's body is inlined and its ops carry `jit(<call>)` in their op_name; on the
    CPU a call is an HLO `call` of a computation named after it, and the ops inside belong to it.
    `names`, the program's call names, picks the call among the jit scopes (helpers such as
    `jit(_where)` are scopes too); without them (an unconstrained program) every op is `-`.
    """
    known = set(names)
    out: dict = {}
    order: list = []
    for text in hlo_texts:
        comp, entry = None, False
        order.append([])
        for line in text.splitlines():
            head = _COMP.match(line)
            if head:
                entry, comp = bool(head.group(1)), head.group(2)
                continue
            m = _INSTR.match(line)
            if not m:
                continue
            instr, rest = m.group(1), m.group(2)
            op = _OPNAME.search(rest)
            scopes = [c for c in _CALL.findall(op.group(1))] if op else []
            scopes = [c for c in scopes if c in known]
            to = _TO_APPLY.search(rest) if " call(" in rest else None
            to = re.sub(r"\.\d+$", "", to.group(1)) if to else None
            base = re.sub(r"\.\d+$", "", comp or "")
            call = (scopes[-1] if scopes else to if to in known else
                    base if base in known and not entry else "-")
            out[instr] = (call, entry)
            if entry:
                launch = "call" if " custom-call(" in rest else "fusion" if " fusion(" in rest else ""
                order[-1].append((instr, call, launch))
    return out, order


def sanitized(name: str) -> str:
    """An HLO instruction's name as XLA:GPU names the kernel it emits (`fusion.3` -> `fusion_3`)."""
    return re.sub(r"[^\w]", "_", name)


def attribute(ks: list[dict], ops: dict, order: list) -> list[str]:
    """Each kernel's call, walking the module's schedule as the kernels come. A kernel with an
    `hlo_op`, or named after its instruction (XLA's fusions are), places the walk there. Two
    cases do not name their instruction:
    - a cuBLAS GEMM or a Mosaic or Triton kernel (the trace may carry no `hlo_op` when XLA runs
      its thunks as CUDA graphs) is the next custom call after the walk's place;
    - XLA:GPU compiles identical fusions once and names the kernel after the first (every
      layer's residual add runs as layer 0's `wrapped_add`): a named kernel whose instruction
      lies behind the walk is the next fusion after it, unless none is left (the program's next
      run begins). An `hlo_op` is the instruction itself (without graphs a GEMM's memset carries
      its GEMM's): it is trusted where it lies.
    A memset is its neighbour's."""
    where = {}
    for m, seq in enumerate(order):
        for i, (name, _, _) in enumerate(seq):
            where.setdefault(name, (m, i))
            where.setdefault(sanitized(name), (m, i))

    def lookup(key):
        if key in where:
            m, i = where[key]
            return order[m][i][1], (m, i)
        if key in ops:
            return ops[key][0], None
        return None

    def after(at, launch):
        m, i = at
        seq = order[m]
        return next(((m, j) for j in range(i + 1, len(seq)) if seq[j][2] == launch), None)

    out, at, last = [], None, "?"
    for k in ks:
        hit = lookup(k["hlo_op"])  # the instruction itself: behind the walk, the next run's
        named = hit is None
        hit = hit or lookup(k["name"])
        if hit:
            call, pos = hit
            if named and pos and at and pos[0] == at[0] and pos[1] <= at[1]:
                pos = after(at, "fusion") or pos
                call = order[pos[0]][pos[1]][1]
            at = pos or at
        elif kind_of(k["name"]) == "memset" or at is None:
            call = last
        else:
            nxt = after(at, "call")
            call = "?" if nxt is None else order[nxt[0]][nxt[1]][1]
            at = nxt or at
        out.append(call)
        last = call
    return out


def gemm_flops(closed_jaxprs) -> dict[str, float]:
    """Call kind -> FLOPs of its `dot_general`s, summed over every call of that kind."""
    import numpy as np

    def dots(jaxpr) -> float:
        f = 0.0
        for e in jaxpr.eqns:
            if e.primitive.name == "dot_general":
                (lc, _), (lb, _) = e.params["dimension_numbers"]
                a = e.invars[0].aval.shape
                k = np.prod([a[i] for i in lc]) if lc else 1
                f += 2.0 * np.prod(e.outvars[0].aval.shape) * k
            for sub in _subjaxprs(e):
                f += dots(sub)
        return f

    out: dict = collections.defaultdict(float)
    for cj in closed_jaxprs:
        for e in cj.jaxpr.eqns:
            if e.primitive.name == "jit" and "name" in e.params:
                out[_LAYER.sub("", e.params["name"])] += dots(e.params["jaxpr"].jaxpr)
    return dict(out)


def _subjaxprs(e):
    for v in e.params.values():
        for x in (v if isinstance(v, (list, tuple)) else [v]):
            if hasattr(x, "jaxpr") and hasattr(x.jaxpr, "eqns"):
                yield x.jaxpr
            elif hasattr(x, "eqns"):
                yield x


def occupancy(ks: list[dict], gap_us: float = 50.0) -> dict:
    """Where the GPU's time went between the first kernel's start and the last one's end, kernels
    sorted by start: `hold_ms` in the edge ops' holds (waiting on a neighbour; on the CPU their
    thunks), `work_ms` in the others (their union: streams may overlap), `idle_ms` in none
    (waiting for the host to launch), and the idle gaps of `gap_us` or more (count and ms; the
    longest four with where they fall and the kernels on either side)."""
    if not ks:
        return {"hold_ms": 0.0, "work_ms": 0.0, "idle_ms": 0.0, "gaps": 0, "gaps_ms": 0.0,
                "worst_gaps": []}
    hold = work = idle = gaps_ns = 0
    gaps, end, t0, last, worst = 0, ks[0]["start_ns"], ks[0]["start_ns"], ks[0]["name"], []
    for k in ks:
        s, e = k["start_ns"], k["start_ns"] + k["ns"]
        if s > end:
            idle += s - end
            if s - end >= gap_us * 1e3:
                gaps, gaps_ns = gaps + 1, gaps_ns + s - end
                worst.append({"ms": (s - end) / 1e6, "at_ms": (end - t0) / 1e6,
                              "after": last[:60], "before": k["name"][:60]})
        if e > end:
            if "HoldKernel" in k["name"] or k["name"].startswith("kj_hold"):
                hold += e - max(s, end)
            else:
                work += e - max(s, end)
            end, last = e, k["name"]
    return {"hold_ms": hold / 1e6, "work_ms": work / 1e6, "idle_ms": idle / 1e6, "gaps": gaps,
            "gaps_ms": gaps_ns / 1e6, "worst_gaps": sorted(worst, key=lambda g: -g["ms"])[:4]}


def summarize(trace_dir: str, hlo_texts, closed_jaxprs=()) -> dict:
    ks = kernels(trace_dir)
    names = [e.params["name"] for cj in closed_jaxprs for e in cj.jaxpr.eqns if "name" in e.params]
    ops, order = call_of_ops(hlo_texts, names)
    if ks and not ks[0]["plane"].startswith("/device"):
        # host thunks nest (a call's thunk spans those of its body): keep the entry's alone
        ks = [k for k in ks if ops.get(k["hlo_op"], ("-", True))[1]]
    ks.sort(key=lambda k: k["start_ns"])
    of = attribute(ks, ops, order)
    flops = gemm_flops(closed_jaxprs)
    by_call: dict = collections.defaultdict(lambda: {"ns": 0, "kernels": 0, "gemm_ns": 0})
    by_kind: dict = collections.defaultdict(lambda: {"ns": 0, "kernels": 0})
    top: dict = collections.defaultdict(lambda: {"ns": 0, "n": 0})
    for k, call in zip(ks, of):
        call = _LAYER.sub("", call)
        kind = kind_of(k["name"])
        c = by_call[call]
        c["ns"] += k["ns"]
        c["kernels"] += 1
        c["gemm_ns"] += k["ns"] if kind == "gemm" else 0
        by_kind[kind]["ns"] += k["ns"]
        by_kind[kind]["kernels"] += 1
        t = top[(k["name"][:90], call)]
        t["ns"] += k["ns"]
        t["n"] += 1
    busy = sum(k["ns"] for k in ks)
    span = (max(k["start_ns"] + k["ns"] for k in ks) - min(k["start_ns"] for k in ks)) if ks else 0
    calls = []
    for name, c in sorted(by_call.items(), key=lambda kv: -kv[1]["ns"]):
        row = {"call": name, "ms": c["ns"] / 1e6, "share": c["ns"] / busy if busy else 0.0,
               "kernels": c["kernels"], "gemm_ms": c["gemm_ns"] / 1e6}
        if flops.get(name):
            row["gemm_tflops"] = flops[name] / 1e12
            row["tflop_s"] = flops[name] / (c["ns"] / 1e9) / 1e12 if c["ns"] else 0.0
        calls.append(row)
    return {
        "kernels": len(ks), "busy_ms": busy / 1e6, "span_ms": span / 1e6, **occupancy(ks),
        "unattributed_ms": sum(c["ms"] for c in calls if c["call"] in ("?", "-")),
        "calls": calls,
        "kinds": {k: {"ms": v["ns"] / 1e6, "kernels": v["kernels"]} for k, v in
                  sorted(by_kind.items(), key=lambda kv: -kv[1]["ns"])},
        "sample": [{"name": k["name"][:60], "hlo_op": k["hlo_op"]} for k in ks[:12]],
        # the last to end: a program that publishes its token ends with kj_mark's kernel
        "last_kernels": [k["name"][:60] for k in sorted(ks, key=lambda k: k["start_ns"]
                                                         + k["ns"])[-3:]],
        "hlo_names": [n for seq in order for n, _, _ in seq[:12]],
        "top_kernels": [{"kernel": n, "call": c, "ms": v["ns"] / 1e6, "n": v["n"]} for (n, c), v in
                        sorted(top.items(), key=lambda kv: -kv[1]["ns"])[:25]],
    }


def table(p: dict) -> str:
    wall = f", the run's wall clock {p['wall_ms']:.2f} ms" if "wall_ms" in p else ""
    lines = [f"kernels {p['kernels']}, busy {p['busy_ms']:.2f} ms, span {p['span_ms']:.2f} ms "
             f"(idle {p['idle_ms']:.2f} ms){wall}, unattributed {p['unattributed_ms']:.2f} ms",
             "| call | ms | share | kernels | GEMM ms | GEMM TFLOP | TFLOP/s |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for c in p["calls"]:
        lines.append(f"| {c['call']} | {c['ms']:.3f} | {100 * c['share']:.1f} % | {c['kernels']} "
                     f"| {c['gemm_ms']:.3f} | "
                     + (f"{c['gemm_tflops']:.3g} | {c['tflop_s']:.0f} |" if "tflop_s" in c
                        else "- | - |"))
    if p.get("last_kernels"):
        lines.append("last kernels: " + ", ".join(p["last_kernels"]))
    lines.append("kinds: " + ", ".join(f"{k} {v['ms']:.2f} ms ({v['kernels']})"
                                       for k, v in p["kinds"].items()))
    for g in p.get("worst_gaps", []):
        lines.append(f"idle gap {g['ms']:.3f} ms at {g['at_ms']:.2f} ms, after {g['after']}, "
                     f"before {g['before']}")
    lines.append("top kernels:")
    lines += [f"  {t['ms']:8.3f} ms  x{t['n']:<4d} {t['call']:<16s} {t['kernel']}"
              for t in p["top_kernels"][:15]]
    if (h := p.get("host")) and "events" in h:
        lines.append(f"host (ms from the first kernel; the GPU ends at {h['gpu_end_ms']:.3f}), "
                     f"{h['events']} events, first and last:")
        lines += [f"  {e['ms']:9.3f} +{e['dur_ms']:.3f}  {e['thread']:<24s} {e['event']}"
                  for e in h["first"] + [{"ms": 0, "dur_ms": 0, "thread": "...", "event": ""}]
                  + h["last"]]
        lines += [f"  busiest: {b['ms']:.3f} ms x{b['n']} {b['event']}" for b in h["busiest"]]
    for h in (p.get("host_execute"), p.get("host_inside")):
        if not h or "inside" not in h:
            continue
        lines.append(f"inside {h['outer']} ({h['n']} of them, {h['ms']:.3f} ms), by event:")
        lines += [f"  {e['ms']:9.3f} ms x{e['n']:<5d} {e['event']}" for e in h["inside"]]
        for i, evs in enumerate(h.get("first", [])):
            lines.append(f"  its {i + 1}. opens with: " + ", ".join(
                f"{e['event']} at +{e['at_ms']:.3f} ({e['dur_ms']:.3f} ms)" for e in evs))
    return "\n".join(lines)
