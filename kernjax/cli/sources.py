"""What several verbs read from their flags: the model (named or a checkpoint), a cut's stages,
a prompt."""

from __future__ import annotations

import sys
from pathlib import Path

from absl import flags

from kernjax.cli import shell

FLAGS = flags.FLAGS


def model_help(what: str = "a named model, with random weights") -> str:
    """--model's help: `what`, then the named models, read from the registry when the command
    prints its help (else not: a stage host imports no model code)."""
    if not {*shell.HELP, "--helpfull", "-helpfull"} & set(sys.argv[1:]):
        return what
    from kernjax import models
    return f"{what}: {', '.join(models.names())}"


def source_flags() -> None:
    flags.DEFINE_string("model", None, model_help())
    flags.DEFINE_string("weights", None, "a Hugging Face checkpoint directory")
    flags.DEFINE_enum("dtype", None, ["float32", "bfloat16"], "compute dtype; default: the "
                      "checkpoint's")
    flags.DEFINE_integer("seed", 0, "seed of a named model's random weights", lower_bound=0)


def source():
    """`(family, config, checkpoint reference, dtype)` from --model/--weights/--dtype/--seed."""
    from kernjax import models, weights
    if FLAGS.model and FLAGS.weights:
        raise ValueError("give --model NAME or --weights DIR, not both (a checkpoint names its "
                         "model)")
    if not (FLAGS.model or FLAGS.weights):
        modes = [f"--{f} DIR (made by `kernjax cut`)" for f in ("stages", "stage_dir")
                 if f in FLAGS]
        modes += [f"--model NAME (random weights; known: {', '.join(models.names())})"]
        raise ValueError(f"no model given: pass {', '.join(modes)} or --weights CHECKPOINT_DIR")
    if FLAGS.weights:
        path = Path(FLAGS.weights).resolve()
        fam, cfg = weights.read_config(path)
        ref = {"dir": str(path), "id": weights.fingerprint(path)}  # what it held at the cut
        return fam, cfg, ref, FLAGS.dtype or cfg.dtype
    fam, cfg = models.named(FLAGS.model)
    dtype = FLAGS.dtype or cfg.dtype
    return fam, cfg, {"model": FLAGS.model, "seed": FLAGS.seed, "dtype": dtype}, dtype


def stages_checkpoint(sd: Path, names) -> Path:
    """The one checkpoint the stages `names` of `sd` run: --weights, else the one they all record,
    found (its fingerprint checked) once; stages that record two (two cuts mixed) are refused."""
    from kernjax import artifact as artifacts
    from kernjax.runtime.runner import checkpoint_dir
    if FLAGS.weights:
        return Path(FLAGS.weights)
    refs = {n: artifacts.read(sd / n).manifest["checkpoint"] for n in names}
    named = {n: f"`{r['dir']}`" if "dir" in r else f"random {r.get('model')} (seed "
             f"{r.get('seed')}, {r.get('dtype')})" for n, r in refs.items()}
    for n in names[1:]:
        if refs[n] != refs[names[0]]:
            raise ValueError(f"`{sd / n}` was cut from {named[n]}, `{sd / names[0]}` from "
                             f"{named[names[0]]} (or it changed in between): one pipeline runs "
                             "one checkpoint; cut again into one --out, or pass --weights DIR")
    return checkpoint_dir(refs[names[0]], sd / names[0])


def pipeline(stages_dir: Path, names, *, dtype, weights_dir, cache):
    from kernjax.runtime.pipeline import Pipeline
    from kernjax.runtime.runner import open_stage
    return Pipeline([open_stage(stages_dir / n, weights=weights_dir, dtype=dtype, cache=cache)
                     for n in names])


def prompt(ckpt: Path, vocab: int) -> list[int]:
    """The prompt of --prompt (through the checkpoint's tokenizer) or --tokens, checked."""
    from kernjax import weights
    if FLAGS.prompt is not None:
        tok = weights.tokenizer(ckpt)
        if tok is None:
            raise ValueError("--prompt needs the checkpoint's tokenizer.json, and this checkpoint "
                             "has none; pass --tokens \"1 2 3\" instead")
        try:
            FLAGS.prompt.encode("utf-8")  # the shell's bytes that are not UTF-8 decode to these
        except UnicodeEncodeError as e:
            raise ValueError(f"--prompt is not UTF-8 text (byte {e.start}); pass UTF-8, or "
                             "--tokens \"1 2 3\"") from None
        toks = tok.encode(FLAGS.prompt, add_special_tokens=False).ids
    else:
        from kernjax.runtime.chain import token_ids
        try:
            toks = token_ids(FLAGS.tokens)
        except ValueError as e:
            raise ValueError(f"--tokens `{FLAGS.tokens[:80]}`: {e}; give token ids separated by "
                             "spaces") from None
    if not toks:
        raise ValueError("the prompt is empty; give at least one token")
    bad = [t for t in toks if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"the prompt has ids {bad[:5]} outside the vocabulary 0..{vocab - 1}")
    return toks


def decode(ckpt: Path | None, token: int) -> str | None:
    from kernjax import weights
    tok = weights.tokenizer(ckpt)
    return tok.decode([token]) if tok else None
