"""The serving batch plan (`kernjax.core.batch.plan`): steps beside packed prompt rows, decode
buckets, micro-batches through a pipeline. Pure: no devices."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kernjax.core.batch import plan
from kernjax.core.pack import Waiting

BOUNDS = dict(rows=8, seqs=4, context=64)


def test_steps_alone_take_the_smallest_bucket_that_holds_them():
    p = plan([5, 9, 3], 3, [], buckets=[1, 4, 16], stages=1, **BOUNDS)
    assert (p.steps, p.pieces, p.bucket) == ((0, 1, 2), (), 4)
    assert plan([5], 1, [], buckets=[1, 4, 16], stages=1, **BOUNDS).bucket == 1


def test_steps_go_beside_prompt_rows_in_the_chunk_and_leave_it_room():
    p = plan([5, 9, 3, 2, 7], 5, [Waiting(0, 0, 20)], buckets=[1, 4], stages=1, **BOUNDS)
    assert p.bucket == 0
    assert p.steps == (0, 1, 2)  # seqs - 1: one sequence left for the prompt
    assert p.pieces == ((0, 5),)  # the rows the steps leave
    assert p.rows == 8


def test_a_pipeline_takes_steps_in_micro_batches_of_its_share():
    p = plan(list(range(10)), 10, [], buckets=[1, 4, 16], stages=3, **BOUNDS)
    assert (len(p.steps), p.bucket) == (4, 4)  # ceil(10 / 3)


def test_unmixed_steps_go_alone_in_their_bucket_and_prompt_rows_after_them():
    """The batch-invariant head's policy: an item is steps only or prompt rows only."""
    p = plan([5, 9, 3], 3, [Waiting(0, 0, 20)], buckets=[16], stages=1, mix=False, **BOUNDS)
    assert (p.steps, p.pieces, p.bucket) == ((0, 1, 2), (), 16)
    p = plan([], 3, [Waiting(0, 0, 20)], buckets=[16], stages=1, mix=False, **BOUNDS)
    assert not p.steps and p.pieces and p.bucket == 0
    p = plan([5], 3, [Waiting(0, 0, 20)], buckets=[], stages=1, mix=False, **BOUNDS)
    assert p.steps == (0,) and p.pieces and p.bucket == 0  # without a bucket: the chunk


def test_without_buckets_steps_go_in_the_chunk():
    p = plan([1, 2, 3, 4, 5, 6], 6, [], buckets=[], stages=1, **BOUNDS)
    assert (p.steps, p.bucket) == ((0, 1, 2, 3), 0)


def test_nothing_to_do_is_none():
    assert plan([], 0, [], buckets=[1], stages=2, **BOUNDS) is None
    assert plan([], 3, [Waiting(0, 4, 0)], buckets=[1], stages=2, **BOUNDS) is None


@settings(max_examples=300, deadline=None)
@given(ready=st.lists(st.integers(0, 40), max_size=12),
       extra=st.integers(0, 6),
       waiting=st.lists(st.tuples(st.integers(0, 30), st.integers(0, 20)), max_size=5),
       buckets=st.sets(st.integers(1, 16), max_size=4), stages=st.integers(1, 4),
       rows=st.integers(1, 16), seqs=st.integers(1, 8), mix=st.booleans())
def test_every_plan_keeps_its_programs_bounds(ready, extra, waiting, buckets, stages, rows, seqs,
                                              mix):
    ws = [Waiting(i, pos, left) for i, (pos, left) in enumerate(waiting)]
    p = plan(ready, len(ready) + extra, ws, rows=rows, seqs=seqs, context=200,
             buckets=sorted(buckets), stages=stages, mix=mix)
    if p is None:
        assert not ready and not any(w.left for w in ws)
        return
    assert p.steps == tuple(range(len(p.steps)))  # the oldest ready steps
    assert len(p.steps) <= -(-max(len(ready) + extra, 1) // stages)
    if p.bucket:
        assert p.bucket in buckets and len(p.steps) <= p.bucket and not p.pieces
        assert all(b < len(p.steps) for b in buckets if b < p.bucket)  # the smallest that fits
    else:
        assert p.rows <= rows and len(p.steps) + len(p.pieces) <= seqs
        assert sum(ready[i] + 1 for i in p.steps) + sum(ws[i].pos + n for i, n in p.pieces) <= 200
    assert p.rows >= 1
    if buckets and not mix:  # unmixed: a step is in a bucket, never beside prompt rows
        assert not (p.steps and p.pieces) and (p.bucket or not p.steps)
        assert bool(p.steps) == bool(ready)  # ready steps go first
