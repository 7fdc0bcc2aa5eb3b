"""The wire between the head and its stages: length-prefixed frames with a version and a limit.

A frame is a fixed 16-byte prefix, then a JSON header, then the raw bytes of its arrays:

    b"KJ" | version u8 | kind u8 | header bytes u32 LE | payload bytes u64 LE | header | payload

The header is a JSON object; `arrays` in it lists `[name, dtype, shape]` of each array, laid back
to back in the payload. Kinds, after kern-serve's PP3 messages:

    HELLO   stage -> head   {stage, stages, cut, pages, listen, arrivals, departures, fills}
            stage -> next   {stage, stages, cut}: the first frame on a stage-to-stage link
    TABLE   head -> stage   {pages, next: {address, arrivals} | null}
    ITEM    head -> stage   {item, rows, program} + the item's fills and tables
    ACTS    stage -> next   {item} + the departures, named as the next stage's arrivals
    TOKENS  last -> head    {item, busy_us} + next_token and the item's log-probabilities
    PING / PONG             liveness, both ways
    ERROR   either way      {message}: the sender is going away because of it

Every reader checks the magic, the version, the limit (`--max_frame`, default 256 MiB) and that
the header and arrays are well formed; a bad frame raises `ProtocolError` naming the peer and
what was wrong, and a closed connection `Closed`. `handshakes` takes the first frame of every
connection to a listener in a thread of its own, within a time limit, so silent or trickling
peers delay nobody and a malformed frame costs one log line. Nothing here knows a model.
"""

from __future__ import annotations

import json
import math
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
PING_MIN = 0.25     # seconds: the head pings every stage every max(PING_MIN, stage_timeout / 4)
HANDSHAKE = 10.0    # seconds a new connection has to send its first frame
PENDING = 64        # connections whose first frame is awaited at once; more are closed
KINDS = ("HELLO", "TABLE", "ITEM", "ACTS", "TOKENS", "PING", "PONG", "ERROR")
CODE = {k: i + 1 for i, k in enumerate(KINDS)}


class ProtocolError(RuntimeError):
    """A frame that is not what the protocol says; the message names the field."""


class Closed(ConnectionError):
    """The peer closed the connection."""


def one_line(text: str) -> str:
    """`text` for a log line: newlines and what is not ASCII escaped, so that what a peer or a
    client sent cannot split the line (or forge a `pp item` one)."""
    return text.encode("ascii", "backslashreplace").decode().replace("\n", "\\n").replace(
        "\r", "\\r")


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
    kind = KINDS[code - 1]
    what = f"{'an' if kind[0] in 'AEIO' else 'a'} {kind} frame"
    if hn + pn > limit:
        raise ProtocolError(f"{what} of {hn + pn} bytes is over the limit of "
                            f"{limit} bytes (--max_frame)")
    try:
        header = json.loads(read(hn))
        if not isinstance(header, dict):
            raise ValueError(f"`{json.dumps(header)[:40]}` is not a JSON object")
        specs = header.pop("arrays")
        if not isinstance(specs, list):
            raise ValueError("`arrays` is not a list")
    except RecursionError:
        raise ProtocolError(f"{what} has a malformed header (nested too deeply)") from None
    except (ValueError, KeyError) as e:
        raise ProtocolError(f"{what} has a malformed header ({e})") from None
    payload = read(pn)
    arrays, at = {}, 0
    try:
        for name, dtype, shape in specs:
            dt = _dtype(dtype) if isinstance(dtype, str) else None
            if (not isinstance(name, str) or name in arrays or dt is None or dt.hasobject
                    or not dt.itemsize or not isinstance(shape, list)
                    or not all(type(d) is int and d >= 0 for d in shape)):
                raise ValueError(f"{[name, dtype, shape]!r}"[:200])
            n = math.prod(shape) * dt.itemsize
            if at + n > pn:
                raise ProtocolError(f"array `{name}` {dtype}{shape} overruns the payload")
            arrays[name] = np.frombuffer(payload, dt, count=n // dt.itemsize, offset=at).reshape(shape)
            at += n
    except (TypeError, ValueError) as e:
        raise ProtocolError(f"{what} lists a malformed array ({e})") from None
    if at != pn:
        raise ProtocolError(f"{what} carries {pn - at} bytes no array claims")
    return kind, header, arrays


class Conn:
    """A framed connection: `send` from any thread (serialized), `recv` from one reader thread."""

    def __init__(self, sock: socket.socket, *, name: str, limit: int = MAX_FRAME):
        self.sock, self.name, self.limit = sock, name, limit
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._lock = threading.Lock()

    def alive(self) -> bool:
        """Whether the peer is still there, for a connection it sends nothing on meanwhile."""
        try:
            return self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
        except BlockingIOError:
            return True
        except OSError:
            return False

    def _read(self, n: int, deadline: float | None = None) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            try:
                if deadline is not None:  # the deadline holds however slowly the bytes come
                    self.sock.settimeout(max(deadline - time.time(), 1e-3))
                chunk = self.sock.recv(min(n - len(buf), 1 << 20))
            except TimeoutError:
                raise ProtocolError(f"{self.name} sent no complete frame in time") from None
            except OSError as e:
                raise Closed(f"{self.name}: {e}") from None
            if not chunk:
                raise Closed(f"{self.name} closed the connection")
            buf += chunk
        return bytes(buf)

    def recv(self, timeout: float | None = None) -> tuple[str, dict, dict[str, np.ndarray]]:
        """The next frame; within `timeout` seconds for the whole frame if given."""
        deadline = None if timeout is None else time.time() + timeout
        read = lambda n: self._read(n, deadline)  # noqa: E731
        try:
            return decode(read(PREFIX.size), read, limit=self.limit)
        except ProtocolError as e:
            if str(e).startswith(self.name):
                raise
            raise ProtocolError(f"{self.name} sent a bad frame: {e}") from None
        finally:
            if deadline is not None:
                self.sock.settimeout(None)

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


def parse_address(text: str, *, any_port: bool = False) -> tuple[str, int]:
    """`host:port` as a tuple; a clear error otherwise. `any_port`: port 0 (a listener's: any
    free port) is allowed."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"`{text}` is not an address; write HOST:PORT, e.g. 127.0.0.1:7000")
    lowest = 0 if any_port else 1
    if not lowest <= int(port) < 65536:
        raise ValueError(f"`{text}`: port {port} is not in {lowest}..65535; write HOST:PORT, e.g. "
                         "127.0.0.1:7000")
    return host, int(port)


def connect(address: str, name: str, timeout: float, *, limit: int = MAX_FRAME, say=None) -> Conn:
    """Connects to `address`, retrying until `timeout` seconds have passed; `say(line)` once if
    the first try fails (the peer is not up yet)."""
    host, port = parse_address(address)
    deadline = time.time() + timeout
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=10)
            sock.settimeout(None)
            return Conn(sock, name=name, limit=limit)
        except OSError as e:
            if time.time() > deadline:
                raise RuntimeError(f"cannot reach {name} at {address} within {timeout:g} s: {e}")
            if say:
                say(f"waiting for {name} at {address} ({e.strerror or e}); retrying for "
                    f"{timeout:g} s")
                say = None
            time.sleep(0.2)


def handshakes(server: socket.socket, take, *, done, deadline: float, log,
               limit: int = MAX_FRAME, wait: float = HANDSHAKE, most: int = PENDING) -> bool:
    """Accepts connections on `server` until `done()` (True) or `deadline` (False).

    Each connection's first frame is read in a thread of its own, within `wait` seconds and the
    deadline, and given to `take(conn, kind, header)`, which keeps the connection (returns None)
    or says why not; `take` and `done` run under one lock. A refusal, a malformed frame, a silent
    or a trickling peer cost one `log` line and the connection (an ERROR frame tells a peer that
    spoke the protocol why), and the wait goes on.
    """
    lock, pending = threading.Lock(), [0]

    def shake(sock: socket.socket, peer) -> None:
        name = f"{peer[0]}:{peer[1]}"
        try:
            conn = Conn(sock, name=name, limit=limit)
            kind, header, _ = conn.recv(timeout=max(0.0, min(wait, deadline - time.time())))
            with lock:
                why = "the pipeline is complete" if done() else take(conn, kind, header)
            if why is None:
                return
            log(f"refused {name}: {one_line(why)}")
            try:
                conn.send("ERROR", {"message": why})
            except Closed:
                pass
        except (ProtocolError, Closed) as e:
            log(f"refused a connection: {one_line(str(e))}")
        except Exception as e:  # noqa: BLE001 (a frame whose fields break a check is refused too)
            log(f"refused {name}: {type(e).__name__}: {one_line(str(e))}")
        finally:
            with lock:
                pending[0] -= 1
        sock.close()

    server.settimeout(0.2)
    full = False
    while not done():
        if time.time() > deadline:
            return False
        try:
            sock, peer = server.accept()
        except TimeoutError:
            continue
        except OSError as e:  # out of file descriptors, say: a line, and try again soon
            if not full:
                log(f"cannot accept connections for now: {e}")
            full = True
            time.sleep(0.1)
            continue
        with lock:
            busy = pending[0] >= most
            pending[0] += not busy
        if busy:
            if not full:
                log(f"closing new connections while {most} are yet to say who they are")
            full = True
            sock.close()
            continue
        full = False
        threading.Thread(target=shake, args=(sock, peer), name="handshake", daemon=True).start()
    return True
