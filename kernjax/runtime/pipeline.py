"""One sequence through the whole program or a cut's stages, in this process: prefill, score,
generate.

`Pipeline` runs stage artifacts in sequence: each item goes to stage 0, each stage's departures
become the next stage's arrivals, and the last stage's outputs are the result. A pipeline of one
stage is the whole program. Every stage runs the item through the same program of its cut
(`prefill`, `score`, `decode<B>`). `kernjax run` and `kernjax chain` are the shells.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kernjax import artifact
from kernjax.core import lowering
from kernjax.core.cut import counted
from kernjax.core.item import GREEDY, Piece, chunks, make_item
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
            sets = {f"`{r.art.path}`": ", ".join(r.art.programs) for r in runners}
            differ = len(set(sets.values())) > 1
            raise StageError(f"the stages belong to different cuts {sorted(ids)}"
                             + ("; their programs differ: " + "; ".join(
                                 f"{p} has {v}" for p, v in sets.items()) if differ else "")
                             + "; re-cut them together")
        if idx != list(range(runners[0].art.stages)):
            raise StageError(f"expected stages 0..{runners[0].art.stages - 1} of cut "
                             f"`{runners[0].art.cut_id}`, got {idx}")
        self.runners = list(runners)
        self.shape = runners[0].art.item
        self.programs = runners[0].art.programs

    def run(self, item, program: str = artifact.DEFAULT) -> dict:
        carry = []
        for r in self.runners:
            carry, out = r.run(item, carry, program=program)
        return out

    def reset(self) -> None:
        for r in self.runners:
            r.reset()

    @property
    def step(self) -> str:
        """The program a one-row step runs: the largest decode bucket, the one a batch-invariant
        head puts every step in (`kernjax.serve.head`), else the prefill chunk."""
        buckets = artifact.decode_buckets(self.programs)
        return f"decode{buckets[-1]}" if buckets else artifact.DEFAULT

    def prefill(self, tokens: Sequence[int], *, chunk: int | None = None):
        """Prefills one prompt; yields the outputs after each chunk (the last is the answer)."""
        shape = self.shape
        chunk = chunk or shape.rows
        check_prompt(tokens, shape, chunk)
        pages = tuple(range(1, -(-len(tokens) // shape.page) + 1))
        toks = np.asarray(tokens, np.int32)
        for a, b in chunks(len(toks), chunk):
            yield self.run(make_item([Piece(toks[a:b], a, pages, 1 if shape.slots else 0)], shape))

    def score(self, tokens: Sequence[int], *, chunk: int | None = None):
        """Scores one prompt through the `score` program, chunk by chunk: each row against the
        prompt's next token (the last row against 0); yields each chunk's outputs."""
        if "score" not in self.programs:
            raise StageError("the cut has no `score` program: re-cut it with this kernjax")
        shape = self.programs["score"].item
        chunk = chunk or shape.rows
        check_prompt(tokens, shape, chunk)
        pages = tuple(range(1, -(-len(tokens) // shape.page) + 1))
        toks = np.asarray(tokens, np.int32)
        for a, b in chunks(len(toks), chunk):
            piece = Piece(toks[a:b], a, pages, 1 if shape.slots else 0, targets=toks[a + 1:b + 1])
            yield self.run(make_item([piece], shape), "score")

    def generate(self, tokens: Sequence[int], *, max_tokens: int, chunk: int | None = None,
                 sampling: tuple = GREEDY, seed: int = 0, stop: Sequence[int] = ()):
        """Generates up to `max_tokens` tokens after one prompt: all but its last token prefill in
        chunks, then the last prompt token and each new one go through the step (`step`); yields
        each step's outputs (its `next_token` is the next token), ending after a token of `stop`."""
        shape = self.shape
        chunk = chunk or shape.rows
        check_prompt(tokens, shape, chunk, extra=max_tokens)
        total = len(tokens) + max_tokens
        pages = tuple(range(1, -(-total // shape.page) + 1))
        slot = 1 if shape.slots else 0
        toks = np.asarray(tokens, np.int32)
        for a, b in chunks(len(toks) - 1, chunk):
            self.run(make_item([Piece(toks[a:b], a, pages, slot)], shape))
        step, last = self.programs[self.step].item, int(toks[-1])
        for k in range(max_tokens):
            pos = len(toks) - 1 + k
            out = self.run(make_item([Piece(np.asarray([last], np.int32), pos, pages, slot,
                                            sampling=sampling, rng=(seed, 0, k))], step),
                           self.step)
            yield out
            last = int(np.asarray(out["next_token"])[0])
            if last in stop:
                return


def check_prompt(tokens: Sequence[int], shape, chunk: int, *, extra: int = 0) -> None:
    """Refuses, with the limit, a prompt this pipeline cannot place (with `extra` tokens to
    generate after it)."""
    if len(tokens) == 0:
        raise ValueError("the prompt is empty; give at least one token")
    if not 1 <= chunk <= shape.rows:
        raise ValueError(f"chunk {chunk} must be between 1 and the program's {shape.rows} rows")
    n = len(tokens) + extra
    what = f"the prompt has {len(tokens)} tokens" + (f" and {extra} to generate" if extra else "")
    if n > shape.context:
        raise ValueError(f"{what}; the program's context is {shape.context} (re-cut with a "
                         "larger --context)")
    if shape.slots == 1:
        raise ValueError("the program's per-sequence states have no slot to lease (slot 0 never "
                         "is); re-cut with more --slots")
    if -(-n // shape.page) + 1 > shape.pages:
        raise ValueError(f"{what}, {counted(-(-n // shape.page), 'page')}; the states hold "
                         f"{shape.pages - 1}")
