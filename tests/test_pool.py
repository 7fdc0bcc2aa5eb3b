"""The page pool against a reference model: a set of free ids, simpler than the code.

Random runs of leases and releases are checked step by step against the model: each lease takes
the lowest free ids or nothing, no page is held twice, page 0 is never leased, and releasing every
lease gives every page back. `fits` is checked against the pool it describes and by its messages.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from kernjax.core.pool import Lease, Pool

SETTINGS = settings(derandomize=True, database=None, deadline=None, max_examples=300)


@st.composite
def _runs(draw):
    """Pool sizes and a run of ops: lease `tokens`, release the k-th held, release one twice."""
    pages, page, width = draw(st.integers(2, 24)), draw(st.integers(1, 8)), draw(st.integers(1, 8))
    op = st.one_of(st.tuples(st.just("lease"), st.integers(1, width * page)),
                   st.tuples(st.just("release"), st.integers(0, 99)),
                   st.tuples(st.just("again"), st.integers(0, 99)))
    return pages, page, width, draw(st.lists(op, max_size=40))


@SETTINGS
@given(_runs())
def test_leases_match_a_set_of_free_pages(run):
    pages, page, width, ops = run
    pool = Pool(pages, page, width)
    free = set(range(1, pages))
    held: list[Lease] = []
    gone: list[Lease] = []
    for op, x in ops:
        if op == "lease":
            need = math.ceil(x / page)
            if need > pages - 1:
                with pytest.raises(ValueError, match="refuse the prompt at admission"):
                    pool.lease(x)
                event("never fits")
            elif need > len(free):
                assert pool.lease(x) is None, (run, x)
                event("not now")
            else:
                got = pool.lease(x)
                assert (got.pages, got.tokens) == (tuple(sorted(free)[:need]), x), (run, x)
                free -= set(got.pages)
                held.append(got)
        elif op == "release" and held:
            lease = held.pop(x % len(held))
            pool.release(lease)
            free |= set(lease.pages)
            gone.append(lease)
        elif op == "again" and gone:
            with pytest.raises(ValueError, match="released already"):
                pool.release(gone[x % len(gone)])
            event("released twice")
        taken = [p for lease in held for p in lease.pages]
        assert len(taken) == len(set(taken)), run
        assert 0 not in taken, run
        assert set(taken) | free == set(range(1, pages)), run
        assert (pool.free, pool.in_use, pool.capacity) == (len(free), len(taken), pages - 1), run
    for lease in held:
        pool.release(lease)
    assert (pool.free, pool.in_use) == (pages - 1, 0), run
    most = min(width, pages - 1)
    assert pool.lease(most * page).pages == tuple(range(1, most + 1)), run


@SETTINGS
@given(st.integers(2, 40), st.integers(1, 16), st.integers(1, 40), st.integers(-2, 700))
def test_fits_exactly_what_an_empty_pool_can_lease(pages, page, width, tokens):
    pool = Pool(pages, page, width)
    ok = tokens >= 1 and math.ceil(tokens / page) <= min(width, pages - 1)
    assert (pool.fits(tokens) is None) == ok
    if ok:
        assert len(pool.lease(tokens).pages) == math.ceil(tokens / page)


def test_fits_names_the_limit():
    row = Pool(pages=1025, page=16, width=256)
    assert row.fits(4096) is None
    assert row.fits(5000) == ("the prompt has 5000 tokens; a sequence holds at most 4096 "
                              "(256 pages of 16)")
    small = Pool(pages=1025, page=16, width=2048)
    assert small.fits(16384) is None
    assert small.fits(20000) == ("the prompt has 20000 tokens; the pool holds 1024 pages of 16 "
                                 "tokens in all")
    assert small.fits(0) == "the prompt has 0 tokens; a sequence needs at least 1"


def test_a_lease_is_all_or_nothing_and_lowest_first():
    pool = Pool(pages=6, page=4, width=4)
    a = pool.lease(5)
    b = pool.lease(1)
    assert (a.pages, b.pages, pool.free) == ((1, 2), (3,), 2)
    assert pool.lease(9) is None
    assert pool.free == 2
    pool.release(a)
    assert pool.lease(12).pages == (1, 2, 4)


def test_a_foreign_or_twice_released_lease_is_refused():
    pool, other = Pool(8, 16, 4), Pool(8, 16, 4)
    mine, theirs = pool.lease(20), other.lease(20)
    with pytest.raises(ValueError, match="not made by this pool"):
        pool.release(theirs)
    with pytest.raises(ValueError, match="not made by this pool"):
        pool.release(Lease(99, (5,), 3))
    pool.release(mine)
    with pytest.raises(ValueError, match="released already"):
        pool.release(mine)
    assert (pool.free, other.in_use) == (7, 2)


def test_a_pool_with_nothing_to_lease_is_refused_with_every_reason():
    with pytest.raises(ValueError) as e:
        Pool(pages=1, page=0, width=0)
    assert [line.split(";")[0] for line in str(e.value).splitlines()] == [
        "pool cannot be made:",
        "  - a pool of 1 pages has none to lease (page 0 is never leased)",
        "  - a page of 0 tokens holds nothing",
        "  - a page-table row of 0 pages holds no sequence",
    ]


def test_slots_are_leased_with_the_pages_lowest_first_and_given_back():
    p = Pool(pages=10, page=4, width=8, slots=3)  # slots 1 and 2
    a, b = p.lease(4), p.lease(4)
    assert (a.slot, b.slot) == (1, 2)
    assert p.lease(1) is None, "no slot free: not now, even with pages free"
    assert p.slots_in_use == 2
    assert p.free == 7, "a refused lease takes nothing"
    p.release(a)
    c = p.lease(8)
    assert c.slot == 1 and len(c.pages) == 2
    assert Pool(pages=10, page=4, width=8).lease(4).slot == 0, "a pool without slots leases none"
    with pytest.raises(ValueError, match="at least 2 slots"):
        Pool(pages=10, page=4, width=8, slots=1)
