"""How fast one process writes into another GPU's memory through CUDA IPC, with and without the
other GPU visible to it: the question behind `--transport ipc` moving 5 MB in ~600 us on two
H200s (experiments/results/2026-11-30-h200x2-serve/), 40x NVLink's bound.

Two processes (cupy, as on the device image; no kernjax): the receiver allocates `--mb` MB on
its GPU (cudaMalloc, outside any pool) and sends the IPC handle; the sender opens it
(cudaIpcMemLazyEnablePeerAccess) and times, with CUDA events, `--iters` copies of a local buffer
into it, by cudaMemcpyAsync and by a copy kernel (as kernjax's push is). Two modes:

- `isolated`: each process sees only its own GPU (`CUDA_VISIBLE_DEVICES`), as the serving
  benchmark runs stages today;
- `visible`: both see both GPUs and pick theirs (cudaSetDevice), so the runtime knows the peer.

    python -m experiments.ipc_bandwidth --gpus 0,1 --modes isolated,visible

Prints one JSON line per mode and measurement: GB/s, and whether the runtime says the sender's
GPU can access the peer (visible mode only); `--out FILE` writes them as JSON with the run's
record.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
from pathlib import Path

from experiments import harness


def receiver(gpu: str, mode: str, nbytes: int, q_handle, q_done) -> None:
    if mode == "isolated":
        os.environ["CUDA_VISIBLE_DEVICES"] = gpu
    import cupy as cp

    rt = cp.cuda.runtime
    cp.cuda.Device(0 if mode == "isolated" else int(gpu)).use()
    ptr = rt.malloc(nbytes)
    rt.memset(ptr, 0, nbytes)
    q_handle.put(rt.ipcGetMemHandle(ptr))
    q_done.get(timeout=300)
    rt.free(ptr)


def sender(gpus: list[str], mode: str, nbytes: int, iters: int, q_handle, q_done, res) -> None:
    if mode == "isolated":
        os.environ["CUDA_VISIBLE_DEVICES"] = gpus[0]
    import cupy as cp

    rt = cp.cuda.runtime
    dev = 0 if mode == "isolated" else int(gpus[0])
    cp.cuda.Device(dev).use()
    out = {"mode": mode, "mb": nbytes / 2 ** 20}
    if mode == "visible":
        out["can_access_peer"] = bool(rt.deviceCanAccessPeer(dev, int(gpus[1])))
    remote = rt.ipcOpenMemHandle(q_handle.get(timeout=300), rt.cudaIpcMemLazyEnablePeerAccess)
    n = nbytes // 8
    src = cp.arange(n, dtype=cp.uint64)
    mem = cp.cuda.UnownedMemory(remote, nbytes, None, dev)
    dst = cp.ndarray((n,), cp.uint64, cp.cuda.MemoryPointer(mem, 0))
    copy = cp.ElementwiseKernel("T x", "T y", "y = x", "kj_ipc_copy")
    stream = cp.cuda.get_current_stream()
    ways = {"memcpy": lambda: rt.memcpyAsync(remote, src.data.ptr, nbytes, rt.memcpyDefault,
                                             stream.ptr),
            "kernel": lambda: copy(src, dst)}
    for name, f in ways.items():
        try:
            f()
            stream.synchronize()
            a, b = cp.cuda.Event(), cp.cuda.Event()
            a.record(stream)
            for _ in range(iters):
                f()
            b.record(stream)
            b.synchronize()
            ms = cp.cuda.get_elapsed_time(a, b) / iters
            ok = bool((dst[:1024] == src[:1024]).all())
            res.put({**out, "way": name, "us": 1e3 * ms, "gb_s": nbytes / ms / 1e6, "check": ok})
        except Exception as e:  # noqa: BLE001 (each way reports its own failure)
            res.put({**out, "way": name, "error": f"{type(e).__name__}: {e}"[:300]})
    rt.ipcCloseMemHandle(remote)
    q_done.put(True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpus", default="0,1", help="sender's GPU, receiver's GPU")
    ap.add_argument("--modes", default="isolated,visible")
    ap.add_argument("--mb", type=float, default=5.0, help="bytes per copy, in MiB")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--out", default=None, help="write the measurements as JSON here")
    a = ap.parse_args()
    gpus = a.gpus.split(",")
    nbytes = int(a.mb * 2 ** 20) // 8 * 8
    ctx = mp.get_context("spawn")
    got = []
    for mode in a.modes.split(","):
        qh, qd, res = ctx.Queue(), ctx.Queue(), ctx.Queue()
        procs = [ctx.Process(target=receiver, args=(gpus[1], mode, nbytes, qh, qd)),
                 ctx.Process(target=sender, args=(gpus, mode, nbytes, a.iters, qh, qd, res))]
        for p in procs:
            p.start()
        for _ in range(2):
            try:
                got.append(res.get(timeout=300))
            except Exception as e:  # noqa: BLE001
                got.append({"mode": mode, "error": f"no result: {type(e).__name__}"})
                print(json.dumps(got[-1]), flush=True)
                break
            print(json.dumps(got[-1]), flush=True)
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    if a.out:
        Path(a.out).write_text(json.dumps({"record": harness.record(gpu=""), "results": got},
                                          indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
