"""Where a prefill chunk's time goes, call by call: each call of one program run alone, lowered as
the platform lowers it in a stage (`kernjax.kernels.lower.as_function`), on random inputs of its shapes.

A call of a later layer with the same name and the same operand shapes as one already timed (every
layer of a dense model, the layers of one kind in a hybrid) takes that time unless `--all`.
The attention call reads the KV state: its positions are set so the chunk sits at the end of
`--context` tokens (one sequence), so it does the work of the last chunk of such a prompt.
Prints a table (ms per call, share of the sum) and, with `--out`, writes JSON with every call's
time (`measured` false where it was taken from its twin) and the run's record
(experiments/harness.py): the profile `kernjax cut --at auto --profile` reads.

    python -m experiments.calls --model qwen3-4b --rows 512 --context 8192 --out calls.json
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time

import kernjax  # noqa: F401  (XLA caches before jax starts)
import jax
import jax.extend.core as jex
import numpy as np
from jax import export

from experiments import harness
from kernjax import models
from kernjax.core.item import Piece, item_shape, make_item
from kernjax.core.trace import states_of
from kernjax.kernels.lower import as_function


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-tiny")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--all", action="store_true", help="time every call, not layer 0 alone")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    fam, cfg = models.named(a.model)
    program = fam.program(cfg, dtype=a.dtype, rows=a.rows, context=a.context)
    shape = item_shape(program, fam.page(cfg))
    item = make_item([Piece(np.zeros(a.rows, np.int32), a.context - a.rows,
                            tuple(range(1, a.context // fam.page(cfg) + 1)), 1 if shape.slots else 0)],
                     shape)
    platform = export.default_export_platform()
    jp = program.jaxpr.jaxpr
    given = {v: item[s.name] for v, s in zip(jp.invars, program.inputs) if s.role in ("fill", "table")}
    rng = np.random.default_rng(0)
    rows, per_layer, timed = [], {}, {}
    suffix = lambda n: re.sub(r"^l\d+\.", "", n)  # noqa: E731
    for k, e in enumerate(jp.eqns):
        name = e.params["name"]
        twin = (suffix(name), tuple((v.aval.shape, str(v.aval.dtype)) for v in e.invars))
        if twin in timed and not a.all:
            ms = timed[twin]
            per_layer[suffix(name)] += ms
            rows.append({"call": k, "name": name, "ms": ms, "measured": False})
            continue
        one = jex.ClosedJaxpr(jex.Jaxpr([], e.invars, e.outvars, [e]), [])
        args = [given[v] if v in given else
                (rng.standard_normal(v.aval.shape) * 0.02).astype(v.aval.dtype)
                if np.issubdtype(v.aval.dtype, np.floating) else
                np.zeros(v.aval.shape, v.aval.dtype) for v in e.invars]
        fn = jax.jit(as_function(one, platform), donate_argnums=tuple(range(states_of(e))))
        args = [jax.device_put(x) for x in args]
        times = []
        for i in range(a.iters + 1):
            t = time.perf_counter()
            out = jax.block_until_ready(fn(*args))
            times.append(time.perf_counter() - t)
            args[:states_of(e)] = out[:states_of(e)]  # a donated state comes back
        ms = timed[twin] = statistics.median(times[1:]) * 1e3
        per_layer[suffix(name)] = per_layer.get(suffix(name), 0.0) + ms
        rows.append({"call": k, "name": name, "ms": ms, "measured": True})
    total = sum(per_layer.values())
    harness.say(f"{a.model} {a.dtype} rows {a.rows}, chunk at the end of {a.context} tokens, on "
                f"{jax.devices()[0].device_kind} (jax {jax.__version__}), median of {a.iters}")
    harness.say("| call | ms (all layers) | share |\n|---|---:|---:|")
    for key, ms in sorted(per_layer.items(), key=lambda kv: -kv[1]):
        harness.say(f"| {key} | {ms:.3f} | {100 * ms / total:.1f} % |")
    harness.say(f"| sum | {total:.3f} | |")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"model": a.model, "rows": a.rows, "context": a.context,
                       "device": jax.devices()[0].device_kind, "record": harness.record(),
                       "calls": rows}, f, indent=1)


if __name__ == "__main__":
    main()
