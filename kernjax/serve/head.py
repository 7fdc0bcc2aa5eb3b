"""The head: stage 0, the only page pool, admission, packing, and the pipeline's bookkeeping.

Startup (kern-serve PP3): the head loads stage 0 and listens on `--pp_listen`; every other stage
connects and says Hello {stage, stages, cut, pages, listen, arrivals, departures, fills}. The head
refuses a Hello with another cut id, a stage number out of range or taken twice, or a signature
that does not chain; once all stages are in it sizes its pool to the fewest pages any stage holds,
answers each with a Table {pages, next} and connects to stage 1.

Serving: `submit` admits a prompt or refuses it at once with the limit it breaks (kern's head
wedged on a prompt past its context bound). The scheduler thread leases pages FIFO under
`max_seqs`, packs items with `pack()` (oldest first, partial chunks), sends each item's fills to
every stage, runs stage 0 and sends its departures on. A full item goes at once, a partial one only
while fewer items than stages are in flight (and at most `4 × stages` items are ever in flight:
back-pressure). The last stage answers every item with its tokens; an item that finishes a prompt
answers that request and returns its pages.

Faults: a stage whose connection closes, that sends an ERROR, or that answers no ping for
`stage_timeout` seconds ends the head: every request in flight or queued is answered with a 503
naming the stage, and the process exits non-zero once the answers are out. The other stages see
their connections close and exit too.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import os
import socket
import sys
import threading
import time
from collections import deque

import numpy as np

from kernjax.item import Piece, make_item
from kernjax.pool import Pool
from kernjax.runner import Runner
from kernjax.serve.pack import Waiting, admissible, full, pack
from kernjax.serve.protocol import (MAX_FRAME, Closed, Conn, ProtocolError, connect,
                                    parse_address)
from kernjax.serve.transport import HostTransport
from kernjax.timeline import log_item


class Refused(Exception):
    """A request the server will not run; `status` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@dataclasses.dataclass
class _Request:
    tokens: np.ndarray
    future: cf.Future
    arrived: float
    lease: object = None
    pos: int = 0


class Head:
    """Stage 0 of a pipeline (or the whole program), serving prompts through the other stages."""

    def __init__(self, runner: Runner, *, listen: str | None = None, max_seqs: int = 256,
                 stage_timeout: float = 60.0, startup_timeout: float = 600.0,
                 max_frame: int = MAX_FRAME, metrics=None, on_exit=None):
        self.runner, self.art = runner, runner.art
        self.shape = self.art.item
        self.stages = self.art.stages
        self.max_seqs, self.stage_timeout, self.max_frame = max_seqs, stage_timeout, max_frame
        self.metrics = metrics
        self.on_exit = on_exit or (lambda code: os._exit(code))
        self.cond = threading.Condition()
        self.queue: deque[_Request] = deque()
        self.live: list[_Request] = []        # leased, rows still to issue
        self.inflight: deque[tuple[int, list]] = deque()  # (item, [(request, finishes)])
        self.failed: str | None = None
        self.item = 0
        self.conns: dict[int, Conn] = {}
        self.fills: dict[int, list[str]] = {}
        self.seen: dict[int, float] = {}
        pages = self.shape.pages
        if self.stages > 1:
            if not listen:
                raise ValueError(f"`{self.art.path}` is stage 0 of {self.stages}; give --pp_listen")
            pages = self._gather(listen, startup_timeout, pages)
        self.pool = Pool(pages, self.shape.page, self.shape.width)
        # pack()'s bound on Σ(pos + n): the keys one item's attention can read, every page-table
        # row full. Each sequence's own bound (one row) is the pool's `fits`.
        self._context = self.shape.seqs * self.shape.context
        threading.Thread(target=self._schedule, name="scheduler", daemon=True).start()
        if self.stages > 1:
            threading.Thread(target=self._heartbeat, name="heartbeat", daemon=True).start()

    # --- startup ----------------------------------------------------------------------------

    def _gather(self, listen: str, timeout: float, pages: int) -> int:
        host, port = parse_address(listen)
        server = socket.create_server((host, port))
        server.settimeout(1.0)
        hellos: dict[int, tuple[Conn, dict, str]] = {}
        deadline = time.time() + timeout
        print(f"head: cut `{self.art.cut_id}`, waiting for stages 1..{self.stages - 1} on {listen}",
              file=sys.stderr, flush=True)
        while len(hellos) < self.stages - 1:
            if time.time() > deadline:
                missing = sorted(set(range(1, self.stages)) - set(hellos))
                raise RuntimeError(f"stages {missing} did not join within {timeout:.0f} s")
            try:
                sock, peer = server.accept()
            except TimeoutError:
                continue
            conn = Conn(sock, name=f"connection from {peer[0]}:{peer[1]}", limit=self.max_frame)
            sock.settimeout(10.0)
            try:
                hello, _ = conn.expect("HELLO")
                why = self._refuse(hello, hellos)
            except (ProtocolError, Closed, OSError) as e:
                print(f"head: refused {conn.name}: {e}", file=sys.stderr, flush=True)
                conn.close()
                continue
            if why:
                print(f"head: refused {conn.name}: {why}", file=sys.stderr, flush=True)
                try:
                    conn.send("ERROR", {"message": why})
                except Closed:
                    pass
                conn.close()
                continue
            sock.settimeout(None)
            conn.name = f"stage {hello['stage']}"
            hellos[hello["stage"]] = (conn, hello, peer[0])
            print(f"head: stage {hello['stage']} joined from {peer[0]}", file=sys.stderr, flush=True)
        server.close()
        pages = min([pages] + [h["pages"] for _, h, _ in hellos.values()])
        for s, (conn, hello, ip) in sorted(hellos.items()):
            nxt = hellos.get(s + 1)
            table = {"pages": pages, "next": None}
            if nxt:
                table["next"] = {"address": f"{nxt[2]}:{nxt[1]['listen']}",
                                 "arrivals": nxt[1]["arrivals"]}
            conn.send("TABLE", table)
            self.conns[s] = conn
            self.fills[s] = hello["fills"]
            self.seen[s] = time.time()
        one = hellos[1][1]
        self.next = HostTransport(connect(f"{hellos[1][2]}:{one['listen']}", "stage 1", 60,
                                          limit=self.max_frame), self.art.departures)
        for s, conn in self.conns.items():
            threading.Thread(target=self._read, args=(s, conn), name=f"stage{s}", daemon=True).start()
        return pages

    def _refuse(self, hello: dict, hellos: dict) -> str | None:
        s = hello.get("stage")
        if hello.get("cut") != self.art.cut_id:
            return (f"stage {s} belongs to cut `{hello.get('cut')}`; the head serves cut "
                    f"`{self.art.cut_id}`: start every stage from one `kernjax.cut --out`")
        if not isinstance(s, int) or not 1 <= s < self.stages:
            return f"stage {s} is not one of 1..{self.stages - 1}"
        if s in hellos:
            return f"stage {s} has joined already"
        want = [[x.name, x.dtype, list(x.shape)] for x in self.art.departures] if s == 1 else None
        if want is not None and hello.get("arrivals") != want:
            return f"stage 1 takes arrivals {hello.get('arrivals')}; stage 0 sends {want}"
        return None

    # --- requests ---------------------------------------------------------------------------

    def submit(self, tokens) -> cf.Future:
        """Queues a prompt; the future gives its first token or raises `Refused`."""
        fut: cf.Future = cf.Future()
        n = len(tokens)
        why = self.pool.fits(n) or admissible(n, rows=self.shape.rows, seqs=self.shape.seqs,
                                              context=self._context)
        with self.cond:
            if self.failed:
                fut.set_exception(Refused(503, self.failed))
            elif why:
                fut.set_exception(Refused(400, why))
            else:
                self.queue.append(_Request(np.asarray(tokens, np.int32), fut, time.time()))
                self.cond.notify_all()
        return fut

    # --- the scheduler ----------------------------------------------------------------------

    def _schedule(self) -> None:
        try:
            while True:
                with self.cond:
                    while not self.failed and not self._admit_and_plan():
                        self.cond.wait(0.5)
                    if self.failed:
                        return
                    plan = self._plan
                    item, pieces = self._take(plan)
                self._issue(item, pieces)
        except Exception as e:  # noqa: BLE001 (any scheduler error ends the head, with a reason)
            self.fail(f"the head's scheduler failed: {type(e).__name__}: {e}")

    def _admit_and_plan(self) -> bool:
        while self.queue and len(self.live) + self._awaiting() < self.max_seqs:
            lease = self.pool.lease(len(self.queue[0].tokens))
            if lease is None:
                break
            r = self.queue.popleft()
            r.lease = lease
            self.live.append(r)
        if self.metrics:
            self.metrics.pages.set(self.pool.in_use)
        if len(self.inflight) >= 4 * self.stages:
            return False
        waiting = [Waiting(i, r.pos, len(r.tokens) - r.pos) for i, r in enumerate(self.live)]
        sh = self.shape
        plan = pack(waiting, rows=sh.rows, seqs=sh.seqs, context=self._context)
        if plan and (full(plan, rows=sh.rows, seqs=sh.seqs) or len(self.inflight) < self.stages):
            self._plan = plan
            return True
        return False

    def _awaiting(self) -> int:
        return sum(f for _, ps in self.inflight for _, f in ps)

    def _take(self, plan):
        k, self.item = self.item, self.item + 1
        pieces, ends = [], []
        for i, n in plan:
            r = self.live[i]
            pieces.append(Piece(r.tokens[r.pos:r.pos + n], r.pos, r.lease.pages))
            r.pos += n
            ends.append((r, r.pos == len(r.tokens)))
        self.live = [r for r in self.live if r.pos < len(r.tokens)]
        self.inflight.append((k, ends))
        return k, pieces

    def _issue(self, k: int, pieces) -> None:
        item = make_item(pieces, self.shape)
        rows = sum(len(p.tokens) for p in pieces)
        for s, conn in self.conns.items():
            conn.send("ITEM", {"item": k, "rows": rows}, {n: item[n] for n in self.fills[s]})
        t0 = time.time()
        departures, outputs = self.runner.run(item)
        if self.stages == 1:
            tokens = np.asarray(outputs["next_token"])
            t1 = time.time()
            log_item(0, k, rows, t0, t1)
            self._answer(k, tokens, [int((t1 - t0) * 1e6)], rows)
        else:
            self.next.send(k, [np.asarray(d) for d in departures],
                           {"busy_us": [int((time.time() - t0) * 1e6)]})
            log_item(0, k, rows, t0, time.time())

    def _answer(self, k: int, tokens: np.ndarray, busy_us: list[int], rows: int) -> None:
        now = time.time()
        with self.cond:
            if not self.inflight or self.inflight[0][0] != k:
                raise ProtocolError(f"tokens for item {k} arrived; item "
                                    f"{self.inflight[0][0] if self.inflight else None} was due")
            _, ends = self.inflight.popleft()
            for i, (r, finished) in enumerate(ends):
                if finished:
                    self.pool.release(r.lease)
                    r.future.set_result((int(tokens[i]), now - r.arrived))
            if self.metrics:
                self.metrics.item(rows, busy_us)
                self.metrics.pages.set(self.pool.in_use)
            self.cond.notify_all()

    # --- stage connections ------------------------------------------------------------------

    def _read(self, s: int, conn: Conn) -> None:
        try:
            while True:
                kind, header, arrays = conn.recv()
                self.seen[s] = time.time()
                if kind == "PONG":
                    continue
                if kind == "ERROR":
                    raise ProtocolError(f"stage {s} failed: {header.get('message')}")
                if kind != "TOKENS" or s != self.stages - 1:
                    raise ProtocolError(f"stage {s} sent {kind}, which a stage never sends the head")
                self._answer(header["item"], arrays["next_token"], header.get("busy_us", []),
                             header.get("rows", 0))
        except (Closed, ProtocolError, OSError) as e:
            # Closed and ProtocolError name the stage already ("stage 1 closed the connection").
            self.fail(str(e) if isinstance(e, (Closed, ProtocolError)) else f"stage {s}: {e}")

    def _heartbeat(self) -> None:
        period = max(0.2, self.stage_timeout / 4)
        while not self.failed:
            now = time.time()
            for s, conn in self.conns.items():
                if now - self.seen[s] > self.stage_timeout:
                    self.fail(f"stage {s} stopped answering for {now - self.seen[s]:.0f} s "
                              f"(--stage_timeout {self.stage_timeout:g})")
                    return
                try:
                    conn.send("PING")
                except Closed:
                    pass  # its reader reports the closed connection
            time.sleep(period)

    def fail(self, message: str) -> None:
        """Ends the head: answers every request with a 503 naming the cause, then exits non-zero."""
        with self.cond:
            if self.failed:
                return
            self.failed = message
            pending = list(self.queue) + list(self.live)
            pending += [r for _, ends in self.inflight for r, f in ends if f]
            self.queue.clear()
            self.live.clear()
            self.cond.notify_all()
        print(f"error: head: {message}; answering {len(pending)} requests with 503 and exiting",
              file=sys.stderr, flush=True)
        for r in pending:
            if not r.future.done():
                r.future.set_exception(Refused(503, f"the pipeline failed: {message}"))
        for conn in self.conns.values():
            try:
                conn.send("ERROR", {"message": message})
            except Closed:
                pass
        threading.Timer(1.0, self.on_exit, (1,)).start()
