"""Whether a decode step's bits depend on the program that runs it or on the rows beside it.

A whole cut with its prefill chunk, score chunk and decode buckets; `--sequences` prompts
prefilled; then each sequence's step (its prompt's last token) alone in the smallest decode
bucket, against the same step (a) alone again (the same call twice), (b) alone in each other
program (only the GEMMs' M changes), (c) beside others in each decode bucket, the prefill chunk
and the score chunk, against alone in that program (only the company changes) and against alone
in the smallest bucket (both change, as in serving). A row per comparison: how many of the
sequences' next tokens, log-probabilities and logits differ, and the largest logit difference.

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


def locate(traced, runner, item_of, small, differs, rep) -> dict | None:
    """For each (program, sequences) beside others, the first call at which a sequence's rows
    (outputs whose first axis is the item's rows or sequences) differ from its rows alone in
    the smallest bucket."""
    import numpy as np
    first = None
    rep.table("program", "beside", "first call that differs", "sequence", "its outputs",
              right="lllll")
    for program, idx in differs:
        calls = by_call(traced[program], runner, item_of(idx, program))
        sh = traced[program].rows, runner.art.programs[program].item.seqs
        alone = {i: dict(by_call(traced[small], runner, item_of([i], small))) for i in idx}
        hit = None
        for c, (name, outs) in enumerate(calls):
            for j, i in enumerate(idx):
                for o, (x, y) in enumerate(zip(outs, alone[i].get(name, ()))):
                    if not (x.ndim and y.ndim and x.shape[0] in sh and y.shape[0] in (1, 2)):
                        continue
                    if np.asarray(x[j]).tobytes() != np.asarray(y[0]).tobytes():
                        hit = {"program": program, "beside": len(idx) - 1, "call": c,
                               "name": name, "sequence": i, "output": o,
                               "shape": list(x.shape)}
                        break
                if hit:
                    break
            if hit:
                break
        rep.row(program, len(idx) - 1, f"{hit['call']} `{hit['name']}`" if hit else "none",
                hit["sequence"] if hit else "", f"output {hit['output']} {hit['shape']}"
                if hit else "")
        first = first or hit
    return first


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3-tiny")
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--decode", default="1,4,16,64")
    ap.add_argument("--sequences", type=int, default=16)
    ap.add_argument("--locate", action="store_true",
                    help="evaluate each program beside others call by call against the smallest "
                         "bucket alone: the first call whose output rows differ")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import numpy as np

    from kernjax import artifact, models
    from kernjax.core.item import Piece, make_item
    from kernjax.runtime.pipeline import Pipeline
    from kernjax.runtime.runner import Runner, checkpoint_dir, load_weights

    fam, cfg = models.named(args.model)
    page, n = fam.page(cfg), args.sequences
    per_seq = -(-256 // page)
    buckets = sorted({int(b) for b in args.decode.split(",")})
    rep = harness.Report(f"Batch invariance of a decode step, {args.model}",
                         "Does a decode step's output depend on the bucket it runs in, or on the "
                         "sequences beside it?")
    with tempfile.TemporaryDirectory() as t:
        cut = Path(t) / "cut"
        subprocess.run([sys.executable, "-m", "kernjax", "cut", "--model", args.model, "--at",
                        str(cfg.layers // 2), "--chunk", str(args.chunk), "--seqs", "4",
                        "--context", "256", "--pages", str(n * per_seq + 1), "--decode",
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
                    compare(program, size, program, got)
                    if program != small:
                        compare(program, size, small, got)
                    differs.append((program, idx))
        if args.locate:
            traced = artifact.programs(fam, cfg, dtype=art.manifest["dtype"], rows=args.chunk,
                                       seqs=4, context=256, pages=n * per_seq + 1,
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
