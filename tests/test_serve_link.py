"""The serving processes' edges, through the real `kernjax serve` on loopback: careless
flags, a taken HTTP port, Ctrl-C, logs with timestamps, /health while stages join, and the stage
links against hostile peers (malformed frames, silent connections, a joined stage that sends a
malformed frame, a stranger at a stage's predecessor port)."""

from __future__ import annotations

import asyncio
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import aiohttp
import numpy as np
import pytest

from kernjax.serve.protocol import CODE, PREFIX, Conn, ProtocolError, connect, encode
from tests.serving import refusing_port, until
from tests.test_serve import _cut, _one

STAMP = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z "


@pytest.fixture(scope="module")
def cut(tmp_path_factory):
    return _cut(tmp_path_factory.mktemp("link") / "two", "1")


def _serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kernjax", "serve", *args], capture_output=True,
                          text=True, timeout=60)


def _clean(text: str) -> None:
    assert "Traceback" not in text, text


@pytest.mark.parametrize("flag, words", [
    (["--max_seqs", "0"], "--max_seqs 0: the head must admit at least 1"),
    (["--stage_timeout", "0.5"], "every 0.25 s (the ping period)"),
    (["--port", "70000"], "--port 70000 is not a TCP port; give one in 1..65535 (0: any free "
                          "one)"),
    (["--pp_head", "127.0.0.1:0"], "port 0 is not in 1..65535"),  # a listener's port 0 only
    (["--log_dir", "x", "--log_file", "y"], "not both"),
])
def test_careless_flags_are_refused_at_startup(cut, flag, words):
    p = _serve("--stage_dir", str(cut / "stage0"), *flag)
    assert p.returncode == 2 and words in p.stderr, p.stderr
    assert p.stderr.count("\n") == 1, p.stderr


def test_a_taken_http_port_fails_before_serving(cut):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        p = _serve("--stage_dir", str(cut / "whole"), "--port", str(port))
    assert p.returncode == 2, p.stderr
    assert f"cannot serve HTTP on 127.0.0.1:{port}" in p.stderr and "--port" in p.stderr, p.stderr
    assert "serving" not in p.stderr
    _clean(p.stderr)


def test_ctrl_c_and_sigterm_on_a_waiting_head_and_stage_are_one_line(cut, tmp_path, procs):
    """Ctrl-C (SIGINT) ends with `interrupted` and 130, SIGTERM with `terminated` and 143."""
    with refusing_port() as refusing:
        nobody = refusing.getsockname()[1]
        head = procs.head(cut / "stage0", tmp_path / "head.log")
        stage = procs.joiner(cut / "stage1", nobody, tmp_path / "stage.log")
        assert head.wait_for("waiting for stage"), head.text()
        assert stage.wait_for("waiting for the head"), stage.text()
        assert re.search(STAMP + rf"stage 1: waiting for the head at 127.0.0.1:{nobody} "
                         r"\(Connection refused\); retrying for 600 s", stage.text()), stage.text()
        head.p.send_signal(signal.SIGTERM)
        stage.p.send_signal(signal.SIGINT)
        for proc, code, word in ((head, 143, "terminated"), (stage, 130, "interrupted")):
            assert proc.wait(60) == code, proc.text()
            assert proc.text().rstrip().endswith(word), proc.text()
            _clean(proc.text())


async def _get(url: str):
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        return r.status, await r.json(content_type=None)


def _trickle(sock: socket.socket, data: bytes, every: float) -> None:
    """Sends `data` a byte every `every` seconds from a thread, until the connection goes."""
    def go():
        for i in range(len(data)):
            try:
                sock.send(data[i:i + 1])
            except OSError:
                return
            time.sleep(every)
    threading.Thread(target=go, daemon=True).start()


def _raw(address, data: bytes) -> socket.socket:
    sock = socket.create_connection(address)
    sock.sendall(data)
    return sock


SILENT = 20  # handled one at a time, 10 s each, they would hold the join for 200 s
REFUSED = ("`[]` is not a JSON object", "nested too deeply", "not a kernjax frame",
           "sent PING where a Hello was due", "belongs to cut `fd`")


def test_the_head_waits_through_junk_and_logs_with_timestamps(cut, tmp_path, procs):
    logs = tmp_path / "logs"
    head = procs.head(cut / "stage0", tmp_path / "head.console", "--log_dir", str(logs))
    pp, url = head.pp, head.url
    socks = []
    try:
        status, body = asyncio.run(_get(url + "/health"))
        assert status == 503 and body["error"]["message"] == "waiting for stage 1 to join", body
        (status, body), = asyncio.run(_one(url, {"prompt": [1, 2, 3]}))
        assert status == 503 and "waiting for stage 1" in body["error"]["message"], body
        # Junk on the stage port: malformed frames, a stranger's Hello, silent and slow peers.
        at = ("127.0.0.1", pp)
        frame = lambda header: PREFIX.pack(b"KJ", 1, CODE["HELLO"], len(header), 0) + header  # noqa: E731
        socks += [_raw(at, frame(b"[]")), _raw(at, frame(b"[" * 100_000 + b"]" * 100_000)),
                  _raw(at, b"GET / HTTP/1.1\r\n\r\n"), _raw(at, encode("PING", {})),
                  _raw(at, encode("HELLO", {"stage": 1, "cut": "fd", "fills": [[1]]})),
                  _raw(at, encode("HELLO", {"stage": 9, "cut": None}))]
        socks += [socket.create_connection(at) for _ in range(SILENT)]
        slow = socket.create_connection(at)
        socks.append(slow)
        _trickle(slow, encode("HELLO", {"stage": 1}), 1.0)
        # the junk refused, the head still waits for its stage
        assert until(lambda: all(w in head.text() for w in REFUSED), 60), head.text()
        assert head.p.poll() is None, head.text()
        t0 = time.monotonic()
        stage = procs.joiner(cut / "stage1", pp, tmp_path / "stage.console", "--log_dir",
                             str(logs))
        # the stage joins beside the silent peers, not after them (a bound only a join held
        # behind them, 200 s, or a hang exceeds)
        assert head.wait_for("serving", 150) and time.monotonic() - t0 < 120, head.text()
        text = head.text()
        for words in REFUSED:
            assert re.search(STAMP + "head: refused .*" + re.escape(words), text), (words, text)
        assert all(_one_line(text, ln) for ln in text.splitlines() if "refused" in ln)
        # a client's mistake (here a 503 while stage 1 joins): one stamp, not absl's prefix too
        assert re.search(STAMP + r"http: POST /v1/completions from \S+: 503 waiting", text), text
        for k in range(3):  # one item each: a one-token prompt is its one-row step
            (status, _), = asyncio.run(_one(url, {"prompt": [3 + k], "max_tokens": 1}))
            assert status == 200
        assert asyncio.run(_get(url + "/health"))[0] == 200
        files = [logs / "stage0.log", logs / "stage1.log"]
        for f in files:
            lines = [ln for ln in f.read_text().splitlines() if " pp item " in ln]
            assert len(lines) == 3 and all(re.match(STAMP + "pp item", ln) for ln in lines), lines
        assert "pp item" not in head.text()  # with a log file, the console skips them
        p = subprocess.run([sys.executable, "-m", "kernjax", "timeline", *map(str, files),
                            "--first", "0"], capture_output=True, text=True, timeout=60)
        assert p.returncode == 0 and "idle share" in p.stdout and "items 0..2" in p.stdout, p
        _clean(head.text() + stage.text())
    finally:
        for sock in socks:
            sock.close()


def test_a_trickling_connection_cannot_hold_the_head_past_its_startup_timeout(cut, tmp_path,
                                                                             procs):
    """--startup_timeout 3 against a Hello that takes 100 s to trickle in: the head gives up in
    about 3 s (bounded here at 60, which only a head held by the trickle or a hang exceeds)."""
    head = procs.head(cut / "stage0", tmp_path / "head.log", "--startup_timeout", "3")
    pp = head.pp
    hello = encode("HELLO", {"stage": 1, "pad": "x" * 100})
    socks = [socket.create_connection(("127.0.0.1", pp)) for _ in range(3)]
    try:
        _trickle(socks[0], hello, 100 / len(hello))
        assert head.wait(60) == 2, head.text()
        assert "stages [1] did not join within 3 s (--startup_timeout)" in head.text(), head.text()
        _clean(head.text())
    finally:
        for sock in socks:
            sock.close()


def _one_line(text: str, line: str) -> bool:
    """A refusal is one line: the next line is another stamped line (or the end)."""
    rest = text.split(line, 1)[1].lstrip("\n")
    return not rest or re.match(STAMP, rest) is not None


class FakeStage:
    """The last stage of a 2-stage cut as a test drives it: joins the head, takes the head's link.
    A context manager: its sockets close at the end (or when joining fails)."""

    def __init__(self, cut, pp: int, named: bool = True):
        from kernjax import artifact as artifacts
        from kernjax.runtime.runner import checkpoint_dir
        from kernjax.serve.stage_host import _slots
        from kernjax.weights import fingerprint
        art = artifacts.read(cut / "stage1")
        ckpt = checkpoint_dir(art.manifest["checkpoint"])
        self.socks = [socket.create_server(("127.0.0.1", 0))]
        try:
            self.conn = connect(f"127.0.0.1:{pp}", "the head", 60)
            self.socks.append(self.conn.sock)
            self.conn.send("HELLO", {
                "stage": 1, "stages": 2, "cut": art.cut_id, "pages": art.item.pages,
                "listen": self.socks[0].getsockname()[1], "arrivals": _slots(art.arrivals),
                "departures": _slots(art.departures),
                "fills": [x.name for x in art.inputs if x.role in ("fill", "table")],
                "checkpoint": {"dir": str(ckpt), "id": fingerprint(ckpt)} if named else None})
            self.table, _ = self.conn.expect("TABLE")
            self.socks[0].settimeout(30)
            sock, _ = self.socks[0].accept()
            self.socks.append(sock)
            self.prev = Conn(sock, name="stage 0")
            hello, _ = self.prev.expect("HELLO")
            assert hello["stage"] == 0 and hello["cut"] == art.cut_id
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for sock in self.socks:
            sock.close()

    def __enter__(self) -> FakeStage:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def next_item(self) -> dict:
        while True:
            kind, header, _ = self.conn.recv()
            if kind == "PING":
                self.conn.send("PONG")
            elif kind == "ITEM":
                return header


def test_a_stage_that_names_no_checkpoint_is_refused(cut, tmp_path, procs):
    """A stage of an older kernjax (no checkpoint in its Hello) cannot be compared: refused."""
    head = procs.head(cut / "stage0", tmp_path / "head.log")
    with pytest.raises(ProtocolError, match="stage 1 named no checkpoint in its Hello: run "
                       "one kernjax on every stage"):
        FakeStage(cut, head.pp, named=False)


@pytest.mark.parametrize("bad, words", ids=["no item", "a non-object header"], argvalues=[
    (encode("TOKENS", {"rows": 3}, {"next_token": np.zeros(4, np.int32)}),
     "stage 1 sent a TOKENS frame without an item number"),
    (PREFIX.pack(b"KJ", 1, CODE["TOKENS"], 2, 0) + b"[]",
     "stage 1 sent a bad frame: a TOKENS frame has a malformed header (`[]` is not a JSON object)"),
])
def test_a_malformed_frame_from_a_joined_stage_ends_the_pipeline_at_once(cut, tmp_path, bad,
                                                                          words, procs):
    """At once: the request is answered within the client's 120 s, where --stage_timeout 600
    would have held it 600 s."""
    head = procs.head(cut / "stage0", tmp_path / "head.log", "--stage_timeout", "600")
    with FakeStage(cut, head.pp) as stage:
        assert head.wait_for("serving"), head.text()
        url = head.url

        async def go():
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
                task = asyncio.create_task(s.post(f"{url}/v1/completions",
                                                  json={"prompt": [1, 2, 3]}))
                await asyncio.to_thread(stage.next_item)
                stage.conn.sock.sendall(bad)
                r = await task
                return r.status, await r.json(content_type=None)

        status, body = asyncio.run(go())
        assert status == 503 and words in body["error"]["message"], body
        assert head.wait(60) == 1, head.text()
    assert f"error: head: {words}" in head.text(), head.text()
    _clean(head.text())


def test_a_stage_started_before_its_head_waits_and_checks_its_predecessor(cut, tmp_path, procs):
    server = refusing_port()  # the head, played by the test: refusing until it listens
    socks = [server]
    try:
        stage = procs.joiner(cut / "stage1", server.getsockname()[1], tmp_path / "stage.log")
        assert stage.wait_for("waiting for the head"), stage.text()
        server.listen()
        server.settimeout(30)
        sock, _ = server.accept()
        server.close()
        socks.append(sock)
        head = Conn(sock, name="stage 1")
        hello, _ = head.expect("HELLO")
        at = ("127.0.0.1", hello["listen"])
        # Strangers reach the stage's predecessor port first: silent, malformed, another cut.
        socks += [socket.create_connection(at) for _ in range(3)]
        socks.append(_raw(at, PREFIX.pack(b"KJ", 1, CODE["HELLO"], 2, 0) + b"[]"))
        other = Conn(socket.create_connection(at), name="the stage")
        socks.append(other.sock)
        other.send("HELLO", {"stage": 0, "stages": 2, "cut": "another"})
        head.send("TABLE", {"pages": hello["pages"], "next": None})
        with pytest.raises(ProtocolError, match="it takes stage 0 of that cut, not stage 0 of "
                                                "cut `another`"):
            other.expect("ACTS")
        assert stage.wait_for("refused a connection"), stage.text()
        assert "joined" not in stage.text(), stage.text()
        pred = Conn(socket.create_connection(at), name="the stage")
        socks.append(pred.sock)
        pred.send("HELLO", {"stage": 0, "stages": 2, "cut": hello["cut"]})
        assert stage.wait_for("joined cut"), stage.text()
        text = stage.text()
        assert re.search(STAMP + "stage 1: joined cut", text), text
        assert re.search(STAMP + r"stage 1: refused a connection: .*`\[\]` is not a JSON object",
                         text), text
        stage.p.send_signal(signal.SIGINT)  # Ctrl-C on a joined stage
        assert stage.wait(60) == 130, stage.text()
        assert stage.text().rstrip().endswith("interrupted")
        _clean(stage.text())
    finally:
        for sock in socks:
            sock.close()


def test_a_stage_the_head_closes_unanswered_asks_again(cut, tmp_path, procs):
    """A head busy with 64 connections yet to say who they are closes a new one unanswered: the
    stage asks again (until --startup_timeout) where it used to exit; a refusal still ends it."""
    with socket.create_server(("127.0.0.1", 0)) as server:  # the head, played by the test
        server.settimeout(60)
        stage = procs.joiner(cut / "stage1", server.getsockname()[1], tmp_path / "stage.log")
        sock, _ = server.accept()
        sock.close()  # unanswered
        sock, _ = server.accept()
        with sock:
            head = Conn(sock, name="stage 1")
            hello, _ = head.expect("HELLO")
            assert hello["stage"] == 1, hello
            head.send("ERROR", {"message": "a refusal for the test"})
            assert stage.wait(60) == 1, stage.text()
    text = stage.text()
    assert "the head closed the connection unanswered" in text, text
    assert "refused: a refusal for the test" in text, text
    _clean(text)
