"""`kernjax serve`: one stage of a pipeline, or the whole program, behind HTTP.

    kernjax serve --stage_dir stages/stage0 --pp_listen 127.0.0.1:7000 --port 8000
    kernjax serve --stage_dir stages/stage1 --pp_head 127.0.0.1:7000
    kernjax serve --stage_dir stages/whole --port 8000      # or --model / --weights

Stage 0 is the head (HTTP, scheduler, page pool); other stages join it. The head binds its HTTP
port once it has loaded its stage, before compiling it (a taken port is an error at once), answers /health with a 503
"waiting for stage(s) ..." while the others join, and says "serving" once they have. Every log line
starts with its UTC time; --log_dir DIR also writes it to DIR/stage<k>.log (--log_file FILE: to
FILE, rewritten at each start), and the console then shows all but the `pp item` lines. Flags can
come from a file with absl's --flagfile.
"""

from __future__ import annotations

import asyncio
import json
import logging as std_logging
import math
import os
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

from absl import flags, logging

from kernjax.cli import sources
from kernjax.runtime import xla
from kernjax.runtime.edge import TRANSPORTS

xla.serving()  # before jax makes its backend

FLAGS = flags.FLAGS


class _Stamped:
    """Whole lines, each behind its UTC time, to the console and the log file (if any); with a
    file, the console skips the `pp item` lines. Lines of several threads never mix."""

    def __init__(self, console, file=None):
        self.console, self.file = console, file
        self.lock, self.parts = threading.Lock(), {}

    def write(self, text: str) -> int:
        with self.lock:
            me = threading.get_ident()
            *lines, rest = (self.parts.pop(me, "") + text).split("\n")
            if rest:
                self.parts[me] = rest
            for line in lines:
                t = time.time()
                stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t))
                line = f"{stamp}.{int(t % 1 * 1e3):03d}Z {line}\n"
                if self.file:
                    self.file.write(line)
                    self.file.flush()
                if not (self.file and line[25:].startswith("pp item ")):
                    try:
                        self.console.write(line)
                        self.console.flush()
                    except (OSError, ValueError):
                        pass  # the console has gone; the file keeps the log
        return len(text)

    def flush(self) -> None:
        pass  # every whole line is flushed as it is written

    def __getattr__(self, name):
        return getattr(self.console, name)


def _log_to() -> None:
    """Stamps every line of stderr; --log_dir/--log_file also write them to a file."""
    path = Path(FLAGS.log_file) if FLAGS.log_file else None
    if FLAGS.log_dir:
        k = 0
        try:  # the stage number names the file; open_stage says what is wrong with a bad manifest
            m = json.loads((Path(FLAGS.stage_dir) / "manifest.json").read_text())
            k = int(m["cut"]["stage"])
        except (TypeError, OSError, ValueError, KeyError):
            pass
        path = Path(FLAGS.log_dir) / f"stage{k}.log"
    file = None
    if path:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            file = path.open("w", encoding="utf-8", errors="backslashreplace")
        except OSError as e:
            raise OSError(f"cannot write the log `{path}`: {e.strerror or e}") from None
    sys.stderr = _Stamped(sys.stderr, file)
    handler = logging.get_absl_handler().python_handler  # absl's lines too, stamped once:
    handler.setStream(sys.stderr)  # without absl's own prefix (its time, thread, file:line)
    handler.setFormatter(std_logging.Formatter("%(message)s"))
    if path:
        print(f"logging to {path}", file=sys.stderr)


def _warm(runner) -> None:
    """Compiles what this stage will run before it joins: its program with edge ops where the
    transport moves activations on the device (running that would wait for the neighbours),
    else the programs of --warm, each run on an empty item (the others compile at first use)."""
    if FLAGS.transport != "host" and runner.art.stages > 1:
        runner.compile_edged()
        return
    names = list(runner.art.programs) if FLAGS.warm == ["all"] else FLAGS.warm
    bad = [n for n in names if n not in runner.art.programs]
    if bad:
        raise ValueError(f"--warm {','.join(FLAGS.warm)}: `{runner.art.path}` has no program "
                         f"`{bad[0]}`; it has {', '.join(runner.art.programs)} (or give all)")
    runner.warm(names)


def _edges() -> None:
    """--transport shm/ipc: a hold waits for a neighbour as long as the head waits for a stage."""
    if FLAGS.transport != "host":
        import jax

        from kernjax.runtime import edge

        if FLAGS.transport in ("ipc", "nccl") and jax.default_backend() != "gpu":
            raise ValueError(f"--transport {FLAGS.transport} moves activations between GPUs; this "
                             f"process runs on {jax.default_backend()}: use --transport shm (one "
                             "host) or host")
        edge.set_hold_timeout(FLAGS.stage_timeout)


def _check_flags() -> None:
    """Careless flags, refused before anything loads."""
    from kernjax.serve.protocol import PING_MIN, parse_address
    f = FLAGS
    if f.max_seqs < 1:
        raise ValueError(f"--max_seqs {f.max_seqs}: the head must admit at least 1 prompt at once")
    if not 0 <= f.port < 65536:
        raise ValueError(f"--port {f.port} is not a TCP port; give one in 1..65535 (0: any free "
                         "one)")
    if not (math.isfinite(f.stage_timeout) and f.stage_timeout >= 4 * PING_MIN):
        raise ValueError(f"--stage_timeout {f.stage_timeout:g}: give at least {4 * PING_MIN:g} s: "
                         "the head pings every stage every quarter of the timeout, but not more "
                         f"often than every {PING_MIN:g} s (the ping period), so a shorter timeout "
                         "fails a healthy stage")
    if not f.startup_timeout > 0:
        raise ValueError(f"--startup_timeout {f.startup_timeout:g}: give the seconds the stages "
                         "have to join, more than 0")
    if f.edge_slots < 1:
        raise ValueError(f"--edge_slots {f.edge_slots}: an edge holds at least 1 item")
    if f.max_frame < 4096:
        raise ValueError(f"--max_frame {f.max_frame}: give at least 4096 bytes (a Hello alone is "
                         "about 1 KiB)")
    for name in ("chunk", "seqs", "context"):
        if f[name].value < 1:
            raise ValueError(f"--{name} {f[name].value}: give at least 1")
    for name in ("pp_listen", "pp_head"):
        if f[name].value:
            try:
                parse_address(f[name].value, any_port=name == "pp_listen")
            except ValueError as e:
                raise ValueError(f"--{name}: {e}") from None
    if f.pp_listen and f.pp_head:
        raise ValueError("give --pp_listen (the head) or --pp_head (a stage past 0), not both")
    if f.log_dir and f.log_file:
        raise ValueError("give --log_dir or --log_file, not both")


def _bind_http(host: str, port: int) -> socket.socket:
    try:
        return socket.create_server((host, port))
    except OSError as e:
        why = os.strerror(e.errno) if e.errno else e
        raise OSError(f"cannot serve HTTP on {host}:{port}: {why}; another process "
                      "holds the port? give another --port") from None


def _start_http(app, sock: socket.socket) -> None:
    """Serves `app` on the bound `sock` from an event loop on a thread of its own, so the main
    thread can wait for the stages (and take Ctrl-C)."""
    from aiohttp import web
    loop = asyncio.new_event_loop()
    # The HTTP server's own options (timeouts, connection limits) go to AppRunner and SockSite.
    runner = web.AppRunner(app, handle_signals=False)
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.SockSite(runner, sock).start())
    threading.Thread(target=loop.run_forever, name="http", daemon=True).start()


def main_def():
    """Usage: kernjax serve (--stage_dir DIR | --model NAME | --weights DIR)
                     [--pp_listen HOST:PORT | --pp_head HOST:PORT] [--port N]

Serves one stage of a cut (--stage_dir), or the whole program, behind HTTP (an OpenAI-style API,
/health, /metrics). Stage 0 is the head: it answers HTTP on --port and takes the other stages at
--pp_listen; every later stage joins it with --pp_head, the head's --pp_listen address."""
    sources.source_flags()
    flags.DEFINE_string("stage_dir", None, "a stage directory made by `kernjax cut` (or whole/)")
    flags.DEFINE_string("pp_listen", None, "head: where the other stages join (HOST:PORT; port 0: "
                        "any free one, which the log names)")
    flags.DEFINE_string("pp_head", None, "a stage past 0: the head's --pp_listen address")
    flags.DEFINE_string("host", "127.0.0.1", "HTTP and stage-link address to bind")
    flags.DEFINE_integer("port", 8000, "HTTP port (head); 0: any free one, which the log names")
    flags.DEFINE_integer("max_seqs", 256, "prompts admitted at once (head)")
    flags.DEFINE_float("stage_timeout", 60.0, "seconds a stage may stay silent before the head "
                       "gives up on it (the head pings every quarter of it; at least 1)")
    flags.DEFINE_float("startup_timeout", 600.0, "seconds to wait for the stages to join (head), "
                       "or for the head to be up (a stage)")
    flags.DEFINE_enum("transport", "host", list(TRANSPORTS), "how activations go "
                      "from stage to stage: `host` over the stage links (any hosts), `shm` by the "
                      "stages' programs through shared memory (stages of one host; "
                      "kernjax/runtime/edge.py), `ipc` the same into the next GPU's memory (CUDA IPC), "
                      "`nccl` by NCCL send/receive in the programs (GPUs of any hosts); every "
                      "stage of a pipeline gives the same")
    flags.DEFINE_integer("edge_slots", 2, "items an edge holds (every transport but host), so "
                         "a stage can run that many items ahead of the next")
    flags.DEFINE_string("served_model_name", None, "model name in the API (default: the model's)")
    flags.DEFINE_integer("chunk", 512, "rows per item, for --model/--weights")
    flags.DEFINE_integer("seqs", 4, "sequences per item, for --model/--weights")
    flags.DEFINE_integer("context", 4096, "longest prompt, for --model/--weights")
    flags.DEFINE_integer("max_frame", 256 << 20, "largest frame (bytes) a process accepts from a "
                         "peer; raise it for items whose activations are larger")
    # absl.logging defines a --log_dir it never uses unless asked to; this one takes its place.
    flags.DEFINE_string("log_dir", None, "also write this process's log to DIR/stage<k>.log",
                        allow_override=True)
    flags.DEFINE_string("log_file", None, "also write this process's log to FILE")
    flags.DEFINE_string("api_key", None, "require `Authorization: Bearer KEY` on every path but "
                        "/health and /metrics (head)")
    flags.DEFINE_integer("max_connections", None, "requests in progress before more get a 503 "
                         "(default: the open-file limit less 256, at least 64 and at most 4096)")
    flags.DEFINE_float("body_timeout", 30.0, "seconds a request body may take to arrive (else "
                       "408); idle connections close after it")
    flags.DEFINE_list("warm", ["all"], "programs to compile before serving (`all`, or names "
                      "such as prefill,decode1); the others compile when first used")
    flags.DEFINE_bool("batch_invariant", True, "head: every step in one decode program "
                      "(--decode_bucket), never beside prompt rows, so a sequence's bits do not "
                      "depend on its company on any backend; --nobatch_invariant: the smallest "
                      "bucket that holds the steps, or the chunk beside prompt rows (on a GPU a "
                      "step's bits then follow its company's size)")
    flags.DEFINE_integer("decode_bucket", None, "head, batch-invariant: the decode bucket every "
                         "step goes in (default: the cut's largest)")
    flags.DEFINE_integer("max_prompts", 64, "prompts in one batch request; with the context it "
                         "bounds the body size (413 past it)")

    def main():
        _check_flags()
        _log_to()
        _edges()
        from kernjax.runtime.runner import Runner, checkpoint_dir, load_weights, open_stage
        from kernjax.serve.head import Head
        from kernjax.serve.http import Metrics, make_app
        from kernjax import artifact, weights
        from kernjax.serve.stage_host import serve_stage
        if FLAGS.stage_dir:
            if FLAGS.model:
                raise ValueError("--stage_dir names the model already; drop --model")
            from kernjax.artifact import read
            ckpt = Path(FLAGS.weights) if FLAGS.weights else checkpoint_dir(
                read(FLAGS.stage_dir).manifest["checkpoint"], FLAGS.stage_dir)  # found once
            runner = open_stage(FLAGS.stage_dir, weights=ckpt, dtype=FLAGS.dtype)
        else:
            fam, cfg, ref, dtype = sources.source()
            with tempfile.TemporaryDirectory() as tmp:
                art = artifact.whole_artifact(fam, cfg, ref, dtype, rows=FLAGS.chunk, seqs=FLAGS.seqs,
                                         context=FLAGS.context, out=Path(tmp) / "whole")
            ckpt = checkpoint_dir(ref)
            runner = Runner(art, load_weights(art, ckpt))
        art = runner.art
        from kernjax.weights import fingerprint
        checkpoint = {"dir": str(ckpt), "id": fingerprint(ckpt)}  # the stages must agree on it
        if art.index > 0:
            if not FLAGS.pp_head:
                raise ValueError(f"`{art.path}` is stage {art.index} of {art.stages}; give "
                                 "--pp_head HOST:PORT (the head's --pp_listen)")
            _warm(runner)
            serve_stage(runner, head=FLAGS.pp_head, host=FLAGS.host,
                        startup_timeout=FLAGS.startup_timeout, max_frame=FLAGS.max_frame,
                        transport=FLAGS.transport, edge_slots=FLAGS.edge_slots,
                        edge_timeout=FLAGS.stage_timeout, checkpoint=checkpoint)
        if FLAGS.pp_head:
            raise ValueError(f"`{art.path}` is stage 0, the head; give --pp_listen, not --pp_head")
        from kernjax.serve.head import pick_bucket
        pick_bucket(art.programs, FLAGS.decode_bucket)  # a bucket the cut lacks: before compiling
        http = _bind_http(FLAGS.host, FLAGS.port)  # before compiling: a taken port fails at once
        _warm(runner)
        metrics = Metrics()
        transport = FLAGS.transport if art.stages > 1 else "none"
        metrics.transport.labels(transport).set(1)
        head = Head(runner, listen=FLAGS.pp_listen, max_seqs=FLAGS.max_seqs,
                    stage_timeout=FLAGS.stage_timeout, startup_timeout=FLAGS.startup_timeout,
                    max_frame=FLAGS.max_frame, metrics=metrics, transport=FLAGS.transport,
                    edge_timeout=FLAGS.stage_timeout, checkpoint=checkpoint,
                    invariant=FLAGS.batch_invariant, decode_bucket=FLAGS.decode_bucket)
        name = FLAGS.served_model_name or art.manifest["model"]["name"]
        app = make_app(head, name=name, vocab=art.manifest["model"]["config"]["vocab"],
                       tokenizer=weights.tokenizer(ckpt), metrics=metrics, checkpoint=ckpt,
                       api_key=FLAGS.api_key, max_connections=FLAGS.max_connections,
                       body_timeout=FLAGS.body_timeout, max_prompts=FLAGS.max_prompts,
                       eos=weights.eos_ids(ckpt), defaults=weights.sampling_defaults(ckpt))
        url = f"http://{FLAGS.host}:{http.getsockname()[1]}"  # the port --port 0 got
        from kernjax.serve.stage_host import memory_line
        print(f"head: {memory_line(runner.memory())}", file=sys.stderr)
        _start_http(app, http)
        if art.stages > 1:
            print(f"head: {url}/health answers 503 until every stage has joined", file=sys.stderr)
        head.join()
        what = "the whole program" if art.stages == 1 else \
            f"{art.stages} stages, transport {transport}"
        print(f"serving `{name}` ({what}, cut `{art.cut_id}`, {head.policy()}) on {url}",
              file=sys.stderr)
        threading.Event().wait()  # HTTP and the pipeline run on their threads; Ctrl-C ends here

    return main

