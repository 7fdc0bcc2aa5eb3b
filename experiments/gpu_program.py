"""The programs a GPU would compile, hashed on any machine: a refactor's proof without device time.

Exports a model's whole program and both stages of a cut for CUDA, as on an H200 (an abstract
device: the Pallas and Mosaic GPU kernels lower without a GPU), and prints one line per program:
a hash of its StableHLO made canonical, its Mosaic GPU kernels and its size. Equal hashes before
and after a change mean the GPU gets the same ops in the same order, so the same compile and the
same bits; a changed hash says the change needs the GPU gates.

Canonical: locations and the kernels' serialized modules dropped (the `kernel_hash` beside each
stays), `sdy.sharding_constraint` dropped (identities on one device, which the abstract device
adds at the end of each nested jit) and SSA values renumbered per function. A function called
from several places and one inlined at each are not equal here.

    python -m experiments.gpu_program --model qwen3-4b --rows 512 --at c226
    python -m experiments.gpu_program --rows 8192 --lowering mlp_tile=64x256   # other knobs

To compare with an older commit, run that commit's own copy in its tree: `git worktree add
/tmp/old REV`, then in /tmp/old `python experiments/gpu_program.py` with the same flags (trees
before the package took it as a script; one without setup.py's mapping of kernjax.models needs
`ln -s ../models kernjax/models`, as gpu_gate.sh's `baseline` step does).

First made for `fd54233` (the `on_gpu` lowerings as one jit each), against `ad61239`, on a 2-core
CPU VM on 2026-12-03: qwen3-4b whole and cut at 18, c226, c227 and 12,24, at 64, 512 and 8192
rows, and k3-mini-gpu cut at 4 and 2,6 at 64 and 512 rows, every program hashed the same; the
whole 8k qwen3-4b program exported in 10.49 s at `ad61239` and 1.65-1.71 s after.
"""

from __future__ import annotations

import argparse
import hashlib
import re
import sys
import time

import kernjax  # noqa: F401  (XLA's flags before jax starts)
from experiments import harness
from kernjax import models
from kernjax.artifact import export_stage
from kernjax.core.cut import cut, points, whole
from kernjax.kernels.attention_hopper import abstract_h200


def canonical(text: str) -> str:
    """StableHLO text as above: equal for the same ops in the same order."""
    text = re.sub(r'module = "[^"]*"', 'module = "-"', text)
    text = re.sub(r"\s*loc\((?:[^()]|\([^()]*\))*\)", "", text)
    text = re.sub(r"#loc\d*\s*=.*\n", "", text)
    lines, alias = [], {}
    for line in text.split("\n"):
        if line.lstrip().startswith("func.func"):
            alias = {}
        m = re.match(r"\s*(%\w+) = sdy\.sharding_constraint (%[\w#]+) ", line)
        if m:
            alias[m.group(1)] = alias.get(m.group(2), m.group(2))
            continue
        lines.append(re.sub(r"%\w+(?:#\d+)?", lambda x: alias.get(x.group(0), x.group(0)), line))
    funcs = []
    for fn in re.split(r"(?=func\.func)", "\n".join(lines)):
        ids: dict[str, str] = {}
        funcs.append(re.sub(r"(%\d+)(#\d+)?(?!\w)", lambda x: ids.setdefault(
            x.group(1), f"%v{len(ids)}") + (x.group(2) or ""), fn))
    return "".join(funcs)


def programs(model: str, rows: int, at: str | None, context: int, lowering=None):
    """(name, stage) of the whole program and, with `at`, each stage of that cut, under the
    kernel knobs `lowering` (None: the defaults)."""
    fam, cfg = models.named(model)
    program = fam.program(cfg, dtype="bfloat16", rows=rows, context=context)
    yield "whole", whole(program, lowering=lowering)
    if at:
        for k, st in enumerate(cut(program, points(at, program), lowering=lowering)):
            yield f"stage{k}", st


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3-4b")
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--context", type=int, default=0, help="default: max(rows, 512)")
    ap.add_argument("--at", default=None, help="a cut, as kernjax cut's --at (18, c226, 12,24)")
    ap.add_argument("--cores", type=int, default=132, help="the abstract H200's SMs")
    ap.add_argument("--lowering", default="", help="kernjax's kernel knobs, KNOB=VALUE,... of "
                    "kernjax.core.lowering.Lowering (default: its defaults)")
    a = ap.parse_args(argv)
    try:
        low = harness.lowering(a.lowering)
    except ValueError as e:
        ap.error(str(e))
    for name, st in programs(a.model, a.rows, a.at, a.context or max(a.rows, 512), low):
        t = time.perf_counter()
        with abstract_h200(a.cores):
            text = export_stage(st, "cuda").mlir_module()
        digest = hashlib.sha256(canonical(text).encode()).hexdigest()[:16]
        print(f"{a.model} rows {a.rows} {name}: {digest}  mosaic_gpu kernels "
              f"{text.count('custom_call @mosaic_gpu_v2')}, {len(text) / 1e6:.1f} MB, exported in "
              f"{time.perf_counter() - t:.2f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
