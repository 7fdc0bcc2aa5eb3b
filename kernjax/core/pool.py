"""The head's page pool: which KV pages each admitted prompt holds until its reply arrives.

This is the part of kern's `kern-pool` that pipeline prefill uses (kern-serve.md §8). There is
one pool, on the head. Every stage's KV states hold only that stage's layers, under the head's
page ids: states never cross a cut and page tables are interchangeable, so one accounting serves
all stages, sized to the fewest pages any stage has. Stages keep no books of their own.

Pages are `page` tokens each. A state has `pages` pages; ids `1..pages-1` are leasable and page 0
never is, because an item's unused page-table entries point at page 0 (item.py). A sequence's
page-table row is `width` pages wide, so one sequence holds at most `width * page` tokens.

A lease is all or nothing: `lease(tokens)` takes `ceil(tokens / page)` pages or none. Pages go
lowest free id first, so the same requests in the same order get the same pages, and a test or a
replayed log sees the same tables. Pipeline prefill leases pages for the prompt only (no decode
reservation, no prefix cache); a sequence that generates grows its lease a page at a time
(`grow`, all or nothing) and releases it when it ends.

Two answers must not be confused, since the head acts differently on each. *Never*: `fits` names
the limit a prompt exceeds (its row, or the whole pool) and admission refuses the request, as
kern's `ExceedsRow` and `ExceedsPool` do. *Not now*: `lease` returns None and admission waits for
a release, as kern's `Busy` does. Leasing a prompt that `fits` refuses is a caller bug and raises.

A program with per-sequence states (`Shape.slots`, `models/seqstate.py`) also needs one state
slot per sequence: a pool made with `slots` leases the lowest free slot (1..slots-1; slot 0 never
is) with the pages, all or nothing, and takes it back with them.

A `Lease` is a handle: `release` takes back the object `lease` returned, once. A second release,
or a lease another pool made, raises rather than corrupt the free list. Pure: ints in, ints out;
no devices, threads or clocks.
"""

from __future__ import annotations

import dataclasses
import heapq


@dataclasses.dataclass(frozen=True)
class Lease:
    """Pages `pages` (ascending ids) and state slot `slot` (0 in a pool without slots) held for
    a prompt of `tokens` tokens; `id` counts from 1."""

    id: int
    pages: tuple[int, ...]
    tokens: int
    slot: int = 0


class Pool:
    """Pages `1..pages-1` of `page` tokens, leased to sequences of at most `width` pages, and
    with `slots`, one of the state slots `1..slots-1` a sequence."""

    def __init__(self, pages: int, page: int, width: int, slots: int = 0):
        errs = []
        if pages < 2:
            errs.append(f"a pool of {pages} pages has none to lease (page 0 is never leased); "
                        "give at least 2")
        if page < 1:
            errs.append(f"a page of {page} tokens holds nothing; give at least 1")
        if width < 1:
            errs.append(f"a page-table row of {width} pages holds no sequence; give at least 1")
        if slots == 1:
            errs.append("a program with per-sequence states needs at least 2 slots (slot 0 is "
                        "never leased)")
        if errs:
            raise ValueError("pool cannot be made:\n" + "\n".join(f"  - {e}" for e in errs))
        self.pages, self.page, self.width = pages, page, width
        self._free = list(range(1, pages))  # ascending, hence already a min-heap
        self.slots = slots
        self._free_slots = list(range(1, slots))
        self._held: dict[int, Lease] = {}
        self._next = 1

    @property
    def capacity(self) -> int:
        """Leasable pages: all but page 0."""
        return self.pages - 1

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def in_use(self) -> int:
        return self.capacity - len(self._free)

    @property
    def slots_in_use(self) -> int:
        return max(self.slots - 1, 0) - len(self._free_slots)

    def fits(self, tokens: int) -> str | None:
        """None if a prompt of `tokens` tokens could ever be leased; otherwise why it never can."""
        if tokens < 1:
            return f"the prompt has {tokens} tokens; a sequence needs at least 1"
        need = -(-tokens // self.page)
        if need > self.width:
            return (f"the prompt has {tokens} tokens; a sequence holds at most "
                    f"{self.width * self.page} ({self.width} pages of {self.page})")
        if need > self.capacity:
            return (f"the prompt has {tokens} tokens; the pool holds {self.capacity} pages of "
                    f"{self.page} tokens in all")
        return None

    def lease(self, tokens: int) -> Lease | None:
        """Pages for `tokens` tokens, lowest free ids first, or None while too few are free.

        Raises:
          ValueError: if `fits` refuses `tokens`; check it at admission.
        """
        why = self.fits(tokens)
        if why is not None:
            raise ValueError(f"cannot lease {tokens} tokens: {why}; refuse the prompt at "
                             "admission with `fits`")
        need = -(-tokens // self.page)
        if need > len(self._free) or (self.slots and not self._free_slots):
            return None
        slot = heapq.heappop(self._free_slots) if self.slots else 0
        got = Lease(self._next, tuple(heapq.heappop(self._free) for _ in range(need)), tokens, slot)
        self._next += 1
        self._held[got.id] = got
        return got

    def grow(self, lease: Lease, tokens: int) -> Lease | None:
        """`lease` grown to hold `tokens` tokens (its pages, then the lowest free ids), or None
        while too few pages are free; the returned lease replaces `lease`, which is spent.
        A sequence that generates grows its lease a page at a time.

        Raises:
          ValueError: for a lease this pool does not hold, or `tokens` past a row (`fits`).
        """
        held = self._held.get(lease.id)
        if held is not lease:
            raise ValueError(f"lease `{lease.id}` is not held by this pool; grow the lease it "
                             "returned last")
        why = self.fits(tokens)
        if why is not None:
            raise ValueError(f"cannot grow lease `{lease.id}` to {tokens} tokens: {why}")
        need = -(-tokens // self.page) - len(lease.pages)
        if need <= 0:
            return lease
        if need > len(self._free):
            return None
        got = dataclasses.replace(lease, pages=lease.pages + tuple(
            heapq.heappop(self._free) for _ in range(need)), tokens=tokens)
        self._held[lease.id] = got
        return got

    def release(self, lease: Lease) -> None:
        """Returns the pages of `lease`, which this pool made and has not taken back.

        Raises:
          ValueError: for a lease released already or made by another pool.
        """
        held = self._held.get(lease.id)
        if held is not lease:
            if held is not None or not 1 <= lease.id < self._next:
                raise ValueError(f"lease `{lease.id}` ({len(lease.pages)} pages) was not made by "
                                 "this pool; release a lease to the pool that leased it")
            raise ValueError(f"lease `{lease.id}` ({len(lease.pages)} pages) was released already "
                             "(or another pool made it); release each lease once")
        del self._held[lease.id]
        for p in lease.pages:
            heapq.heappush(self._free, p)
        if lease.slot:
            heapq.heappush(self._free_slots, lease.slot)
