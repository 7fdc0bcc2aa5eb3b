"""Transfer per item over an edge: two processes, the programs of kernjax/edge.py, no model.

Stage 0's program pushes `--departures` arrays of `--shape` (`--dtype`) into the edge for each of
`--items` items; stage 1's program receives them and sums one element of each (so the receive is
used). Both are issued at once, item after item, as serving issues them; each side's clock runs
from its first issue to its last item's token. The time per item of the slower side, against
bytes / `--link_gbs` (NVLink measured at 338 GB/s on the two-H200 machine), is the transfer's
cost; serving's item period (`python -m kernjax.timeline`) gives its share.

    python experiments/transfer.py --transport ipc --gpus 0,1 --items 200          # two GPUs
    python experiments/transfer.py --transport shm --items 50 --shape 64,64        # the CPU

Prints one line per side and a summary; `--out FILE` writes it as JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def side(rank: int, a, q_out, q_in, res) -> None:
    if a.gpus:
        os.environ["CUDA_VISIBLE_DEVICES"] = a.gpus.split(",")[rank]
    sys.path.insert(0, str(REPO))
    import jax
    import jax.numpy as jnp
    import numpy as np

    from kernjax import edge
    from kernjax.trace import Slot

    shape = tuple(int(x) for x in a.shape.split(","))
    slots = [Slot(f"x{i}", "departure", a.dtype, shape) for i in range(a.departures)]
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
        sys.path.insert(0, str(REPO / "experiments"))
        import gpuprofile

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


def main() -> int:
    from kernjax.edge import TRANSPORTS  # jax comes with it: each rank's process sets its GPU first

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
    a = ap.parse_args()
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
    import numpy as np

    nbytes = a.departures * int(np.prod([int(x) for x in a.shape.split(",")])) * \
        np.dtype(a.dtype if a.dtype != "bfloat16" else "float16").itemsize
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
        Path(a.out).write_text(json.dumps(summary, indent=1) + "\n")
    return 0 if got[1]["check"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
