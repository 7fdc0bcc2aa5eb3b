"""What one item costs a served program, against the size of its states.

A served cut is made for many sequences (`--seqs`, `--context`), so its KV states are large
(qwen3-4b, 16 sequences of 16k tokens: 36 GiB). The work of an item should follow its rows and
the context its sequences have, never the size of the pool. This script cuts the model at each
`--configs` entry (SEQS:CONTEXT), opens its whole program as the server does
(`kernjax.runtime.runner.open_stage`), and times an empty item (every row padding) and a full item of one
sequence, run after run; and it counts the copies of a state-sized buffer in the compiled module
(a copy of a state per item is a pool-sized cost), with `--stages` in the stages' programs too.

    python -m experiments.peritem --model qwen3-tiny --configs 1:256,16:2048,16:8192
    python -m experiments.peritem --model qwen3-4b --configs 1:8192,16:16384   (GPU)
    XLA_FLAGS=... python -m experiments.peritem --model qwen3-4b --configs 16:16384 --issue 40

With `--issue`, the host's time to issue an item while the GPU runs the ones before: the
served whole program's host spent ~4.6 ms an item updating XLA's CUDA graph and 1.6 launching
it (`load.py --trace`); under which XLA flags, and with which operands, does that go away.
None (one H200, `614aef7`, `experiments/results/2026-12-01-h200/`): 6.6 ms with graphs as they
are, 8.9 without, 10-12 with SKIP_PROFILED; operands on the device save 0.3 ms.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
from absl import app, flags

from experiments import harness
from kernjax.core.item import Piece, make_item
from kernjax.kernels import ffi
from kernjax.runtime import runner as R

flags.DEFINE_string("model", "qwen3-tiny", "a named model, random weights")
flags.DEFINE_string("configs", "1:256,16:2048", "comma-separated SEQS:CONTEXT program shapes")
flags.DEFINE_integer("chunk", 512, "rows per item")
flags.DEFINE_integer("iters", 10, "timed runs per case")
flags.DEFINE_integer("issue", 0, "also issue this many full items back to back, as a server "
                     "does, and time each call's return on the host: fresh numpy operands each "
                     "item (`np`) against one set put on the device before (`dev`)")
flags.DEFINE_bool("stages", False, "also count the state copies in the stages' programs, plain "
                  "and with edge ops (a copied state is a pool-sized cost per item)")
flags.DEFINE_string("out", None, "a directory for results.json and README.md")
FLAGS = flags.FLAGS


def state_copies(hlo: str, shapes: set[str]) -> int:
    """Copy instructions whose operand or result has the shape of a state."""
    n = 0
    for line in hlo.splitlines():
        if re.search(r"= \S+ copy(-start)?\(", line):
            m = re.search(r"= (\w+\[[\d,]*\])", line)
            if m and m.group(1).split("[")[1].rstrip("]") in shapes:
                n += 1
    return n


def issue(r, item) -> str:
    """The host's time per call while the GPU runs the calls before (median), and the wall
    time per item over the run, for fresh numpy operands and for device-resident ones."""
    out = []
    dev = {k: jax.device_put(v) for k, v in item.items()}
    for name in ("np", "dev"):
        items = [{k: v.copy() for k, v in item.items()} if name == "np" else dev
                 for _ in range(FLAGS.issue)]
        jax.block_until_ready(r.run(items[0]))
        ts, t0 = [], time.perf_counter()
        for it in items:
            t = time.perf_counter()
            last = r.run(it)
            ts.append(time.perf_counter() - t)
        jax.block_until_ready(last)
        wall = (time.perf_counter() - t0) / len(items)
        out.append(f"{name} {1e3 * float(np.median(ts)):.2f} ms (wall {1e3 * wall:.2f} ms/item)")
    return ", ".join(out)


def main(_):
    report = harness.Report(f"An item's cost against its program's states: {FLAGS.model}, chunk "
                            f"{FLAGS.chunk}", __doc__.split("\n\n")[0])
    report.note(f"{FLAGS.model}, chunk {FLAGS.chunk}, {jax.devices()[0].device_kind}, "
                f"jax {jax.__version__}")
    report.table("seqs", "context", "states MiB", "state copies", "empty item ms",
                 "full item ms", right="rrrrrr")
    for cfg in FLAGS.configs.split(","):
        seqs, context = (int(x) for x in cfg.split(":"))
        with tempfile.TemporaryDirectory() as d:
            subprocess.run([sys.executable, "-m", "kernjax", "cut", "--model", FLAGS.model, "--at",
                            "1", "--chunk", str(FLAGS.chunk), "--seqs", str(seqs), "--context",
                            str(context), "--decode", "", "--out", d], check=True,
                           capture_output=True)
            r = R.open_stage(Path(d) / "whole")
            states = [s for s in r.art.inputs if s.role == "state"]
            shapes = {",".join(map(str, s.shape)) for s in states}
            shape = r.art.item
            pages = tuple(range(1, 1 + -(-FLAGS.chunk // shape.page)))
            full = make_item([Piece(np.arange(FLAGS.chunk, dtype=np.int32) % 1000, 0, pages)],
                             shape)
            times = {}
            for name, item in (("empty", make_item([], shape)), ("full", full)):
                jax.block_until_ready(r.run(item))
                ts = []
                for _ in range(FLAGS.iters):
                    t = time.perf_counter()
                    jax.block_until_ready(r.run(item))
                    ts.append(time.perf_counter() - t)
                times[name] = 1e3 * float(np.median(ts))
            if FLAGS.issue:
                report.note(f"  issue, {FLAGS.issue} full items back to back (XLA_FLAGS="
                            f"{os.environ.get('XLA_FLAGS', '')!r}): " + issue(r, full))
            mib = sum(s.nbytes for s in states) / 2 ** 20
            report.row(seqs, context, f"{mib:.0f}", state_copies(r.fn.as_text(), shapes),
                       f"{times['empty']:.2f}", f"{times['full']:.2f}")
            if FLAGS.stages:  # the stages' programs, plain and with edge ops: compiled, not run
                ffi.register()
                for st in ("stage0", "stage1"):
                    s_ = R.open_stage(Path(d) / st)
                    s_.compile_edged()
                    report.note(f"  {st}: state copies {state_copies(s_.fn.as_text(), shapes)} "
                                f"plain, {state_copies(s_.edged.as_text(), shapes)} with edge ops")
                    del s_
    report.write(FLAGS.out and Path(FLAGS.out))


if __name__ == "__main__":
    app.run(main)
