"""A stage process past the head: receive items and arrivals, run, send departures or tokens.

The stage listens for its predecessor, joins the head (`--pp_head`, retried for
`startup_timeout`, saying once that it waits) with a Hello, takes its Table (pages, and the next
stage's address and arrivals, which must equal its own departures), connects to the next stage
(saying Hello {stage, cut} on that link) and accepts as its predecessor only a connection whose
Hello names stage s-1 of its cut; any other connection is refused with one log line. Then, item
by item in order, through the program the head names for it (a prefill or score chunk, a decode
bucket): the fills come from the head, the arrivals from the stage before, the departures go to
the stage after, and the last stage sends the head the item's tokens and log-probabilities. A reader thread
answers the head's pings while the main thread computes.

Any error ends the process with a message naming the stage and what failed; a closed connection
to the head or a neighbour ends it too, so when one process goes the pipeline goes.
"""

from __future__ import annotations

import contextlib
import os
import queue
import socket
import sys
import threading
import time

import numpy as np

from kernjax.artifact import DEFAULT
from kernjax.runtime.runner import Runner
from kernjax.serve.head import ANSWER
from kernjax.serve.protocol import MAX_FRAME, Closed, ProtocolError, connect, handshakes
from kernjax.runtime import edge
from kernjax.serve.transport import HostTransport
from kernjax.serve.timeline import log_item


def memory_line(m: dict) -> str:
    """What a stage holds on its device, for its startup line."""
    def gib(b: int) -> str:
        unit = next(u for u in (3, 2, 1, 0) if b >= 1024 ** u or u == 0)
        return f"{b / 1024 ** unit:.{2 if unit == 3 else 1}f} {['B', 'KiB', 'MiB', 'GiB'][unit]}"

    peak = f"device peak {gib(m['peak'])}" if m.get("peak") else "device peak: none counted"
    return (f"weights {gib(m['weights'])} + states {gib(m['states'])} = "
            f"{gib(m['weights'] + m['states'])}; {peak}"
            + (f"; the program holds {gib(m['program'])} at once" if m.get("program") else ""))


def _slots(xs):
    return [[x.name, x.dtype, list(x.shape)] for x in xs]


def serve_stage(runner: Runner, *, head: str, host: str = "127.0.0.1",
                startup_timeout: float = 600.0, max_frame: int = MAX_FRAME,
                transport: str = "host", edge_slots: int = 2, edge_timeout: float = 60.0,
                checkpoint: dict | None = None) -> None:
    """Runs stage `runner` of a pipeline whose head listens at `head`; returns never.
    `checkpoint`: {dir, id (`weights.fingerprint`)} of its weights, for the head to compare.
    `transport`: how the arrivals come in (kernjax/serve/transport.py); the departures go the
    way the next stage's Hello says."""
    art = runner.art
    s, last = art.index, art.index == art.stages - 1

    told: list = []  # the head's link once joined: a dying stage tells it why (the first cause)

    def die(msg: str, cause: int = s) -> None:  # cause: this stage, or s-1 whose link it lost
        print(f"error: stage {s}: {msg}", file=sys.stderr, flush=True)
        for conn in told:
            with contextlib.suppress(Closed, OSError):
                conn.send("ERROR", {"message": msg, "stage": cause})
        os._exit(1)

    def say(msg: str) -> None:
        print(f"stage {s}: {msg}", file=sys.stderr, flush=True)

    if s == 0:
        die(f"`{art.path}` is stage 0, the head: start it with --pp_listen")
    got = []

    def take(conn, kind: str, hello: dict) -> str | None:
        if kind != "HELLO":
            return f"sent {kind} where stage {s - 1}'s Hello was due"
        if hello.get("cut") != art.cut_id or hello.get("stage") != s - 1:
            return (f"this is stage {s} of cut `{art.cut_id}`; it takes stage {s - 1} of that cut, "
                    f"not stage {hello.get('stage')} of cut `{hello.get('cut')}`")
        got.append(conn)
        return None

    try:
        in_edge, via = edge.receiving(art.arrivals, art.index - 1, transport, edge_slots)
        out_edge = None
        server = socket.create_server((host, 0))
        fills = list(dict.fromkeys(x.name for p in art.programs.values() for x in p.inputs
                                   if x.role in ("fill", "table")))
        deadline, said = time.time() + startup_timeout, False
        while True:  # a head that closes unanswered (64 strangers yet to say who they are) is
            # asked again; one that refuses (an ERROR frame) is not
            hconn = connect(head, "the head", max(1.0, deadline - time.time()), limit=max_frame,
                            say=say)
            try:
                hconn.send("HELLO", {"stage": s, "stages": art.stages, "cut": art.cut_id,
                                     "lowering": art.lowering, "programs": list(art.programs),
                                     "pages": art.item.pages, "listen": server.getsockname()[1],
                                     "arrivals": _slots(art.arrivals),
                                     "departures": _slots(art.departures), "fills": fills,
                                     "memory": runner.memory(), "checkpoint": checkpoint, **via})
                table, _ = hconn.expect("TABLE")
                break
            except ConnectionError as e:
                hconn.close()
                if time.time() > deadline:
                    raise
                if not said:
                    say(f"the head closed the connection unanswered ({e}); asking again until "
                        "--startup_timeout")
                said = True
                time.sleep(1.0)
        if type(table.get("pages")) is not int or table["pages"] < 2 or not (
                table.get("next") is None or isinstance(table["next"], dict)):
            die(f"the head sent a malformed Table: {str(table)[:200]}")
        if table["pages"] > art.item.pages:
            hconn.send("ERROR", {"message": f"stage {s} holds {art.item.pages} pages, not "
                                            f"{table['pages']}"})
            die(f"the head asks for {table['pages']} pages; this stage holds {art.item.pages}")
        nxt = None
        if (table["next"] is None) != last:
            die(f"the head's table says next={table['next']}, but this is stage {s} of "
                f"{art.stages}")
        if table["next"]:
            if table["next"].get("arrivals") != _slots(art.departures):
                die(f"stage {s + 1} takes {table['next'].get('arrivals')}; this stage departs "
                    f"{_slots(art.departures)}")
            conn = connect(str(table["next"].get("address")), f"stage {s + 1}", 60,
                           limit=max_frame)
            conn.send("HELLO", {"stage": s, "stages": art.stages, "cut": art.cut_id})
            nxt = HostTransport(conn, art.departures)
            out_edge = edge.sending(art.departures, art.index, table["next"])
        if not handshakes(server, take, done=lambda: bool(got), deadline=time.time() + 60,
                          log=say, limit=max_frame):
            die(f"stage {s - 1} did not connect within 60 s")
        server.close()
        got[0].name = f"stage {s - 1}"
        prev = HostTransport(got[0], art.arrivals)
    except (OSError, RuntimeError, ValueError, ProtocolError, Closed) as e:
        die(f"cannot join the pipeline: {e}")
    if in_edge:  # NCCL: the communicator with the stage before forms in the background
        try:
            in_edge.ready(60)
        except RuntimeError as e:
            die(str(e))
    told.append(hconn)
    say(memory_line(runner.memory()))
    say(f"joined cut `{art.cut_id}` ({table['pages']} pages), transport {transport}"
        + (f" ({edge_slots} slots per edge)" if in_edge and transport != "nccl" else ""))

    items: queue.Queue = queue.Queue()

    def read_head() -> None:
        try:
            while True:
                kind, header, arrays = hconn.recv()
                if kind == "PING":
                    hconn.send("PONG")
                elif kind == "ITEM":
                    items.put((header, arrays))
                elif kind == "ERROR":
                    die(f"the head stopped: {header.get('message')}")
                else:
                    die(f"the head sent {kind}, which the head never sends a stage")
        except (Closed, ProtocolError) as e:
            die(f"lost the head: {e}")

    threading.Thread(target=read_head, name="head", daemon=True).start()
    if in_edge:
        return _serve_edged(runner, hconn, items, prev, out_edge, die, edge_timeout)
    try:
        while True:
            header, fills = items.get()
            k = header["item"]
            program = runner.program(header.get("program", DEFAULT))
            t0 = time.time()
            try:
                arrivals, acts = prev.recv(k, slots=program.arrivals)
            except (Closed, ProtocolError) as e:
                die(str(e), s - 1)
            t1 = time.time()
            departures, outputs = runner.run(fills, arrivals, program=program.name)
            # np.asarray waits for the device, so `busy` is the work, not its launch.
            departures = [np.asarray(d) for d in departures]
            answer = None if nxt else {n: np.asarray(v) for n, v in outputs.items()
                                       if n in ANSWER}
            busy = acts.get("busy_us", []) + [int((time.time() - t1) * 1e6)]
            if nxt:
                nxt.send(k, departures, {"busy_us": busy}, slots=program.departures)
            else:
                hconn.send("TOKENS", {"item": k, "rows": header["rows"], "busy_us": busy},
                           answer)
            log_item(s, k, header["rows"], t0, time.time())
    except (Closed, ProtocolError) as e:
        die(str(e))
    except Exception as e:  # noqa: BLE001 (any error ends the stage, with a reason)
        die(f"{type(e).__name__}: {e}")


def _serve_edged(runner: Runner, hconn, items: queue.Queue, prev, out_edge, die,
                 timeout: float) -> None:
    """The item loop of the edge transports: issue item k at once (the program holds on the
    device until its arrivals are in) and go on to k+1; a thread of the last stage waits for
    item k's tokens and sends them, the others' watcher sees item k leave in the edge's
    `arrived` word (a load from shared memory, no driver call)."""
    art = runner.art
    s, last = art.index, art.index == art.stages - 1

    def watch_prev() -> None:  # nothing comes on the link: it only says when stage s-1 goes
        try:
            prev.conn.recv()
            die(f"stage {s - 1} sent a frame on the link, which the shm transport never uses")
        except (Closed, ProtocolError) as e:
            die(str(e), s - 1)

    threading.Thread(target=watch_prev, name="prev", daemon=True).start()
    done: queue.Queue = queue.Queue()

    def finish() -> None:  # item k left (the others) or its tokens went to the head (the last)
        try:
            while True:
                k, rows, t0, tokens = done.get()  # tokens: the item's outputs
                if last:
                    hconn.send("TOKENS", {"item": k, "rows": rows, "busy_us": []},
                               {n: np.asarray(v) for n, v in tokens.items() if n in ANSWER})
                elif not edge.left(out_edge, k, timeout):
                    die(f"stage {s + 1} stopped taking items: item {k} waited {timeout:g} s for "
                        "its slot")
                log_item(s, k, rows, t0, time.time())
        except (Closed, ProtocolError) as e:
            die(str(e))
        except Exception as e:  # noqa: BLE001 (any error ends the stage, with a reason)
            die(f"{type(e).__name__}: {e}")

    threading.Thread(target=finish, name="finish", daemon=True).start()
    try:
        while True:  # issue only: the host never waits here for the device
            header, fills = items.get()
            k, t0 = header["item"], time.time()
            outputs, _ = runner.run_edged(fills, k)
            done.put((k, header["rows"], t0, outputs))
    except (Closed, ProtocolError) as e:
        die(str(e))
    except Exception as e:  # noqa: BLE001 (any error ends the stage, with a reason)
        die(f"{type(e).__name__}: {e}")
