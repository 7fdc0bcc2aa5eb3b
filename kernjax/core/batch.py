"""What the next item of a serving pipeline carries: one-row steps of generating sequences beside
the next rows of prompts, under the chunk's row budget (continuous batching).

A sequence that generates needs one row per token: its last known token at its position, whose
sampled next token comes back with the item (a *step*; a prompt's last token is its first step,
kern's one-row step). A prompt's other rows go in chunks (`pack`). Every item is one program of
the cut: a decode bucket (`decode<B>`: B sequences of one row) when it holds steps only, else the
prefill chunk (or the score chunk where a prompt is scored) holding the steps first and the
packed prompt rows after them, within the chunk's rows, sequences and context (vLLM and SGLang's
chunked-prefill policy: steps are never held back for a prompt, and a prompt fills what the steps
leave). Unmixed (`mix=False`, the head's batch-invariant policy), steps never share an item with
prompt rows while there is a bucket to hold them: an item is steps only or prompt rows only.

Through a pipeline of S stages a sequence's next step waits for its last token, so one item of
every step would leave S - 1 stages idle. Steps are taken as micro-batches of at most
ceil(generating / S) sequences, oldest first, so S disjoint micro-batches keep every stage busy
in the steady state. A row's bits do not depend on which item or program holds it (each program
gives a row the same arithmetic on the CPU: tested), so there the policy changes speed, never
tokens. On a GPU a row's bits follow its program's row count (XLA picks each GEMM's kernel by its
shape), so the head's batch-invariant policy offers one bucket and `mix=False`: every step then
runs in one program, whatever its company.

Pure: ints in, a plan out.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from kernjax.core.pack import Waiting, pack


@dataclasses.dataclass(frozen=True)
class Plan:
    """The next item: `steps` (indices into the ready list), `pieces` (`(index into waiting,
    rows)`, as `pack` plans them), and its program: `bucket` B for a decode bucket, or 0 for the
    chunk."""

    steps: tuple[int, ...]
    pieces: tuple[tuple[int, int], ...]
    bucket: int

    @property
    def rows(self) -> int:
        return len(self.steps) + sum(n for _, n in self.pieces)


def plan(ready: Sequence[int], generating: int, waiting: Sequence[Waiting], *, rows: int,
         seqs: int, context: int, buckets: Sequence[int], stages: int,
         mix: bool = True) -> Plan | None:
    """The next item, or None when there is nothing to issue.

    Args:
      ready: the positions of the sequences whose step can go now, oldest first.
      generating: the sequences taking steps, ready or in flight (the micro-batch is a share
        of them).
      waiting: the prompts with chunk rows left, in admission order (`pack`'s input).
      rows, seqs, context: the chunk program's bounds (`pack`'s).
      buckets: the decode programs' sequence counts; empty: steps go in the chunk program.
      stages: the pipeline's stages.
      mix: whether steps may go beside prompt rows in the chunk; False: a step goes in a bucket
        whenever there is one (ready steps first, then prompt rows in an item of their own).
    """
    share = -(-max(generating, len(ready), 1) // stages)
    top = max(buckets) if buckets else seqs
    take = min(len(ready), share, top)
    left = any(w.left for w in waiting)
    alone = buckets and not mix  # steps and prompt rows never in one item
    if left and not (alone and take):
        d = 0 if alone else min(take, seqs - 1, rows - 1)
        ctx = context - sum(p + 1 for p in ready[:d])
        pieces = pack(waiting, rows=rows - d, seqs=seqs - d, context=ctx) if ctx > 0 else []
        if pieces:
            return Plan(tuple(range(d)), tuple(pieces), 0)
    if not take:
        return None
    fit = sorted(b for b in buckets if b >= take)
    if fit:
        return Plan(tuple(range(take)), (), fit[0])
    return Plan(tuple(range(min(take, seqs, rows))), (), 0)
