"""The pipeline timeline: where each stage spends an item's time, read back from the stages' logs.

Every stage process logs one line per item when the item's mark passes:
`pp item stage=S item=K rows=R issued_us=I done_us=D`, with `issued_us` the wall-clock time the
stage issued the item's work and `done_us` the time it finished, both in microseconds. Lines may
carry any prefix (absl's, a timestamp) and sit among other lines; `parse` finds them with a regex
and ignores everything else. This is kern's `tools/pp_timeline.py`, done the same way.

Only items present on every stage are kept, so a log cut short on one stage does not skew the
others. An item on stage `s` can start only once it is issued, the stage has finished the item
before, and the stage upstream has finished this item:

    start  = max(issued[s][k], done[s][k-1], done[s-1][k])
    gap    = start - done[s][k-1] = idle + wait, the stage has nothing to do:
      idle   the part of the gap with no item in flight anywhere (no request to serve); an item
             is in flight from its first issued to its last done on any stage
      wait   the rest: pipeline wait, the stage waits for input while other stages work
    held   = done - start              its own work, plus any wait for downstream to take
    period = done[s][k] - done[s][k-1]

"Upstream" is the next lower stage number in the logs; item 0 has no previous item and is left out
of the statistics (`first=1`). A stage's wait share (wait over period) is the time it could give to
more work, its idle share the time the server had nothing to do (docs/serving.md). Percentiles are
numpy's. Stages on different hosts read different clocks: a skew shows as a negative held.

`gantt` draws items `first..last` as text, one row per stage ('.' a gap, the item number mod 10
from start to done); `png` with matplotlib. `kernjax timeline LOG... [--png FILE]
[--first K] [--last K]` prints the report and the gantt.
"""

from __future__ import annotations

import bisect
import math
import re
import sys
from collections.abc import Iterable
from pathlib import Path

import numpy as np

_LINE = re.compile(r"\bpp item stage=(\d+) item=(\d+) rows=(\d+) issued_us=(\d+) done_us=(\d+)",
                   re.ASCII)


def log_item(stage: int, item: int, rows: int, issued: float, done: float) -> None:
    """The timeline line every stage writes per item (wall-clock microseconds)."""
    print(f"pp item stage={stage} item={item} rows={rows} issued_us={int(issued * 1e6)} "
          f"done_us={int(done * 1e6)}", file=sys.stderr, flush=True)


def parse(lines: Iterable[str]) -> dict[int, dict[int, tuple[int, int, int]]]:
    """Reads the `pp item` lines among `lines` into stage -> item -> (issued_us, done_us, rows).

    Raises:
      ValueError: no line is a `pp item` line, one stage logs one item twice, or a line's item
        is done before it was issued.
    """
    items: dict[int, dict[int, tuple[int, int, int]]] = {}
    odd = []  # lines that mention `pp item` and do not parse: said, not counted
    for line in lines:
        m = _LINE.search(line)
        if m is None:
            odd += [line] if "pp item" in line else []
            continue
        stage, item, rows, issued, done = map(int, m.groups())
        per = items.setdefault(stage, {})
        if item in per:
            raise ValueError(f"stage {stage} logs item {item} twice; give each stage's log once, "
                             "and one run per log")
        if done < issued:
            raise ValueError(f"stage {stage} item {item}: done_us {done} precedes issued_us "
                             f"{issued}; a `pp item` line gives its issue time first")
        per[item] = (issued, done, rows)
    if odd:
        print(f"note: {len(odd)} line(s) mention `pp item` but do not parse, skipped; the first: "
              f"{odd[0][:160]!r}", file=sys.stderr)
    if not items:
        raise ValueError("no `pp item stage=S item=K rows=R issued_us=I done_us=D` lines found; "
                         "give the logs of the stage processes")
    return {s: dict(sorted(items[s].items())) for s in sorted(items)}


def _flights(items) -> tuple[list[int], list[int]]:
    """When any item is in flight: the union of [first issued, last done] over items, merged, as
    sorted starts and ends."""
    spans: dict[int, list[int]] = {}
    for per in items.values():
        for k, (issued, done, _) in per.items():
            a, b = spans.setdefault(k, [issued, done])
            spans[k] = [min(a, issued), max(b, done)]
    starts, ends = [], []
    for a, b in sorted(spans.values()):
        if ends and a <= ends[-1]:
            ends[-1] = max(ends[-1], b)
        else:
            starts.append(a)
            ends.append(b)
    return starts, ends


def _idle(a: int, b: int, starts: list[int], ends: list[int]) -> int:
    """The part of [a, b] that no flight covers."""
    busy, i = 0, bisect.bisect_right(ends, a)
    while i < len(starts) and starts[i] < b:
        busy += max(0, min(b, ends[i]) - max(a, starts[i]))
        i += 1
    return (b - a) - busy


def _spans(items):
    """Stage -> item -> (start, done, wait, idle, period) over the items on every stage, in µs;
    wait, idle and period are None for an item whose previous item the stage did not log."""
    stages = sorted(items)
    common = sorted(set.intersection(*(set(items[s]) for s in stages)))
    if not common:
        raise ValueError(f"no item is on every stage ({', '.join(map(str, stages))}); "
                         + "; ".join(f"stage {s} logs items {_ranges(items[s])}" for s in stages))
    flights = _flights(items)
    out = {}
    for i, s in enumerate(stages):
        own, up = items[s], items[stages[i - 1]] if i else None
        out[s] = {}
        for k in common:
            issued, done, _ = own[k]
            prev = own[k - 1][1] if k - 1 in own else None
            start = max(t for t in (issued, prev, up[k][1] if up else None) if t is not None)
            if prev is None:
                out[s][k] = (start, done, None, None, None)
            else:
                idle = _idle(prev, start, *flights) if start > prev else 0
                out[s][k] = (start, done, start - prev - idle, idle, done - prev)
    return out


def _ranges(ids) -> str:
    """`0..4, 7, 9..10`: sorted item numbers as runs."""
    ids, runs = sorted(ids), []
    for k in ids:
        if runs and k == runs[-1][1] + 1:
            runs[-1][1] = k
        else:
            runs.append([k, k])
    return ", ".join(str(a) if a == b else f"{a}..{b}" for a, b in runs)


def report(items, *, first: int = 1, last: int | None = None) -> str:
    """Per stage: period, held and wait p50 and p90 in ms, the wait share and the idle share (of
    the total period), as a table.

    Args:
      items: `parse`'s result.
      first: the first item counted (item 0 has no period, so 1).
      last: the last item counted; default: the last item on every stage.

    Raises:
      ValueError: no item is on every stage, or none of them in `first..last` has a period.
    """
    spans = _spans(items)
    table = [["stage", "items", "period p50", "p90", "held p50", "p90", "wait p50", "p90",
              "wait share", "idle share"]]
    counted = set()
    for s, per in spans.items():
        ks = [k for k, (*_, period) in per.items()
              if first <= k and (last is None or k <= last) and period is not None]
        rows = [per[k] for k in ks]
        if not rows:
            raise ValueError(f"no item in {first}..{'' if last is None else last} has a period on "
                             f"stage {s} (items on every stage: {_ranges(per)}); widen --first/"
                             "--last")
        counted.update(ks)
        held = [done - start for start, done, *_ in rows]
        wait, idle, period = ([r[i] for r in rows] for i in (2, 3, 4))
        ms = [np.percentile(np.asarray(v, np.float64), q) / 1e3
              for v in (period, held, wait) for q in (50, 90)]
        shares = [sum(v) / sum(period) if sum(period) else math.nan for v in (wait, idle)]
        table.append([str(s), str(len(rows)), *(f"{v:.3f}" for v in ms),
                      *(f"{100 * v:.1f}%" for v in shares)])
    widths = [max(len(r[c]) for r in table) for c in range(len(table[0]))]
    lines = ["  ".join(f.rjust(w) for f, w in zip(r, widths)).rstrip() for r in table]
    head = f"{len(spans)} stages, items {_ranges(counted)}, times in ms"
    return "\n".join([head, *lines])


def _shown(items, first: int, last: int | None, max_items: int):
    """Items `first..last` on every stage (at most `max_items` when `last` is None)."""
    spans = _spans(items)
    ks = [k for k in next(iter(spans.values())) if first <= k and (last is None or k <= last)]
    if not ks:
        raise ValueError(f"no item in {first}..{'' if last is None else last} is on every stage "
                         f"(items on every stage: {_ranges(next(iter(spans.values())))}); widen "
                         "--first/--last")
    ks = ks if last is not None else ks[:max_items]
    return {s: {k: per[k][:2] for k in ks} for s, per in spans.items()}, ks


def gantt(items, *, first: int = 0, last: int | None = None, width: int = 120,
          max_items: int = 20) -> str:
    """Items `first..last` on every stage (`max_items` from `first` if `last` is None) as text: a
    row per stage of `width` columns, '.' a gap and the item number mod 10 from start to done."""
    if width < 1:
        raise ValueError(f"gantt width {width}: give at least 1 column")
    shown, ks = _shown(items, first, last, max_items)
    t0 = min(start for per in shown.values() for start, _ in per.values())
    t1 = max(done for per in shown.values() for _, done in per.values())
    span = max(t1 - t0, 1)
    label = max(len(str(s)) for s in shown)
    lines = [f"items {ks[0]}..{ks[-1]} over {span / 1e3:.3f} ms, {span / 1e3 / width:.3f} ms a "
             "column"]
    for s, per in shown.items():
        row = ["."] * width
        for k, (start, done) in per.items():
            c0 = min(max((start - t0) * width // span, 0), width - 1)
            c1 = min(max(-(-(done - t0) * width // span), c0 + 1), width)
            row[c0:c1] = str(k % 10) * (c1 - c0)
        lines.append(f"stage {s:>{label}} |{''.join(row)}|")
    return "\n".join(lines)


def png(items, path, *, first: int = 0, last: int | None = None, max_items: int = 20) -> Path:
    """Draws `gantt`'s chart as a PNG at `path`: a horizontal bar per item on each stage's row."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    shown, ks = _shown(items, first, last, max_items)
    t0 = min(start for per in shown.values() for start, _ in per.values())
    fig = Figure(figsize=(12, 1.2 + 0.6 * len(shown)))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    colors = [f"C{i}" for i in range(10)]
    for y, (s, per) in enumerate(shown.items()):
        for k, (start, done) in per.items():
            x, w = (start - t0) / 1e3, max(done - start, 0) / 1e3
            ax.broken_barh([(x, w)], (y - 0.4, 0.8), facecolors=colors[k % 10], edgecolor="k",
                           linewidth=0.5)
            ax.text(x + w / 2, y, str(k), ha="center", va="center", fontsize=7)
    ax.set_yticks(range(len(shown)), [f"stage {s}" for s in shown])
    ax.invert_yaxis()
    ax.set_xlabel("ms since the first start")
    ax.set_title(f"pipeline timeline, items {ks[0]}..{ks[-1]}")
    fig.tight_layout()
    try:
        fig.savefig(path, format="png", dpi=100)
    except OSError as e:
        raise OSError(f"--png {path}: cannot write it ({e.strerror or e})") from None
    return Path(path)
