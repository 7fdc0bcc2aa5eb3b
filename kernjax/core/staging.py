"""The staging plan for weights derived at load (kern's `derive.rs` `plan`/`layout`).

Derive programs run call by call while loading; their calls, concatenated in program-name order,
are numbered 0, 1, 2, .... A source tensor is live from the first call that reads it to the last
(a closed window `[first, last]`) and sits, for that window only, in ONE staging allocation.

`layout` places the windows first-fit in arrival order:
1. sort windows by (first, index in the input): deterministic, independent of names;
2. the placed windows still alive are those with `last >= first` (they started no later);
3. try offset 0; on hitting an alive window, jump to its end rounded up to `align` bytes, until
   the bytes fit;
4. total = max(offset + nbytes).
Windows alive at the same call never share a byte; a source whose last reader has run hands its
bytes on. `peak_live` is the widest live set, a lower bound on the total: first-fit meets it when
every size is the same multiple of `align` (and can exceed it otherwise, by fragmentation and
alignment); it never exceeds the sum of sizes rounded up to `align`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple


@dataclasses.dataclass(frozen=True)
class Recipe:
    """One derive call: `fn(*sources)` returns the arrays `outputs` (each `(name, shape,
    dtype)`), reading the checkpoint tensors `sources` (each `(name, shape, dtype)`)."""

    outputs: tuple[tuple[str, tuple[int, ...], str], ...]
    sources: tuple[tuple[str, tuple[int, ...], str], ...]
    fn: Callable


class Window(NamedTuple):
    """A source of `nbytes` bytes read by derive calls `first` .. `last` (inclusive)."""
    name: str
    nbytes: int
    first: int
    last: int


class Plan(NamedTuple):
    offsets: dict[str, int]  # name -> byte offset in the staging allocation
    total: int               # the allocation's size in bytes


def windows(calls: Iterable[Iterable[str]], nbytes: dict[str, int]) -> list[Window]:
    """The windows of the sources read by `calls` (each a list of source names), in the order
    their first reader arrives."""
    span: dict[str, list[int]] = {}
    for i, names in enumerate(calls):
        for name in names:
            span.setdefault(name, [i, i])[1] = i
    return [Window(n, nbytes[n], a, b) for n, (a, b) in span.items()]


def _check(ws: Sequence[Window], align: int) -> None:
    if align < 1:
        raise ValueError(f"align must be >= 1, got {align}")
    names = [w.name for w in ws]
    if len(set(names)) != len(names):
        raise ValueError("source names must be unique")
    for w in ws:
        if w.nbytes < 0 or w.first > w.last:
            raise ValueError(f"bad window {w}: needs nbytes >= 0 and first <= last")


def layout(ws: Sequence[Window], align: int = 256) -> Plan:
    """First-fit offsets for `ws` in one allocation (see the module doc)."""
    ws = [Window(*w) for w in ws]
    _check(ws, align)
    placed: list[tuple[int, int, int]] = []  # (offset, nbytes, last)
    offsets: dict[str, int] = {}
    for w in sorted(ws, key=lambda w: w.first):  # stable: ties keep input order
        off = 0
        for o, n, _ in sorted(p for p in placed if p[2] >= w.first):
            if off + w.nbytes <= o:
                break  # fits in the gap before this one
            if o + n > off and n > 0:  # overlaps: jump past it
                off = -(-(o + n) // align) * align
        placed.append((off, w.nbytes, w.last))
        offsets[w.name] = off
    return Plan(offsets, max((o + n for o, n, _ in placed), default=0))


def peak_live(ws: Sequence[Window]) -> int:
    """The largest total of bytes live at one call: the lower bound on any layout's size."""
    ws = [Window(*w) for w in ws]
    return max((sum(v.nbytes for v in ws if v.first <= t <= v.last) for t in {w.first for w in ws}),
               default=0)
