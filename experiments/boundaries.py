"""What the call boundaries cost: one prefill chunk of the whole program, with every call a
compilation boundary (what kernjax runs) against an unconstrained jit of the same program (every
call inlined bare, `lower.as_function(fences=False)`: XLA free to fuse across them).

The chunk is the last one of a `context`-token prompt, so attention reads the full context.
Weights are random on the device; states are donated and fed back, as the runtime does. Prints
one line: median milliseconds of each over `--iters` runs and whether their logits are bitwise
equal (they need not be: the boundaries change fusion, which is the point); `--out DIR` writes
them with the run's record (results.json, README.md).

    python -m experiments.boundaries --model qwen3-tiny --rows 512 --context 4096
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import kernjax  # noqa: F401  (sets the deterministic XLA flags before jax starts)
import jax
import jax.numpy as jnp
from jax import export
import numpy as np

from experiments import harness
from kernjax import models
from kernjax.core.cut import whole
from kernjax.core.item import Piece, item_shape, make_item
from kernjax.artifact import export_stage
from kernjax.core.trace import trace
from kernjax.kernels.lower import as_function


def _time(fn, args, states_at, iters):
    args = list(args)
    times = []
    out = None
    for i in range(iters + 2):
        t = time.perf_counter()
        out = fn(*args)
        jax.block_until_ready(out)
        if i >= 2:
            times.append(time.perf_counter() - t)
        for k, j in states_at:  # feed the donated states back
            args[k] = out[j]
    return statistics.median(times) * 1e3, out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-tiny")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--xla_flags", default="", help="appended to XLA_FLAGS after kernjax's own")
    ap.add_argument("--out", default=None, help="a directory for results.json and README.md")
    a = ap.parse_args()
    if a.xla_flags:
        os.environ["XLA_FLAGS"] += " " + a.xla_flags
    fam, cfg = models.named(a.model)
    kw = dict(dtype=a.dtype, rows=a.rows, context=a.context)
    fn, inputs, outputs = fam.prefill(cfg, **kw)
    program = trace(fn, inputs, outputs, rows=a.rows)
    shape = item_shape(program, fam.page(cfg))
    toks = np.random.default_rng(0).integers(0, cfg.vocab, a.context)
    item = make_item([Piece(toks[-a.rows:], a.context - a.rows,
                            tuple(range(1, a.context // fam.page(cfg) + 1)))], shape)
    key = jax.random.key(0)
    args = []
    for i, s in enumerate(program.inputs):
        if s.role == "weight":
            x = jax.random.normal(jax.random.fold_in(key, i), s.shape, jnp.float32) * 0.02
            args.append((x + 1.0 if len(s.shape) == 1 else x).astype(s.dtype))
        elif s.role == "state":
            args.append(jnp.zeros(s.shape, s.dtype))
        else:
            args.append(jnp.asarray(item[s.name]))
    donate = tuple(i for i, s in enumerate(program.inputs) if s.role == "state")
    back = [(i, j) for j, o in enumerate(program.outputs) for i, s in enumerate(program.inputs)
            if o.role == "state" and s.name == o.name]
    logits = [o.name for o in program.outputs].index("logits")

    exp = export_stage(whole(program))
    bounded = jax.jit(exp.call, donate_argnums=donate)
    t_b, out_b = _time(bounded, [jnp.copy(x) for x in args], back, a.iters)

    free = jax.jit(as_function(program.jaxpr, export.default_export_platform(), fences=False),
                   donate_argnums=donate)
    t_f, out_f = _time(free, [jnp.copy(x) for x in args], back, a.iters)

    same = np.asarray(out_b[logits]).tobytes() == np.asarray(out_f[logits]).tobytes()
    report = harness.Report(f"What the call boundaries cost: {a.model}, {a.rows} rows at the end "
                            f"of {a.context} tokens", __doc__.split("\n\n")[0])
    report.table("rows", "context", "bounded ms", "unconstrained ms", "ratio",
                 "logits bitwise equal", right="rrrrrl")
    report.row(a.rows, a.context, f"{t_b:.2f}", f"{t_f:.2f}", f"{t_b / t_f:.3f}", same)
    report.write(a.out and Path(a.out), bounded_ms=t_b, unconstrained_ms=t_f, same=same)
    print(f"{a.model} {a.dtype} rows {a.rows} context {a.context} on {jax.devices()[0].device_kind}"
          f" (jax {jax.__version__}): bounded {t_b:.2f} ms, unconstrained {t_f:.2f} ms, "
          f"ratio {t_b / t_f:.3f}; {a.rows / t_b * 1e3:.0f} vs {a.rows / t_f * 1e3:.0f} tokens/s; "
          f"logits bitwise equal: {same}; XLA_FLAGS={os.environ.get('XLA_FLAGS')}")


if __name__ == "__main__":
    main()
