"""Transfer per item over an edge: two processes, the programs of kernjax/runtime/edge.py, no model.

Stage 0's program pushes `--departures` arrays of `--shape` (`--dtype`) into the edge for each of
`--items` items; stage 1's program receives them and sums one element of each (so the receive is
used). Both are issued at once, item after item, as serving issues them; each side's clock runs
from its first issue to its last item's token. The time per item of the slower side, against
bytes / `--link_gbs` (NVLink measured at 338 GB/s on the two-H200 machine), is the transfer's
cost; serving's item period (`kernjax timeline`) gives its share.

    python -m experiments.transfer --transport ipc --gpus 0,1 --items 200          # two GPUs
    python -m experiments.transfer --transport shm --items 50 --shape 64,64        # the CPU

Prints one line per side and a summary; `--out FILE` writes it as JSON, with the run's record.

That loop's time per item is bounded below by each side's host issuing its programs: it says how
fast a pipeline can go, not how long one transfer takes. `--pingpong` measures that instead, on
one GPU's clock: side 0's program pushes an item over edge 0 and then waits for it back over
edge 1; side 1, whose programs are all issued before side 0 starts, sends each item straight
back. From side 0's profile, per item, the round trip runs from its push's first copy kernel to
the end of its wait for the return; half of it is the time from departure ready to arrival
usable.

    python -m experiments.transfer --transport ipc --gpus 0,1 --items 200 --pingpong
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import tempfile
import threading
import time
from pathlib import Path

from experiments import harness


def _slots(rank: int, a):
    """`(shape, slots)` of one item's departures, in a process that sees only its rank's GPU
    (set before jax is imported)."""
    if a.gpus:
        os.environ["CUDA_VISIBLE_DEVICES"] = a.gpus.split(",")[rank]
    from kernjax.core.trace import Slot

    shape = tuple(int(x) for x in a.shape.split(","))
    return shape, [Slot(f"x{i}", "departure", a.dtype, shape) for i in range(a.departures)]


def side(rank: int, a, q_out, q_in, res) -> None:
    shape, slots = _slots(rank, a)
    import jax
    import jax.numpy as jnp
    import numpy as np

    from kernjax.runtime import edge
    if rank == 1:  # the receiver makes the edge and names it, as a serving stage does
        e, fields = edge.receiving(slots, 0, a.transport, a.slots)
        q_out.put(fields)
        e.ready(120)
        fn = edge.edged(lambda *xs: [sum(x.reshape(-1)[0].astype(jnp.float32) for x in xs)],
                        slots, [], edge_in=0, edge_out=None)
        args = []
    else:
        e = edge.sending(slots, 0, q_in.get())
        fn = edge.edged(lambda *xs: list(xs), [], slots, edge_in=None, edge_out=0)
        args = [jnp.ones(shape, a.dtype) * (i + 1) for i in range(a.departures)]
    run = jax.jit(fn)
    item = lambda k: jnp.asarray([k], jnp.int32)  # noqa: E731
    jax.block_until_ready(run(*args, item(0)))  # compile and item 0, outside the clock
    where = tempfile.mkdtemp(prefix=f"kernjax-transfer{rank}-") if a.trace else None
    # --trace: the kernels of each item (experiments/gpuprofile.py), summed after the run
    with jax.profiler.trace(where) if where else contextlib.nullcontext():
        t = time.perf_counter()
        out = [run(*args, item(k)) for k in range(1, a.items + 1)]
        jax.block_until_ready(out)
        dt = time.perf_counter() - t
    kernels = ""
    if a.trace:
        from experiments import gpuprofile

        p = gpuprofile.summarize(where, [])
        kernels = "; ".join(f"{k['kernel'][:40]} {1e3 * k['ms'] / a.items:.1f} us/item"
                            for k in p["top_kernels"][:6])
    if rank == 1:
        want = float(a.departures * (a.departures + 1) / 2)
        got = float(np.asarray(out[-1][0]))
        res.put({"rank": 1, "s": dt, "check": got == want, "kernels": kernels})
    else:
        res.put({"rank": 0, "s": dt, "kernels": kernels})
    time.sleep(0.5)
    e.close(unlink=rank == 1)


def pingpong_side(rank: int, a, q_out, q_in, go, res) -> None:
    """Side 0 pushes item k over edge 0 and waits for it over edge 1, in one program; side 1
    takes it off edge 0 and pushes it onto edge 1. Side 0 profiles its items."""
    shape, slots = _slots(rank, a)
    import jax
    import jax.numpy as jnp
    import numpy as np

    from kernjax.runtime import edge
    from kernjax.kernels import ffi
    e_in, fields = edge.receiving(slots, 1 - rank, a.transport, a.slots)  # side 0 takes edge 1
    q_out.put(fields)
    e_out = edge.sending(slots, rank, q_in.get())
    e_in.ready(120)
    if rank == 1:
        fn = edge.edged(lambda *xs: list(xs), slots, slots, edge_in=0, edge_out=1)
        args = []
    else:
        def fn(*args):
            *xs, item = args
            tok = ffi.hold(item, item, *xs, edge=0, word=edge.TAKEN)
            for i, x in enumerate(xs):
                tok = ffi.push(x, tok, item, edge=0, index=i)
            tok = ffi.post(tok, item + 1, edge=0, word=edge.ARRIVED)
            tok = ffi.hold(tok, item, edge=1, word=edge.ARRIVED)
            got = []
            for i, sl in enumerate(slots):
                x, tok = ffi.recv(tok, item, sl.spec(), edge=1, index=i)
                got.append(x.reshape(-1)[0].astype(jnp.float32))
            return [sum(got), ffi.post(tok, item + 1, edge=1, word=edge.TAKEN)]
        args = [jnp.ones(shape, a.dtype) * (i + 1) for i in range(a.departures)]
    run = jax.jit(fn)
    item = lambda k: jnp.asarray([k], jnp.int32)  # noqa: E731
    if rank == 1:  # items issued ahead of side 0's first: no wait on this host
        # Not all of them before side 0 starts: each waits on the device for its arrival, and a
        # host that issues hundreds of those blocks in the launch queue (or XLA's in-flight
        # limit) before it can say go: 24 ahead, the rest while side 0 runs.
        out, ahead = [], threading.Event()

        def issue():
            for k in range(a.items + 1):
                out.append(run(*args, item(k)))
                if k + 1 == min(24, a.items + 1):
                    ahead.set()
        if jax.default_backend() == "cpu":  # (the CPU runs a program as it is issued)
            ahead.set()
        t = threading.Thread(target=issue, daemon=True)
        t.start()
        ahead.wait()
        go.put(True)
        t.join()
        jax.block_until_ready(out)
        res.put({"rank": 1})
        time.sleep(0.5)
        e_in.close(unlink=True)
        e_out.close()
        return
    go.get(timeout=300)
    jax.block_until_ready(run(*args, item(0)))  # compile and item 0, outside the profile
    where = tempfile.mkdtemp(prefix="kernjax-pingpong-")
    with jax.profiler.trace(where):
        out = [run(*args, item(k)) for k in range(1, a.items + 1)]
        jax.block_until_ready(out)
    from experiments import gpuprofile

    rtts, pushes = round_trips(gpuprofile.kernels(where), nccl=a.transport == "nccl")
    want = float(a.departures * (a.departures + 1) / 2)
    res.put({"rank": 0, "rtt_ns": rtts, "push_ns": sum(pushes) / max(len(rtts), 1),
             "check": float(np.asarray(out[-1][0])) == want})
    time.sleep(0.5)
    e_in.close(unlink=True)
    e_out.close()


def round_trips(ks: list[dict], nccl: bool) -> tuple[list[int], list[int]]:
    """Side 0's profiled kernels (`gpuprofile.kernels`) -> per item, (the round trip, the push's
    copies) in ns. An item's program runs hold (edge 0), its push's copies, post, hold (edge 1,
    until the item is back), the receive's copies, post: the trip is from the first push copy's
    start to the second hold's end. On an NCCL edge it is from the send kernel's start to the end
    of the receive's, which waits. On the CPU the custom calls' thunks stand for the kernels."""
    ks = sorted(ks, key=lambda k: k["start_ns"])
    end = lambda k: k["start_ns"] + k["ns"]  # noqa: E731
    if nccl:
        ks = [k for k in ks if "nccl" in k["name"].lower()]
        return [end(r) - s["start_ns"] for s, r in zip(ks[::2], ks[1::2])], \
            [s["ns"] for s in ks[::2]]
    rtts, pushes, t0, holds = [], [], None, 0
    for k in ks:
        if "HoldKernel" in k["name"] or k["name"].startswith("kj_hold"):
            holds += 1
            if holds % 2 == 0 and t0 is not None:
                rtts.append(end(k) - t0)
                t0 = None
        elif ("CopyKernel" in k["name"] or k["name"].startswith("kj_push")) and holds % 2 == 1:
            t0 = k["start_ns"] if t0 is None else t0
            pushes.append(k["ns"])
    return rtts, pushes


def item_bytes(a) -> int:
    import numpy as np

    return a.departures * int(np.prod([int(x) for x in a.shape.split(",")])) * \
        np.dtype(a.dtype if a.dtype != "bfloat16" else "float16").itemsize


def pingpong(a) -> dict:
    ctx = mp.get_context("spawn")
    q01, q10, go, res = ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=pingpong_side, args=(0, a, q01, q10, go, res)),
             ctx.Process(target=pingpong_side, args=(1, a, q10, q01, go, res))]
    for p in procs:
        p.start()
    got = {}
    for _ in range(2):
        r = res.get(timeout=600)
        got[r["rank"]] = r
    for p in procs:
        p.join(30)
    import numpy as np

    rtt = np.asarray(got[0]["rtt_ns"]) / 1e3
    return {"transport": a.transport, "mode": "pingpong", "items": int(rtt.size),
            "rtt_us_p50": float(np.median(rtt)) if rtt.size else None,
            "rtt_us_p90": float(np.percentile(rtt, 90)) if rtt.size else None,
            "one_way_us": float(np.median(rtt)) / 2 if rtt.size else None,
            "push_copies_us": got[0]["push_ns"] / 1e3, "check": got[0]["check"]}


def main() -> int:
    from kernjax.runtime.edge import TRANSPORTS  # jax comes with it: each rank's process sets its GPU first

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--transport", default="shm", choices=[t for t in TRANSPORTS if t != "host"])
    ap.add_argument("--gpus", default="", help="two GPU ids, sender first (empty: as jax sees)")
    ap.add_argument("--items", type=int, default=200)
    ap.add_argument("--shape", default="512,2560", help="one departure's shape")
    ap.add_argument("--departures", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--slots", type=int, default=2, help="shm/ipc: slots per edge")
    ap.add_argument("--link_gbs", type=float, default=338.0)
    ap.add_argument("--trace", action="store_true",
                    help="profile the timed items: each side's top kernels, per item")
    ap.add_argument("--out", default=None)
    ap.add_argument("--pingpong", action="store_true",
                    help="the round trip of one item, from side 0's profile (see above)")
    a = ap.parse_args()
    nbytes = item_bytes(a)
    if a.pingpong:
        summary = pingpong(a) | {"bytes_per_item": nbytes,
                                 "link_bound_us": nbytes / (a.link_gbs * 1e9) * 1e6}
        print(json.dumps(summary, indent=1))
        if a.out:
            Path(a.out).write_text(json.dumps({**summary, "record": harness.record(gpu="")},
                                              indent=1) + "\n")
        return 0 if summary["check"] else 1
    ctx = mp.get_context("spawn")
    handles, res = ctx.Queue(), ctx.Queue()
    down = ctx.Process(target=side, args=(1, a, handles, None, res))
    down.start()
    up = ctx.Process(target=side, args=(0, a, None, handles, res))
    up.start()
    got = {}
    for _ in range(2):
        r = res.get(timeout=600)
        got[r["rank"]] = r
    for p in (up, down):
        p.join(30)
    per = max(got[0]["s"], got[1]["s"]) / a.items
    bound = nbytes / (a.link_gbs * 1e9)
    summary = {"transport": a.transport, "items": a.items, "bytes_per_item": nbytes,
               "sender_us_per_item": got[0]["s"] / a.items * 1e6,
               "receiver_us_per_item": got[1]["s"] / a.items * 1e6,
               "us_per_item": per * 1e6, "link_bound_us": bound * 1e6,
               "check": got[1]["check"]}
    if a.trace:
        summary |= {"sender_kernels": got[0]["kernels"], "receiver_kernels": got[1]["kernels"]}
    print(json.dumps(summary, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps({**summary, "record": harness.record(gpu="")},
                                          indent=1) + "\n")
    return 0 if got[1]["check"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
