"""What merging a layer's GEMMs would buy qwen3-4b, before the model is changed for it.

At 8k tokens in one chunk, GEMMs are 78 of the 133 ms (`docs/bitwise.md`), as five calls a layer
(q, k, v, gate and up separate; o; down) with silu·mul a call of its own between them. This
times, on random bf16 operands at `--rows` rows, each way a layer's GEMMs could run:

- `qkv 3`: q, k and v as three products (today), each fenced like a call;
- `qkv 1`: one product over the weights concatenated at load (6144 columns);
- `gate_up 2` against `gate_up 1` (19456 columns), the same way;
- `silu_mul+down 2`: silu(gate)·up and the down product as two calls (today), against
  `silu_mul+down 1`: both in one call, where XLA may fuse the product's prologue (Triton).

Each case is one jitted function of `optimization_barrier`-fenced parts, as kernjax lowers calls
on a GPU; kernjax's XLA flags apply (it is imported first). Prints ms and TFLOP/s per case.

    python experiments/gemms.py --rows 512,2048,8192
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kernjax  # noqa: E402,F401  (XLA flags: no dot merger, the shared autotune cache)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

D, Q, KV, F = 2560, 4096, 1024, 9728  # qwen3-4b: hidden, q heads x 128, kv heads x 128, MLP


def fenced(f):
    return lambda *a: jax.lax.optimization_barrier(f(*jax.lax.optimization_barrier(a)))


def cases():
    dot = fenced(lambda x, w: x @ w)
    qkv3 = lambda x, wq, wk, wv: [dot(x, w) for w in (wq, wk, wv)]  # noqa: E731
    qkv1 = dot
    gu2 = lambda x, wg, wu: [dot(x, w) for w in (wg, wu)]  # noqa: E731
    sm = fenced(lambda g, u: jax.nn.silu(g) * u)
    down = fenced(lambda h, w: h @ w)
    sd2 = lambda g, u, w: down(sm(g, u), w)  # noqa: E731
    sd1 = fenced(lambda g, u, w: (jax.nn.silu(g) * u) @ w)
    return {
        "qkv 3": (qkv3, lambda r: [(r, D), (D, Q), (D, KV), (D, KV)], 2 * D * (Q + 2 * KV)),
        "qkv 1": (qkv1, lambda r: [(r, D), (D, Q + 2 * KV)], 2 * D * (Q + 2 * KV)),
        "gate_up 2": (gu2, lambda r: [(r, D), (D, F), (D, F)], 2 * D * 2 * F),
        "gate_up 1": (qkv1, lambda r: [(r, D), (D, 2 * F)], 2 * D * 2 * F),
        "silu_mul+down 2": (sd2, lambda r: [(r, F), (r, F), (F, D)], 2 * F * D),
        "silu_mul+down 1": (sd1, lambda r: [(r, F), (r, F), (F, D)], 2 * F * D),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="512,2048,8192")
    ap.add_argument("--iters", type=int, default=50)
    a = ap.parse_args()
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}")
    print("| rows | case | ms | TFLOP/s |")
    print("|---:|---|---:|---:|")
    key = jax.random.key(0)
    for r in (int(x) for x in a.rows.split(",")):
        for name, (f, shapes, flops_per_row) in cases().items():
            args = [jax.random.normal(k, s, jnp.bfloat16) * 0.05
                    for k, s in zip(jax.random.split(key, len(shapes(r))), shapes(r))]
            run = jax.jit(f)
            jax.block_until_ready(run(*args))
            ts = []
            for _ in range(5):
                t = time.perf_counter()
                for _ in range(a.iters):
                    out = run(*args)
                jax.block_until_ready(out)
                ts.append((time.perf_counter() - t) / a.iters)
            ms = 1e3 * float(np.median(ts))
            print(f"| {r} | {name} | {ms:.4f} | {flops_per_row * r / ms / 1e9:.1f} |", flush=True)


if __name__ == "__main__":
    main()
