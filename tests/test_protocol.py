"""The wire: frames round-trip, and every malformed frame is refused with a message."""

from __future__ import annotations

import json
import socket
import struct
import threading
import time

import ml_dtypes
import numpy as np
import pytest

from kernjax.serve.protocol import (PREFIX, Closed, Conn, ProtocolError, decode, encode,
                                    handshakes, parse_address)
from kernjax.serve.transport import HostTransport
from kernjax.core.trace import Slot


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
    (_frame(header=b"[]"), r"`\[\]` is not a JSON object"),
    (_frame(header=b'"hello"'), "is not a JSON object"),
    (_frame(header=b"[" * 100_000 + b"]" * 100_000), "nested too deeply"),
    (_frame(header=b'{"arrays": {}}'), "`arrays` is not a list"),
    (_frame(header=json.dumps({"arrays": [["x", "object", [1]]]}).encode(), payload=b"12345678"),
     "malformed array"),
    (_frame(header=json.dumps({"arrays": [["x", "uint8", [-1]]]}).encode()), "malformed array"),
    (_frame(header=json.dumps({"arrays": [["x", "uint8", [1]], ["x", "uint8", [1]]]}).encode(),
            payload=b"ab"), "malformed array"),
    (_frame(header=json.dumps({"arrays": [["x", "uint8", [1 << 40, 1 << 40]]]}).encode()),
     "overruns the payload"),
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


@pytest.mark.parametrize("text", ["7000", "host:", ":7000", "h:99999", "h:0", "h:x"])
def test_bad_addresses_say_how_to_write_one(text):
    with pytest.raises(ValueError, match="HOST:PORT"):
        parse_address(text)


def test_prefix_is_sixteen_bytes():
    assert PREFIX.size == 16 and struct.calcsize("<2sBBIQ") == 16


def _trickle(sock: socket.socket, data: bytes, every: float, stop: threading.Event) -> None:
    """Sends `data` a byte every `every` seconds from a thread, until `stop` or the connection
    goes."""
    def go():
        for byte in data:
            if stop.wait(every):
                return
            try:
                sock.send(bytes([byte]))
            except OSError:  # closed by the test between the wait and the send
                return
    threading.Thread(target=go, daemon=True).start()


def _long_hello() -> bytes:
    """A Hello of about 400 bytes: 120 s at a byte every 0.3 s."""
    return encode("HELLO", {"ok": True, "pad": "x" * 350})


def test_a_deadline_holds_while_bytes_trickle():
    """recv(timeout=0.6) against a frame trickling in for 120 s, a byte every 0.3 s: the deadline
    holds for the frame, not for each byte (bounded at 30 s, which only a deadline that does not
    hold, or a hang, exceeds)."""
    a, b = _pair()
    stop = threading.Event()
    try:
        _trickle(a, _long_hello(), 0.3, stop)
        t0 = time.monotonic()
        with pytest.raises(ProtocolError, match="peer sent no complete frame in time"):
            Conn(b, name="peer").recv(timeout=0.6)
        assert time.monotonic() - t0 < 30
    finally:
        stop.set()
        a.close()
        b.close()


def _handshakes(server, *, wait=5.0, deadline=5.0):
    """Runs `handshakes` on `server` taking one HELLO {"ok": true}; (kept, refusal lines, result)."""
    got, lines = [], []

    def take(conn, kind, header):
        if kind != "HELLO" or header.get("ok") is not True:
            return f"not ok: {kind} {header}"
        got.append(conn)
        return None

    done = handshakes(server, take, done=lambda: bool(got), deadline=time.time() + deadline,
                      log=lines.append, wait=wait)
    return got, lines, done


def test_a_refusal_is_logged_on_one_line_whatever_the_peer_sent():
    with socket.create_server(("127.0.0.1", 0)) as server:
        peer = socket.create_connection(server.getsockname())
        peer.sendall(encode("HELLO", {"why": "x\npp item stage=0 item=9 rows=1 issued_us=1 "
                                             "done_us=2 \u00e9"}))
        lines = []
        handshakes(server, lambda conn, kind, header: header["why"], done=lambda: False,
                   deadline=time.time() + 1.0, log=lines.append, wait=1.0)
        peer.close()
    assert len(lines) == 1 and "\n" not in lines[0] and lines[0].isascii(), lines
    assert "x\\npp item" in lines[0], lines


def test_silent_and_malformed_peers_delay_no_handshake():
    """Five silent peers, each given 60 s to speak, and three malformed ones connect first; a real
    peer that connects then is taken at once (one at a time, the silent ones would hold it 300 s:
    bounded at 30 s, which only that or a hang exceeds)."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        addr = server.getsockname()
        silent = [socket.create_connection(addr) for _ in range(5)]
        bad = [socket.create_connection(addr) for _ in range(3)]
        bad[0].sendall(_frame(kind=1, header=b"[]"))
        bad[1].sendall(_frame(kind=1, header=b"[" * 50_000))
        bad[2].sendall(encode("HELLO", {"ok": False}))
        got, lines, out = [], [], []

        def take(conn, kind, header):
            if kind != "HELLO" or header.get("ok") is not True:
                return f"not ok: {kind} {header}"
            got.append(conn)
            return None

        th = threading.Thread(target=lambda: out.append(handshakes(
            server, take, done=lambda: bool(got), deadline=time.time() + 120, log=lines.append,
            wait=60.0)))
        th.start()
        end = time.monotonic() + 30
        while len(lines) < 3 and time.monotonic() < end:  # the bad ones are refused while the
            time.sleep(0.02)                               # silent ones still wait
        assert len(lines) >= 3, lines
        good = socket.create_connection(addr)  # and then a real peer joins at once
        good.sendall(encode("HELLO", {"ok": True}))
        th.join(30)
        assert out and out[0], lines
        kind, header, _ = Conn(bad[2], name="bad").recv()
        assert kind == "ERROR" and header["message"].startswith("not ok: HELLO")
        for sock in silent + bad + [good]:
            sock.close()
    text = "\n".join(lines)
    assert "is not a JSON object" in text and "not ok: HELLO" in text, text


def test_the_deadline_holds_against_silent_and_trickling_peers():
    """A 1 s deadline against a silent peer given 300 s to speak and a Hello trickling in for
    120 s: handshakes returns, without a peer, within 30 s (which only a deadline that does not
    hold, or a hang, exceeds)."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        addr = server.getsockname()
        silent = socket.create_connection(addr)
        slow = socket.create_connection(addr)
        stop = threading.Event()
        try:
            _trickle(slow, _long_hello(), 0.3, stop)
            t0 = time.monotonic()
            got, lines, done = _handshakes(server, wait=300.0, deadline=1.0)
            assert not done and not got and time.monotonic() - t0 < 30, lines
        finally:
            stop.set()
            silent.close()
            slow.close()


def test_a_handshake_slower_than_its_wait_is_refused():
    with socket.create_server(("127.0.0.1", 0)) as server:
        addr = server.getsockname()
        silent = socket.create_connection(addr)
        peers = [silent]
        late = threading.Timer(1.0, lambda: peers.append(socket.create_connection(addr)) or
                               peers[-1].sendall(encode("HELLO", {"ok": True})))
        late.start()
        try:
            got, lines, done = _handshakes(server, wait=0.5, deadline=30.0)
            assert done and any("no complete frame in time" in ln for ln in lines), lines
        finally:
            late.join()
            for sock in peers:
                sock.close()
