"""`kernjax demo` (or `kernjax` alone): the main job on the embedded default.

The default model (`kernjax.models.DEFAULT`, a small random-weight model) is cut on the CPU into 2
stages at its middle layer and into 3 (after layer 1's first call, and mid-way through the middle
layer), and the chain gate runs the stages and the whole program on seven prompts, comparing
logits, tokens and log-probabilities bitwise after every chunk of the prefill and score programs
and every decode step; then the 2 stages generate a continuation. It runs the real command-line
tools and shows each.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from absl import flags

from kernjax.cli import sources


FLAGS = flags.FLAGS


def _run(*args: str) -> None:
    cmd = [sys.executable, "-m", "kernjax", *args]
    print(f"\n$ kernjax {shlex.join(args)}", flush=True)
    if subprocess.run(cmd).returncode:
        sys.exit(f"`kernjax {shlex.join(args)}` failed")


def _accepted(cut, error, program, at) -> bool:
    try:
        cut(program, at)
        return True
    except error:
        return False


def main_def():
    """Usage: kernjax demo [--model NAME] [--chunk N] [--out DIR]

The main job, also what `kernjax` with no verb runs: cuts the model into 2 and 3 stages, runs
the chain gate on each (whole program and stages bitwise identical on seven prompts: prefill,
scores and decode steps) and generates 16 tokens through the 2 stages, showing every command it
runs."""
    from kernjax import models
    flags.DEFINE_string("model", models.DEFAULT, sources.model_help("the named model to cut"))
    flags.DEFINE_integer("chunk", 64, "rows per chunk")
    flags.DEFINE_string("out", None, "keep the stage artifacts here (default: a temporary "
                        "directory)")
    return main


def main() -> None:
    from kernjax import models
    from kernjax.core.cut import CutError, cut
    name = FLAGS.model or models.DEFAULT
    fam, cfg = models.named(name)
    program = fam.program(cfg, dtype=cfg.dtype, rows=FLAGS.chunk, context=2560)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(FLAGS.out or tmp)
        rng = np.random.default_rng(0)
        c = FLAGS.chunk
        prompts = out / "prompts.txt"
        out.mkdir(parents=True, exist_ok=True)
        prompts.write_text("".join(" ".join(map(str, rng.integers(0, cfg.vocab, n))) + "\n"
                                   for n in (1, c - 1, c, c + 1, 300, 1000, 2049)))
        starts, half = program.layers, len(program.layers) // 2
        mid = range(starts[half], starts[half + 1] if half + 1 < len(starts) else len(program.calls))
        inner = next(k for k in mid[len(mid) // 2:] if _accepted(cut, CutError, program,
                                                                 [starts[1], k]))
        for at, sub in ((f"{half}", "two"), (f"1,c{inner}", "three")):
            _run("cut", "--model", name, "--at", at, "--chunk", str(c),
                 "--context", "2560", "--out", str(out / sub))
            _run("chain", "--stages", str(out / sub), "--prompts", str(prompts))
        _run("run", "--stages", str(out / "two"), "--tokens", "1 2 3", "--max_tokens", "16")
    print("\nsplit equals whole, bit for bit. Next: README.md (the cut, run, chain and serve "
          "commands).")

