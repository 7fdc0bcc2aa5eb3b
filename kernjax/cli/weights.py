"""`kernjax weights random`: a named model's deterministic random checkpoint."""

from __future__ import annotations

import time

from absl import flags

from kernjax.cli import sources


FLAGS = flags.FLAGS


def main_def():
    """Usage: kernjax weights random --model NAME --out DIR [--seed N] [--dtype D]

The verb `random` writes the named model's deterministic random checkpoint in Hugging Face
format (config.json, safetensors), with a small byte-level tokenizer.json that fits its
vocabulary."""
    flags.DEFINE_string("model", None, sources.model_help("the named model"))
    flags.DEFINE_integer("seed", 0, "random seed", lower_bound=0)
    flags.DEFINE_enum("dtype", None, ["float32", "bfloat16"], "dtype (default: the model's)")
    flags.DEFINE_string("out", None, "checkpoint directory to write")
    flags.mark_flags_as_required(["model", "out"])

    def main():
        from kernjax import models, weights
        _, cfg = models.named(FLAGS.model)
        t0 = time.time()
        path = weights.write_random(FLAGS.model, seed=FLAGS.seed, dtype=FLAGS.dtype or cfg.dtype,
                                    out=FLAGS.out)
        print(f"wrote random {FLAGS.model} (seed {FLAGS.seed}, {FLAGS.dtype or cfg.dtype}) to "
              f"{path} in {time.time() - t0:.1f} s")

    main.verbs = ["random"]
    return main
