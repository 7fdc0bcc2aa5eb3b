"""The chain gate: the whole program and a cut's stages on the same prompts, compared bitwise.

Both run every prompt chunk by chunk, through each program of the cut (prefill, score, decode
steps); after every chunk and every step each output of the last stage (tokens, logits,
log-probabilities) must equal the whole program's byte for byte. kern's `pp_chain`, in one
process.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from kernjax.core import lowering
from kernjax.core.cut import counted
from kernjax.artifact import decode_buckets
from kernjax.runtime.pipeline import Pipeline


def differing_bytes(a, b) -> int:
    x, y = np.asarray(a), np.asarray(b)
    if x.shape != y.shape or x.dtype != y.dtype:
        return max(x.nbytes, y.nbytes)
    xb, yb = x.view(np.uint8), y.view(np.uint8)
    return int(np.count_nonzero(xb != yb))


def chain(whole: Pipeline, split: Pipeline, prompts: Sequence[Sequence[int]], *, chunk: int,
          say: Callable[[str], None] = print, steps: int = 4) -> bool:
    """Runs every prompt through both, in each program of the cut: prefill chunk by chunk, score
    chunk by chunk (where the cut has a score program) and `steps` decode steps after it in the
    largest decode bucket, the one a batch-invariant head serves (where the cut has decode
    programs and the context has room); says one line per prompt; True when
    every output of every run is identical. Refuses (a ValueError naming the knob) a whole program exported with other kernels
    than the stages: they would be compared against another program."""
    why = lowering.refusal(f"`{whole.runners[0].art.path}`", whole.runners[0].art.lowering,
                           f"`{split.runners[0].art.path}`", split.runners[0].art.lowering)
    if why:
        raise ValueError(why)
    ok = True
    shape = whole.shape
    for n, prompt in enumerate(prompts):
        runs = [("prefill", lambda p: p.prefill(prompt, chunk=chunk))]
        if "score" in whole.programs:
            runs.append(("score", lambda p: p.score(prompt, chunk=chunk)))
        room = shape.context - len(prompt)
        pages = shape.pages - 1 - -(-(len(prompt) + min(steps, room)) // shape.page)
        if steps and room > 0 and pages >= 0 and decode_buckets(whole.programs):
            runs.append(("decode", lambda p: p.generate(prompt, max_tokens=min(steps, room),
                                                         chunk=chunk)))
        diff, first, counts = 0, None, {}
        for what, go in runs:
            whole.reset()
            split.reset()
            k = 0
            # strict: a pipeline that stops early is an error, not a pass
            for w, s in zip(go(whole), go(split), strict=True):
                k += 1
                d = sum(differing_bytes(w[key], s[key]) for key in sorted(w))
                if d and first is None:
                    first = f"{what} {'step' if what == 'decode' else 'chunk'} {k}"
                diff += d
            counts[what] = k
        line = (f"prompt {n}: {counted(len(prompt), 'token')}, "
                f"{counted(counts['prefill'], 'chunk')}"
                + (f", {counted(counts['decode'], 'decode step')}" if "decode" in counts else "")
                + ": ")
        if diff:
            ok = False
            say(line + f"DIFFERENT ({diff} bytes differ, first at {first})")
        else:
            say(line + "IDENTICAL")
    say(f"PASS: {counted(len(prompts), 'prompt')} bitwise identical" if ok else
        f"FAIL: the stages differ from the whole program on some of {len(prompts)} prompts")
    return ok


def token_ids(text: str) -> list[int]:
    """Token ids separated by whitespace or commas, in ASCII digits (int() would also read
    `١`, `１２` or `1_0`); a ValueError names the first that is not one."""
    ids = text.replace(",", " ").split()
    bad = [t for t in ids if not re.fullmatch(r"-?[0-9]+", t)]
    if bad:
        raise ValueError(f"`{bad[0][:20]}` is not a token id")
    return [int(t) for t in ids]


def read_prompts(path) -> list[list[int]]:
    """One prompt per non-empty line, token ids separated by whitespace."""
    if not Path(path).exists() or Path(path).is_dir():
        raise ValueError(f"--prompts `{path}` " + ("is a directory" if Path(path).exists() else
                                                   "does not exist"))
    out = []
    with open(path, encoding="utf-8", errors="replace") as f:  # a stray byte: a bad id below
        for k, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                out.append(token_ids(line))
            except ValueError as e:
                raise ValueError(f"{path}:{k}: a prompt line holds token ids separated by "
                                 f"spaces ({e})") from e
    if not out:
        raise ValueError(f"{path} holds no prompt")
    return out

