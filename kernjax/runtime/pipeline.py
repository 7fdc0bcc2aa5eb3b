"""Single-prompt prefill: a prompt run chunk by chunk through the whole program or a cut's stages.

`Pipeline` runs stage artifacts in sequence in one process: each item goes to stage 0, each
stage's departures become the next stage's arrivals, and the last stage's `tokens` and `logits`
are the result. A pipeline of one stage is the whole program. `kernjax run` is the shell.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kernjax.core import lowering
from kernjax.core.cut import counted
from kernjax.core.item import Piece, chunks, make_item
from kernjax.runtime.runner import Runner, StageError


class Pipeline:
    """Stages of one cut, in order, run one item at a time in this process."""

    def __init__(self, runners: Sequence[Runner]):
        for r in runners[1:]:
            why = lowering.refusal(f"`{runners[0].art.path}`", runners[0].art.lowering,
                                   f"`{r.art.path}`", r.art.lowering)
            if why:
                raise StageError(why)
        ids = {r.art.cut_id for r in runners}
        idx = [r.art.index for r in runners]
        if len(ids) != 1:
            raise StageError(f"the stages belong to different cuts {sorted(ids)}; re-cut them "
                             "together")
        if idx != list(range(runners[0].art.stages)):
            raise StageError(f"expected stages 0..{runners[0].art.stages - 1} of cut "
                             f"`{runners[0].art.cut_id}`, got {idx}")
        self.runners = list(runners)
        self.shape = runners[0].art.item

    def run(self, item) -> dict:
        carry = []
        for r in self.runners:
            carry, out = r.run(item, carry)
        return out

    def reset(self) -> None:
        for r in self.runners:
            r.reset()

    def prefill(self, tokens: Sequence[int], *, chunk: int | None = None):
        """Prefills one prompt; yields the outputs after each chunk (the last is the answer)."""
        shape = self.shape
        chunk = chunk or shape.rows
        check_prompt(tokens, shape, chunk)
        pages = tuple(range(1, -(-len(tokens) // shape.page) + 1))
        toks = np.asarray(tokens, np.int32)
        for a, b in chunks(len(toks), chunk):
            yield self.run(make_item([Piece(toks[a:b], a, pages, 1 if shape.slots else 0)], shape))


def check_prompt(tokens: Sequence[int], shape, chunk: int) -> None:
    """Refuses, with the limit, a prompt this pipeline cannot place."""
    if len(tokens) == 0:
        raise ValueError("the prompt is empty; give at least one token")
    if not 1 <= chunk <= shape.rows:
        raise ValueError(f"chunk {chunk} must be between 1 and the program's {shape.rows} rows")
    if len(tokens) > shape.context:
        raise ValueError(f"the prompt has {len(tokens)} tokens; the program's context is "
                         f"{shape.context} (re-cut with a larger --context)")
    if shape.slots == 1:
        raise ValueError("the program's per-sequence states have no slot to lease (slot 0 never "
                         "is); re-cut with more --slots")
    if -(-len(tokens) // shape.page) + 1 > shape.pages:
        raise ValueError(f"the prompt needs {counted(-(-len(tokens) // shape.page), 'page')}; "
                         f"the states hold {shape.pages - 1}")

