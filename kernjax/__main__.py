"""`python -m kernjax`: the main job on the embedded default.

A deterministic random-weight qwen3-tiny is cut on the CPU into 2 and into 3 stages, and the chain
gate runs the stages and the whole program on seven prompts, comparing logits and tokens bitwise
after every chunk. It runs the real command-line tools and shows each command it runs.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from absl import app, flags

flags.DEFINE_string("model", "qwen3-tiny", "the named model to cut (random weights)")
flags.DEFINE_integer("chunk", 64, "rows per chunk")
flags.DEFINE_string("out", None, "keep the stage artifacts here (default: a temporary directory)")
FLAGS = flags.FLAGS


def _run(*args: str) -> None:
    cmd = [sys.executable, "-m", *args]
    print(f"\n$ python -m {shlex.join(args)}", flush=True)
    if subprocess.run(cmd).returncode:
        sys.exit(f"`python -m {shlex.join(args)}` failed")


def main(argv) -> None:
    del argv
    from kernjax import models
    _, cfg = models.named(FLAGS.model)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(FLAGS.out or tmp)
        rng = np.random.default_rng(0)
        c = FLAGS.chunk
        prompts = out / "prompts.txt"
        out.mkdir(parents=True, exist_ok=True)
        prompts.write_text("".join(" ".join(map(str, rng.integers(0, cfg.vocab, n))) + "\n"
                                   for n in (1, c - 1, c, c + 1, 300, 1000, 2049)))
        mid = cfg.layers // 2
        for at, name in ((f"{mid}", "two"), (f"1,c{2 + 12 * mid + 8}", "three")):
            _run("kernjax.cut", "--model", FLAGS.model, "--at", at, "--chunk", str(c),
                 "--context", "2560", "--out", str(out / name))
            _run("kernjax.chain", "--stages", str(out / name), "--prompts", str(prompts))
    print("\nsplit equals whole, bit for bit. Next: README.md (the cut, run and chain commands).")


if __name__ == "__main__":
    app.run(main)
