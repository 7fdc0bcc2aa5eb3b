"""The head's top-20 on a GPU: one `jax.lax.top_k` with k = 20 (past XLA:GPU's TopK kernel, which
takes k <= 16, so XLA sorts each row whole) against `kernjax.kernels.head.top_k` (steps of at most
16, each XLA's TopK kernel), timed alternately in one process, with the same bits checked:

- alone, on what the online pass gives it for each vocabulary slice: [rows, 20 + 8192] float32;
- in the score head (`head.score`: every row's target log-probability and top-20, the vocabulary
  in slices) of `--model`'s hidden size and vocabulary, bf16, on random inputs.

    python -m experiments.topk --model qwen3-4b --rows 2,64,512 --out OUT
"""

from __future__ import annotations

import argparse

from experiments import harness


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3-tiny")
    ap.add_argument("--rows", default="2,64,512")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    from kernjax import models
    from kernjax.kernels import head

    _, cfg = models.named(a.model)
    steps = head.top_k
    ways = {"lax.top_k": lambda x, k: jax.lax.top_k(x, k), "steps of 16": steps}
    rep = harness.Report(f"The head's top-{head.K}, {a.model}",
                         "Is the top-20 in steps of 16 faster than one top_k of 20, alone and in "
                         "the score head, with the same bits?")
    rep.table("what", "rows", "way", "ms (median of rounds)", "same bits", right="lrlrl")
    rng = np.random.default_rng(0)
    matmul = lambda x, w: jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())))  # noqa: E731
    w = jnp.asarray(rng.standard_normal((cfg.vocab, cfg.hidden)) * 0.02, jnp.bfloat16)
    results = []
    for rows in (int(r) for r in a.rows.split(",")):
        width = head.K + min(head.SLICE, cfg.vocab)
        x = jnp.asarray(rng.standard_normal((rows, width)), jnp.float32)
        x = x.at[:, :head.K].set(-jnp.inf)  # the running top-20 before the first slice
        h = jnp.asarray(rng.standard_normal((rows, cfg.hidden)), jnp.bfloat16)
        t = jnp.asarray(rng.integers(0, cfg.vocab, rows), jnp.int32)
        cases = {}
        for name, way in ways.items():
            cases[("slice", name)] = (jax.jit(lambda x, way=way: way(x, head.K)), (x,))
            head.top_k = way  # the score head traces with this way, now
            try:
                f = jax.jit(lambda h, t: head.score(h, w, t, matmul))
                f.lower(h, t).compile()
            finally:
                head.top_k = steps
            cases[("score head", name)] = (f, (h, t))
        outs = {key: jax.device_get(f(*args)) for key, (f, args) in cases.items()}
        times: dict = {key: [] for key in cases}
        for _ in range(a.rounds):  # alternated
            for key, (f, args) in cases.items():
                times[key].append(harness.timed(f, args, a.iters, rounds=1))
        for (what, name), ts in times.items():
            ref = outs[(what, "lax.top_k")]
            same = all(np.asarray(p).tobytes() == np.asarray(q).tobytes()
                       for p, q in zip(ref, outs[(what, name)], strict=True))
            ms = float(np.median(ts))
            rep.row(what, rows, name, f"{ms:.3f}", str(same))
            results.append({"what": what, "rows": rows, "way": name, "ms": ms, "rounds_ms": ts,
                            "same": same})
    rep.write(harness.out_dir("topk", a.out), model=a.model, rows=a.rows, results=results)


if __name__ == "__main__":
    main()
