"""The head: stage 0, the only page pool, admission, packing, and the pipeline's bookkeeping.

Startup (kern-serve PP3): the head loads stage 0 and listens on `--pp_listen`; every other stage
connects and says Hello {stage, stages, cut, pages, listen, arrivals, departures, fills,
checkpoint}. The head reads every connection's Hello in a thread of its own
(`protocol.handshakes`) and refuses, with one log line, a Hello with another cut id or other
weights, a stage number out of range or taken twice, or a signature that does not chain, and
anything that is not a Hello in time; once all stages are in (`join`, while `waiting()` says
which are missing and requests get a 503) it sizes its pool to the fewest pages any stage holds,
answers each with a Table {pages, next} and connects to stage 1.

Serving: `submit` admits a prompt or refuses it at once with the limit it breaks (kern's head
wedged on a prompt past its context bound). The scheduler thread leases pages FIFO under
`max_seqs`, packs items with `pack()` (oldest first, partial chunks), sends each item's fills to
every stage, runs stage 0 and sends its departures on; on an edge, or serving the whole program,
it issues the next item while a thread (`_finish`) waits for this one. A full item goes at once, a
partial one once fewer items than stages are in flight, or as many if it holds all there is to
issue (docs/serving.md); at most `4 × stages` are in flight (back-pressure). The last stage answers
every item with its tokens; an item that finishes a prompt answers it and frees its pages.

Faults: a stage whose connection closes, that sends an ERROR, or that answers no ping for
`stage_timeout` seconds ends the head: every request in flight or queued is answered with a 503
naming the stage, and the process exits non-zero once the answers are out. The other stages see
their connections close and exit too.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import os
import queue
import socket
import sys
import threading
import time
from collections import deque

import numpy as np

from kernjax.core import lowering
from kernjax.core.item import Piece, make_item
from kernjax.core.pool import Pool
from kernjax.runtime.runner import Runner
from kernjax.core.pack import Waiting, admissible, full, pack
from kernjax.serve.protocol import (MAX_FRAME, PING_MIN, Closed, Conn, ProtocolError, connect,
                                    handshakes, parse_address)
from kernjax.runtime import edge
from kernjax.serve.transport import HostTransport
from kernjax.serve.timeline import log_item

# The most bytes the head reads of a connection's first frame before it has joined (a Hello is
# about 1 KB): pending connections cannot make the head hold --max_frame each.
HELLO_MAX = 1 << 20


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
    gone: object = None   # () -> True once the client has gone (its connection closed)

    def abandoned(self) -> bool:
        try:
            return bool(self.gone and self.gone())
        except Exception:  # noqa: BLE001 (a broken check never stops the scheduler)
            return False

    def settle(self, result=None, error: Exception | None = None) -> None:
        """Answers the request; a future its caller cancelled has no one to answer."""
        try:
            self.future.set_exception(error) if error else self.future.set_result(result)
        except cf.InvalidStateError:
            pass


class Head:
    """Stage 0 of a pipeline (or the whole program), serving prompts through the other stages."""

    def __init__(self, runner: Runner, *, listen: str | None = None, max_seqs: int = 256,
                 stage_timeout: float = 60.0, startup_timeout: float = 600.0,
                 max_frame: int = MAX_FRAME, metrics=None, on_exit=None,
                 transport: str = "host", edge_timeout: float = 60.0,
                 checkpoint: dict | None = None):
        self.runner, self.art = runner, runner.art
        self.checkpoint = checkpoint  # {dir, id}: each stage's Hello must name the same id
        self.transport, self.edge, self.edge_timeout = transport, None, edge_timeout
        self.shape = self.art.item
        self.stages = self.art.stages
        self.max_seqs, self.stage_timeout, self.max_frame = max_seqs, stage_timeout, max_frame
        self.metrics = metrics
        self.on_exit = on_exit or (lambda code: os._exit(code))
        self.cond = threading.Condition()
        self.queue: deque[_Request] = deque()
        self.live: list[_Request] = []        # leased, rows still to issue
        self.inflight: deque[tuple[int, list]] = deque()  # (item, [(request, finishes)])
        self._ran: queue.Queue = queue.Queue()  # issued, for `_finish`: (item, rows, t0, tokens)
        self.failed: str | None = None
        self.joining: str | None = None       # while stages join: which are missing
        self.item = 0
        self.conns: dict[int, Conn] = {}
        self.fills: dict[int, list[str]] = {}
        self.seen: dict[int, float] = {}
        self.listen, self.startup_timeout = listen, startup_timeout
        self.pool = Pool(self.shape.pages, self.shape.page, self.shape.width, self.shape.slots)
        # pack()'s bound on Σ(pos + n): the keys one item's attention can read, every page-table
        # row full. Each sequence's own bound (one row) is the pool's `fits`.
        self._context = self.shape.seqs * self.shape.context
        if self.stages > 1:
            if not listen:
                raise ValueError(f"`{self.art.path}` is stage 0 of {self.stages}; give --pp_listen")
            host, port = parse_address(listen, any_port=True)
            try:
                self._server = socket.create_server((host, port))
            except OSError as e:
                raise OSError(f"cannot listen for the stages on {listen} (--pp_listen): "
                              f"{os.strerror(e.errno) if e.errno else e}") from None
            self.listen = f"{host}:{self._server.getsockname()[1]}"  # port 0: the one it got
            # Until every stage is in, `failed` holds why requests get a 503 (see `join`).
            self.failed = self.joining = self._missing(range(1, self.stages))

    def _missing(self, stages) -> str:
        s = sorted(stages)
        return f"waiting for stage{'s' if len(s) > 1 else ''} " + \
            (f"{s[0]}..{s[-1]}" if len(s) > 1 and s[-1] - s[0] == len(s) - 1 else
             ", ".join(map(str, s))) + " to join"

    def waiting(self) -> str | None:
        """While the other stages join: which are missing; None once all are in."""
        return self.joining

    def join(self) -> None:
        """Waits for the other stages (RuntimeError after `startup_timeout`), then serves."""
        if self.metrics:
            self.metrics.memory(0, self.runner.memory())
        if self.stages > 1:
            pages = self._gather(self.startup_timeout)
            with self.cond:
                self.pool = Pool(pages, self.shape.page, self.shape.width, self.shape.slots)
                self.failed = self.joining = None
            for s, conn in self.conns.items():
                threading.Thread(target=self._read, args=(s, conn), name=f"stage{s}",
                                 daemon=True).start()
            threading.Thread(target=self._heartbeat, name="heartbeat", daemon=True).start()
        if self.edge or self.stages == 1:  # the scheduler issues, `_finish` waits
            threading.Thread(target=self._finish, name="finish", daemon=True).start()
        threading.Thread(target=self._schedule, name="scheduler", daemon=True).start()

    # --- startup ----------------------------------------------------------------------------

    def _gather(self, timeout: float) -> int:
        hellos: dict[int, tuple[Conn, dict, str]] = {}
        say = lambda msg: print(f"head: {msg}", file=sys.stderr, flush=True)  # noqa: E731

        def take(conn: Conn, kind: str, hello: dict) -> str | None:
            if kind != "HELLO":
                return f"sent {kind} where a Hello was due"
            why = self._refuse(hello, hellos)
            if why:
                return why
            s, ip = hello["stage"], conn.sock.getpeername()[0]
            conn.name = f"stage {s}"
            hellos[s] = (conn, hello, ip)
            missing = set(range(1, self.stages)) - set(hellos)
            with self.cond:
                self.failed = self.joining = self._missing(missing) if missing else \
                    "every stage has joined; starting the pipeline"
            say(f"stage {s} joined from {ip}")
            return None

        say(f"cut `{self.art.cut_id}`, {self._missing(range(1, self.stages))} on {self.listen}")
        deadline = time.time() + timeout
        while done := handshakes(self._server, take, done=lambda: len(hellos) == self.stages - 1,
                                 deadline=deadline, log=say, limit=min(self.max_frame, HELLO_MAX)):
            gone = [s for s, (conn, _, _) in hellos.items() if not conn.alive()]
            if not gone:
                break
            for s in gone:  # it said Hello, then went: wait for it again (restarted, say)
                say(f"stage {s} left before the pipeline started; waiting for it again")
                del hellos[s]
        self._server.close()
        if not done:
            missing = sorted(set(range(1, self.stages)) - set(hellos))
            why = f"stages {missing} did not join within {timeout:g} s (--startup_timeout)"
            for conn, _, _ in hellos.values():  # told, a joined stage ends; closed, it asks again
                try:
                    conn.send("ERROR", {"message": f"the head gives up: {why}"})
                except ConnectionError:
                    pass
            raise RuntimeError(f"{why}; start them with --pp_head {self.listen}")
        pages = min([self.shape.pages] + [h["pages"] for _, h, _ in hellos.values()])
        for s, (conn, hello, ip) in sorted(hellos.items()):
            nxt = hellos.get(s + 1)
            table = {"pages": pages, "next": None}
            if nxt:
                table["next"] = {"address": f"{nxt[2]}:{nxt[1]['listen']}",
                                 "arrivals": nxt[1]["arrivals"],
                                 **{k: nxt[1][k] for k in ("transport", "edge", "slots", "ipc",
                                                           "nccl") if k in nxt[1]}}
            conn.send("TABLE", table)
            self.conns[s] = conn
            self.fills[s] = hello["fills"]
            if self.metrics and isinstance(hello.get("memory"), dict):
                self.metrics.memory(s, hello["memory"])
            self.seen[s] = time.time()
        conn = connect(f"{hellos[1][2]}:{hellos[1][1]['listen']}", "stage 1", 60,
                       limit=self.max_frame)
        conn.send("HELLO", {"stage": 0, "stages": self.stages, "cut": self.art.cut_id})
        self.next = HostTransport(conn, self.art.departures)
        self.edge = edge.sending(self.art.departures, 0, hellos[1][1])
        return pages

    def _refuse(self, hello: dict, hellos: dict) -> str | None:
        s = hello.get("stage")
        if isinstance(hello.get("lowering"), dict) and (why := lowering.refusal(
                f"stage {s}", hello["lowering"], "the head (stage 0)", self.art.lowering)):
            return why
        if hello.get("cut") != self.art.cut_id:
            return (f"stage {s} belongs to cut `{hello.get('cut')}`; the head serves cut "
                    f"`{self.art.cut_id}`: start every stage from one `kernjax cut --out`")
        if type(s) is not int or not 1 <= s < self.stages or hello.get("stages") != self.stages:
            return (f"a Hello from stage {s!r} of {hello.get('stages')!r} stages; this cut has "
                    f"stages 0..{self.stages - 1}")
        if s in hellos and hellos[s][0].alive():  # a stage sends nothing until its Table
            return f"stage {s} has joined already"
        pages, listen, fills = hello.get("pages"), hello.get("listen"), hello.get("fills")
        bad = [k for k, ok in (
            ("pages", type(pages) is int and pages > 0),
            ("listen", type(listen) is int and 0 < listen < 65536),
            ("arrivals", isinstance(hello.get("arrivals"), list)),
            ("fills", isinstance(fills, list) and all(isinstance(f, str) for f in fills)
             and set(fills) <= set(make_item([], self.shape)))) if not ok]
        if bad:
            return f"stage {s} sent a malformed Hello: {', '.join(bad)}"
        if hello.get("transport", "host") != self.transport:
            return (f"stage {s} uses the {hello.get('transport', 'host')} transport; the head "
                    f"uses {self.transport}: start every stage with the same --transport")
        theirs, mine = hello.get("checkpoint"), self.checkpoint
        if mine and not (isinstance(theirs, dict) and isinstance(theirs.get("dir"), str)):
            return f"stage {s} named no checkpoint in its Hello: run one kernjax on every stage"
        if mine and theirs.get("id") != mine["id"]:
            if theirs["dir"] == mine["dir"]:
                return (f"stage {s} read other tensors from `{mine['dir']}` than the head did: "
                        "it changed since the head loaded it; restart the head and every stage")
            return (f"stage {s} runs the weights of `{theirs['dir'][:200]}`, the head those of "
                    f"`{mine['dir']}`, and their tensors differ (ids {str(theirs.get('id'))[:20]}"
                    f", {mine['id']}): two checkpoints in one pipeline compute neither's "
                    f"function; start every stage with --weights {mine['dir']}")
        want = [[x.name, x.dtype, list(x.shape)] for x in self.art.departures] if s == 1 else None
        if want is not None and hello.get("arrivals") != want:
            return f"stage 1 takes arrivals {hello.get('arrivals')}; stage 0 sends {want}"
        return None

    # --- requests ---------------------------------------------------------------------------

    def submit(self, tokens, gone=None) -> cf.Future:
        """Queues a prompt; the future gives `(first token, seconds)` or raises `Refused`."""
        return self.submit_all([tokens], gone)[0]

    def submit_all(self, prompts, gone=None) -> list[cf.Future]:
        """Queues prompts, each its own sequence, or refuses them all at once. While `gone()`
        says the client has gone, a prompt not yet packed is dropped: `Refused(499)`."""
        futs = [cf.Future() for _ in prompts]
        sh = self.shape
        why = next((f"prompt {i}: {w}" if len(prompts) > 1 else w for i, p in enumerate(prompts)
                    if (w := self.pool.fits(len(p)) or admissible(
                        len(p), rows=sh.rows, seqs=sh.seqs, context=self._context))), None)
        with self.cond:
            error = Refused(503, self.failed) if self.failed else Refused(400, why) if why else None
            for fut, p in zip(futs, prompts):
                if error:
                    fut.set_exception(error)
                else:
                    self.queue.append(_Request(np.asarray(p, np.int32), fut, time.time(),
                                              gone=gone))
            self.cond.notify_all()
        return futs

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
        gone = Refused(499, "the client closed the connection before its prompt was packed")
        for r in [r for r in self.live if r.pos == 0 and r.abandoned()]:
            self.live.remove(r)
            self.pool.release(r.lease)
            r.settle(error=gone)
        while self.queue and len(self.live) + self._awaiting() < self.max_seqs:
            if self.queue[0].abandoned():
                self.queue.popleft().settle(error=gone)
                continue
            lease = self.pool.lease(len(self.queue[0].tokens))
            if lease is None:
                break
            r = self.queue.popleft()
            r.lease = lease
            self.live.append(r)
        if self.metrics:
            self.metrics.pages.set(self.pool.in_use)
            self.metrics.slots.set(self.pool.slots_in_use)
        if len(self.inflight) >= 4 * self.stages:
            return False
        waiting = [Waiting(i, r.pos, len(r.tokens) - r.pos) for i, r in enumerate(self.live)]
        sh = self.shape
        plan = pack(waiting, rows=sh.rows, seqs=sh.seqs, context=self._context)
        if plan and (full(plan, rows=sh.rows, seqs=sh.seqs) or len(self.inflight) < self.stages
                     or len(self.inflight) == self.stages and not self.queue  # all there is
                     and sum(n for _, n in plan) == sum(w.left for w in waiting)):
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
            pieces.append(Piece(r.tokens[r.pos:r.pos + n], r.pos, r.lease.pages, r.lease.slot))
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
        if self.edge:  # the program pushes into stage 1's slot itself; `_finish` logs it
            self.runner.run_edged(item, k)
            return self._ran.put((k, rows, t0, None))
        departures, outputs = self.runner.run(item)
        if self.stages == 1:  # on to the next item while this one runs
            self._ran.put((k, rows, t0, outputs["next_token"]))
        else:
            self.next.send(k, [np.asarray(d) for d in departures],
                           {"busy_us": [int((time.time() - t0) * 1e6)]})
            log_item(0, k, rows, t0, time.time())

    def _finish(self) -> None:
        """Waits for each issued item in order, off the scheduler's thread: on an edge, for item
        k to leave (stage 1's edge says it arrived: a load from shared memory, no driver call;
        fails after the timeout); serving the whole program, for its tokens, and answers (an
        item is busy from its issue or the end of the item before, whichever is later)."""
        last = 0.0
        try:
            while not self.failed:
                try:
                    k, rows, t0, tokens = self._ran.get(timeout=0.5)
                except queue.Empty:
                    continue
                if self.edge and not edge.left(self.edge, k, self.edge_timeout,
                                               stop=lambda: bool(self.failed)):
                    if not self.failed:
                        self.fail(f"stage 1 stopped taking items: item {k} waited "
                                  f"{self.edge_timeout:g} s for its slot (--stage_timeout)")
                    return
                tokens = None if self.edge else np.asarray(tokens)
                t1 = time.time()
                log_item(0, k, rows, t0, t1)
                if tokens is not None:
                    self._answer(k, tokens, [int((t1 - max(t0, last)) * 1e6)], rows)
                last = t1
        except Exception as e:  # noqa: BLE001 (a failed item ends the head, with a reason)
            self.fail(f"the program failed: {type(e).__name__}: {e}")

    def _answer(self, k: int, tokens: np.ndarray, busy_us: list[int], rows: int) -> None:
        now = time.time()
        with self.cond:
            if self.failed:  # `fail` answers every request still in flight
                return
            if not self.inflight or self.inflight[0][0] != k:
                raise ProtocolError(f"tokens for item {k} arrived; item "
                                    f"{self.inflight[0][0] if self.inflight else None} was due")
            _, ends = self.inflight.popleft()
            for r, finished in ends:
                if finished:
                    self.pool.release(r.lease)
            if self.metrics:  # before any reply: a client that has its answer sees the pool back
                self.metrics.item(rows, busy_us)
                self.metrics.pages.set(self.pool.in_use)
                self.metrics.slots.set(self.pool.slots_in_use)
            for i, (r, finished) in enumerate(ends):
                if finished:
                    r.settle((int(tokens[i]), now - r.arrived))
            self.cond.notify_all()

    # --- stage connections ------------------------------------------------------------------

    def _read(self, s: int, conn: Conn) -> None:
        try:
            while True:
                kind, header, arrays = conn.recv()
                self.seen[s] = time.time()
                if kind == "PONG":
                    continue
                if kind == "ERROR":  # the first cause: the stage, or the upstream stage it lost
                    c = header.get("stage")
                    c = c if type(c) is int and 0 < c < s else s
                    return self.fail(f"stage {c} failed" + (f" (stage {s} says)" * (c != s))
                                     + f": {header.get('message')}")
                if kind != "TOKENS" or s != self.stages - 1:
                    raise ProtocolError(f"stage {s} sent {kind}, which a stage never sends the head")
                k, tokens = header.get("item"), arrays.get("next_token")
                if type(k) is not int or tokens is None or tokens.ndim != 1:
                    raise ProtocolError(f"stage {s} sent a TOKENS frame without an item number "
                                        f"and a next_token vector ({str(header)[:100]})")
                self._answer(k, tokens, header.get("busy_us", []), header.get("rows", 0))
        except Exception as e:  # noqa: BLE001 (any error on a link ends the pipeline, at once)
            why = str(e) if isinstance(e, (Closed, ProtocolError)) else f"{type(e).__name__}: {e}"
            self.fail(why if why.startswith(f"stage {s}") else f"stage {s}: {why}")

    def _heartbeat(self) -> None:
        period = max(PING_MIN, self.stage_timeout / 4)
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
            if self.failed and not self.joining:
                return
            self.failed, self.joining = message, None
            pending = list(self.queue) + list(self.live)
            pending += [r for _, ends in self.inflight for r, f in ends if f]
            self.queue.clear()
            self.live.clear()
            self.cond.notify_all()
        n = len(pending)
        print(f"error: head: {message}; answering {n} request{'s' * (n != 1)} with 503 and exiting",
              file=sys.stderr, flush=True)
        for r in pending:
            r.settle(error=Refused(503, f"the pipeline failed: {message}"))
        for conn in self.conns.values():
            try:
                conn.send("ERROR", {"message": message})
            except Closed:
                pass
        threading.Timer(1.0, self.on_exit, (1,)).start()
