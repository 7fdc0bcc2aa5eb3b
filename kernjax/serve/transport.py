"""How departures reach the next stage. The interface the GPU transport fills in, and the host one.

A transport moves one item's departures from stage s to stage s+1, in item order, and nothing
else: what crosses is exactly what the stage signatures say (names, dtypes, shapes), checked on
both ends. `HostTransport` sends the bytes over the stage-to-stage TCP connection, so it works on
the CPU and, as a fallback, between GPUs (device to host to device). The GPU transport (roadmap
K5: `push` into the next stage's IPC slot on XLA's stream, `hold`/`mark` for order) keeps the same
two methods.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kernjax.serve.protocol import Conn, ProtocolError
from kernjax.trace import Slot


class HostTransport:
    """Departures as raw bytes in ACTS frames over one connection."""

    def __init__(self, conn: Conn, slots: Sequence[Slot]):
        self.conn, self.slots = conn, tuple(slots)

    def send(self, item: int, arrays: Sequence, header: dict | None = None) -> None:
        """Sends item `item`'s departures, in signature order."""
        if len(arrays) != len(self.slots):
            raise ProtocolError(f"item {item}: {len(arrays)} departures; the signature has "
                                f"{len(self.slots)}")
        self.conn.send("ACTS", {**(header or {}), "item": item},
                       {s.name: np.asarray(a) for s, a in zip(self.slots, arrays)})

    def recv(self, item: int) -> tuple[list[np.ndarray], dict]:
        """Receives item `item`'s arrivals; refuses anything the signature does not say."""
        header, arrays = self.conn.expect("ACTS")
        if header.get("item") != item:
            raise ProtocolError(f"{self.conn.name} sent item {header.get('item')} where item "
                                f"{item} was due")
        want = [(s.name, s.dtype, list(s.shape)) for s in self.slots]
        got = [(k, str(v.dtype), list(v.shape)) for k, v in arrays.items()]
        if got != want:
            raise ProtocolError(f"{self.conn.name} sent arrivals {got}; this stage takes {want}")
        return list(arrays.values()), header
