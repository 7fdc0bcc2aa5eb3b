"""The command-line shells: `python -m kernjax.cut`, `.run`, `.chain` and `.weights`.

Thin absl shells over the library: each defines its flags, turns them into plain arguments and
prints. A user error (bad flag value, a refused cut, a checkpoint that does not fit) ends with a
one-paragraph message and exit status 2, never a traceback; Ctrl-C ends with `interrupted` and
status 130. `--help` lists the flags the command defines.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

from absl import app, flags, logging

FLAGS = flags.FLAGS


HELP = {"--help", "-help", "--helpshort", "-helpshort", "-h", "-?"}


def run(main_def) -> None:
    """Defines a command's flags and runs it under absl. `--help` lists the flags the command
    defined and exits 0; a user error is a message and status 2; Ctrl-C is one line and 130."""
    for sig in (signal.SIGINT, signal.SIGTERM):  # also where a shell started us with SIGINT ignored
        signal.signal(sig, _stop)
    try:
        # the objects, held: a command may override absl's own flag, and the freed object's id
        # could come back as a new flag's (serve's --log_file went missing from --help so)
        before = {id(f): f for f in (FLAGS[n] for n in FLAGS)}
        main = main_def()
        args = sys.argv[1:]
        if HELP & set(args[:args.index("--")] if "--" in args else args):
            own = {FLAGS[n] for n in FLAGS if id(FLAGS[n]) not in before}
            print(usage(main_def.__doc__ or sys.modules["__main__"].__doc__ or "",
                        sorted(own, key=lambda f: f.name)))
            sys.exit(0)

        def wrapped(argv):
            logging.set_verbosity(logging.WARNING)
            extra = argv[1:]
            takes, verbs = getattr(main, "takes_args", False), getattr(main, "verbs", [])
            if not takes and extra != verbs[:1]:
                _fail((f"unexpected arguments {extra}; " if extra else "") + (
                    f"the verb is {verbs[0]}, " if verbs else "") + "every option is a --flag "
                    "(see --help)")
            try:  # kernjax's own errors (CutError, StageError, ...) are ValueError or RuntimeError
                return main(extra) if takes else main()
            except (ValueError, RuntimeError, OSError) as e:
                _fail(str(e))
            except MemoryError as e:  # states sized past the host's memory, say
                _fail(f"out of memory: {e}; lower --pages, --seqs or --context")

        app.run(wrapped, flags_parser=_parse)
    except KeyboardInterrupt as e:
        _exit_now(str(e))


# Seconds after Ctrl-C (or SIGTERM) before the process ends without its KeyboardInterrupt: one
# raised inside a callback (a JAX GC hook during a cut, say) is printed as ignored and lost.
STOP_GRACE = 5.0
_EXITING = threading.Lock()
_ON_STOP: list = []  # what a stop that ends the process this way still undoes (a half cut)


def _stop(signum, _frame):
    name = signal.Signals(signum).name
    threading.Thread(target=_exit_now, args=(name, STOP_GRACE), daemon=True).start()
    raise KeyboardInterrupt(name)


def _exit_now(name: str, after: float = 0.0) -> None:
    time.sleep(after)
    _EXITING.acquire()  # one line: the unwinding and the grace thread may both get here
    for undo in list(_ON_STOP):
        undo()
    print("terminated" if name == "SIGTERM" else "interrupted", file=sys.stderr, flush=True)
    try:
        sys.stdout.flush()
    finally:  # at once: a thread still running must not hold the exit
        os._exit(143 if name == "SIGTERM" else 130)


def usage(doc: str, own) -> str:
    """The command's usage (its docstring) and its flags, each with its help and default."""
    lines = [doc.strip(), "", "flags:"]
    for f in own:
        req = any("other than None" in getattr(v, "message", "") for v in f.validators)
        tail = " (required)" if req else "" if f.default is None else f" (default: {f.default})"
        lines.append(textwrap.fill(f"  --{'[no]' if f.boolean else ''}{f.name}: {f.help}{tail}",
                                   100, subsequent_indent="      "))
    lines += ["", "Flags can also come from a file: --flagfile=FILE. --helpfull lists absl's too."]
    return "\n".join(lines)


def _parse(argv: list[str]) -> list[str]:
    """absl's flag parsing, its errors (a missing, unknown or malformed flag) as user errors."""
    try:
        return FLAGS(argv)
    except UnicodeDecodeError as e:  # absl reads --flagfile as UTF-8
        _fail(f"a --flagfile is not UTF-8 text ({e.reason} at byte {e.start}); write it as text")
    except flags.Error as e:
        msg = re.sub(r"flag --(\w+)=None: Flag --\w+ must have a value other than None\.",
                     r"--\1 is required", str(e))
        _fail(re.sub(r"^ERROR::\s*", "", msg).replace("\n", "; ") + " (see --help)")


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
    flags.DEFINE_integer("seed", 0, "seed of a named model's random weights", lower_bound=0)


def source():
    """`(family, config, checkpoint reference, dtype)` from --model/--weights/--dtype/--seed."""
    from kernjax import models, weights
    if FLAGS.model and FLAGS.weights:
        raise ValueError("give --model NAME or --weights DIR, not both (a checkpoint names its "
                         "model)")
    if not (FLAGS.model or FLAGS.weights):
        modes = [f"--{f} DIR (made by `kernjax.cut`)" for f in ("stages", "stage_dir")
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


def model_meta(fam, cfg) -> dict:
    return {"family": fam.__name__.rsplit(".", 1)[-1], "name": cfg.name,
            "config": dataclasses.asdict(cfg), "fallbacks": fam.FALLBACKS}


def parse_at(text: str, calls) -> list[int]:
    """`18` is the first call of layer 18 (`l18.`), `c218` is call 218; commas separate points.
    Points are checked in the user's words: a layer that does not exist or has no layer before it
    (0), a bad token, points out of order."""
    layers = sorted({int(m[1]) for c in calls if (m := re.match(r"l(\d+)\.", c))})
    span = f"cut at a layer from 1 to {layers[-1]} or at a call c<N>" if layers else \
        "name a call index with c<N>"
    out, said, errs = [], [], []
    for tok in (t.strip() for t in text.split(",")):
        if tok.startswith("c") and tok[1:].isdigit():
            out.append(int(tok[1:]))
            said.append(f"call {int(tok[1:])}")
        elif tok.isdigit() and int(tok) in layers[1:]:
            out.append(next(i for i, c in enumerate(calls) if c.startswith(f"l{int(tok)}.")))
            said.append(f"layer {int(tok)} (call {out[-1]})")
        elif tok.isdigit():
            errs.append(f"--at {tok}: " + (f"a cut before layer {tok} leaves stage 0 without a "
                                           "layer" if int(tok) in layers else
                                           f"the program has no layer {tok}") + f"; {span}")
        else:
            errs.append(f"--at `{tok}`: give a layer number (18) or a call index (c218)")
    errs += [f"--at {text}: {sa} and {sb} are not increasing; give the points in order"
             for a, b, sa, sb in zip(out, out[1:], said, said[1:]) if b <= a]
    if errs:
        raise ValueError("\n".join(errs))
    return out


def profile_times(path, program, model: str) -> list[float]:
    """Each call's time (ms) from a profile of `experiments/calls.py`, which names every call."""
    try:
        prof = json.loads(Path(path).read_text())
        got = {c["name"]: float(c["ms"]) for c in prof["calls"]}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"--profile `{path}` is not a profile of experiments/calls.py --out "
                         f"({type(e).__name__}: {e})") from None
    if prof.get("model") != model or prof.get("rows") != program.rows:
        raise ValueError(f"--profile `{path}` times {prof.get('model')} at {prof.get('rows')} "
                         f"rows; this cut is {model} at {program.rows} (re-run experiments/"
                         f"calls.py --model {model} --rows {program.rows})")
    missing = [c for c in program.calls if c not in got]
    if missing:
        raise ValueError(f"--profile `{path}` has no time for {', '.join(missing[:5])}"
                         f"{' ...' if len(missing) > 5 else ''}; re-run experiments/calls.py for "
                         "this model")
    return [got[c] for c in program.calls]


def auto_cut(program, model: str):
    """The cut of --at auto: even periods by the profile, skipping points the cut refuses."""
    from kernjax.cut import CutError, balanced, cut
    if not FLAGS.profile:
        raise ValueError("--at auto needs --profile FILE: per-call times from experiments/"
                         "calls.py --out on the device that will run the stages")
    if not 2 <= FLAGS.stages <= len(program.calls):
        raise ValueError(f"--stages {FLAGS.stages}: give 2 to {len(program.calls)}")
    ms, banned = profile_times(FLAGS.profile, program, model), set()
    while True:
        points = balanced(ms, FLAGS.stages, frozenset(banned))
        try:
            stages = cut(program, points)
            break
        except CutError:  # some point splits a state or an output: never use it again
            bad = {p for p in points if _refused(program, p)}
            if not bad:
                raise
            banned |= bad
    periods = [sum(ms[a:b]) for a, b in zip([0, *points], [*points, len(ms)])]
    even = sum(periods) / len(periods)
    print(f"--at auto: c{', c'.join(map(str, points))} "
          f"({', '.join(f'`{program.calls[p]}`' for p in points)}); stage periods "
          f"{', '.join(f'{p:.3f}' for p in periods)} ms by the profile, the longest "
          f"{max(periods) / even:.3f} of even")
    return stages


def _refused(program, point: int) -> bool:
    from kernjax.cut import CutError, cut
    try:
        cut(program, [point])
    except CutError:
        return True
    return False


def cut_main():
    """Usage: python -m kernjax.cut (--model NAME | --weights DIR) --at POINTS --out DIR

Traces the model's forward, cuts it before each point (18: layer 18; c218: call 218; commas
separate points), prints what each stage keeps and sends, and writes stage0/ .. stageN/ and
whole/ into DIR, replacing a previous cut there."""
    source_flags()
    flags.DEFINE_string("at", None, "cut points: a layer (18), a call index (c218), comma-separated;"
                        " or `auto`: --stages stages of even periods by --profile")
    flags.DEFINE_integer("stages", 2, "with --at auto: how many stages")
    flags.DEFINE_string("profile", None, "with --at auto: per-call times, as "
                        "experiments/calls.py --out writes them for this model and --chunk")
    flags.DEFINE_string("out", None, "directory for stage0/ .. stageN/ and whole/")
    flags.DEFINE_integer("chunk", 512, "rows per run of the program")
    flags.DEFINE_integer("seqs", 4, "sequences one item may hold (packed prefill)")
    flags.DEFINE_integer("context", 4096, "the longest sequence, in tokens")
    flags.DEFINE_integer("pages", None, "pages per KV state (default: seqs full contexts + 1)")
    flags.DEFINE_integer("slots", None, "sequence slots per per-sequence state, slot 0 never "
                         "leased (models with recurrent states, k3-mini; default 4 * seqs + 1)")
    flags.mark_flags_as_required(["at", "out"])

    def main():
        from kernjax.cut import counted, cut, describe, whole
        from kernjax.item import item_shape
        fam, cfg, ref, dtype = source()
        out = Path(FLAGS.out)
        old = previous_cut(out)
        t0 = time.time()
        low = [f"--{n} {v} must be at least {lo}" + " and below 2^31" * (v >= lo) for n, lo in
               (("chunk", 1), ("seqs", 1), ("context", 1), ("pages", 2), ("slots", 2))
               if (v := getattr(FLAGS, n)) is not None and not lo <= v < 2**31]
        if low:
            raise ValueError("; ".join(low) + " (see --help)")
        extra = {}
        if FLAGS.slots is not None:
            if "slots" not in inspect.signature(fam.program).parameters:
                raise ValueError(f"--slots: {cfg.name} has no per-sequence states (its states "
                                 "are paged: size them with --pages)")
            extra["slots"] = FLAGS.slots
        program = fam.program(cfg, dtype=dtype, rows=FLAGS.chunk, seqs=FLAGS.seqs,
                              context=FLAGS.context, pages=FLAGS.pages, **extra)
        if "dir" in ref:
            _check_checkpoint(fam, cfg, program, Path(ref["dir"]))
        auto = FLAGS.at.strip() == "auto"
        stages = auto_cut(program, cfg.name) if auto else \
            cut(program, parse_at(FLAGS.at, program.calls))
        print(f"{cfg.name}, {dtype}, chunk {FLAGS.chunk}: {len(program.calls)} calls, KV in pages "
              f"of {fam.page(cfg)} rows, traced in {time.time() - t0:.1f} s")
        print(describe(program, stages))
        meta = dict(model=model_meta(fam, cfg), checkpoint=ref, dtype=dtype,
                    item=item_shape(program, fam.page(cfg)))
        write_cut(out, (*stages, whole(program)), old, meta)
        print(f"wrote {counted(len(stages), 'stage')} and whole/ to {out} in "
              f"{time.time() - t0:.1f} s")

    return main


def _check_checkpoint(fam, cfg, program, ckpt: Path) -> None:
    """Every tensor the program reads, or derives its weights from, is in the checkpoint with its
    shape (the files' headers only): a config.json that contradicts its safetensors is refused
    at the cut, not when a stage loads."""
    from kernjax import weights
    from kernjax.runner import split_derived
    plain, recipes = split_derived(fam.derived(cfg) if hasattr(fam, "derived") else [],
                                   [(s.name, s.shape, s.dtype) for s in program.inputs
                                    if s.role == "weight"])
    try:
        weights.load(ckpt, plain + [src for r in recipes for src in r.sources],
                     fallbacks=fam.FALLBACKS, shapes_only=True)
    except weights.WeightError as e:
        if not re.search(r"` has shape |` is missing from ", str(e)):  # the files are at fault
            raise
        raise weights.WeightError(f"{e}\nThe program follows `{ckpt / 'config.json'}`: it and "
                                  "the checkpoint's tensors disagree; mend one of them") from None


def write_cut(out: Path, stages, old: list[str], meta: dict) -> None:
    """Replaces the previous cut's directories `old` in `out` with `stages`' artifacts. A write
    that fails (or Ctrl-C) takes what this cut wrote with it, so `out` is left as a new cut can
    be written into, not half a cut that the next one would refuse."""
    from kernjax import stage as artifacts
    from kernjax.cut import counted
    if old:
        _say(f"removing the previous cut from {out}: {', '.join(old)}")
        for name in old:
            shutil.rmtree(out / name)
    written, made = [], not out.exists()

    def undo():
        for name in written:
            shutil.rmtree(out / name, ignore_errors=True)
        if made:  # a new --out goes too, if empty: it would only be in the way
            with contextlib.suppress(OSError):
                out.rmdir()
        _say(f"removed what this cut had written to {out}")

    _ON_STOP.append(undo)  # also where Ctrl-C's KeyboardInterrupt is lost (`_stop`)
    try:
        for st in stages:
            name = f"stage{st.index}" if st.stages > 1 else "whole"
            _say(f"writing {out / name} ({counted(len(st.calls), 'call')})")
            written.append(name)
            artifacts.write(out / name, st, **meta)
    except BaseException:
        undo()
        raise
    finally:
        _ON_STOP.remove(undo)


def previous_cut(out: Path) -> list[str]:
    """The stage directories a previous cut wrote into `out`; refuses an `out` that holds
    anything a cut does not write."""
    from kernjax.stage import EDGED, PROGRAM
    if not out.exists():
        return []
    if not out.is_dir():
        raise ValueError(f"--out `{out}` is a file; give a directory")
    ours, other = [], []
    for p in sorted(out.iterdir()):
        mine = (re.fullmatch(r"stage\d+|whole", p.name) and p.is_dir()
                and {f.name for f in p.iterdir()} <= {"manifest.json", PROGRAM, EDGED}
                and (p / "manifest.json").is_file()
                and '"cut"' in (p / "manifest.json").read_text(errors="replace"))
        (ours if mine else other).append(p.name + "/" * p.is_dir())
    if other:
        raise ValueError(f"--out `{out}` holds {', '.join(other[:5])}{' ...' * (len(other) > 5)}"
                         ", which kernjax.cut did not write; cut into a new or empty directory")
    return ours


def whole_artifact(fam, cfg, ref: dict, dtype: str, *, rows: int, seqs: int, context: int,
                   out: Path):
    """The uncut program of a model as a verified one-stage artifact written to `out`."""
    from kernjax import stage as artifacts
    from kernjax.cut import whole
    from kernjax.item import item_shape
    program = fam.program(cfg, dtype=dtype, rows=rows, seqs=seqs, context=context)
    return artifacts.read(artifacts.write(out, whole(program), model=model_meta(fam, cfg),
                                          checkpoint=ref, dtype=dtype,
                                          item=item_shape(program, fam.page(cfg))))


def _stages_checkpoint(sd: Path, names) -> Path:
    """The one checkpoint the stages `names` of `sd` run: --weights, else the one they all record,
    found (its fingerprint checked) once; stages that record two (two cuts mixed) are refused."""
    from kernjax import stage as artifacts
    from kernjax.runner import checkpoint_dir
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


def _pipeline(stages_dir: Path, names, *, dtype, weights_dir, cache):
    from kernjax.run import Pipeline
    from kernjax.runner import open_stage
    return Pipeline([open_stage(stages_dir / n, weights=weights_dir, dtype=dtype, cache=cache)
                     for n in names])


def stage_names(stages_dir: Path) -> list[str]:
    """The stage directories of a cut directory, in order; a path a level off says which to use."""
    if not stages_dir.is_dir():
        raise ValueError(f"--stages `{stages_dir}` does not exist" if not stages_dir.exists() else
                         f"--stages `{stages_dir}` is a file; give a `kernjax.cut --out` directory")
    names = sorted((p.name for p in stages_dir.glob("stage*") if p.name[5:].isdigit()),
                   key=lambda n: int(n[5:]))
    if names:
        return names
    if (stages_dir / "manifest.json").is_file():
        up = (stages_dir if stages_dir.name else stages_dir.resolve()).parent
        raise ValueError(f"`{stages_dir}` is one stage; --stages takes the cut directory that "
                         f"holds it: `{up}`")
    cuts = sorted(str(p.parent) for p in stages_dir.glob("*/stage0"))
    raise ValueError(f"`{stages_dir}` holds no stage0/ .. directories; " + (
        f"it holds cuts: pass one of {', '.join(f'`{c}`' for c in cuts)}" if cuts else
        "make them with `python -m kernjax.cut --out`"))


def run_main():
    """Usage: python -m kernjax.run (--stages DIR | --model NAME | --weights DIR)
                         (--prompt TEXT | --tokens IDS)

Prefills one prompt, chunk by chunk, through a cut's stages or the whole program, and prints the
prompt's length and its first token."""
    source_flags()
    flags.DEFINE_string("prompt", None, "a text prompt (needs the checkpoint's tokenizer.json)")
    flags.DEFINE_string("tokens", None, "a prompt as token ids: \"1 2 3\"")
    flags.DEFINE_integer("chunk", None, "rows per chunk (default 512, or the stages' rows)",
                         lower_bound=1, upper_bound=2**31 - 1)
    flags.DEFINE_string("stages", None, "run the stage artifacts in this directory instead")
    flags.DEFINE_string("save", None, "write logits (last row, float32) and token to FILE.npz")

    def main():
        if (FLAGS.prompt is None) == (FLAGS.tokens is None):
            raise ValueError("give exactly one of --prompt TEXT or --tokens \"1 2 3\"")
        if FLAGS.stages and FLAGS.model:
            raise ValueError("--stages names the model already; drop --model")
        save = FLAGS.save and (FLAGS.save if FLAGS.save.endswith(".npz") else FLAGS.save + ".npz")
        if save and not os.access(Path(save).parent, os.W_OK):  # before the prefill, not after
            raise OSError(f"--save {FLAGS.save}: cannot write `{save}` (" + ("Permission denied)"
                          if Path(save).parent.is_dir() else "No such file or directory)"))
        sd = FLAGS.stages and Path(FLAGS.stages)
        names = sd and stage_names(sd)
        import numpy as np
        from kernjax import stage as artifacts
        from kernjax.cut import counted
        from kernjax.run import Pipeline
        from kernjax.runner import Runner, checkpoint_dir, load_weights
        if sd:
            m = artifacts.read(sd / names[0]).manifest
            ref_dir = _stages_checkpoint(sd, names)
            tokens = _prompt(ref_dir, m["model"]["config"]["vocab"])
            pipe = _pipeline(sd, names, dtype=FLAGS.dtype, weights_dir=ref_dir, cache={})
        else:
            fam, cfg, ref, dtype = source()
            ref_dir = checkpoint_dir(ref)
            tokens = _prompt(ref_dir, cfg.vocab)
            # The smallest whole program that holds the prompt: one sequence, whole pages.
            context = -(-len(tokens) // fam.page(cfg)) * fam.page(cfg)
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


def _prompt(ckpt: Path, vocab: int) -> list[int]:
    """The prompt of --prompt (through the checkpoint's tokenizer) or --tokens, checked."""
    if FLAGS.prompt is not None:
        tok = tokenizer(ckpt)
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
        from kernjax.chain import token_ids
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


def tokenizer(ckpt: Path | None):
    """The checkpoint's `tokenizer.json` (the tokenizers library), or None when it has none."""
    if ckpt is None or not (ckpt / "tokenizer.json").is_file():
        return None
    from tokenizers import Tokenizer
    try:
        return Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    except Exception as e:  # noqa: BLE001 (the tokenizers library raises plain Exceptions)
        raise ValueError(f"`{ckpt / 'tokenizer.json'}` is not a tokenizer the tokenizers library "
                         f"reads ({str(e)[:120]}); remove it to use token ids, or replace it") \
            from None


def _decode(ckpt: Path | None, token: int) -> str | None:
    tok = tokenizer(ckpt)
    return tok.decode([token]) if tok else None


def chain_main():
    """Usage: python -m kernjax.chain --stages DIR --prompts FILE

The chain gate: runs every prompt of FILE (token ids, one prompt a line) through the cut's whole/
and through its stages, compares logits and tokens bitwise after every chunk, prints one line per
prompt and PASS or FAIL; exits 0 on PASS, 1 on FAIL."""
    flags.DEFINE_string("stages", None, "a `kernjax.cut --out` directory (whole/ and stage*/)")
    flags.DEFINE_string("prompts", None, "a file with one line of token ids per prompt")
    flags.DEFINE_integer("chunk", None, "rows per chunk (default: the stages' rows)",
                         lower_bound=1, upper_bound=2**31 - 1)
    flags.DEFINE_string("weights", None, "a checkpoint overriding the one the stages record")
    flags.DEFINE_enum("dtype", None, ["float32", "bfloat16"], "must match the stages' dtype")
    flags.mark_flags_as_required(["stages", "prompts"])

    def main():
        from kernjax.chain import chain, read_prompts
        from kernjax.cut import counted
        sd = Path(FLAGS.stages)
        prompts = read_prompts(FLAGS.prompts)
        names = stage_names(sd)
        cache = {}
        t0 = time.time()
        ckpt = _stages_checkpoint(sd, ["whole"] + names)
        whole = _pipeline(sd, ["whole"], dtype=FLAGS.dtype, weights_dir=ckpt, cache=cache)
        split = _pipeline(sd, names, dtype=FLAGS.dtype, weights_dir=ckpt, cache=cache)
        vocab = whole.runners[0].art.manifest["model"]["config"]["vocab"]
        for k, p in enumerate(prompts):
            if any(not 0 <= t < vocab for t in p):
                raise ValueError(f"prompt {k} has token ids outside the vocabulary 0..{vocab - 1}")
        _say(f"loaded whole/ and {counted(len(split.runners), 'stage')} in "
             f"{time.time() - t0:.1f} s")
        ok = chain(whole, split, prompts, chunk=FLAGS.chunk or whole.shape.rows)
        sys.exit(0 if ok else 1)

    return main


def weights_main():
    """Usage: python -m kernjax.weights random --model NAME --out DIR [--seed N] [--dtype D]

The verb `random` writes the named model's deterministic random checkpoint in Hugging Face
format (config.json, safetensors), with a small byte-level tokenizer.json that fits its
vocabulary."""
    flags.DEFINE_string("model", None, "the named model")
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
