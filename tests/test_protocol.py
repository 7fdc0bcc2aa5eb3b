"""The wire: frames round-trip, and every malformed frame is refused with a message."""

from __future__ import annotations

import json
import socket
import struct

import ml_dtypes
import numpy as np
import pytest

from kernjax.serve.protocol import (PREFIX, Closed, Conn, ProtocolError, decode, encode,
                                    parse_address)
from kernjax.serve.transport import HostTransport
from kernjax.trace import Slot


def _decode(frame: bytes, limit=1 << 20):
    buf = memoryview(frame)[PREFIX.size:]
    at = [0]

    def read(n):
        out = bytes(buf[at[0]:at[0] + n])
        at[0] += n
        return out

    return decode(frame[:PREFIX.size], read, limit=limit)


def test_a_frame_round_trips_arrays_bitwise():
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    y = np.array([1.5, -2.25], dtype=ml_dtypes.bfloat16)
    kind, header, arrays = _decode(encode("ACTS", {"item": 7}, {"x": x, "y": y}))
    assert (kind, header) == ("ACTS", {"item": 7})
    assert arrays["x"].tobytes() == x.tobytes() and arrays["y"].dtype == y.dtype
    assert arrays["y"].tobytes() == y.tobytes()


def _frame(magic=b"KJ", version=1, kind=4, header=b"{}", payload=b""):
    return PREFIX.pack(magic, version, kind, len(header), len(payload)) + header + payload


@pytest.mark.parametrize("frame, words", [
    (_frame(magic=b"GE"), "not a kernjax frame"),
    (_frame(version=9), "frame version 9"),
    (_frame(kind=99), "unknown frame kind 99"),
    (_frame(header=b"{not json"), "malformed header"),
    (_frame(header=b'{"item": 1}'), "malformed header"),
    (_frame(header=json.dumps({"arrays": [["x", "float32", [4]]]}).encode(), payload=b"1234"),
     "overruns the payload"),
    (_frame(header=json.dumps({"arrays": [["x", "nope", [1]]]}).encode(), payload=b"1234"),
     "malformed array"),
    (_frame(header=json.dumps({"arrays": []}).encode(), payload=b"1234"), "no array claims"),
    (_frame(header=b"{}", payload=b"x" * (2 << 20)), "over the limit"),
])
def test_malformed_frames_are_refused_with_a_message(frame, words):
    with pytest.raises(ProtocolError, match=words):
        _decode(frame)


def _pair():
    """Two ends of a loopback TCP connection (Conn sets TCP options)."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        a = socket.create_connection(server.getsockname())
        b, _ = server.accept()
    return a, b


def test_a_closed_connection_is_closed_not_a_crash():
    a, b = _pair()
    conn = Conn(b, name="peer")
    a.sendall(_frame()[:5])
    a.close()
    with pytest.raises(Closed, match="peer closed the connection"):
        conn.recv()


def test_the_transport_refuses_what_the_signature_does_not_say():
    a, b = _pair()
    slots = [Slot("l0.next_input_norm:0", "departure", "float32", (2, 3))]
    tx, rx = HostTransport(Conn(a, name="s0"), slots), HostTransport(Conn(b, name="s0"), slots)
    tx.send(0, [np.ones((2, 3), np.float32)])
    got, _ = rx.recv(0)
    assert got[0].shape == (2, 3)
    tx.conn.send("ACTS", {"item": 1}, {"l0.next_input_norm:0": np.ones((2, 4), np.float32)})
    with pytest.raises(ProtocolError, match="this stage takes"):
        rx.recv(1)
    tx.send(5, [np.ones((2, 3), np.float32)])
    with pytest.raises(ProtocolError, match="item 5 where item 2 was due"):
        rx.recv(2)


@pytest.mark.parametrize("text", ["7000", "host:", ":7000", "h:99999", "h:x"])
def test_bad_addresses_say_how_to_write_one(text):
    with pytest.raises(ValueError, match="HOST:PORT"):
        parse_address(text)


def test_prefix_is_sixteen_bytes():
    assert PREFIX.size == 16 and struct.calcsize("<2sBBIQ") == 16
