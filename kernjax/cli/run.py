"""`kernjax run`: prefill one prompt and print its first token, or generate its continuation."""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

from absl import flags

from kernjax.cli import sources

FLAGS = flags.FLAGS


def main_def():
    """Usage: kernjax run (--stages DIR | --model NAME | --weights DIR)
                         (--prompt TEXT | --tokens IDS)

Prefills one prompt, chunk by chunk, through a cut's stages or the whole program, and prints the
prompt's length and its first token; with --max_tokens N, generates N tokens (greedy, or drawn
with --temperature and --seed), each after the last through the cut's one-row step, and prints
the continuation."""
    sources.source_flags()
    flags.DEFINE_string("prompt", None, "a text prompt (needs the checkpoint's tokenizer.json)")
    flags.DEFINE_string("tokens", None, "a prompt as token ids: \"1 2 3\"")
    flags.DEFINE_integer("chunk", None, "rows per chunk (default 512, or the stages' rows)",
                         lower_bound=1, upper_bound=2**31 - 1)
    flags.DEFINE_string("stages", None, "run the stage artifacts in this directory instead")
    flags.DEFINE_string("save", None, "write logits (last row, float32) and token to FILE.npz")
    flags.DEFINE_integer("max_tokens", None, "generate this many tokens after the prompt "
                         "(stopping early at the checkpoint's end-of-sequence token)",
                         lower_bound=1, upper_bound=2**20)
    flags.DEFINE_float("temperature", 0.0, "with --max_tokens: 0 is greedy, above 0 samples",
                       lower_bound=0.0)
    flags.DEFINE_integer("sample_seed", 0, "with --max_tokens and --temperature: the sampling seed",
                         lower_bound=0, upper_bound=2**32 - 1)

    def main():
        if (FLAGS.prompt is None) == (FLAGS.tokens is None):
            raise ValueError("give exactly one of --prompt TEXT or --tokens \"1 2 3\"")
        if FLAGS.stages and FLAGS.model:
            raise ValueError("--stages names the model already; drop --model")
        save = FLAGS.save and (FLAGS.save if FLAGS.save.endswith(".npz") else FLAGS.save + ".npz")
        if save and not os.access(Path(save).parent, os.W_OK):  # before the prefill, not after
            raise OSError(f"--save {FLAGS.save}: cannot write `{save}` (" + ("Permission denied)"
                          if Path(save).parent.is_dir() else "No such file or directory)"))
        from kernjax import artifact
        from kernjax import artifact as artifacts
        sd = FLAGS.stages and Path(FLAGS.stages)
        names = sd and artifact.stage_names(sd)
        import numpy as np
        from kernjax.core.cut import counted
        from kernjax.runtime.pipeline import Pipeline
        from kernjax.runtime.runner import Runner, checkpoint_dir, load_weights
        if sd:
            m = artifacts.read(sd / names[0]).manifest
            ref_dir = sources.stages_checkpoint(sd, names)
            tokens = sources.prompt(ref_dir, m["model"]["config"]["vocab"])
            pipe = sources.pipeline(sd, names, dtype=FLAGS.dtype, weights_dir=ref_dir, cache={})
        else:
            fam, cfg, ref, dtype = sources.source()
            ref_dir = checkpoint_dir(ref)
            tokens = sources.prompt(ref_dir, cfg.vocab)
            # The smallest whole program that holds the prompt: one sequence, whole pages.
            context = -(-len(tokens) // fam.page(cfg)) * fam.page(cfg)
            with tempfile.TemporaryDirectory() as tmp:
                if FLAGS.max_tokens:  # room for the continuation too
                    context = -(-(len(tokens) + FLAGS.max_tokens) // fam.page(cfg)) * fam.page(cfg)
                art = artifact.whole_artifact(fam, cfg, ref, dtype, rows=FLAGS.chunk or 512, seqs=1,
                                              context=context, out=Path(tmp) / "whole",
                                              decode=(1,) if FLAGS.max_tokens else ())
            pipe = Pipeline([Runner(art, load_weights(art, ref_dir))])
        t0 = time.time()
        if FLAGS.max_tokens:
            return _generate(pipe, tokens, ref_dir, t0)
        out = None
        for out in pipe.prefill(tokens, chunk=FLAGS.chunk):
            pass
        token = int(np.asarray(out["next_token"])[0])
        logits = np.asarray(out["logits"])[0].astype(np.float32)
        text = sources.decode(ref_dir, token)
        print(f"prompt: {counted(len(tokens), 'token')}; first token: {token}"
              + (f" {text!r}" if text is not None else "")
              + f" ({time.time() - t0:.2f} s, compile included)")
        if save:
            try:
                np.savez(save, logits=logits, token=np.int32(token))
            except OSError as e:
                raise OSError(f"--save {FLAGS.save}: cannot write `{save}` ({e.strerror or e})") \
                    from None
            print(f"saved logits and token to {save}")

    return main


def _generate(pipe, tokens, ckpt, t0) -> None:
    """Generates --max_tokens tokens after `tokens`, printing the continuation as it grows."""
    import sys

    import numpy as np

    from kernjax import weights
    from kernjax.core.item import GREEDY
    tok = weights.tokenizer(ckpt)
    eos = weights.eos_ids(ckpt)
    sampling = GREEDY if FLAGS.temperature == 0 else (FLAGS.temperature, 1.0, 0, 0.0)
    ids, first = [], None
    for out in pipe.generate(tokens, max_tokens=FLAGS.max_tokens, chunk=FLAGS.chunk,
                             sampling=sampling, seed=FLAGS.sample_seed, stop=eos):
        ids.append(int(np.asarray(out["next_token"])[0]))
        first = first or time.time()
    text = tok.decode(ids) if tok else None
    print(f"prompt: {len(tokens)} tokens; generated {len(ids)}"
          + (" (ended at the end-of-sequence token)" if ids and ids[-1] in eos else "")
          + f", first after {first - t0:.2f} s, all in {time.time() - t0:.2f} s (compile "
          "included)")
    print("tokens: " + " ".join(map(str, ids)))
    if text is not None:
        print(f"text: {text!r}")
    sys.stdout.flush()
