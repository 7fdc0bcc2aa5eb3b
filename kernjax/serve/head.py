"""The head: stage 0, the only page pool, admission, batching, and the pipeline's bookkeeping.

Startup (kern-serve PP3): the head loads stage 0 and listens on `--pp_listen`; every other stage
connects and says Hello {stage, stages, cut, pages, listen, arrivals, departures, fills,
checkpoint}. The head reads every connection's Hello in a thread of its own
(`protocol.handshakes`) and refuses, with one log line, a Hello with another cut id or other
weights, a stage number out of range or taken twice, or a signature that does not chain, and
anything that is not a Hello in time; once all stages are in (`join`, while `waiting()` says
which are missing and requests get a 503) it sizes its pool to the fewest pages any stage holds,
answers each with a Table {pages, next} and connects to stage 1.

Serving: `start` admits a request (its prompts, each `n` sequences) or refuses it at once with
the limit it breaks (kern's head wedged on a prompt past its context bound). A sequence is a
prompt and the tokens it generates. The scheduler thread leases a prompt's pages FIFO under
`max_seqs`, and builds each item with `batch.plan`: the one-row steps of generating sequences
(a prompt's last token is its first step) beside the prompts' next rows, packed by `pack()`; the
item's program is a decode bucket, the prefill chunk, or the score chunk where a prompt is being
scored (`echo` with log-probabilities). Batch-invariant (`invariant`, the default), steps use one
decode bucket (`decode_bucket`, the cut's largest unless named) and never share an item with
prompt rows, so every step runs in one program whatever its company: on a GPU a row's bits follow
its program's row count. Otherwise steps take the smallest bucket that holds them, or ride in the
chunk beside prompt rows. It sends each item's program and fills to every stage, runs stage 0 and
sends its departures on; on an edge, or serving the whole program, it issues the next item while
a thread (`_finish`) waits for this one. An item of prompt rows only goes at once when full, else
once fewer items of prompt rows than stages are in flight, or as many if it holds all there is to
issue (docs/serving.md); an item with steps goes at once; at most `4 x stages` are in flight
(back-pressure). The last stage answers every item with its outputs (tokens, log-probabilities,
row scores); each answered step appends its sequence's token, which ends the sequence on a stop
token or at `max_tokens`.

Pages grow with a sequence, a page at a time (`Pool.grow`); a step that finds no page free waits,
and when nothing is in flight to free one, the newest generating sequence is preempted: its pages
go back and it is recomputed later from its tokens so far (the same bits: a row's arithmetic does
not depend on its item; batch-invariant, the rows it generated go again as steps in the bucket,
the program they first ran in). Nothing admitted is lost. A sequence whose client has gone is
dropped at its next step.

The device transports (`shm`, `ipc`, `nccl`) carry the prefill program's activations only: there
steps go in the prefill chunk and scoring is refused.

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

from kernjax import artifact
from kernjax.core import lowering
from kernjax.core.batch import plan as plan_item
from kernjax.core.item import GREEDY, Piece, make_item
from kernjax.core.pool import Pool
from kernjax.runtime.runner import Runner
from kernjax.core.pack import Waiting, admissible, full
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


@dataclasses.dataclass(frozen=True)
class Ask:
    """What a request asks of each of its prompts: `max_tokens` tokens generated (0: the prompt
    is scored only), drawn with `sampling` (temperature, top_p, top_k, min_p) and the counter
    key (`seed`, choice, step), `n` sequences a prompt, ending at a token of `stop_ids`;
    `score`: the prompt's own log-probabilities (`echo`)."""

    max_tokens: int = 1
    sampling: tuple = GREEDY
    seed: int = 0
    n: int = 1
    stop_ids: frozenset = frozenset()
    score: bool = False


class Seq:
    """One sequence: its tokens (the prompt, then what it generated), where its rows stand, its
    lease, and where its events go (`emit(kind, data)`: `prompt`, `token`, `done`, `error`)."""

    def __init__(self, tokens, ask: Ask, choice: int, emit, gone, arrived: float, step: bool,
                 replay: bool = False):
        self.tokens = [int(t) for t in tokens]
        self.prompt, self.ask, self.choice = len(self.tokens), ask, choice
        self.emit, self.gone, self.arrived = emit, gone, arrived
        self.step = step        # the last known token goes as a one-row step (else in a chunk)
        self.replay = replay    # recomputed, its generated rows go as steps again (as they went)
        self.pos = 0            # rows issued: their keys and values are written or in flight
        self.made = 0           # tokens generated
        self.lease = None
        self.inflight = 0       # its pieces in items not answered yet
        self.scores: list | None = [] if ask.score else None  # the prompt's rows, by chunk
        self.ended = False
        self.cancelled = False  # set by the client's side: a stop string ended it, say
        self.first: float | None = None

    @property
    def scoring(self) -> bool:
        """Whether its prompt rows still go through the score program."""
        return self.ask.score and self.made == 0 and self.pos < self.prompt - 1

    def chunk_end(self) -> int:
        """Rows that go in chunks: all but the last known token's, which is the step's (without
        a step program, a prompt's last chunk samples its first token). Replaying, the prompt's
        rows only: every row from the prompt's last on goes as a step, as it first went."""
        n = len(self.tokens)
        if self.ask.max_tokens == 0 or self.replay:
            return self.prompt - 1
        return n - 1 if self.step or self.made else n

    def left(self) -> int:
        return max(self.chunk_end() - self.pos, 0)

    def ready(self) -> bool:
        """Whether its step can go: its chunks are out (items run in order on every stage) and
        its last token is known, its row not issued."""
        return (not self.ended and self.ask.max_tokens > 0
                and self.made < self.ask.max_tokens
                and self.chunk_end() <= self.pos <= len(self.tokens) - 1
                and (self.step or self.made > 0))

    def scored(self) -> int:
        """Prompt rows whose scores have come back."""
        return sum(len(c[0]) for c in self.scores or ())

    def abandoned(self) -> bool:
        try:
            return self.cancelled or bool(self.gone and self.gone())
        except Exception:  # noqa: BLE001 (a broken check never stops the scheduler)
            return False

    def say(self, kind: str, data=None) -> None:
        try:
            self.emit(kind, data)
        except Exception:  # noqa: BLE001 (a client's callback never stops the scheduler)
            pass


class Head:
    """Stage 0 of a pipeline (or the whole program), serving prompts through the other stages."""

    def __init__(self, runner: Runner, *, listen: str | None = None, max_seqs: int = 256,
                 stage_timeout: float = 60.0, startup_timeout: float = 600.0,
                 max_frame: int = MAX_FRAME, metrics=None, on_exit=None,
                 transport: str = "host", edge_timeout: float = 60.0,
                 checkpoint: dict | None = None, invariant: bool = True,
                 decode_bucket: int | None = None):
        self.runner, self.art = runner, runner.art
        self.invariant = invariant  # one decode program for every step, never beside prompt rows
        self.decode_bucket = pick_bucket(self.art.programs, decode_bucket)
        self.checkpoint = checkpoint  # {dir, id}: each stage's Hello must name the same id
        self.transport, self.edge, self.edge_timeout = transport, None, edge_timeout
        self.shape = self.art.item
        self.stages = self.art.stages
        self.max_seqs, self.stage_timeout, self.max_frame = max_seqs, stage_timeout, max_frame
        self.metrics = metrics
        self.on_exit = on_exit or (lambda code: os._exit(code))
        self.cond = threading.Condition()
        self.queue: deque[Seq] = deque()     # admitted requests' sequences, not yet leased
        self.live: list[Seq] = []             # leased: rows to issue, steps to take
        self.inflight: deque[tuple[int, str, list]] = deque()  # (item, program, [entries])
        self.preemptions = 0
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
            theirs, mine = hello.get("programs"), list(self.art.programs)
            differ = (f" (its programs are {', '.join(map(str, theirs))}; the head's "
                      f"{', '.join(mine)})" if isinstance(theirs, list) and theirs != mine
                      else "")
            return (f"stage {s} belongs to cut `{hello.get('cut')}`{differ}; the head serves cut "
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

    @property
    def programs(self) -> dict:
        """The programs items may run: every program of the cut on the host transport and
        serving the whole program; the prefill chunk alone on a device transport."""
        if self.stages > 1 and self.transport != "host":
            return {artifact.DEFAULT: self.art.default}
        return self.art.programs

    def policy(self) -> str:
        """Where steps go, in words (the startup line says it)."""
        if not artifact.decode_buckets(self.programs):
            return "steps in the prefill chunk"
        if self.invariant:
            return f"steps in decode{self.decode_bucket}, batch-invariant"
        return "steps in the smallest decode bucket or beside prompt rows"

    @property
    def buckets(self) -> list[int]:
        """The decode buckets steps may use: batch-invariant, the one chosen (a row's bits then
        never follow its company's size); else all of the cut's."""
        every = artifact.decode_buckets(self.programs)
        return [self.decode_bucket] if self.invariant and every else every

    def refusal(self, prompts, ask: Ask) -> str | None:
        """Why these prompts cannot be served as `ask` says, or None."""
        sh = self.shape
        if ask.score and "score" not in self.programs:
            return ("this pipeline cannot score prompts: " + (
                f"its --transport {self.transport} carries the prefill program only; serve with "
                "--transport host" if "score" in self.art.programs else
                "its cut has no score program; re-cut it with this kernjax"))
        for i, p in enumerate(prompts):
            at = f"prompt {i}: " if len(prompts) > 1 else ""
            need = len(p) + max(ask.max_tokens - 1, 0)
            why = admissible(len(p), rows=sh.rows, seqs=sh.seqs, context=self._context)
            if not why and (w := self.pool.fits(need)):
                why = w if need == len(p) else (
                    f"the prompt has {len(p)} tokens and max_tokens is {ask.max_tokens}, "
                    f"{need} tokens in the sequence; {w.split('; ', 1)[-1]}")
            if why:
                return at + why
        return None

    def start(self, prompts, ask: Ask = Ask(), emit=None, gone=None) -> list[Seq]:
        """Admits `prompts` (token-id arrays), `ask.n` sequences each, or refuses them all with
        `Refused`. `emit(index, kind, data)` gets each sequence's events, `index` = prompt x n +
        choice: `prompt` (its prompt's scores), `token` (each token generated), `done` (the
        finish reason), `error` (a `Refused`); `gone()` says when the client has left. Returns
        the sequences, in that order (`Seq.cancelled` ends one early)."""
        why = self.refusal(prompts, ask)
        now = time.time()
        step = bool(self.buckets) and (ask.max_tokens > 0)
        with self.cond:
            if self.failed:
                raise Refused(503, self.failed)
            if why:
                raise Refused(400, why)
            made = []
            for i, p in enumerate(prompts):
                for c in range(ask.n):
                    k = i * ask.n + c
                    say = (lambda k: lambda kind, data: emit(k, kind, data))(k) if emit else \
                        (lambda kind, data: None)
                    made.append(Seq(p, ask, c, say, gone, now, step, step and self.invariant))
            for r in made:
                if len(r.tokens) == 1 and ask.max_tokens == 0:  # nothing to run: no row scores
                    r.say("prompt", _prompt_scores(r))  # no row to run: its scores are none
                    self._end(r, "length", now)
                else:
                    self.queue.append(r)
            self.cond.notify_all()
        return made

    def submit(self, tokens, gone=None) -> cf.Future:
        """Queues a prompt for its first token; the future gives `(token, seconds)` or raises
        `Refused`."""
        return self.submit_all([tokens], gone)[0]

    def submit_all(self, prompts, gone=None) -> list[cf.Future]:
        """Queues prompts for their first token each (`submit`), or refuses them all at once.
        While `gone()` says the client has gone, a prompt not yet packed is dropped:
        `Refused(499)`."""
        futs = [cf.Future() for _ in prompts]
        got: dict[int, int] = {}

        def emit(k, kind, data):
            if kind == "token":
                got[k] = data["id"]
            elif kind == "done":
                _settle(futs[k], (got[k], data["seconds"]))
            elif kind == "error":
                _settle(futs[k], error=data)
        try:
            self.start(prompts, Ask(), emit, gone)
        except Refused as e:
            for f in futs:
                f.set_exception(e)
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
                    k, program, pieces = self._take(self._plan)
                self._issue(k, program, pieces)
        except Exception as e:  # noqa: BLE001 (any scheduler error ends the head, with a reason)
            self.fail(f"the head's scheduler failed: {type(e).__name__}: {e}")

    def _drop(self, r: Seq, why: Refused) -> None:
        self._free(r)
        r.ended = True
        r.say("error", why)

    def _admit_and_plan(self) -> bool:
        # A sequence dropped with items in flight is safe to free: every stage runs items in
        # order, so what it writes is written before any later item reuses its pages.
        gone = Refused(499, "the client closed the connection")
        for r in [r for r in self.live if r.abandoned()]:
            self.live.remove(r)
            self._drop(r, gone)
        while self.queue and len(self.live) < self.max_seqs:
            r = self.queue[0]
            if r.abandoned():
                self._drop(self.queue.popleft(), gone)
                continue
            # pages for every known row but the last: a replayed sequence's generated rows too,
            # or it could be admitted, chunk its prompt and be preempted again, over and over
            need = max(len(r.tokens) - 1 if r.replay else r.chunk_end(), 1)
            # a page kept free for each running sequence's next step: a sequence admitted into
            # the last free pages would starve the running ones (and, preempted, come back)
            if -(-need // self.pool.page) + len(self.live) > self.pool.free:
                break
            lease = self.pool.lease(need)
            if lease is None:
                break
            self.queue.popleft()
            r.lease = lease
            self.live.append(r)
        if self.metrics:
            self._gauges()
        if len(self.inflight) >= 4 * self.stages:
            return False
        ready = [r for r in self.live if r.ready() and self._room(r)]
        generating = sum(1 for r in self.live if r.made > 0 or r.left() == 0)
        waiting = [Waiting(i, r.pos, r.left()) for i, r in enumerate(self.live)]
        sh = self.shape
        p = plan_item([r.pos for r in ready], generating, waiting, rows=sh.rows, seqs=sh.seqs,
                      context=self._context, buckets=self.buckets, stages=self.stages,
                      mix=not self.invariant)
        if p is None:
            if not self.inflight and any(r.ready() for r in self.live):
                self._preempt()  # steps wait for pages that nothing in flight will free
            return False
        pieces = [(i, n) for i, n in p.pieces]
        chunks = sum(1 for _, program, _ in self.inflight if not program.startswith("decode"))
        if not p.steps and not (full(pieces, rows=sh.rows, seqs=sh.seqs)
                                or chunks < self.stages
                                or chunks == self.stages and not self.queue
                                and sum(n for _, n in pieces) == sum(w.left for w in waiting)):
            return False
        self._plan = ([ready[i] for i in p.steps], [(self.live[i], n) for i, n in p.pieces],
                      p.bucket)
        return True

    def _room(self, r: Seq) -> bool:
        """Whether `r`'s lease holds its next step's row, grown a page if it must be."""
        grown = self.pool.grow(r.lease, len(r.tokens))
        if grown is None:
            return False
        r.lease = grown
        return True

    def _preempt(self) -> None:
        """Frees the pages of the newest sequence not in flight: it goes back to the queue's
        front and is recomputed from its tokens when pages allow. (One sequence alone always
        fits the pool: admission checked it.)"""
        cands = [r for r in self.live if not r.inflight]
        if len(self.live) < 2 or not cands:
            return
        r = cands[-1]
        self._free(r)
        r.pos = 0
        if r.scores is not None:  # its prompt is scored again from the start
            r.scores = []
        self.queue.appendleft(r)
        self.preemptions += 1
        if self.metrics:
            self.metrics.preemptions.inc()

    def _gauges(self) -> None:
        self.metrics.pages.set(self.pool.in_use)
        self.metrics.slots.set(self.pool.slots_in_use)
        self.metrics.running.set(len(self.live))
        self.metrics.waiting.set(len(self.queue))

    def _take(self, plan):
        steps, chunks, bucket = plan
        k, self.item = self.item, self.item + 1
        pieces, entries = [], []
        scoring = any(r.scoring for r, _ in chunks)
        program = f"decode{bucket}" if bucket else ("score" if scoring else artifact.DEFAULT)
        for r in steps:  # entries: (seq, rows, emits, scored); a replayed row emits nothing
            pieces.append(Piece(np.asarray(r.tokens[r.pos:r.pos + 1], np.int32), r.pos,
                                r.lease.pages, r.lease.slot, sampling=r.ask.sampling,
                                rng=(r.ask.seed, r.choice, r.made)))
            entries.append((r, 1, r.pos == len(r.tokens) - 1, False))
            r.pos += 1
            r.inflight += 1
        for r, n in chunks:
            a, b = r.pos, r.pos + n
            emits = b == len(r.tokens) and r.ask.max_tokens > 0
            scored = scoring and r.scoring
            pieces.append(Piece(np.asarray(r.tokens[a:b], np.int32), a, r.lease.pages,
                                r.lease.slot, sampling=r.ask.sampling,
                                rng=(r.ask.seed, r.choice, r.made),
                                targets=np.asarray(r.tokens[a + 1:b + 1], np.int32) if scored
                                else None))
            entries.append((r, n, emits, scored))
            r.pos = b
            r.inflight += 1
        self.inflight.append((k, program, entries))
        return k, program, pieces

    def _issue(self, k: int, program: str, pieces) -> None:
        item = make_item(pieces, self.programs[program].item)
        rows = sum(len(p.tokens) for p in pieces)
        for s, conn in self.conns.items():
            conn.send("ITEM", {"item": k, "rows": rows, "program": program},
                      {n: item[n] for n in self.fills[s] if n in item})
        t0 = time.time()
        if self.edge:  # the program pushes into stage 1's slot itself; `_finish` logs it
            self.runner.run_edged(item, k)
            return self._ran.put((k, rows, t0, None))
        departures, outputs = self.runner.run(item, program=program)
        if self.stages == 1:  # on to the next item while this one runs
            self._ran.put((k, rows, t0, outputs))
        else:
            self.next.send(k, [np.asarray(d) for d in departures],
                           {"busy_us": [int((time.time() - t0) * 1e6)]},
                           slots=self.programs[program].departures)
            log_item(0, k, rows, t0, time.time())

    def _finish(self) -> None:
        """Waits for each issued item in order, off the scheduler's thread: on an edge, for item
        k to leave (stage 1's edge says it arrived: a load from shared memory, no driver call;
        fails after the timeout); serving the whole program, for its outputs, and answers (an
        item is busy from its issue or the end of the item before, whichever is later)."""
        last = 0.0
        try:
            while not self.failed:
                try:
                    k, rows, t0, outputs = self._ran.get(timeout=0.5)
                except queue.Empty:
                    continue
                if self.edge and not edge.left(self.edge, k, self.edge_timeout,
                                               stop=lambda: bool(self.failed)):
                    if not self.failed:
                        self.fail(f"stage 1 stopped taking items: item {k} waited "
                                  f"{self.edge_timeout:g} s for its slot (--stage_timeout)")
                    return
                if outputs is not None:
                    outputs = {n: np.asarray(v) for n, v in outputs.items() if n in ANSWER}
                t1 = time.time()
                log_item(0, k, rows, t0, t1)
                if outputs is not None:
                    self._answer(k, outputs, [int((t1 - max(t0, last)) * 1e6)], rows)
                last = t1
        except Exception as e:  # noqa: BLE001 (a failed item ends the head, with a reason)
            self.fail(f"the program failed: {type(e).__name__}: {e}")

    def _answer(self, k: int, out: dict, busy_us: list[int], rows: int) -> None:
        now = time.time()
        with self.cond:
            if self.failed:  # `fail` answers every request still in flight
                return
            if not self.inflight or self.inflight[0][0] != k:
                raise ProtocolError(f"outputs for item {k} arrived; item "
                                    f"{self.inflight[0][0] if self.inflight else None} was due")
            _, program, entries = self.inflight.popleft()
            missing = [n for n in ("next_token",) + ("target_logprob",) * (program == "score")
                       if n not in out]
            if missing:
                raise ProtocolError(f"item {k} ({program}) came back without {missing[0]}")
            if self.metrics:  # before any reply: a client that has its answer sees the pool back
                self.metrics.item(rows, busy_us)
            at = 0
            for i, (r, n, emits, scored) in enumerate(entries):
                r.inflight -= 1
                if scored and r.scores is not None:
                    r.scores.append(tuple(np.asarray(out[name][at:at + n]) for name in
                                          ("target_logprob", "row_top_ids", "row_top_logprobs")))
                at += n
                if r.ended:
                    continue
                if r.scores is not None and r.scored() >= r.prompt - 1:
                    r.say("prompt", _prompt_scores(r))
                    r.scores = None  # said
                if emits:
                    self._token(r, i, out, now)
                elif r.ask.max_tokens == 0 and r.scores is None and not r.inflight:
                    self._end(r, "length", now)
            self.cond.notify_all()

    def _token(self, r: Seq, i: int, out: dict, now: float) -> None:
        t = int(out["next_token"][i])
        r.tokens.append(t)
        r.made += 1
        if r.first is None:
            r.first = now
            if self.metrics:
                self.metrics.ttft.observe(now - r.arrived)
        elif self.metrics:
            self.metrics.tpot.observe((now - r.first) / max(r.made - 1, 1))
        finish = ("stop" if t in r.ask.stop_ids else "length" if (
            r.made >= r.ask.max_tokens or len(r.tokens) >= self.shape.context) else None)
        data = {"id": t, "seconds": now - r.arrived, "finish_reason": finish}
        if "logprob" in out:
            data.update(logprob=float(out["logprob"][i]), top_ids=out["top_ids"][i].tolist(),
                        top_logprobs=out["top_logprobs"][i].tolist())
        if finish:  # pages back before the client hears: one that has its answer sees them free
            self._free(r)
        r.say("token", data)  # a last token says so: its client need not wait for `done`
        if self.metrics:
            self.metrics.generated.inc()
        if finish:
            self._end(r, finish, now)

    def _free(self, r: Seq) -> None:
        """`r`'s pages back in the pool, and the gauges say so before its client hears more."""
        if r in self.live:
            self.live.remove(r)
        if r.lease is not None:
            self.pool.release(r.lease)
            r.lease = None
        if self.metrics:
            self._gauges()

    def _end(self, r: Seq, reason: str, now: float) -> None:
        r.ended = True
        self._free(r)
        r.say("done", {"finish_reason": reason, "seconds": now - r.arrived,
                       "tokens": r.made, "prompt_tokens": r.prompt})

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
                self._answer(k, dict(arrays), header.get("busy_us", []), header.get("rows", 0))
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
            pending += [r for _, _, es in self.inflight for r, *_ in es if r not in pending]
            pending = [r for r in dict.fromkeys(pending) if not r.ended]
            self.queue.clear()
            self.live.clear()
            self.cond.notify_all()
        n = len(pending)
        print(f"error: head: {message}; answering {n} request{'s' * (n != 1)} with 503 and exiting",
              file=sys.stderr, flush=True)
        for r in pending:
            r.ended = True
            r.say("error", Refused(503, f"the pipeline failed: {message}"))
        for conn in self.conns.values():
            try:
                conn.send("ERROR", {"message": message})
            except Closed:
                pass
        threading.Timer(1.0, self.on_exit, (1,)).start()


# The outputs the head reads of an item (the last stage sends these, never the logits).
ANSWER = ("next_token", "logprob", "top_ids", "top_logprobs", "target_logprob", "row_top_ids",
          "row_top_logprobs")


def _prompt_scores(r: Seq) -> dict:
    """A scored prompt's rows, joined: each token's log-probability after the first, and each
    row's top-K (row i scores token i + 1)."""
    n = r.prompt - 1
    lp, ti, tl = (np.concatenate([c[j] for c in r.scores])[:n] if r.scores else
                  np.zeros((0,) if j == 0 else (0, 0)) for j in range(3))
    return {"logprobs": lp.tolist(), "top_ids": np.asarray(ti).tolist(),
            "top_logprobs": np.asarray(tl).tolist()}


def _settle(fut: cf.Future, result=None, error: Exception | None = None) -> None:
    """Answers a future; one its caller cancelled has no one to answer."""
    try:
        fut.set_exception(error) if error else fut.set_result(result)
    except cf.InvalidStateError:
        pass


def pick_bucket(programs, asked: int | None) -> int | None:
    """The decode bucket a batch-invariant head puts every step in: `asked`, or the largest of
    `programs`' (None without any); ValueError if the cut has no bucket `asked`."""
    every = artifact.decode_buckets(programs)
    if asked is not None and asked not in every:
        raise ValueError(f"--decode_bucket {asked}: the program's decode buckets are "
                         f"{', '.join(map(str, every)) or 'none'}; give one of them (`kernjax "
                         f"cut --decode` sets a cut's)")
    return asked if asked is not None else (every[-1] if every else None)
