"""`kernjax chain`: the chain gate, whole against stages, bit for bit."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from absl import flags

from kernjax.cli import shell, sources  # noqa: F401

FLAGS = flags.FLAGS


def main_def():
    """Usage: kernjax chain --stages DIR --prompts FILE

The chain gate: runs every prompt of FILE (token ids, one prompt a line) through the cut's whole/
and through its stages, compares logits and tokens bitwise after every chunk, prints one line per
prompt and PASS or FAIL; exits 0 on PASS, 1 on FAIL."""
    flags.DEFINE_string("stages", None, "a `kernjax cut --out` directory (whole/ and stage*/)")
    flags.DEFINE_string("prompts", None, "a file with one line of token ids per prompt")
    flags.DEFINE_integer("chunk", None, "rows per chunk (default: the stages' rows)",
                         lower_bound=1, upper_bound=2**31 - 1)
    flags.DEFINE_string("weights", None, "a checkpoint overriding the one the stages record")
    flags.DEFINE_enum("dtype", None, ["float32", "bfloat16"], "must match the stages' dtype")
    flags.mark_flags_as_required(["stages", "prompts"])

    def main():
        from kernjax import artifact
        from kernjax.runtime.chain import chain, read_prompts
        from kernjax.core.cut import counted
        sd = Path(FLAGS.stages)
        prompts = read_prompts(FLAGS.prompts)
        names = artifact.stage_names(sd)
        cache = {}
        t0 = time.time()
        ckpt = sources.stages_checkpoint(sd, ["whole"] + names)
        whole = sources.pipeline(sd, ["whole"], dtype=FLAGS.dtype, weights_dir=ckpt, cache=cache)
        split = sources.pipeline(sd, names, dtype=FLAGS.dtype, weights_dir=ckpt, cache=cache)
        vocab = whole.runners[0].art.manifest["model"]["config"]["vocab"]
        for k, p in enumerate(prompts):
            if any(not 0 <= t < vocab for t in p):
                raise ValueError(f"prompt {k} has token ids outside the vocabulary 0..{vocab - 1}")
        shell.say(f"loaded whole/ and {counted(len(split.runners), 'stage')} in "
             f"{time.time() - t0:.1f} s")
        ok = chain(whole, split, prompts, chunk=FLAGS.chunk or whole.shape.rows)
        sys.exit(0 if ok else 1)

    return main
