"""Packing, after kern's `pp/pack.rs` tests: its unit cases, then plans applied until drained.

The property test restates the rules plainly rather than re-running them: every plan stays within
its bounds, takes the oldest prompts in order with only the last one partial, leaves out no prompt
that could still take a row, and applying plans repeatedly sends every row exactly once. Prompts
that `admissible` accepts always drain; one it refuses wedges `pack`, which is why it refuses.
"""

from __future__ import annotations

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from kernjax.core.pack import Waiting, admissible, full, pack

B = dict(rows=8, seqs=3, context=20)


def _w(*pairs):
    return [Waiting(i, pos, left) for i, (pos, left) in enumerate(pairs)]


def test_kern_cases():
    assert pack(_w((0, 5), (0, 5), (0, 5)), **B) == [(0, 5), (1, 3)]
    assert pack(_w((0, 20)), **B) == [(0, 8)]
    assert pack(_w((16, 8), (0, 8)), **B) == [(0, 4)]
    assert pack(_w((10, 2), (0, 8)), **B) == [(0, 2), (1, 6)]
    assert pack(_w((20, 2)), **B) == []


def test_kern_cases_oldest_first():
    assert pack(_w((0, 1), (0, 1), (0, 1), (0, 1)), **B) == [(0, 1), (1, 1), (2, 1)]
    assert pack(_w((4, 0), (0, 2)), **B) == [(1, 2)]
    assert pack([], **B) == []


def test_a_prompt_too_long_for_company_goes_through_alone():
    assert pack(_w((5, 3), (15, 5)), **B) == [(0, 3)]
    assert pack(_w((8, 0), (15, 5)), **B) == [(1, 5)]


def _drain(waiting, *, rows, seqs, context, note=lambda what: None):
    """Plans and applies until empty, checking each plan; returns the rows sent per prompt."""
    w = list(waiting)
    sent = [[] for _ in w]
    for _ in range(sum(x.left for x in w) + 1):
        plan = pack(w, rows=rows, seqs=seqs, context=context)
        if not plan:
            break
        active = [i for i, x in enumerate(w) if x.left > 0]
        idx = [i for i, _ in plan]
        assert sum(n for _, n in plan) <= rows, (w, plan)
        assert len(plan) <= seqs, (w, plan)
        assert sum(w[i].pos + n for i, n in plan) <= context, (w, plan)
        assert all(a < b for a, b in zip(idx, idx[1:])), (w, plan)
        assert idx[0] == active[0], (w, plan)
        assert idx == active[:len(plan)], (w, plan)
        assert all(1 <= n <= w[i].left for i, n in plan), (w, plan)
        assert all(n == w[i].left for i, n in plan[:-1]), (w, plan)
        used = sum(n for _, n in plan)
        ctx = sum(w[i].pos + n for i, n in plan)
        if len(plan) < len(active) and len(plan) < seqs and used < rows:
            nxt = w[active[len(plan)]]
            assert ctx + nxt.pos + 1 > context, (w, plan)
            note("cut short by context")
        if full(plan, rows=rows, seqs=seqs):
            note("full")
        for i, n in plan:
            sent[i] += range(w[i].pos, w[i].pos + n)
            w[i] = Waiting(w[i].seq, w[i].pos + n, w[i].left - n)
    return w, sent


@st.composite
def _queues(draw):
    """Bounds and up to six prompts of length 1..context, some already part issued."""
    rows, seqs = draw(st.integers(1, 10)), draw(st.integers(1, 4))
    context = draw(st.integers(1, 30))
    prompts = []
    for seq in range(draw(st.integers(0, 6))):
        total = draw(st.integers(1, context))
        pos = draw(st.sampled_from([0, 0, draw(st.integers(0, total))]))
        prompts.append(Waiting(seq, pos, total - pos))
    return dict(rows=rows, seqs=seqs, context=context), prompts


@settings(derandomize=True, database=None, deadline=None, max_examples=400)
@given(_queues())
def test_plans_drain_every_admissible_prompt_within_bounds(case):
    bounds, waiting = case
    assert all(admissible(x.pos + x.left, **bounds) is None for x in waiting)
    if any(x.pos > 0 for x in waiting):
        event("some prompt part issued")
    w, sent = _drain(waiting, **bounds, note=event)
    assert all(x.left == 0 for x in w), (case, w)
    assert sent == [list(range(x.pos, x.pos + x.left)) for x in waiting], case


def test_kern_small_inputs_all_drain():
    """Kern's exhaustive case: lefts 0..4 x 0..4 x 0..10, the first prompt at 0..3."""
    for a in range(4):
        for b in range(4):
            for c in range(10):
                for p0 in range(3):
                    waiting = _w((p0, a), (0, b), (0, c))
                    w, sent = _drain(waiting, **B)
                    assert all(x.left == 0 for x in w), (a, b, c, p0)
                    assert sum(map(len, sent)) == a + b + c, (a, b, c, p0)


def test_a_prompt_longer_than_the_context_wedges_pack_so_admission_refuses_it():
    w, _ = _drain(_w((0, 21)), **B)
    assert (w[0].pos, w[0].left, pack(w, **B)) == (20, 1, [])
    assert admissible(21, **B) == ("the prompt has 21 tokens; an item's context holds at most 20 "
                                   "(the sum over its sequences of position plus rows), so its "
                                   "last rows could never be packed")
    assert admissible(20, **B) is None
    assert admissible(0, **B) == "the prompt has 0 tokens; a sequence needs at least 1"


def test_full_is_all_rows_or_all_sequences():
    assert full([(0, 5), (1, 3)], rows=8, seqs=3)
    assert full([(0, 1), (1, 1), (2, 1)], rows=8, seqs=3)
    assert not full([(0, 4)], rows=8, seqs=3)
    assert not full([], rows=8, seqs=3)


def test_bounds_and_rows_below_one_are_refused():
    with pytest.raises(ValueError, match="`rows` = 0, `context` = 0"):
        pack([], rows=0, seqs=3, context=0)
    with pytest.raises(ValueError, match="`seqs` = 0"):
        admissible(5, rows=8, seqs=0, context=20)
    with pytest.raises(ValueError, match="sequence `7` has pos -1"):
        Waiting(7, -1, 3)
