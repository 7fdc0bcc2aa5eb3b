"""The command-line shells: `python -m kernjax.cut`, `.run`, `.chain` and `.weights`.

Thin absl shells over the library: each defines its flags, turns them into plain arguments and
prints. A user error (bad flag value, a refused cut, a checkpoint that does not fit) ends with a
one-paragraph message and exit status 2, never a traceback.
"""

from __future__ import annotations

import dataclasses
import sys
import tempfile
import time
from pathlib import Path

from absl import app, flags, logging

FLAGS = flags.FLAGS


def run(main_def) -> None:
    """Defines a command's flags and runs it under absl, turning user errors into messages."""
    main = main_def()

    def wrapped(argv):
        logging.set_verbosity(logging.WARNING)
        extra = argv[1:]
        takes = getattr(main, "takes_args", False)
        if extra and not takes and extra != getattr(main, "verbs", [])[:1] * len(extra):
            _fail(f"unexpected arguments {extra}; every option is a --flag (see --help)")
        from kernjax.cut import CutError
        from kernjax.runner import StageError
        from kernjax.stage import ArtifactError
        from kernjax.trace import TraceError
        from kernjax.weights import WeightError
        try:
            return main(extra) if takes else main()
        except (CutError, StageError, ArtifactError, TraceError, WeightError, ValueError,
                RuntimeError, OSError) as e:
            _fail(str(e))

    app.run(wrapped)


def _fail(msg: str) -> None:
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(2)


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def source_flags() -> None:
    flags.DEFINE_string("model", None, "a named model, with random weights")
    flags.DEFINE_string("weights", None, "a Hugging Face checkpoint directory")
    flags.DEFINE_enum("dtype", None, ["float32", "bfloat16"], "compute dtype; default: the "
                      "checkpoint's")
    flags.DEFINE_integer("seed", 0, "seed of a named model's random weights")


def source():
    """`(family, config, checkpoint reference, dtype)` from --model/--weights/--dtype/--seed."""
    from kernjax import models, weights
    if bool(FLAGS.model) == bool(FLAGS.weights):
        raise ValueError("give exactly one of --model NAME (random weights; known: "
                         f"{', '.join(models.names())}) or --weights CHECKPOINT_DIR")
    if FLAGS.weights:
        path = Path(FLAGS.weights).resolve()
        fam, cfg = weights.read_config(path)
        return fam, cfg, {"dir": str(path)}, FLAGS.dtype or cfg.dtype
    fam, cfg = models.named(FLAGS.model)
    dtype = FLAGS.dtype or cfg.dtype
    return fam, cfg, {"model": FLAGS.model, "seed": FLAGS.seed, "dtype": dtype}, dtype


def model_meta(fam, cfg) -> dict:
    return {"family": fam.__name__.rsplit(".", 1)[-1], "name": cfg.name,
            "config": dataclasses.asdict(cfg), "fallbacks": fam.FALLBACKS}


def parse_at(text: str, calls) -> list[int]:
    """`18` is the first call of layer 18 (`l18.`), `c218` is call 218; commas separate points."""
    out = []
    for tok in text.split(","):
        tok = tok.strip()
        if tok.startswith("c") and tok[1:].isdigit():
            out.append(int(tok[1:]))
        elif tok.isdigit():
            k = next((i for i, c in enumerate(calls) if c.startswith(f"l{tok}.")), None)
            if k is None:
                raise ValueError(f"--at {tok}: the program has no layer {tok} (no call named "
                                 f"`l{tok}.*`); name a call index with c<N>")
            out.append(k)
        else:
            raise ValueError(f"--at `{tok}`: give a layer number (18) or a call index (c218)")
    return out


def cut_main():
    source_flags()
    flags.DEFINE_string("at", None, "cut points: a layer (18), a call index (c218), comma-separated")
    flags.DEFINE_string("out", None, "directory for stage0/ .. stageN/ and whole/")
    flags.DEFINE_integer("chunk", 512, "rows per run of the program")
    flags.DEFINE_integer("seqs", 4, "sequences one item may hold (packed prefill)")
    flags.DEFINE_integer("context", 4096, "the longest sequence, in tokens")
    flags.DEFINE_integer("pages", None, "pages per KV state (default: seqs full contexts + 1)")
    flags.mark_flags_as_required(["at", "out"])

    def main():
        from kernjax import stage as artifacts
        from kernjax.cut import cut, describe, whole
        from kernjax.item import item_shape
        fam, cfg, ref, dtype = source()
        t0 = time.time()
        program = fam.program(cfg, dtype=dtype, rows=FLAGS.chunk, seqs=FLAGS.seqs,
                              context=FLAGS.context, pages=FLAGS.pages)
        stages = cut(program, parse_at(FLAGS.at, program.calls))
        print(f"{cfg.name}, {dtype}, chunk {FLAGS.chunk}: {len(program.calls)} calls, traced in "
              f"{time.time() - t0:.1f} s")
        print(describe(program, stages))
        meta = dict(model=model_meta(fam, cfg), checkpoint=ref, dtype=dtype,
                    item=item_shape(program, fam.PAGE))
        out = Path(FLAGS.out)
        for st in (*stages, whole(program)):
            name = f"stage{st.index}" if st.stages > 1 else "whole"
            _say(f"writing {out / name} ({len(st.calls)} calls)")
            artifacts.write(out / name, st, **meta)
        print(f"wrote {len(stages)} stages and whole/ to {out} in {time.time() - t0:.1f} s")

    return main


def whole_artifact(fam, cfg, ref: dict, dtype: str, *, rows: int, seqs: int, context: int,
                   out: Path):
    """The uncut program of a model as a verified one-stage artifact written to `out`."""
    from kernjax import stage as artifacts
    from kernjax.cut import whole
    from kernjax.item import item_shape
    program = fam.program(cfg, dtype=dtype, rows=rows, seqs=seqs, context=context)
    return artifacts.read(artifacts.write(out, whole(program), model=model_meta(fam, cfg),
                                          checkpoint=ref, dtype=dtype,
                                          item=item_shape(program, fam.PAGE)))


def _pipeline(stages_dir: Path, names, *, dtype, weights_dir, cache):
    from kernjax.run import Pipeline
    from kernjax.runner import open_stage
    return Pipeline([open_stage(stages_dir / n, weights=weights_dir, dtype=dtype, cache=cache)
                     for n in names])


def stage_names(stages_dir: Path) -> list[str]:
    names = sorted((p.name for p in stages_dir.glob("stage*") if p.name[5:].isdigit()),
                   key=lambda n: int(n[5:]))
    if not names:
        raise ValueError(f"`{stages_dir}` holds no stage0/ .. directories; make them with "
                         "`python -m kernjax.cut --out`")
    return names


def run_main():
    source_flags()
    flags.DEFINE_string("prompt", None, "a text prompt (needs the checkpoint's tokenizer.json)")
    flags.DEFINE_string("tokens", None, "a prompt as token ids: \"1 2 3\"")
    flags.DEFINE_integer("chunk", None, "rows per chunk (default 512, or the stages' rows)")
    flags.DEFINE_string("stages", None, "run the stage artifacts in this directory instead")
    flags.DEFINE_string("save", None, "write logits (last row, float32) and token to FILE.npz")

    def main():
        import numpy as np
        from kernjax import stage as artifacts
        from kernjax.run import Pipeline
        from kernjax.runner import Runner, checkpoint_dir, load_weights
        if bool(FLAGS.prompt) == bool(FLAGS.tokens):
            raise ValueError("give exactly one of --prompt TEXT or --tokens \"1 2 3\"")
        if FLAGS.stages:
            if FLAGS.model:
                raise ValueError("--stages names the model already; drop --model")
            sd = Path(FLAGS.stages)
            m = artifacts.read(sd / stage_names(sd)[0]).manifest
            ref_dir = Path(FLAGS.weights) if FLAGS.weights else checkpoint_dir(m["checkpoint"])
            tokens = _prompt(ref_dir, m["model"]["config"]["vocab"])
            pipe = _pipeline(sd, stage_names(sd), dtype=FLAGS.dtype, weights_dir=FLAGS.weights,
                             cache={})
        else:
            fam, cfg, ref, dtype = source()
            ref_dir = checkpoint_dir(ref)
            tokens = _prompt(ref_dir, cfg.vocab)
            # The smallest whole program that holds the prompt: one sequence, whole pages.
            context = -(-len(tokens) // fam.PAGE) * fam.PAGE
            with tempfile.TemporaryDirectory() as tmp:
                art = whole_artifact(fam, cfg, ref, dtype, rows=FLAGS.chunk or 512, seqs=1,
                                     context=context, out=Path(tmp) / "whole")
            pipe = Pipeline([Runner(art, load_weights(art, ref_dir))])
        t0 = time.time()
        out = None
        for out in pipe.prefill(tokens, chunk=FLAGS.chunk):
            pass
        token = int(np.asarray(out["next_token"])[0])
        logits = np.asarray(out["logits"])[0].astype(np.float32)
        text = _decode(ref_dir, token)
        print(f"prompt: {len(tokens)} tokens; first token: {token}"
              + (f" {text!r}" if text is not None else "")
              + f" ({time.time() - t0:.2f} s, compile included)")
        if FLAGS.save:
            np.savez(FLAGS.save, logits=logits, token=np.int32(token))
            print(f"saved logits and token to {FLAGS.save}")

    return main


def _prompt(ckpt: Path, vocab: int) -> list[int]:
    """The prompt of --prompt (through the checkpoint's tokenizer) or --tokens, checked."""
    if FLAGS.prompt:
        tok = tokenizer(ckpt)
        if tok is None:
            raise ValueError("--prompt needs the checkpoint's tokenizer.json, and this checkpoint "
                             "has none; pass --tokens \"1 2 3\" instead")
        toks = tok.encode(FLAGS.prompt, add_special_tokens=False).ids
    else:
        try:
            toks = [int(t) for t in FLAGS.tokens.replace(",", " ").split()]
        except ValueError:
            raise ValueError(f"--tokens `{FLAGS.tokens}`: give token ids separated by spaces") \
                from None
    if not toks:
        raise ValueError("the prompt is empty; give at least one token")
    bad = [t for t in toks if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"the prompt has ids {bad[:5]} outside the vocabulary 0..{vocab - 1}")
    return toks


def tokenizer(ckpt: Path | None):
    """The checkpoint's `tokenizer.json` (the tokenizers library), or None when it has none."""
    if ckpt is None or not (ckpt / "tokenizer.json").is_file():
        return None
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(ckpt / "tokenizer.json"))


def _decode(ckpt: Path | None, token: int) -> str | None:
    tok = tokenizer(ckpt)
    return tok.decode([token]) if tok else None


def chain_main():
    flags.DEFINE_string("stages", None, "a `kernjax.cut --out` directory (whole/ and stage*/)")
    flags.DEFINE_string("prompts", None, "a file with one line of token ids per prompt")
    flags.DEFINE_integer("chunk", None, "rows per chunk (default: the stages' rows)")
    flags.DEFINE_string("weights", None, "a checkpoint overriding the one the stages record")
    flags.DEFINE_enum("dtype", None, ["float32", "bfloat16"], "must match the stages' dtype")
    flags.mark_flags_as_required(["stages", "prompts"])

    def main():
        from kernjax.chain import chain, read_prompts
        sd = Path(FLAGS.stages)
        prompts = read_prompts(FLAGS.prompts)
        cache = {}
        t0 = time.time()
        whole = _pipeline(sd, ["whole"], dtype=FLAGS.dtype, weights_dir=FLAGS.weights, cache=cache)
        split = _pipeline(sd, stage_names(sd), dtype=FLAGS.dtype, weights_dir=FLAGS.weights,
                          cache=cache)
        vocab = whole.runners[0].art.manifest["model"]["config"]["vocab"]
        for k, p in enumerate(prompts):
            if any(not 0 <= t < vocab for t in p):
                raise ValueError(f"prompt {k} has token ids outside the vocabulary 0..{vocab - 1}")
        _say(f"loaded whole/ and {len(split.runners)} stages in {time.time() - t0:.1f} s")
        ok = chain(whole, split, prompts, chunk=FLAGS.chunk or whole.shape.rows)
        sys.exit(0 if ok else 1)

    return main


def weights_main():
    flags.DEFINE_string("model", None, "the named model")
    flags.DEFINE_integer("seed", 0, "random seed")
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
