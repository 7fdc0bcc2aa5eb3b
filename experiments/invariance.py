"""Whether a decode step's bits depend on the program that runs it or on the rows beside it.

A whole cut with its prefill chunk, score chunk and decode buckets; `--sequences` prompts
prefilled; then each sequence's step (its prompt's last token) alone in the smallest decode
bucket, against the same step (a) alone again (the same call twice), (b) alone in each other
program (only the GEMMs' M changes), (c) beside others in each decode bucket, the prefill chunk
and the score chunk, against alone in that program (only the company changes) and against alone
in the smallest bucket (both change, as in serving). A row per comparison: how many of the
sequences' next tokens, log-probabilities and logits differ, and the largest logit difference.
With `--locate`, each item whose steps differ is evaluated again one call at a time (the
program's top-level equations, on the same weights and states), beside the smallest bucket's
items of its sequences alone: the first call whose output rows part.

    python -m experiments.invariance --model qwen3-tiny
    python -m experiments.invariance --model qwen3-4b --chunk 512     # a GPU
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from experiments import harness

OUTS = ("next_token", "logprob", "top_ids", "logits")
SEQS, CONTEXT = 4, 256  # the chunk programs' sequences, and every sequence's context


def by_call(prog, runner, item) -> list[tuple[str, list]]:
    """`prog` (a traced Program) evaluated one top-level call at a time on the runner's weights
    and states: each call's name and its outputs."""
    import jax.extend.core as jex
    jaxpr = prog.jaxpr.jaxpr
    args = [runner.weights[s.name] if s.role == "weight" else
            runner.states[s.name] if s.role == "state" else item[s.name] for s in prog.inputs]
    env = dict(zip(jaxpr.constvars, prog.jaxpr.consts))
    env.update(zip(jaxpr.invars, args))
    out = []
    for name, eqn in zip(prog.calls, jaxpr.eqns, strict=True):
        ins = [v.val if isinstance(v, jex.Literal) else env[v] for v in eqn.invars]
        params = dict(eqn.params)
        if "donated_invars" in params:  # the runner's states stay whole
            params["donated_invars"] = (False,) * len(params["donated_invars"])
        got = eqn.primitive.bind(*ins, **params)
        got = got if eqn.primitive.multiple_results else [got]
        env.update(zip(eqn.outvars, got))
        out.append((name, got))
    return out


def _first_difference(calls, alone, idx, rows) -> tuple | None:
    """(call index, call name, sequence, output index, shape) of the first output row of `calls`
    (an item of the sequences `idx`) that differs from the sequence's own row in `alone[i]` (by
    call name), comparing outputs whose first axis is one of `rows` (the two items' rows or
    sequences)."""
    import numpy as np
    for c, (name, outs) in enumerate(calls):
        for j, i in enumerate(idx):
            for o, (x, y) in enumerate(zip(outs, alone[i].get(name, ()))):
                if x.ndim and y.ndim and x.shape[0] in rows[0] and y.shape[0] in rows[1] \
                        and np.asarray(x[j]).tobytes() != np.asarray(y[0]).tobytes():
                    return c, name, i, o, list(x.shape)
    return None


def locate(traced, runner, item_of, small, differs, rep) -> dict | None:
    """For each (program, sequences) beside others whose steps differ, the first call at which
    a sequence's rows differ from its rows alone in the smallest bucket."""
    first, alone = None, {}
    rep.table("program", "beside", "first call that differs", "sequence", "its outputs",
              right="lllll")
    shape = lambda p: (traced[p].rows, runner.art.programs[p].item.seqs)  # noqa: E731
    for program, idx in differs:
        calls = by_call(traced[program], runner, item_of(idx, program))
        for i in idx:
            if i not in alone:
                alone[i] = dict(by_call(traced[small], runner, item_of([i], small)))
        hit = _first_difference(calls, alone, idx, (shape(program), shape(small)))
        if hit is None:
            rep.row(program, len(idx) - 1, "none (call by call the rows agree)", "", "")
            continue
        c, name, i, o, sh = hit
        rep.row(program, len(idx) - 1, f"{c} `{name}`", i, f"output {o} {sh}")
        first = first or {"program": program, "beside": len(idx) - 1, "call": c, "name": name,
                          "sequence": i, "output": o, "shape": sh}
    return first


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3-tiny")
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--decode", default="1,4,16,64")
    ap.add_argument("--sequences", type=int, default=16)
    ap.add_argument("--locate", action="store_true",
                    help="evaluate each item whose steps differ call by call against the smallest "
                         "bucket alone: the first call whose output rows differ")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import numpy as np

    from kernjax import artifact, models
    from kernjax.core.item import Piece, make_item
    from kernjax.runtime.pipeline import Pipeline
    from kernjax.runtime.runner import Runner, checkpoint_dir, load_weights

    fam, cfg = models.named(args.model)
    n = args.sequences
    per_seq = -(-CONTEXT // fam.page(cfg))
    buckets = sorted({int(b) for b in args.decode.split(",")})
    rep = harness.Report(f"Batch invariance of a decode step, {args.model}",
                         "Does a decode step's output depend on the bucket it runs in, or on the "
                         "sequences beside it?")
    with tempfile.TemporaryDirectory() as t:
        cut = Path(t) / "cut"
        subprocess.run([sys.executable, "-m", "kernjax", "cut", "--model", args.model, "--at",
                        str(cfg.layers // 2), "--chunk", str(args.chunk), "--seqs", str(SEQS),
                        "--context", str(CONTEXT), "--pages", str(n * per_seq + 1), "--decode",
                        ",".join(map(str, buckets)), "--out", str(cut)],
                       check=True, stdout=subprocess.DEVNULL)
        art = artifact.read(cut / "whole")
        pipe = Pipeline([Runner(art, load_weights(art, checkpoint_dir(art.manifest["checkpoint"])))])
        rng = np.random.default_rng(0)
        prompts = [rng.integers(1, min(cfg.vocab, 30000), int(k)).astype(np.int32)
                   for k in rng.integers(8, 200, size=n)]
        pages = [tuple(range(1 + i * per_seq, 1 + (i + 1) * per_seq)) for i in range(n)]
        pipe.reset()
        for i, p in enumerate(prompts):
            for a in range(0, len(p) - 1, pipe.shape.rows):
                pipe.run(make_item([Piece(p[a:min(a + pipe.shape.rows, len(p) - 1)], a, pages[i])],
                                   pipe.shape))

        def item_of(idx, program):
            pieces = [Piece(prompts[i][-1:], len(prompts[i]) - 1, pages[i]) for i in idx]
            return make_item(pieces, pipe.programs[program].item)

        def steps(idx, program):
            out = pipe.run(item_of(idx, program), program)
            return {i: {k: np.asarray(out[k])[j] for k in OUTS} for j, i in enumerate(idx)}

        small = f"decode{buckets[0]}"
        seats = {f"decode{b}": b for b in buckets}
        seats.update({"prefill": pipe.programs["prefill"].item.seqs})
        if "score" in pipe.programs:
            seats["score"] = pipe.programs["score"].item.seqs
        alone = {p: {i: steps([i], p)[i] for i in range(n)} for p in seats}
        rep.table("program", "beside", "against", "sequences", "tokens differ", "logprobs differ",
                  "logits differ", "largest |logit diff|", right="lllrrrrr")
        rows, differs, found = [], [], None

        def compare(program, size, against, got):
            ref = alone[against]
            d = {k: sum(got[i][k].tobytes() != ref[i][k].tobytes() for i in got) for k in OUTS}
            big = max(float(np.max(np.abs(got[i]["logits"].astype(np.float32)
                                          - ref[i]["logits"].astype(np.float32)))) for i in got)
            rows.append({"program": program, "beside": size - 1, "against": f"alone in {against}",
                         "sequences": len(got), **d, "max_logit_diff": big})
            rep.row(program, size - 1, f"alone in {against}", len(got), d["next_token"],
                    d["logprob"], d["logits"], f"{big:.3g}")
            return any(d.values())

        # the same call twice; each program alone against the smallest bucket (only M changes);
        # beside others against alone in the same program (only the company changes) and
        # against alone in the smallest bucket (both change, as in serving)
        compare(small, 1, small, {i: steps([i], small)[i] for i in range(n)})
        for program, seqs in seats.items():
            if program != small:
                compare(program, 1, small, alone[program])
            for size in sorted({min(seqs, n), min(seqs, n) // 2}):
                if size > 1:
                    idx = [int(i) for i in rng.permutation(n)[:size]]
                    got = steps(idx, program)
                    part = compare(program, size, program, got)
                    if (program != small and compare(program, size, small, got)) or part:
                        differs.append((program, idx))
        if args.locate:
            traced = artifact.programs(fam, cfg, dtype=art.manifest["dtype"], rows=args.chunk,
                                       seqs=SEQS, context=CONTEXT, pages=n * per_seq + 1,
                                       decode=buckets)
            found = locate(traced, pipe.runners[0], item_of, small, differs, rep)
    same = all(r[k] == 0 for r in rows for k in OUTS)
    rep.note("every step the same bits in every company" if same else
             "some steps differ with their company (above)")
    rep.write(harness.out_dir("invariance", args.out), rows=rows, model=args.model,
              chunk=args.chunk, buckets=buckets, same=same, located=found)
    print("PASS: batch invariant" if same else "FAIL: not batch invariant")


if __name__ == "__main__":
    main()
