"""Edges between stages: their memory, its binding in a process, and stage programs that hold,
receive, push and post at their edges on the device (csrc/edge.h).

An edge joins stage s to stage s+1 (edge number s). Its memory is a header with two int32 words,
`arrived` and `taken`, and a ring of `nslots` slots, each holding one item's departures at fixed
offsets (`Layout`). Item k uses slot k % nslots. `edged` wraps a stage's program so that, for item
k (an int32[1] operand, so nothing recompiles from item to item):

  stage s+1: hold until arrived >= k+1, receive the arrivals from slot k, post taken = k+1;
  stage s:   after its departures exist, hold until taken >= k+1-nslots (slot k is free again),
             push the departures into slot k, post arrived = k+1.

A stage's host thread can so issue item k before item k's arrivals exist: the device waits, the
host never does. The memory of an edge:

  `SharedEdge`            POSIX shared memory, mapped by both stages of one host: the words and
                          slots the upstream writes are the bytes the downstream reads, and
                          nothing relays them (on a GPU the pages are pinned and mapped, so the
                          device reads and writes them directly);
  `SharedEdge(device=)`   the words there, the slots in the downstream GPU's memory (CUDA IPC);
  `NcclEdge`              no slots: push and receive are NCCL sends and receives (any hosts).

The whole program has no edges and calls none of these ops, so its bits are what they always were.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing import resource_tracker, shared_memory
from pathlib import Path

import jax
import numpy as np

# How activations go from stage to stage (`kernjax.serve --transport`): over the stage links, or
# through an edge's memory of each kind above.
TRANSPORTS = ("host", "shm", "ipc", "nccl")

from kernjax.kernels import ffi
from kernjax.core.trace import Slot

# A segment's creator leaves it to Python's resource tracker (a child process, started with these
# options) to remove if it ends first (Ctrl-C, a kill), without the tracker's warning of the
# "leak" it mends. Attachers untrack theirs (Python 3.12 tracks them too: a second removal).
if "ignore::UserWarning:multiprocessing.resource_tracker" not in sys.warnoptions:
    sys.warnoptions.append("ignore::UserWarning:multiprocessing.resource_tracker")

ARRIVED, TAKEN = 0, 1
HEADER = 128  # arrived at byte 0, taken at byte 64: one cache line each
ALIGN = 256


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where each departure sits in a slot, and how many slots the ring has."""

    slots: tuple[Slot, ...]
    nslots: int
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    stride: int

    @classmethod
    def of(cls, slots: Sequence[Slot], nslots: int = 2) -> Layout:
        if nslots < 1:
            raise ValueError(f"an edge needs at least one slot, not {nslots}")
        offsets, sizes, at = [], [], 0
        for s in slots:
            offsets.append(at)
            sizes.append(s.nbytes)
            at += -(-s.nbytes // ALIGN) * ALIGN
        return cls(tuple(slots), nslots, tuple(offsets), tuple(sizes), max(at, ALIGN))

    @property
    def nbytes(self) -> int:
        return HEADER + self.stride * self.nslots


class SharedEdge:
    """An edge's memory in POSIX shared memory, created by one stage and opened by the other
    (`name`); `bind(edge)` points this process's edge ops at it. Keep it open while programs
    that use it may run. `device`: the slots are device memory of the creating stage's GPU
    instead (CUDA IPC: the creator's `ipc` handle, opened by the other stage), the words stay in
    shared memory."""

    def __init__(self, layout: Layout, *, name: str | None = None, create: bool = True,
                 device: bool = False, ipc: bytes | None = None):
        self.layout = layout
        size = HEADER if device else layout.nbytes
        self.shm = shared_memory.SharedMemory(name=name, create=create, size=size)
        if not create:
            resource_tracker.unregister(self.shm._name, "shared_memory")
        if self.shm.size < size:
            raise ValueError(f"shared memory `{name}` holds {self.shm.size} bytes; the edge "
                             f"needs {size}")
        self.words = np.ndarray((HEADER // 4,), np.int32, self.shm.buf)
        if create:
            self.words[:] = 0
        self.base = self.words.ctypes.data
        self.bound: list[int] = []
        self.pinned = jax.default_backend() == "gpu"  # a GPU's edge ops read and write it
        if self.pinned:
            ffi.register()
            ffi._extension().host_register(self.base, size)
        self.slots, self.ipc, self.device, self.created = self.base + HEADER, ipc, device, create
        if device:
            ext = ffi._extension()
            if create:
                self.slots, self.ipc = ext.device_alloc(layout.stride * layout.nslots)
            else:
                self.slots = ext.ipc_open(ipc)

    @property
    def name(self) -> str:
        return self.shm.name

    @property
    def arrived(self) -> int:
        return int(self.words[0])

    @property
    def taken(self) -> int:
        return int(self.words[16])

    def ready(self, timeout: float) -> None:
        """Bound at once: nothing to wait for (an `NcclEdge` may have to)."""

    def bind(self, edge: int) -> None:
        lay = self.layout
        ffi.register()
        ffi._extension().bind_edge(edge, self.base, self.base + 64, self.slots, lay.stride,
                                   lay.nslots, list(lay.offsets), list(lay.sizes))
        self.bound.append(edge)

    def close(self, unlink: bool = False) -> None:
        for e in self.bound:
            ffi._extension().unbind_edge(e)
        self.bound.clear()
        if self.pinned:
            ffi._extension().host_unregister(self.base)
            self.pinned = False
        if self.device:
            ffi._extension().device_free(self.slots, opened=not self.created)
            self.device = False
        del self.words
        self.shm.close()
        if unlink:
            self.shm.unlink()


class NcclEdge:
    """An edge between hosts: each item's departures go by NCCL send/receive on the stages'
    streams (csrc/nccl.cc), rank 0 upstream and rank 1 downstream of a two-rank communicator
    whose unique id the downstream stage makes and names in its Hello. No slots; the words are
    this process's own pinned memory, where `post` marks an item done for the watcher."""

    def __init__(self, layout: Layout, *, uid: bytes | None = None, rank: int):
        ext = load_nccl()
        self.layout, self.rank = layout, rank
        self.uid = uid if uid is not None else ext.nccl_unique_id()
        self.words_addr = ext.host_alloc(HEADER, mapped=True)
        self.words = np.ctypeslib.as_array((ctypes.c_int32 * (HEADER // 4)).from_address(
            self.words_addr))
        self._thread: threading.Thread | None = None
        self._edge: int | None = None
        self._error: BaseException | None = None

    @property
    def arrived(self) -> int:
        return int(self.words[0])

    def bind(self, edge: int) -> None:
        """Joins the communicator (blocks until the other stage joins too)."""
        load_nccl().nccl_bind_edge(edge, self.words_addr, self.words_addr + 64, self.uid,
                                   self.rank, list(self.layout.sizes))
        self._edge = edge

    def bind_in_background(self, edge: int) -> None:
        def go():
            try:
                self.bind(edge)
            except BaseException as e:  # noqa: BLE001 (reported by `wait`)
                self._error = e

        self._thread = threading.Thread(target=go, name=f"nccl-edge{edge}", daemon=True)
        self._thread.start()

    def close(self, unlink: bool = False) -> None:
        """Unbinds the edge and gives the words back (the communicator lives as long as the
        process)."""
        if self._edge is not None:
            ffi._extension().unbind_edge(self._edge)
        del self.words
        ffi._extension().host_free(self.words_addr, mapped=True)

    def ready(self, timeout: float) -> None:
        """After `bind_in_background`: raises if the other stage did not join in `timeout` s."""
        if self._thread is None:
            return
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise RuntimeError(f"the stage before did not join the NCCL edge within {timeout:g} s")
        if self._error:
            raise RuntimeError(f"the NCCL edge failed: {self._error}")


def load_nccl():
    """The extension with NCCL loaded: `$KERNJAX_NCCL`, else the nvidia-nccl wheel's library,
    else `libnccl.so.2` from the loader's path."""
    ffi.register()
    ext = ffi._extension()
    path = os.environ.get("KERNJAX_NCCL")
    if not path:
        try:
            import nvidia.nccl  # the wheel cupy and torch bring

            path = str(Path(list(nvidia.nccl.__path__)[0]) / "lib" / "libnccl.so.2")
        except ImportError:
            path = "libnccl.so.2"
    ext.nccl_load(path)
    return ext


def receiving(slots: Sequence[Slot], edge: int, kind: str, nslots: int):
    """The downstream side of edge `edge` for transport `kind`: its memory made and bound (None for
    `host`, whose activations go over the stage links), and the fields its Hello carries so the
    upstream can open it (`sending`). An NCCL edge binds in the background: `ready` before
    running items."""
    if kind == "host":
        return None, {"transport": kind}
    if kind == "nccl":
        e = NcclEdge(Layout.of(slots, 1), rank=1)
        e.bind_in_background(edge)
        return e, {"transport": kind, "nccl": e.uid.hex()}
    if kind not in ("shm", "ipc"):
        raise ValueError(f"no edge memory for transport `{kind}`")
    e = SharedEdge(Layout.of(slots, nslots), device=kind == "ipc")
    e.bind(edge)
    return e, {"transport": kind, "edge": e.name, "slots": nslots,
               **({"ipc": e.ipc.hex()} if kind == "ipc" else {})}


def sending(slots: Sequence[Slot], edge: int, fields: dict):
    """The upstream side of edge `edge`, opened from the downstream's Hello `fields` and bound;
    None where the downstream takes its arrivals over the stage link (`host`)."""
    kind = fields.get("transport", "host")
    if kind == "host":
        return None
    ok = {"nccl": isinstance(fields.get("nccl"), str),
          "shm": isinstance(fields.get("edge"), str) and type(fields.get("slots")) is int}
    ok["ipc"] = ok["shm"] and isinstance(fields.get("ipc"), str)
    if not ok.get(kind):
        raise ValueError(f"the next stage's {kind} edge is malformed: {str(fields)[:200]}")
    if kind == "nccl":
        e = NcclEdge(Layout.of(slots, 1), uid=bytes.fromhex(fields["nccl"]), rank=0)
    else:
        e = SharedEdge(Layout.of(slots, fields["slots"]), name=fields["edge"], create=False,
                       device=kind == "ipc", ipc=bytes.fromhex(fields["ipc"]) if kind == "ipc"
                       else None)
    e.bind(edge)
    return e


def left(e, k: int, timeout: float, stop: Callable[[], bool] = lambda: False) -> bool:
    """Whether item `k` has left through edge `e` (its `arrived` word reached k+1) within
    `timeout` s: loads from host memory, backing off to 2 ms, never a driver call. False at the
    deadline, or as soon as `stop()` says to give up."""
    deadline, pause = time.time() + timeout, 0.0001
    while e.arrived < k + 1:
        if stop() or time.time() > deadline:
            return False
        time.sleep(pause)
        pause = min(2 * pause, 0.002)
    return True


def set_hold_timeout(seconds: float) -> None:
    """How long a hold waits for a neighbour before its stage fails (60 s by default)."""
    ffi.register()
    ffi._extension().set_hold_timeout(float(seconds))


def edged(fn: Callable, arrivals: Sequence[Slot], departures: Sequence[Slot], *,
          edge_in: int | None, edge_out: int | None) -> Callable:
    """`fn(*inputs, *arrivals) -> (*departures, *outputs)` as `g(*inputs, item) -> (*outputs,
    tok)`: the arrivals come from edge `edge_in`'s slot of item `item` (int32[1]), the departures
    go to edge `edge_out`'s; `tok`, the end of the edge ops' chain, is for nothing but order."""
    nd = len(departures)

    def run(*args):
        *inputs, item = args
        tok = item
        got = []
        if arrivals:
            tok = ffi.hold(tok, item, edge=edge_in, word=ARRIVED)
            for i, s in enumerate(arrivals):
                x, tok = ffi.recv(tok, item, s.spec(), edge=edge_in, index=i)
                got.append(x)
            tok = ffi.post(tok, item + 1, edge=edge_in, word=TAKEN)
        out = fn(*inputs, *got)
        if departures:
            tok = ffi.hold(tok, item, *out[:nd], edge=edge_out, word=TAKEN)
            for i, x in enumerate(out[:nd]):
                tok = ffi.push(x, tok, item, edge=edge_out, index=i)
            tok = ffi.post(tok, item + 1, edge=edge_out, word=ARRIVED)
        return [*out[nd:], tok]

    return run
