"""Items: the fills and tables one run of a program takes, built from sequence pieces.

An item holds pieces of up to `seqs` sequences in `rows` rows, packed from row 0 and split by
`cu_seqlens`; the rest is padding. Every stage of a cut gets the same item; each takes the fills
and tables its own calls read. Pure: arrays in, arrays out.

  tokens      [rows]     the piece's token ids (0 in padding)
  positions   [rows]     each row's position in its sequence (0 in padding)
  slots       [rows]     where a row's keys and values go: `page * page_size + offset`;
                         padding gets `pages * page_size`, one past the end, so it writes nothing
  cu_seqlens  [seqs+1]   row offsets of the pieces; unused sequences are empty
  seq_slots   [seqs]     each sequence's slot in the per-sequence states (a recurrent state, a
                         conv tail: `models/seqstate.py`); unused entries hold `slots`, one past
                         the end, so they write nothing. A piece that starts at position 0 is a
                         fresh sequence, whose slot the model starts from zeros.
  page_table  [seqs, w]  each sequence's pages in order; unused entries are page 0, never leased
  sampling    [seqs, 4]  each sequence's (temperature, top_p, top_k, min_p), float32; greedy
                         (0, 1, 0, 0) where unused (`kernjax/kernels/head.py`)
  rng         [seqs, 3]  each sequence's (seed, choice, step), uint32: the key of its next draw
  targets     [rows]     the token each row is scored against (the score program): the piece's
                         next tokens; 0 past them and in padding
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np


GREEDY = (0.0, 1.0, 0, 0.0)  # (temperature, top_p, top_k, min_p): the most likely token


@dataclasses.dataclass(frozen=True)
class Piece:
    """Rows `start..start+len(tokens)` of one sequence, whose pages are `pages` and whose
    per-sequence states are at `slot` (0 for a program without them). Its next token is drawn
    with `sampling` and the key `rng` (seed, choice, step); `targets`, where given, are the
    tokens its rows are scored against (as many as its rows, or fewer: the rest get 0)."""

    tokens: np.ndarray
    start: int
    pages: tuple[int, ...]
    slot: int = 0
    sampling: tuple = GREEDY
    rng: tuple = (0, 0, 0)
    targets: np.ndarray | None = None


@dataclasses.dataclass(frozen=True)
class Shape:
    """What an item must fit: rows, sequences, page-table width, pages per paged state, page
    size, and slots per per-sequence state (0: the program has none)."""

    rows: int
    seqs: int
    width: int
    pages: int
    page: int
    slots: int = 0

    @property
    def context(self) -> int:
        return self.width * self.page


def item_shape(program, page: int) -> Shape:
    """The item shape a traced program takes, read off its fills, tables and states (a model
    lists its paged states before its per-sequence ones)."""
    by = {s.name: s for s in program.inputs}
    state = next((s for s in program.inputs if s.role == "state"), None)
    return Shape(rows=program.rows, seqs=by["cu_seqlens"].shape[0] - 1,
                 width=by["page_table"].shape[1], pages=state.shape[0] if state else 0, page=page,
                 slots=program.slots)


def make_item(pieces: Sequence[Piece], shape: Shape) -> dict[str, np.ndarray]:
    """The fills and tables of one item holding `pieces`, in order."""
    rows, n = shape.rows, sum(len(p.tokens) for p in pieces)
    if n > rows or len(pieces) > shape.seqs:
        raise ValueError(f"{len(pieces)} pieces of {n} rows do not fit an item of {rows} rows "
                         f"and {shape.seqs} sequences")
    tokens = np.zeros(rows, np.int32)
    positions = np.zeros(rows, np.int32)
    # A padding row's slot is past the state (dropped), and one of its own, so that every
    # item's slots are distinct and the KV write may promise unique indices (a plain store on a
    # GPU, not an atomic one).
    slots = shape.pages * shape.page + np.arange(rows, dtype=np.int32)
    cu = np.full(shape.seqs + 1, n, np.int32)
    seq_slots = np.full(shape.seqs, shape.slots, np.int32)
    table = np.zeros((shape.seqs, shape.width), np.int32)
    sampling = np.tile(np.asarray(GREEDY, np.float32), (shape.seqs, 1))
    rng = np.zeros((shape.seqs, 3), np.uint32)
    targets = np.zeros(rows, np.int32)
    at = 0
    for i, p in enumerate(pieces):
        k, end = len(p.tokens), p.start + len(p.tokens)
        if end > shape.context:
            raise ValueError(f"a sequence reaches position {end}; the program's context is "
                             f"{shape.context} tokens")
        if len(p.pages) * shape.page < end:
            raise ValueError(f"a sequence at position {end} has only {len(p.pages)} pages")
        if shape.slots and not 1 <= p.slot < shape.slots:
            raise ValueError(f"a sequence has state slot {p.slot}; the program's slots are 1 to "
                             f"{shape.slots - 1}")
        pos = np.arange(p.start, end, dtype=np.int32)
        pages = np.asarray(p.pages, np.int32)
        cu[i] = at
        tokens[at:at + k] = p.tokens
        positions[at:at + k] = pos
        slots[at:at + k] = pages[pos // shape.page] * shape.page + pos % shape.page
        table[i, :len(pages)] = pages
        seq_slots[i] = p.slot if shape.slots else 0
        sampling[i] = p.sampling
        rng[i] = p.rng
        if p.targets is not None:
            t = np.asarray(p.targets, np.int32)[:k]
            targets[at:at + len(t)] = t
        at += k
    return {"tokens": tokens, "positions": positions, "slots": slots, "cu_seqlens": cu,
            "seq_slots": seq_slots, "page_table": table, "sampling": sampling, "rng": rng,
            "targets": targets}


def chunks(n: int, rows: int) -> list[tuple[int, int]]:
    """`(start, end)` of each chunk of a prompt of `n` tokens, `rows` at a time."""
    return [(a, min(a + rows, n)) for a in range(0, n, rows)]
