"""The cut: a program partitioned at call indices into stages, each a program of its own.

This is kern's `cut` (crates/kern-manifest/src/cut.rs) done on a jaxpr. A forward is a pure
function of its inputs, so running its calls in two pieces, handing the values that cross from
the first piece to the second, computes the same thing: a cut changes no arithmetic. With every
call a compilation boundary (trace.py), it changes no bits either.

Stage `s` runs calls `bounds[s]..bounds[s+1]` with `bounds = [0, *at, n]`. A value *crosses*
cut point `a` if a call before `a` defines it and a call at or after `a`, or a `tokens`/`logits`
output, reads it. The crossing values at a stage's first call are its *arrivals*, those at its
end its *departures*. A value a later stage needs and a middle stage does not use is forwarded by
the middle stage (an arrival that is also a departure); kern refuses such cuts, kernjax accepts
them and the summary says so.

Program inputs never travel: each stage binds the weights, states, fills and tables its own calls
read, and nothing else. A state belongs to one stage: the calls that read any version of it (its
input, or a new version a call returned) must all fall in one stage, so a cut between a layer's
`kv_write` and its `attn` is refused. `tokens` and `logits` come from the last stage.

Refusals are collected, never stopped at the first: `CutError` lists every reason, each naming
the call. Pure: jaxprs and ints in, data out; no devices, files or clocks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import jax.extend.core as jex
import numpy as np

from kernjax.core import lowering
from kernjax.core.trace import Program, Slot, routes, states_of


class CutError(ValueError):
    """The program cannot be cut at these points; the message has one bullet per reason."""

    def __init__(self, reasons: Sequence[str]):
        self.reasons = tuple(reasons)
        super().__init__("program cannot be cut:\n" + "\n".join(f"  - {r}" for r in reasons))


@dataclasses.dataclass(frozen=True)
class Stage:
    """One stage of a cut: its calls, what it binds, receives and sends, and its jaxpr.

    Made only by `cut` and `whole`; holding one means the cut was checked. The jaxpr's inputs are
    `inputs + arrivals` and its outputs `departures + outputs`, in that order.
    """

    index: int
    stages: int
    cut_id: str
    points: tuple[int, ...]
    first: int
    end: int
    calls: tuple[str, ...]
    inputs: tuple[Slot, ...]
    arrivals: tuple[Slot, ...]
    departures: tuple[Slot, ...]
    outputs: tuple[Slot, ...]
    forwarded: tuple[str, ...]
    jaxpr: jex.ClosedJaxpr
    rows: int
    lowering: dict  # the lowering table (`kernjax.core.lowering`) every stage of the cut shares
    program: str = "prefill"  # which of the cut's programs this is a stage of (`cut_all`)


def table(lowering_: lowering.Lowering | None = None) -> dict:
    """The lowering table a cut records: the knobs and the registered `on_gpu` routes."""
    return (lowering_ or lowering.DEFAULT).table(routes())


def cut_id(program: Program | Mapping[str, Program], points: Sequence[int],
           table_: dict | None = None) -> str:
    """FNV-1a 64 over the program's text (of a set: each program's name and text, by name), each
    cut point as a little-endian u64 (as kern does), then the lowering table
    (`lowering.canonical`): one jaxpr exported with other kernels is another cut."""
    h = 0xCBF29CE484222325
    text = program.text().encode() if isinstance(program, Program) else b"".join(
        n.encode() + b"\0" + program[n].text().encode() for n in sorted(program))
    data = text + b"".join(int(p).to_bytes(8, "little") for p in points)
    data += lowering.canonical(table_ if table_ is not None else table())
    for b in data:
        h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return f"{h:016x}"


def cut(program: Program, at: Sequence[int], *,
        lowering: lowering.Lowering | None = None) -> tuple[Stage, ...]:
    """Cuts `program` before each call index in `at`; returns one Stage per piece.

    Raises:
      CutError: listing every reason the points cannot cut this program.
    """
    return _cut(program, at, table(lowering))


def _cut(program: Program, at: Sequence[int], table_: dict,
         cid: str | None = None) -> tuple[Stage, ...]:
    n, at = len(program.calls), [int(a) for a in at]
    errs = []
    if not at:
        errs.append(f"no cut point: give at least one call index between 1 and {n - 1}")
    for a in at:
        if a <= 0:
            errs.append(f"cut point {a} is at or before call 0 (`{program.calls[0]}`); "
                        "the first stage would run no call")
        elif a >= n:
            errs.append(f"cut point {a} is past the last call {n - 1} (`{program.calls[-1]}`); "
                        "the last stage would run no call")
    for a, b in zip(at, at[1:]):
        if b <= a:
            errs.append(f"cut points {a} and {b} are not increasing; each stage needs a call")
    if errs:
        raise CutError(errs)
    return _partition(program, [0, *at, n], tuple(at), table_, cid)


def cut_all(programs: Mapping[str, Program], at: Sequence[int], *,
            lowering: lowering.Lowering | None = None) -> dict[str, tuple[Stage, ...]]:
    """Cuts every program of a set (a prefill chunk, a score program, decode buckets) before the
    same call indices, with one cut id over all. The programs must run the same calls in every
    stage but the last, so that stage s of each is one process's work; the first program is the
    reference the others are compared with.

    Raises:
      CutError: listing every reason, a point past a program's calls or a program whose calls
        differ from the reference's before the last point.
    """
    names = list(programs)
    ref = programs[names[0]]
    at = [int(a) for a in at]
    errs = []
    t = table(lowering)
    cid = cut_id(programs, at, t)
    out = {}
    for name in names:
        try:
            out[name] = tuple(dataclasses.replace(st, program=name)
                              for st in _cut(programs[name], at, t, cid))
        except CutError as e:
            errs += [f"program `{name}`: {r}" for r in e.reasons]
    end = max(at, default=0)
    for name in names[1:]:
        calls = programs[name].calls
        k = next((k for k in range(min(end, len(calls), len(ref.calls)))
                  if calls[k] != ref.calls[k]), None)
        if k is not None:
            errs.append(f"program `{name}` runs call {k} `{calls[k]}` where `{names[0]}` runs "
                        f"`{ref.calls[k]}`, before the cut point {end}: the programs of a cut "
                        "must share the calls of every stage but the last")
    if errs:
        raise CutError(sorted(set(errs), key=errs.index))
    return out


def whole_all(programs: Mapping[str, Program], *,
              lowering: lowering.Lowering | None = None) -> dict[str, Stage]:
    """Every program of a set uncut, one stage each, with one cut id over all (`cut_all`)."""
    t = table(lowering)
    cid = cut_id(programs, (), t)
    return {n: dataclasses.replace(_partition(p, [0, len(p.calls)], (), t, cid)[0], program=n)
            for n, p in programs.items()}


def balanced(ms: Sequence[float], stages: int, banned: frozenset[int] = frozenset()) -> list[int]:
    """Cut points (call indices) splitting calls with times `ms` into `stages` contiguous stages
    whose largest total is as small as it can be, never at a point in `banned`; ties go to the
    earliest points. Exact (dynamic programming over prefix sums)."""
    n = len(ms)
    pre = [0.0]
    for m in ms:
        pre.append(pre[-1] + m)
    inf = float("inf")
    # best[s][j]: the least max-period of calls 0..j-1 in s stages; at[s][j]: its last point.
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    at = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for s_ in range(1, stages + 1):
        for j in range(s_, n + 1):
            for i in range(s_ - 1, j):
                if i in banned and 0 < i < n:
                    continue
                v = max(best[s_ - 1][i], pre[j] - pre[i])
                if v < best[s_][j]:
                    best[s_][j], at[s_][j] = v, i
    if best[stages][n] == inf:
        raise CutError([f"no {stages}-stage cut exists among the allowed points"])
    points, j = [], n
    for s_ in range(stages, 0, -1):
        j = at[s_][j]
        points.append(j)
    return sorted(points)[1:]


def whole(program: Program, *, lowering: lowering.Lowering | None = None) -> Stage:
    """The uncut program as a one-stage cut: the reference every split is compared with."""
    return _partition(program, [0, len(program.calls)], (), table(lowering))[0]


def _partition(program: Program, bounds: list[int], points: tuple[int, ...],
               table_: dict, cid: str | None = None) -> tuple[Stage, ...]:
    jp, calls = program.jaxpr.jaxpr, program.calls
    eqns, nst = jp.eqns, len(bounds) - 1
    stage_of = np.repeat(np.arange(nst), np.diff(bounds))
    inputs = dict(zip(jp.invars, program.inputs))
    errs: list[str] = []

    # Where each value is defined: an input, or output j of call k.
    made: dict[jex.Var, tuple[int, int]] = {}
    for k, e in enumerate(eqns):
        for j, v in enumerate(e.outvars):
            if not isinstance(v, jex.DropVar):
                made[v] = (k, j)

    # Versions of each state: its input, and each result a call returns for a state argument.
    version: dict[jex.Var, str] = {v: s.name for v, s in inputs.items() if s.role == "state"}
    for k, e in enumerate(eqns):
        for i in range(states_of(e)):
            v = e.invars[i]
            if isinstance(v, jex.Literal) or v not in version:
                errs.append(f"call {k} (`{calls[k]}`) declares argument {i} a state, "
                            "but it is not a version of any state input")
            elif not isinstance(e.outvars[i], jex.DropVar):
                version[e.outvars[i]] = version[v]

    # Who reads each value: call indices, and `n` for a tokens/logits output.
    n = len(eqns)
    readers: dict[jex.Var, list[int]] = {}
    for k, e in enumerate(eqns):
        for v in e.invars:
            if not isinstance(v, jex.Literal):
                readers.setdefault(v, []).append(k)
    emitted: dict[jex.Var, Slot] = {}
    for v, s in zip(jp.outvars, program.outputs):
        if isinstance(v, jex.Literal):
            continue
        if s.role == "state":
            if version.get(v) != s.name:
                errs.append(f"output `{s.name}` is a state output but is not a version of "
                            f"state `{s.name}`")
        else:
            emitted[v] = s
            readers.setdefault(v, []).append(n)
            if v in made and stage_of[made[v][0]] != nst - 1:
                k = made[v][0]
                errs.append(f"output `{s.name}` is made by call {k} (`{calls[k]}`) in stage "
                            f"{stage_of[k]} of {nst}; a pipeline's outputs come from its last stage")

    # A state belongs to the one stage whose calls read its versions.
    owners: dict[str, dict[int, list[int]]] = {}
    for v, name in version.items():
        for k in readers.get(v, []):
            if k < n:
                owners.setdefault(name, {}).setdefault(int(stage_of[k]), []).append(k)
    for name in sorted(owners, key=_natural):
        by = owners[name]
        if len(by) > 1:
            where = "; ".join(f"stage {s}: " + ", ".join(f"call {k} (`{calls[k]}`)"
                                                           for k in sorted(set(ks)))
                              for s, ks in sorted(by.items()))
            errs.append(f"state `{name}` is touched by {len(by)} stages ({where}); "
                        "a state region belongs to one stage")
    if errs:
        raise CutError(errs)
    owner = {name: next(iter(by)) for name, by in owners.items()}

    # Values crossing each inner bound, in definition order.
    crossing: list[list[jex.Var]] = []
    for b in bounds[1:-1]:
        crossing.append(sorted((v for v, (k, _) in made.items()
                                if k < b and any(r >= b for r in readers.get(v, []))),
                               key=made.__getitem__))

    def slot(v: jex.Var, role: str) -> Slot:
        k, j = made[v]
        return Slot(f"{calls[k]}:{j}", role, str(v.aval.dtype), tuple(v.aval.shape))

    cid = cid or cut_id(program, points, table_)
    stages = []
    for s in range(nst):
        lo, hi = bounds[s], bounds[s + 1]
        body = eqns[lo:hi]
        last = s == nst - 1
        outs = [(v, o) for v, o in zip(jp.outvars, program.outputs)
                if (o.role == "state" and owner.get(o.name, nst - 1) == s)
                or (o.role != "state" and last)]
        read = {v for e in body for v in e.invars if not isinstance(v, jex.Literal)}
        read |= {v for v, _ in outs if v in inputs}
        kept = [v for v in jp.invars if v in read]
        arrive = crossing[s - 1] if s else []
        depart = crossing[s] if not last else []
        ins = (*(inputs[v] for v in kept), *(slot(v, "arrival") for v in arrive))
        outn = (*(slot(v, "departure") for v in depart), *(o for _, o in outs))
        debug = jp.debug_info._replace(
            func_src_info=f"stage {s} of {nst}", arg_names=tuple(x.name for x in ins),
            result_paths=tuple(x.name for x in outn))
        stage_jaxpr = jex.Jaxpr(
            constvars=[], invars=[*kept, *arrive], outvars=[*depart, *(v for v, _ in outs)],
            eqns=body, effects=frozenset().union(*(e.effects for e in body)), debug_info=debug)
        used = {v for e in body for v in e.invars}
        stages.append(Stage(
            index=s, stages=nst, cut_id=cid, points=points, first=lo, end=hi,
            calls=calls[lo:hi], inputs=tuple(inputs[v] for v in kept),
            arrivals=tuple(slot(v, "arrival") for v in arrive),
            departures=tuple(slot(v, "departure") for v in depart),
            outputs=tuple(o for _, o in outs),
            forwarded=tuple(slot(v, "arrival").name for v in arrive if v not in used),
            jaxpr=jex.ClosedJaxpr(stage_jaxpr, []), rows=program.rows, lowering=table_))
    return tuple(stages)


def counted(n: int, word: str) -> str:
    """`1 token`, `2 tokens`: a count with its noun in agreement."""
    return f"{n} {word}{'' if n == 1 else 's'}"


def _natural(name: str):
    return [int(t) if t.isdigit() else t for t in name.replace(".", " ").split()]


def _span(names: Sequence[str]) -> str:
    """`kv.0`-`kv.17` for a run of numbered names, else the names joined."""
    if not names:
        return "none"
    if len(names) > 2:
        return f"{names[0]}–{names[-1]}"
    return ", ".join(names)


def _mib(b: int) -> str:
    return f"{b / 2**20:.1f} MiB" if b >= 2**20 else f"{b / 1024:.1f} KiB"


def describe(program: Program, stages: Sequence[Stage],
             programs: Mapping[str, Program] | None = None) -> str:
    """The per-stage summary `kernjax cut` prints: calls, weights, states, crossings, cut id; with
    `programs`, the cut's set (`cut_all`), which the cut id covers."""
    all_states = [s.name for s in program.inputs if s.role == "state"]
    lines = []
    for st in stages:
        ws = [s for s in st.inputs if s.role == "weight"]
        ss = sorted((s.name for s in st.inputs if s.role == "state"), key=_natural)
        lines.append(f"stage {st.index}: calls {st.first}..{st.end - 1} "
                     f"(`{st.calls[0]}` .. `{st.calls[-1]}`, {counted(len(st.calls), 'call')})")
        lines.append(f"  weights: {len(ws)} of "
                     f"{sum(s.role == 'weight' for s in program.inputs)}, "
                     f"{_mib(sum(s.nbytes for s in ws))}")
        lines.append(f"  states: {_span(ss)} ({len(ss)} of {len(all_states)}), "
                     f"{_mib(sum(s.nbytes for s in st.inputs if s.role == 'state'))}; "
                     "each state is one region, held whole by this stage")
        for title, vals in (("arrivals", st.arrivals), ("departures", st.departures)):
            if not vals:
                continue
            per_row = sum(v.nbytes // st.rows for v in vals if v.shape[:1] == (st.rows,))
            fixed = sum(v.nbytes for v in vals if v.shape[:1] != (st.rows,))
            lines.append(f"  {title}: {len(vals)}, {per_row} B per row"
                         + (f" + {fixed} B per item" if fixed else ""))
            for v in vals:
                tag = " (forwarded: this stage does not read it)" if v.name in st.forwarded else ""
                lines.append(f"    {v.name} {v.dtype}{list(v.shape)}{tag}")
        outs = [o.name for o in st.outputs if o.role != "state"]
        if outs:
            lines.append(f"  outputs: {', '.join(outs)}")
    if programs:
        lines.append(f"programs: " + ", ".join(
            f"{n} ({p.rows} rows, {p.inputs[[s.name for s in p.inputs].index('cu_seqlens')].shape[0] - 1} seqs)"
            if "cu_seqlens" in [s.name for s in p.inputs] else f"{n} ({p.rows} rows)"
            for n, p in programs.items()) + "; every stage runs each, the last with its head")
    lines.append(f"cut `{stages[0].cut_id}` into {len(stages)} stages")
    return "\n".join(lines)


def points(text: str, program: Program) -> list[int]:
    """`18` is the first call of layer 18 (as the program declares it), `c218` is call 218; commas separate points.
    Points are checked in the user's words: a layer that does not exist or has no layer before it
    (0), a bad token, points out of order."""
    starts = program.layers  # the first call of each layer, as the model declares them
    layers = list(range(len(starts)))
    span = f"cut at a layer from 1 to {layers[-1]} or at a call c<N>" if layers else \
        "name a call index with c<N>"
    out, said, errs = [], [], []
    for tok in (t.strip() for t in text.split(",")):
        if tok.startswith("c") and tok[1:].isdigit():
            out.append(int(tok[1:]))
            said.append(f"call {int(tok[1:])}")
        elif tok.isdigit() and int(tok) in layers[1:]:
            out.append(starts[int(tok)])
            said.append(f"layer {int(tok)} (call {out[-1]})")
        elif tok.isdigit():
            errs.append(f"--at {tok}: " + (f"a cut before layer {tok} leaves stage 0 without a "
                                           "layer" if int(tok) in layers else
                                           f"the program has no layer {tok}") + f"; {span}")
        else:
            errs.append(f"--at `{tok}`: give a layer number (18) or a call index (c218)")
    errs += [f"--at {text}: {sa} and {sb} are not increasing; give the points in order"
             for a, b, sa, sb in zip(out, out[1:], said, said[1:]) if b <= a]
    if errs:
        raise ValueError("\n".join(errs))
    return out


def auto(program: Program, ms: Sequence[float], stages: int, *, lowering=None):
    """The cut into `stages` stages of even periods by the per-call times `ms`, skipping points
    the cut refuses. Returns `(stages, points, periods)`."""
    if not 2 <= stages <= len(program.calls):
        raise ValueError(f"--stages {stages}: give 2 to {len(program.calls)}")
    banned = set()
    while True:
        at = balanced(list(ms), stages, frozenset(banned))
        try:
            out = cut(program, at, lowering=lowering)
            break
        except CutError:  # some point splits a state or an output: never use it again
            bad = {p for p in at if _refused(program, p)}
            if not bad:
                raise
            banned |= bad
    periods = [sum(ms[a:b]) for a, b in zip([0, *at], [*at, len(ms)])]
    return out, at, periods


def _refused(program: Program, point: int) -> bool:
    try:
        cut(program, [point])
    except CutError:
        return True
    return False
