"""Checkpoints: Hugging Face safetensors loaded by tensor name, and deterministic random ones.

A checkpoint is a directory with `config.json` and `model.safetensors` (or shards listed in
`model.safetensors.index.json`). `load` reads only the tensors asked for, checks each one's shape
and stored dtype, casts to the asked dtype and names every missing or mis-shaped tensor in one
error. A model may name fallbacks: a tensor a checkpoint omits read from another (none does now:
a tied head is the embedding in the program itself).

Random weights are written in the same format (`kernjax weights random`), so every
random run goes through the real loader, with a small byte-level `tokenizer.json` so text prompts
work without a download. Each tensor draws from its own generator seeded by
`(seed, crc32(name))`: the same name gives the same bytes whatever else the checkpoint holds.
A named model's random checkpoint is made once into a cache directory (`$KERNJAX_CACHE`, default
`~/.cache/kernjax`) and read from there after.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import sys
import time
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from kernjax.runtime.xla import cache_dir

SHARD_BYTES = 2 << 30


class WeightError(ValueError):
    """A checkpoint that cannot supply what a program binds; says which tensor and what to do."""


# The safetensors dtypes a tensor the model reads as float may be stored in (cast at load), and
# the one an integer tensor (MXFP4's packed values and scales) must be stored in.
FLOATS = {"F16", "BF16", "F32", "F64"}
_FLOAT_NAMES = {"float16", "bfloat16", "float32", "float64"}
_CODES = {"uint8": "U8", "int8": "I8", "int32": "I32", "int64": "I64", "uint32": "U32"}


def np_dtype(name: str) -> np.dtype:
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def _need_dir(ckpt: Path) -> None:
    if not ckpt.is_dir():
        raise WeightError(f"checkpoint `{ckpt}` " + ("is a file; pass its directory" if
                                                     ckpt.exists() else "does not exist"))


def read_config(ckpt: str | os.PathLike):
    """`(family module, config)` for a checkpoint directory, from its `config.json`."""
    _need_dir(Path(ckpt))
    path = Path(ckpt) / "config.json"
    if not path.is_file():
        raise WeightError(f"`{ckpt}` has no config.json; pass a Hugging Face checkpoint directory")
    try:
        d = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise WeightError(f"`{path}` is not valid JSON ({e})") from None
    if not isinstance(d, dict):
        raise WeightError(f"`{path}` holds a JSON {type(d).__name__}, not an object")
    from kernjax import models
    fam = models.family(d.get("model_type", "?"))
    try:
        cfg = fam.config_from_hf(d, name=d.get("_name", Path(ckpt).name))
    except KeyError as e:
        raise WeightError(f"`{path}` has no {e}") from None
    except (TypeError, ValueError, ZeroDivisionError) as e:
        raise WeightError(f"`{path}`: {e}") from None
    bad = [f"{f.name} {getattr(cfg, f.name)!r}" for f in dataclasses.fields(cfg)
           if not _fits(f, getattr(cfg, f.name))]
    if bad:
        raise WeightError(f"`{path}` gives {', '.join(bad)}: sizes are integers from 1 (counts "
                          "with a default from 0) below 2^31, scales positive floats, the dtype "
                          "float32, bfloat16 or float16")
    return fam, cfg


def _fits(f: dataclasses.Field, v) -> bool:
    """Whether a model config's field `f` holds a value the model code can use."""
    if f.type in ("int", int):
        return type(v) is int and (f.default is dataclasses.MISSING) <= v < 2**31
    if f.type in ("float", float):
        return isinstance(v, float) and 0 < v < float("inf")
    if f.name == "dtype":
        return v in ("float32", "bfloat16", "float16")
    return f.type not in ("bool", bool) or type(v) is bool


def same_model(ckpt: str | os.PathLike, model: Mapping) -> None:
    """Refuses a checkpoint whose config.json describes another model than `model` (a
    manifest's `model`: its `hf` is the config.json the cut's config writes, compared key by key
    with the checkpoint's, so no model code runs); a checkpoint without config.json is left to
    `load`."""
    if not (Path(ckpt) / "config.json").is_file():
        return
    try:
        got = json.loads((Path(ckpt) / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise WeightError(f"`{Path(ckpt) / 'config.json'}` is not JSON ({e}); mend it") from None
    skip = {"architectures", "torch_dtype", "dtype", "quantization"}
    diff = [f"{k} {got.get(k)} (the stages: {v})" for k, v in model["hf"].items()
            if k not in skip and k in got and got[k] != v]
    if diff:
        raise WeightError(f"checkpoint `{ckpt}` is another model than the stages were cut for: "
                          f"{', '.join(diff)}; pass --weights with the checkpoint they were cut "
                          "from, or re-cut with this one")


def _files(ckpt: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file that holds it."""
    _need_dir(ckpt)
    index = ckpt / "model.safetensors.index.json"
    if index.is_file():
        try:
            wm = json.loads(index.read_text())["weight_map"]
            if not (isinstance(wm, dict) and all(isinstance(v, str) and v == Path(v).name != ""
                                                 for v in wm.values())):
                raise ValueError("weight_map is not a map of tensor names to file names in "
                                 "the checkpoint directory")
        except (ValueError, KeyError, TypeError) as e:  # JSON and UTF-8 errors are ValueErrors
            raise WeightError(f"`{index}` is malformed ({type(e).__name__}: {e}); write or "
                              "download it again") from None
        bad = sorted({v for v in wm.values() if not (ckpt / v).is_file()})  # a FIFO would hang
        if bad:
            raise WeightError(f"`{index}` names {', '.join(bad)}, which `{ckpt}` does not hold "
                              "as files; download the missing shards")
        return {k: ckpt / v for k, v in wm.items()}
    single = ckpt / "model.safetensors"
    if not single.is_file():
        raise WeightError(f"`{ckpt}` has neither model.safetensors nor "
                          "model.safetensors.index.json")
    try:
        with safe_open(single, framework="numpy") as f:
            return {k: single for k in f.keys()}
    except SafetensorError as e:
        raise WeightError(f"`{single}` is not a safetensors file this reader can read ({e}); "
                          "write or download it again") from None


def fingerprint(ckpt: str | os.PathLike) -> str:
    """A short id of a checkpoint's tensors, cheap however large: each tensor's name, dtype and
    shape and up to 4 KiB at its start, middle and end (all of a tensor up to 12 KiB), read
    where the shard index says, however the tensors are split into files. Checkpoints of one
    shape differ in it where a tensor differs throughout (another seed, a fine-tune, one norm
    retrained); a change confined to part of a large tensor may not show. The stages of a
    pipeline must agree on it (the head refuses a stage that does not). A damaged file is
    hashed as far as it reads: `load` says what is wrong with it."""
    h, headers = hashlib.blake2b(digest_size=8), {}
    for name, path in sorted(_files(Path(ckpt)).items()):
        with open(path, "rb") as f:
            try:
                if path not in headers:  # safetensors: u64 header length, JSON header, data
                    n = int.from_bytes(f.read(8), "little")
                    headers[path] = (8 + n, json.loads(f.read(min(n, 100 << 20))))
                t = headers[path][1][name]
                a, b = (headers[path][0] + int(x) for x in t["data_offsets"])
                h.update(json.dumps([name, t["dtype"], t["shape"]]).encode())
            except (ValueError, TypeError, KeyError, IndexError) as e:
                h.update(f"{name}: {type(e).__name__}".encode())
                continue
            for off in sorted({a, max(a, (a + b) // 2 - 2048), max(a, b - 4096)}):
                f.seek(off)
                h.update(f.read(max(0, min(4096, b - off))))
    return h.hexdigest()


def load(ckpt: str | os.PathLike, want: Sequence[tuple[str, tuple[int, ...], str]], *,
         fallbacks: Mapping[str, str] | None = None, progress: bool = True,
         shapes_only: bool = False) -> dict[str, np.ndarray]:
    """Reads the tensors `want` (`(name, shape, dtype)`) from a checkpoint directory.

    Args:
      ckpt: the checkpoint directory.
      want: each tensor's checkpoint name, expected shape and the dtype to cast it to.
      fallbacks: for a tensor the checkpoint may omit, the tensor read instead.
      progress: print progress to stderr for loads over 256 MiB.
      shapes_only: check that every tensor is there with its shape (the files' headers), read
        none, return {}.
    """
    ckpt = Path(ckpt)
    where = _files(ckpt)
    errs, plan = [], []
    for name, shape, dtype in want:
        alt = (fallbacks or {}).get(name)
        src = name if name in where else (alt if alt in where else None)
        if src is None:
            errs.append(f"tensor `{name}` is missing from `{ckpt}`")
        else:
            plan.append((name, src, tuple(shape), dtype))
    total = sum(int(np.prod(s)) * np_dtype(d).itemsize for _, _, s, d in plan)
    out, done, t0, shown = {}, 0, time.time(), 0.0
    handles = {}
    try:
        for name, src, shape, dtype in plan:
            f = where[src]
            try:
                if f not in handles:
                    handles[f] = safe_open(f, framework="numpy").__enter__()
                header = handles[f].get_slice(src)
                got, stored = tuple(header.get_shape()), header.get_dtype()
            except Exception as e:  # a missing shard, or an index naming the wrong file
                errs.append(f"tensor `{src}` cannot be read from `{f.name}`: {e}")
                continue
            if got != shape:
                errs.append(f"tensor `{src}` has shape {list(got)}; the model expects {list(shape)}")
                continue
            if stored not in (FLOATS if dtype in _FLOAT_NAMES else {_CODES.get(dtype)}):
                errs.append(f"tensor `{src}` is stored as {stored}; the model reads it as {dtype}"
                            + (f" (from {', '.join(sorted(FLOATS))})" if dtype in _FLOAT_NAMES
                               else ""))
                continue
            if shapes_only:
                continue
            try:
                x = handles[f].get_tensor(src)
            except Exception as e:  # noqa: BLE001 (a header promising bytes the file lacks, say)
                errs.append(f"tensor `{src}` cannot be read from `{f.name}`: {e}")
                continue
            out[name] = x if x.dtype == np_dtype(dtype) else x.astype(np_dtype(dtype))
            done += out[name].nbytes
            now = time.time()
            if progress and total > 256 << 20 and (now - shown > 2 or done == total):
                shown = now
                print(f"loading weights: {len(out)}/{len(plan)} tensors, {done / 2**30:.1f}/"
                      f"{total / 2**30:.1f} GiB, {now - t0:.0f} s", file=sys.stderr, flush=True)
    finally:
        for h in handles.values():
            h.__exit__(None, None, None)
    if errs:
        more = [f"... and {len(errs) - 8} more"] if len(errs) > 8 else []
        raise WeightError("checkpoint does not match the program:\n"
                          + "\n".join(f"  - {e}" for e in errs[:8] + more))
    return out


def write_random(name: str, *, seed: int, dtype: str, out: str | os.PathLike,
                 progress: bool = True) -> Path:
    """Writes the named model's deterministic random checkpoint (config.json + safetensors)."""
    from kernjax import models
    fam, cfg = models.named(name)
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise WeightError(f"`{out}` is not empty; write a random checkpoint into a new directory")
    out.mkdir(parents=True, exist_ok=True)
    shapes = fam.weight_shapes(cfg)
    sources = fam.source_shapes(cfg)
    total = sum(int(np.prod(s)) for _, s in shapes) * np_dtype(dtype).itemsize
    total += sum(int(np.prod(s)) * np_dtype(d).itemsize for _, s, d in sources)
    shards, cur, size, t0 = [], {}, 0, time.time()
    for i, (tname, shape) in enumerate(shapes):
        rng = np.random.default_rng([seed, zlib.crc32(tname.encode())])
        cur[tname] = fam.random_weight(tname, shape, rng).astype(np_dtype(dtype))
        size += cur[tname].nbytes
        if size >= SHARD_BYTES or (i == len(shapes) - 1 and not sources):
            shards.append(cur)
            cur, size = {}, 0
        if progress and total > 256 << 20 and (i % 20 == 0 or i == len(shapes) - 1):
            print(f"random weights: {i + 1}/{len(shapes)} tensors, {time.time() - t0:.0f} s",
                  file=sys.stderr, flush=True)
    if sources:  # tensors kept in their own dtype (MXFP4 bytes), made by the family
        for k, (tname, x) in enumerate(fam.random_sources(cfg, seed)):
            cur[tname] = x
            size += x.nbytes
            if size >= SHARD_BYTES or k == len(sources) - 1:
                shards.append(cur)
                cur, size = {}, 0
    mask = os.umask(0)
    os.umask(mask)
    names = ["model.safetensors"] if len(shards) == 1 else \
        [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    for fname, sh in zip(names, shards):
        try:
            save_file(sh, out / fname, metadata={"format": "pt"})
        except SafetensorError as e:  # a read-only --out, say
            raise OSError(f"cannot write `{out / fname}`: {e}") from None
        os.chmod(out / fname, 0o666 & ~mask)  # as its other files: safetensors writes 0600
    if len(shards) > 1:
        wm = {t: fname for fname, sh in zip(names, shards) for t in sh}
        (out / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": wm}, indent=2))
    eos = write_tokenizer(out, cfg.vocab)
    conf = {**fam.hf_config(cfg), "torch_dtype": dtype, "_name": name, "_seed": seed}
    if eos:
        conf["eos_token_id"] = eos[0]
        (out / "generation_config.json").write_text(json.dumps(
            {"eos_token_id": eos, "do_sample": False}, indent=2))
    (out / "config.json").write_text(json.dumps(conf, indent=2))
    return out


# What a random checkpoint's tokenizer is trained on; changing it changes every such tokenizer.
TEXT = """Hello, world! The quick brown fox jumps over the lazy dog. A pipeline cuts a model's
program into stages: each stage runs its own calls, keeps the weights and states they read, and
hands the values that cross to the next stage. Run in sequence, the stages give the same logits
and tokens as the whole program, bit for bit. What is the capital of France? Paris is. Once upon a
time there was a little model that read one prompt at a time, chunk by chunk, and answered with
its first token. 0 1 2 3 4 5 6 7 8 9 + - * / = ( ) [ ] { } < > " ' ? ! . , ; : the of and to in
"""


SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2 of a random tokenizer
# ChatML: a random checkpoint chats in the format of the popular open chat models (without tool
# and thinking parts).
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def write_tokenizer(out: Path, vocab: int) -> list[int]:
    """Writes `tokenizer.json`: a byte-level BPE trained on `TEXT` with at most `vocab` ids (at
    most 1024), so any text encodes to ids in range, its special tokens `SPECIAL` first; and
    `tokenizer_config.json` with a ChatML chat template. The same bytes every time. Returns the
    end-of-sequence ids (`<|im_end|>`, `<|endoftext|>`). Nothing is written for a vocabulary
    smaller than the 256 bytes."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers, trainers
    from tokenizers import models as tm
    if vocab < 256 + len(SPECIAL):
        return []
    tok = Tokenizer(tm.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([TEXT], trainers.BpeTrainer(
        vocab_size=min(vocab, 1024), initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=list(SPECIAL), show_progress=False))
    tmp = out / f"tokenizer.json.tmp{os.getpid()}"
    tmp.write_text(tok.to_str(pretty=True))
    tmp.replace(out / "tokenizer.json")
    ids = {t: tok.token_to_id(t) for t in SPECIAL}
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHAT_TEMPLATE,
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None,
        "model_max_length": 1 << 20,
        "added_tokens_decoder": {str(i): {"content": t, "special": True}
                                 for t, i in ids.items()}}, indent=2))
    return [ids["<|im_end|>"], ids["<|endoftext|>"]]


def sampling_defaults(ckpt: Path | None) -> dict:
    """The sampling a request gets for the fields it leaves out, from the checkpoint's
    `generation_config.json` (as vLLM reads it): its `temperature`, `top_p`, `top_k` and `min_p`,
    and temperature 0 (greedy) where it says `do_sample: false` and names no temperature; {} for
    a checkpoint without one (OpenAI's defaults then)."""
    p = Path(ckpt) / "generation_config.json" if ckpt else None
    try:
        g = json.loads(p.read_text()) if p and p.is_file() else {}
    except ValueError:
        return {}
    if not isinstance(g, dict):
        return {}
    out = {k: g[k] for k in ("temperature", "top_p", "top_k", "min_p")
           if type(g.get(k)) in (int, float)}
    if g.get("do_sample") is False and "temperature" not in out:
        out["temperature"] = 0.0
    return out


def eos_ids(ckpt: Path | None) -> frozenset[int]:
    """The checkpoint's end-of-sequence token ids: `generation_config.json`'s `eos_token_id` (an
    id or a list) and `config.json`'s; none for a checkpoint that names none."""
    out: set[int] = set()
    for f in ("generation_config.json", "config.json"):
        p = Path(ckpt) / f if ckpt else None
        if p is None or not p.is_file():
            continue
        try:
            v = json.loads(p.read_text()).get("eos_token_id")
        except (ValueError, AttributeError):
            continue
        out |= {t for t in (v if isinstance(v, list) else [v]) if type(t) is int and t >= 0}
    return frozenset(out)


def random_checkpoint(name: str, *, seed: int = 0, dtype: str | None = None) -> Path:
    """The cached random checkpoint of a named model, written on first use."""
    from kernjax import models
    _, cfg = models.named(name)
    dtype = dtype or cfg.dtype
    path = cache_dir() / "random" / f"{name}-seed{seed}-{dtype}"
    if not (path / "config.json").is_file():
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        try:
            write_random(name, seed=seed, dtype=dtype, out=tmp)
        except BaseException:  # a failed or interrupted write leaves no half checkpoint behind
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        try:
            tmp.rename(path)
        except OSError:  # another process made it first
            shutil.rmtree(tmp, ignore_errors=True)
    if not all((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        write_tokenizer(path, cfg.vocab)  # cached before random checkpoints had them
    return path


def split_derived(recipes, want) -> tuple[list, list]:
    """`(the weights of want read from the checkpoint as they are, the recipes that derive the
    rest)`; want holds `(name, shape, dtype)`."""
    names = {w[0] for w in want}
    used = [r for r in recipes if any(n in names for n, _, _ in r.outputs)]
    made = {n for r in used for n, _, _ in r.outputs}
    return [w for w in want if w[0] not in made], used


def check_sources(fam, cfg, program, ckpt: Path) -> None:
    """Every tensor the program reads, or derives its weights from, is in the checkpoint with its
    shape (the files' headers only): a config.json that contradicts its safetensors is refused
    at the cut, not when a stage loads."""
    plain, recipes = split_derived(fam.derived(cfg),
                                   [(s.name, s.shape, s.dtype) for s in program.inputs
                                    if s.role == "weight"])
    try:
        load(ckpt, plain + [src for r in recipes for src in r.sources],
                     fallbacks=fam.FALLBACKS, shapes_only=True)
    except WeightError as e:
        if not re.search(r"` has shape |` is missing from ", str(e)):  # the files are at fault
            raise
        raise WeightError(f"{e}\nThe program follows `{ckpt / 'config.json'}`: it and "
                                  "the checkpoint's tensors disagree; mend one of them") from None


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
