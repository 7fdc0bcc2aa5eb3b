"""Roadmap K14: a dense layer's small calls as csrc/dense.cu's kernels against XLA's lowerings.

For qwen3-4b's shapes (bf16, 32 q heads, 8 kv heads of 128, hidden 2560) at each row count, the
calls of layer 0 of a traced one-layer program, each as a program runs it (between barriers):

- `qk xla`: q_norm, k_norm, rope and kv_write, XLA's lowerings, one after another;
- `qk apart`: the four as `kj_head_norm` x2, `kj_rope`, `kj_kv_write` (a cut among them);
- `qk fused`: the four as one `kj_qk_rope`;
- `add_norm xla` and `add_norm cuda` (`kj_add_norm`).

Each is one jit, dispatched run after run with its state (kv, or the residual) donated and
carried; ms is one run's, the median of rounds (at 512 rows the host's dispatch may be what is
timed). Also printed: whether the
kernels give the bits of each other (fused = apart; the residual = XLA's, one rounded add), and
how far from XLA's their results are (largest difference in bf16 steps of its head's largest
value, and the share of elements that differ).

The kernels are on (`Lowering(dense_cuda=True)`, `kernjax.core.lowering`) whatever the caller's
default; `--out DIR` writes the table with the run's record (results.json, README.md).

    python -m experiments.dense_calls --rows 512,2048,8192
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import kernjax  # noqa: F401  (its XLA flags, as the model's calls compile)
import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np

from experiments import harness
from experiments.harness import fenced  # a call's barriers
from kernjax.core import lowering
from kernjax.kernels import dense_cuda
from kernjax.models import qwen3

GROUP = ("q_norm", "k_norm", "rope", "kv_write")


def layer0(rows: int, cfg=None):
    """The eqns of layer 0's calls by short name, and the program's config."""
    cfg = cfg or dataclasses.replace(qwen3.CONFIGS["qwen3-4b"], layers=1)
    program = qwen3.program(cfg, dtype="bfloat16", rows=rows, context=max(rows, 512))
    return {e.params["name"].split(".")[-1]: e for e in program.jaxpr.jaxpr.eqns}, cfg


def inputs(rows: int, cfg, seed: int = 0):
    """qkv, the two norm weights, positions, a state and slots (negative and dropped ones too)."""
    H, KV, D = cfg.heads, cfg.kv_heads, cfg.head_dim
    k = jax.random.split(jax.random.key(seed), 4)
    qkv = (4 * jax.random.normal(k[0], (rows, (H + 2 * KV) * D))).astype(jnp.bfloat16)
    wq, wk = ((1 + 0.1 * jax.random.normal(kk, (D,))).astype(jnp.bfloat16) for kk in k[1:3])
    positions = jnp.arange(rows, dtype=jnp.int32) + 7
    page = qwen3.page(cfg)  # the program's (layer0), as the state it writes
    pages = -(-max(rows, 512) // page) + 1
    kv = jax.random.normal(k[3], (pages, page, 2, KV, D)).astype(jnp.bfloat16)
    slots = jnp.arange(rows, dtype=jnp.int32) + 16
    if rows >= 4:  # the pool's last row (a negative slot counts from the end), and one dropped
        slots = slots.at[-2:].set(jnp.array([-1, pages * page + 5], jnp.int32))
    return qkv, wq, wk, positions, kv, slots


def xla_group(calls):
    f = [fenced(jex.jaxpr_as_fun(calls[n].params["jaxpr"])) for n in GROUP]

    def run(qkv, wq, wk, positions, kv, slots):
        q, = f[0](qkv, wq)
        k, = f[1](qkv, wk)
        q, k = f[2](q, k, positions)
        kv, = f[3](kv, k, qkv, slots)
        return q, kv
    return run


def apart_group(calls):
    rules = (dense_cuda.head_norm, dense_cuda.head_norm, dense_cuda.rope, dense_cuda.kv_write)
    f = [fenced(r([calls[n]], (True,) * len(calls[n].outvars))) for r, n in zip(rules, GROUP)]

    def run(qkv, wq, wk, positions, kv, slots):
        q, k = f[0](qkv, wq), f[1](qkv, wk)
        q, k = f[2](q, k, positions)
        return q, f[3](kv, k, qkv, slots)
    return run


def fused_group(calls):
    return fenced(dense_cuda.qk_group([calls[n] for n in GROUP], (False, False, True, False, True)))


def timed_state(fn, args, state: int, iters: int) -> float:
    """Median ms of one run of `fn` over 5 rounds of `iters`, one dispatch each, its state
    (argument `state`, donated) carried from run to run, as a program's state is. (Chaining the
    runs in one jit let XLA drop the work of its own lowerings whose results only a barrier
    read: XLA's four calls timed at 0.052 ms at 8192 rows there, against 0.123 alone and
    0.119 a layer in the program's profile.)"""
    run = jax.jit(fn, donate_argnums=(state,))
    args = list(args)
    args[state] = jnp.copy(args[state])
    ts = []
    for r in range(6):
        t = time.perf_counter()
        for _ in range(iters):
            outs = run(*args)
            args[state] = outs[-1]
        jax.block_until_ready(outs)
        ts.append((time.perf_counter() - t) / iters)
    return 1e3 * float(np.median(ts[1:]))  # the first round warms up


def steps(a, b) -> tuple[float, float]:
    """Largest |a - b| in bf16 steps (2^-7) of the largest |b| of its head (its last axis: a sum
    that cancels has the error of its terms), and the share of elements that differ."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    step = np.max(np.abs(b), axis=-1, keepdims=True) * 2.0 ** -7 + 1e-30
    return float(np.max(np.abs(a - b) / step)), float(np.mean(a != b))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="512,2048,8192")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--out", default=None, help="a directory for results.json and README.md")
    a = ap.parse_args()
    report = harness.Report("A dense layer's small calls as csrc/dense.cu's kernels against XLA's",
                            __doc__.split("\n\n")[0])
    report.note(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; qwen3-4b shapes, bf16; "
                f"median of 5 rounds of {a.iters} runs")
    report.table("rows", "calls", "ms", "/ xla", "bits", "max steps from xla", "share differing",
                 right="rlrrlrr")
    with lowering.use(lowering.Lowering(dense_cuda=True)):  # the kernels are what it times
        run(a, report)
    report.write(a.out and Path(a.out))


def run(a, report) -> None:
    for rows in map(int, a.rows.split(",")):
        calls, cfg = layer0(rows)
        args = inputs(rows, cfg)
        ref = jax.jit(xla_group(calls))(*args)
        outs, base = {}, None
        for name, make in (("xla", xla_group), ("apart", apart_group), ("fused", fused_group)):
            fn = make(calls)
            outs[name] = jax.jit(fn)(*args)
            ms = timed_state(fn, args, 4, a.iters)
            base = base or ms
            bits = "" if name == "xla" else ("= apart" if name == "fused" and all(
                np.asarray(x).tobytes() == np.asarray(y).tobytes()
                for x, y in zip(outs["fused"], outs["apart"])) else
                "" if name == "apart" else "DIFFER from apart")
            d = [steps(x, y) for x, y in zip(outs[name], ref)]
            report.row(rows, f"qk {name}", f"{ms:.4f}", f"{ms / base:.3f}", bits,
                       ", ".join(f"{s:.2f}" for s, _ in d),
                       ", ".join(f"{100 * f:.2f}%" for _, f in d))
        k = jax.random.split(jax.random.key(1), 3)
        y, h = (jax.random.normal(kk, (rows, cfg.hidden)).astype(jnp.bfloat16) for kk in k[:2])
        w = (1 + 0.1 * jax.random.normal(k[2], (cfg.hidden,))).astype(jnp.bfloat16)
        xla = fenced(jex.jaxpr_as_fun(calls["post_attn_norm"].params["jaxpr"]))
        own = fenced(dense_cuda.add_norm([calls["post_attn_norm"]], (True, True)))
        rn, rs = jax.jit(xla)(y, h, w)
        base = None
        for name, fn in (("xla", xla), ("cuda", own)):
            ms = timed_state(fn, (y, h, w), 1, a.iters)
            base = base or ms
            n, s = jax.jit(fn)(y, h, w)
            same = np.asarray(s).tobytes() == np.asarray(rs).tobytes()
            (dn, fn_), (ds, _) = steps(n, rn), steps(s, rs)
            report.row(rows, f"add_norm {name}", f"{ms:.4f}", f"{ms / base:.3f}",
                       "residual = xla" if same else "residual DIFFERS", f"{dn:.2f}, {ds:.2f}",
                       f"{100 * fn_:.2f}%")


if __name__ == "__main__":
    main()
