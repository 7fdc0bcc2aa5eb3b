"""How departures reach the next stage (`--transport`).

A transport moves one item's departures from stage s to stage s+1, in item order, and nothing
else: what crosses is exactly what the stage signatures say (names, dtypes, shapes), checked on
both ends.

- `host`: `HostTransport` sends the bytes over the stage-to-stage TCP connection, so it works on
  the CPU, across hosts and, as a fallback, between GPUs (device to host to device). The host
  thread waits for each item's departures before it sends them.
- `shm`: the stages run their programs with edge ops (`kernjax.runtime.edge`): stage s+1 creates its
  arrivals' edge in shared memory (a ring of `--edge_slots` slots) and names it in its Hello; the
  head hands the name to stage s in its Table; stage s's program pushes into it and posts, stage
  s+1's program holds until the item is in. No host thread waits for a device or relays a byte.
  Stages of one host only; on a GPU the words and slots are pinned host memory.
- `nccl` (GPUs of any hosts): the programs' push and receive are NCCL sends and receives on
  the stages' streams, through a two-rank communicator per edge whose unique id stage s+1 makes
  and names in its Hello (`kernjax.runtime.edge.NcclEdge`; NCCL's own flow control stands in for the
  slots).
- `ipc` (GPUs of one host): as `shm`, but stage s+1's slots are device memory of its GPU,
  allocated outside JAX, whose CUDA IPC handle travels in its Hello; stage s's program writes
  into them over NVLink. The words stay in pinned shared memory.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kernjax.serve.protocol import Conn, ProtocolError
from kernjax.core.trace import Slot


class HostTransport:
    """Departures as raw bytes in ACTS frames over one connection."""

    def __init__(self, conn: Conn, slots: Sequence[Slot]):
        self.conn, self.slots = conn, tuple(slots)

    def send(self, item: int, arrays: Sequence, header: dict | None = None, *,
             slots: Sequence[Slot] | None = None) -> None:
        """Sends item `item`'s departures, in signature order (`slots`: those of the item's
        program, by default the default program's)."""
        slots = self.slots if slots is None else tuple(slots)
        if len(arrays) != len(slots):
            raise ProtocolError(f"item {item}: {len(arrays)} departures; the signature has "
                                f"{len(slots)}")
        self.conn.send("ACTS", {**(header or {}), "item": item},
                       {s.name: np.asarray(a) for s, a in zip(slots, arrays)})

    def recv(self, item: int, *, slots: Sequence[Slot] | None = None
             ) -> tuple[list[np.ndarray], dict]:
        """Receives item `item`'s arrivals; refuses anything the signature (`slots`: of the
        item's program) does not say."""
        slots = self.slots if slots is None else tuple(slots)
        header, arrays = self.conn.expect("ACTS")
        if header.get("item") != item:
            raise ProtocolError(f"{self.conn.name} sent item {header.get('item')} where item "
                                f"{item} was due")
        want = [(s.name, s.dtype, list(s.shape)) for s in slots]
        got = [(k, str(v.dtype), list(v.shape)) for k, v in arrays.items()]
        if got != want:
            raise ProtocolError(f"{self.conn.name} sent arrivals {got}; this stage takes {want}")
        return list(arrays.values()), header
