"""The wire between the head and its stages: length-prefixed frames with a version and a limit.

A frame is a fixed 16-byte prefix, then a JSON header, then the raw bytes of its arrays:

    b"KJ" | version u8 | kind u8 | header bytes u32 LE | payload bytes u64 LE | header | payload

The header is a JSON object; `arrays` in it lists `[name, dtype, shape]` of each array, laid back
to back in the payload. Kinds, after kern-serve's PP3 messages:

    HELLO   stage -> head   {stage, stages, cut, pages, listen, arrivals, departures}
    TABLE   head -> stage   {pages, next: {address, arrivals} | null}
    ITEM    head -> stage   {item, rows} + the item's fills and tables
    ACTS    stage -> next   {item} + the departures, named as the next stage's arrivals
    TOKENS  last -> head    {item, busy_us} + next_token
    PING / PONG             liveness, both ways
    ERROR   either way      {message}: the sender is going away because of it

Every reader checks the magic, the version, the limit (`--max_frame`, default 256 MiB) and that
the header and arrays are well formed; a bad frame raises `ProtocolError` naming what was wrong,
and a closed connection `Closed`. Nothing here knows a model.
"""

from __future__ import annotations

import json
import socket
import struct
import threading
import time
from collections.abc import Mapping

import ml_dtypes
import numpy as np

MAGIC = b"KJ"
VERSION = 1
PREFIX = struct.Struct("<2sBBIQ")
MAX_FRAME = 256 << 20
KINDS = ("HELLO", "TABLE", "ITEM", "ACTS", "TOKENS", "PING", "PONG", "ERROR")
CODE = {k: i + 1 for i, k in enumerate(KINDS)}


class ProtocolError(RuntimeError):
    """A frame that is not what the protocol says; the message names the field."""


class Closed(ConnectionError):
    """The peer closed the connection."""


def _dtype(name: str) -> np.dtype:
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def encode(kind: str, header: Mapping, arrays: Mapping[str, np.ndarray] = ()) -> bytes:
    """One frame of `kind` carrying `header` and `arrays` (any array-likes, sent as raw bytes)."""
    arrays = {k: np.ascontiguousarray(np.asarray(v)) for k, v in dict(arrays).items()}
    head = dict(header)
    head["arrays"] = [[k, str(v.dtype), list(v.shape)] for k, v in arrays.items()]
    hb = json.dumps(head, separators=(",", ":")).encode()
    payload = b"".join(v.tobytes() for v in arrays.values())
    return PREFIX.pack(MAGIC, VERSION, CODE[kind], len(hb), len(payload)) + hb + payload


def decode(prefix: bytes, read, *, limit: int = MAX_FRAME) -> tuple[str, dict, dict[str, np.ndarray]]:
    """Parses one frame from its 16-byte prefix and `read(n)`, which returns exactly n bytes."""
    magic, version, code, hn, pn = PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise ProtocolError(f"not a kernjax frame (starts with {prefix[:4]!r}); is the peer a "
                            "kernjax stage of the same version?")
    if version != VERSION:
        raise ProtocolError(f"frame version {version}; this kernjax speaks version {VERSION}: "
                            "run the same kernjax on every stage")
    if not 1 <= code <= len(KINDS):
        raise ProtocolError(f"unknown frame kind {code}")
    if hn + pn > limit:
        raise ProtocolError(f"a {KINDS[code - 1]} frame of {hn + pn} bytes is over the limit of "
                            f"{limit} bytes (--max_frame)")
    try:
        header = json.loads(read(hn))
        specs = header.pop("arrays")
        assert isinstance(header, dict) and isinstance(specs, list)
    except (ValueError, KeyError, AssertionError, AttributeError) as e:
        raise ProtocolError(f"a {KINDS[code - 1]} frame has a malformed header ({e})") from None
    payload = read(pn)
    arrays, at = {}, 0
    try:
        for name, dtype, shape in specs:
            dt = _dtype(dtype)
            n = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
            if at + n > pn or any(int(d) < 0 for d in shape):
                raise ProtocolError(f"array `{name}` {dtype}{shape} overruns the payload")
            arrays[name] = np.frombuffer(payload, dt, count=n // dt.itemsize, offset=at).reshape(shape)
            at += n
    except (TypeError, ValueError) as e:
        raise ProtocolError(f"a {KINDS[code - 1]} frame lists a malformed array ({e})") from None
    if at != pn:
        raise ProtocolError(f"a {KINDS[code - 1]} frame carries {pn - at} bytes no array claims")
    return KINDS[code - 1], header, arrays


class Conn:
    """A framed connection: `send` from any thread (serialized), `recv` from one reader thread."""

    def __init__(self, sock: socket.socket, *, name: str, limit: int = MAX_FRAME):
        self.sock, self.name, self.limit = sock, name, limit
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._lock = threading.Lock()

    def _read(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            try:
                chunk = self.sock.recv(min(n - len(buf), 1 << 20))
            except OSError as e:
                raise Closed(f"{self.name}: {e}") from None
            if not chunk:
                raise Closed(f"{self.name} closed the connection")
            buf += chunk
        return bytes(buf)

    def recv(self) -> tuple[str, dict, dict[str, np.ndarray]]:
        return decode(self._read(PREFIX.size), self._read, limit=self.limit)

    def send(self, kind: str, header: Mapping = (), arrays: Mapping = ()) -> None:
        frame = encode(kind, dict(header), arrays)
        with self._lock:
            try:
                self.sock.sendall(frame)
            except OSError as e:
                raise Closed(f"{self.name}: {e}") from None

    def expect(self, kind: str) -> tuple[dict, dict[str, np.ndarray]]:
        """The next frame, which must be `kind` (an ERROR frame is raised as its message)."""
        got, header, arrays = self.recv()
        if got == "ERROR":
            raise ProtocolError(f"{self.name} refused: {header.get('message')}")
        if got != kind:
            raise ProtocolError(f"{self.name} sent {got} where {kind} was due")
        return header, arrays

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def parse_address(text: str) -> tuple[str, int]:
    """`host:port` as a tuple; a clear error otherwise."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"`{text}` is not an address; write HOST:PORT, e.g. 127.0.0.1:7000")
    return host, int(port)


def connect(address: str, name: str, timeout: float, *, limit: int = MAX_FRAME) -> Conn:
    """Connects to `address`, retrying until `timeout` seconds have passed."""
    host, port = parse_address(address)
    deadline = time.time() + timeout
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=10)
            sock.settimeout(None)
            return Conn(sock, name=name, limit=limit)
        except OSError as e:
            if time.time() > deadline:
                raise RuntimeError(f"cannot reach {name} at {address} within {timeout:.0f} s: {e}")
            time.sleep(0.2)
