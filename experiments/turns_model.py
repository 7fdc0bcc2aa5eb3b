"""A model of how the Hopper attention kernel's warpgroups synchronize, checked under random
interleavings: for each schedule of `kernjax/kernels/attention_hopper.py` (`pingpong`, `overlapped`
with `turns`) and the turns one way at named barriers (`named`), the sequence of
barrier operations each warpgroup runs, with the memory warpgroup's ring of `steps` slots.

It checks what a GPU run shows only as a hang or wrong bits: no deadlock; a named barrier's phase
(256 arrivals) is always completed by both compute warpgroups, never by two arrivals of one; no
named barrier is left half-arrived at exit; a warpgroup issues products only while it holds the
turn, and hands over only a turn it holds; every product is issued once. The
sequences are written by hand from the kernel's code: change them with it.

    python -m experiments.turns_model        # every schedule, 1-8 steps, 300 interleavings each
"""

from __future__ import annotations

import argparse
import itertools
import random


def memory(cta: int, steps: int) -> list[tuple]:
    """The memory warpgroup: keys then values of each step, a slot refilled once both compute
    warpgroups freed it."""
    ops = []
    for t in range(cta):
        for which in "kv":
            if t >= steps:
                ops.append(("wait_free", which, t - steps))
            ops.append(("ready", which, t))
    return ops


def _sync(w):  # wait at this warpgroup's own named barrier (14 + w) for the turn
    return ("sync", 14 + w)


def _arrive(w):  # hand the turn to the other warpgroup, not waiting
    return ("arrive", 15 - w)


def _release(t) -> list[tuple]:  # a step the warpgroup's rows do not need
    return [("wait_ready", "k", t), ("wait_ready", "v", t), ("free", "k", t), ("free", "v", t)]


def pingpong(w: int, kv: int, cta: int) -> list[tuple]:
    ops = [("wait_ready", "k", 0)] if kv > 0 else []
    if w == 1:
        ops.append(_sync(w))
    for t in range(kv):
        ops += [("issue", w, "qk", t), _arrive(w), ("free", "k", t), ("wait_ready", "v", t),
                _sync(w), ("issue", w, "pv", t)]
        if t + 1 < kv:
            ops.append(("wait_ready", "k", t + 1))
        ops.append(("free", "v", t))
    for t in range(kv, cta):
        ops += _release(t) + [_arrive(w), _sync(w)]
    return ops + ([_arrive(w)] if w == 0 else [])


def _first_scores(w) -> list[tuple]:  # overlapped: step 0's scores, issued ahead
    return ([_sync(w)] if w == 1 else []) + [("wait_ready", "k", 0), ("issue", w, "qk", 0),
                                             _arrive(w), ("free", "k", 0)]


def overlapped(w: int, kv: int, cta: int) -> list[tuple]:
    own = max(kv, 1)
    ops = _first_scores(w)
    for t in range(1, own):
        ops += [("wait_ready", "k", t), ("wait_ready", "v", t - 1), _sync(w), ("issue", w, "qk", t),
                ("issue", w, "pv", t - 1), _arrive(w), ("free", "k", t), ("free", "v", t - 1)]
    last = own - 1
    ops += [("wait_ready", "v", last), _sync(w), ("issue", w, "pv", last), _arrive(w),
            ("free", "v", last)]
    for t in range(own, cta):
        ops += _release(t) + [_sync(w), _arrive(w)]
    return ops + ([_sync(w)] if w == 0 else [])


SCHEDULES = {"pingpong": pingpong, "overlapped": overlapped}


def run(programs: list[list[tuple]], rng: random.Random) -> list[tuple]:
    """Runs the programs (memory first, then compute warpgroups 0 and 1), one enabled operation
    at a time in random order; returns the products in the order issued. Raises AssertionError on
    a deadlock or a misuse of a named barrier."""
    pc = [0] * len(programs)
    ready, freed = set(), {}
    bars = {b: {"count": 0, "phase": 0, "by": []} for b in (14, 15)}
    waiting: dict[int, tuple[int, int]] = {}
    issued = []
    owner = 1  # who holds the turn (program index): compute warpgroup 0 starts with it

    def enabled(p: int) -> bool:
        if p in waiting:
            bar, phase = waiting[p]
            return bars[bar]["phase"] > phase
        op = programs[p][pc[p]]
        if op[0] == "wait_ready":
            return op[1:] in ready
        if op[0] == "wait_free":
            return freed.get(op[1:], 0) == 2
        return True

    while True:
        live = [p for p in range(len(programs)) if pc[p] < len(programs[p])]
        if not live:
            for b, bar in bars.items():
                assert bar["count"] == 0, f"named barrier {b} half-arrived at exit"
            return issued
        can = [p for p in live if enabled(p)]
        assert can, "deadlock: " + ", ".join(
            f"{p}: {programs[p][pc[p]]}" for p in live)
        p = rng.choice(can)
        if p in waiting:  # its sync returned: the turn is its own
            del waiting[p]
            pc[p] += 1
            assert owner is None, f"warpgroup {p - 1} woke while {owner - 1} holds the turn"
            owner = p
            continue
        op = programs[p][pc[p]]
        if op[0] == "ready":
            ready.add(op[1:])
        elif op[0] == "free":
            freed[op[1:]] = freed.get(op[1:], 0) + 1
        elif op[0] == "issue":
            assert owner == p, f"warpgroup {p - 1} issued {op[2:]} without the turn"
            issued.append(op[1:])
        elif op[0] in ("sync", "arrive"):
            bar = bars[op[1]]
            bar["count"] += 128
            bar["by"].append(p)
            joined = bar["phase"]
            if bar["count"] == 256:
                assert len(set(bar["by"])) == 2, \
                    f"named barrier {op[1]}: a phase completed by warpgroup {p - 1} alone"
                bar.update(count=0, phase=joined + 1, by=[])
            if op[0] == "sync":
                waiting[p] = (op[1], joined)
                continue
            assert owner == p, f"warpgroup {p - 1} handed over a turn it does not hold"
            owner = None
        pc[p] += 1


def check(schedule: str, *, max_steps: int = 8, steps: int = 2, trials: int = 300,
          seed: int = 0) -> int:
    """Every (keys steps of warpgroup 0, of warpgroup 1) up to `max_steps` for one schedule,
    `trials` interleavings each; returns how many runs passed (it raises on the first failure)."""
    rng, runs, sched = random.Random(seed), 0, SCHEDULES[schedule]
    for cta in range(1, max_steps + 1):
        for kv0, kv1 in itertools.product(range(cta + 1), repeat=2):
            if max(kv0, kv1) != cta:
                continue
            for _ in range(trials):
                issued = run([memory(cta, steps), sched(0, kv0, cta), sched(1, kv1, cta)], rng)
                # (overlapped runs step 0 for a warpgroup without rows)
                want = {(w, kind, t) for w, kv in ((0, kv0), (1, kv1))
                        for t in range(kv if schedule == "pingpong" else max(kv, 1))
                        for kind in ("qk", "pv")}
                assert sorted(issued) == sorted(want), f"{schedule}: products {issued}"
                runs += 1
    return runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max_steps", type=int, default=8)
    ap.add_argument("--trials", type=int, default=300)
    a = ap.parse_args()
    for name in SCHEDULES:
        print(f"{name}: {check(name, max_steps=a.max_steps, trials=a.trials)} runs, no deadlock, "
              "every named-barrier phase completed by both warpgroups, none left half-arrived")


if __name__ == "__main__":
    main()
