"""What the next item of a packed prefill carries: the oldest prompts' next rows, back to back.

This is kern's `pack` (crates/kern-serve/src/pp/pack.rs). An item reads each stage's weights once
whatever its rows, so a pipeline fed one prompt per item pays a whole weight pass for a prompt's
last few rows. Packing fills each item instead: the admitted prompts, in admission order, each
give their next rows until the item is out of rows, sequences or context.

The rule, exactly kern's. Walk the prompts with rows left, oldest first, keeping the rows used and
the context used so far. A prompt at position `pos` gets `n = min(left, rows - used, room)` rows,
where `room = max(0, context - (ctx + pos))`. Stop at the first prompt that gets none, or once
`seqs` pieces are planned; otherwise plan `(i, n)` and add `n` to the rows and `pos + n` to the
context. So only the last planned piece can be partial, and no prompt overtakes an older one:
a prompt arriving later never starves an earlier, longer one.

The context bound is a sum over the item, Σ(pos + n). A piece's rows attend to the keys at
positions `0..pos+n` of their sequence, so the sum counts the keys all rows of the item read: it
bounds the attention work of one item, what a program sized by its context expands. It is not a
sequence's own limit, which is its page-table row (`Pool.fits`).

Kern's bug this module avoids. The oldest prompt with rows left is always planned first, into an
empty item, so it gets `room = context - pos`. If its length exceeds `context`, it reaches
`pos == context` with rows still left, and from then on `pack` returns an empty plan forever;
since nothing may pass the oldest prompt, the head wedged silently (kern's admission checked only
the page row). Admission must refuse such a prompt with `admissible`. Conversely, when every
waiting prompt's length is at most `context`, the oldest unfinished prompt advances by at least
one row per plan, so repeated packing drains everything: a prompt whose rows do not fit beside
others still goes through once it is alone.

`full` says whether an item leaves no room: the head sends a full item at once, and holds a
partial one while as many items as stages are in flight (`head.py` has an exception). An item cut
short by the context bound counts as partial, as in kern. Pure: ints in, ints out.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class Waiting:
    """Sequence `seq`, with rows `0..pos` already issued and `left` rows still to issue."""

    seq: int
    pos: int
    left: int

    def __post_init__(self):
        if self.pos < 0 or self.left < 0:
            raise ValueError(f"sequence `{self.seq}` has pos {self.pos} and left {self.left}; "
                             "both count rows and must be at least 0")


def pack(waiting: Sequence[Waiting], *, rows: int, seqs: int,
         context: int) -> list[tuple[int, int]]:
    """The next item as `(index into waiting, rows)` per piece, oldest first.

    Empty when nothing is waiting, or when the oldest prompt with rows left cannot advance.

    Args:
      waiting: the admitted prompts in admission order; those with no rows left are skipped.
      rows: the most rows an item holds.
      seqs: the most pieces (sequences) an item holds.
      context: the most Σ(pos + n) over an item's pieces: the keys its rows read.
    """
    _check(rows=rows, seqs=seqs, context=context)
    plan: list[tuple[int, int]] = []
    used = ctx = 0
    for i, w in enumerate(waiting):
        if w.left == 0:
            continue
        room = max(0, context - (ctx + w.pos))
        n = min(w.left, rows - used, room)
        if n == 0 or len(plan) == seqs:
            break
        plan.append((i, n))
        used += n
        ctx += w.pos + n
    return plan


def full(plan: Sequence[tuple[int, int]], *, rows: int, seqs: int) -> bool:
    """Whether the planned item has all its rows or all its sequences, so it goes out at once."""
    return sum(n for _, n in plan) == rows or len(plan) == seqs


def admissible(tokens: int, *, rows: int, seqs: int, context: int) -> str | None:
    """None if `pack` always eventually places a prompt of `tokens` tokens; otherwise why not.

    A prompt is placed once it is the oldest, so this is whether it can be packed alone.
    """
    _check(rows=rows, seqs=seqs, context=context)
    if tokens < 1:
        return f"the prompt has {tokens} tokens; a sequence needs at least 1"
    if tokens > context:
        return (f"the prompt has {tokens} tokens; an item's context holds at most {context} "
                "(the sum over its sequences of position plus rows), so its last rows could "
                "never be packed")
    return None


def _check(*, rows: int, seqs: int, context: int) -> None:
    bad = [f"`{k}` = {v}" for k, v in (("rows", rows), ("seqs", seqs), ("context", context))
           if v < 1]
    if bad:
        raise ValueError(f"item bounds {', '.join(bad)} let an item hold nothing, so every plan "
                         "would be empty; give each bound at least 1")
