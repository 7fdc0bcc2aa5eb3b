"""Whether a decode step's bits depend on its company, program by program, and where they part.

A whole cut with its prefill chunk, score chunk and decode buckets; `--sequences` prompts
prefilled; then each sequence's step (its prompt's last token) alone in the smallest decode
bucket, against the same step (a) alone in each larger bucket (the GEMMs' M alone changes),
(b) beside others in each bucket, in the prefill chunk and in the score chunk (the item changes
too), and (c) alone again (the same call twice). A row per comparison: how many of the
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3-tiny")
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--decode", default="1,4,16,64")
    ap.add_argument("--sequences", type=int, default=16)
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

        def steps(idx, program):
            pieces = [Piece(prompts[i][-1:], len(prompts[i]) - 1, pages[i]) for i in idx]
            out = pipe.run(make_item(pieces, pipe.programs[program].item), program)
            return {i: {k: np.asarray(out[k])[j] for k in OUTS} for j, i in enumerate(idx)}

        small = f"decode{buckets[0]}"
        alone = {i: steps([i], small)[i] for i in range(n)}
        seats = {f"decode{b}": b for b in buckets}
        seats.update({"prefill": pipe.programs["prefill"].item.seqs})
        if "score" in pipe.programs:
            seats["score"] = pipe.programs["score"].item.seqs
        rep.table("program", "beside", "sequences", "tokens differ", "logprobs differ",
                  "logits differ", "largest |logit diff|", right="llrrrrr")
        rows = []

        def compare(program, size, got):
            d = {k: sum(got[i][k].tobytes() != alone[i][k].tobytes() for i in got) for k in OUTS}
            big = max(float(np.max(np.abs(got[i]["logits"].astype(np.float32)
                                          - alone[i]["logits"].astype(np.float32)))) for i in got)
            rows.append({"program": program, "beside": size - 1, "sequences": len(got), **d,
                         "max_logit_diff": big})
            rep.row(program, size - 1, len(got), d["next_token"], d["logprob"], d["logits"],
                    f"{big:.3g}")

        compare(small + " again", 1, {i: steps([i], small)[i] for i in range(n)})
        for program, seqs in seats.items():
            if program != small:
                compare(program, 1, {i: steps([i], program)[i] for i in range(min(n, 4))})
            for size in sorted({min(seqs, n), min(seqs, n) // 2}):
                if size > 1:
                    idx = [int(i) for i in rng.permutation(n)[:size]]
                    compare(program, size, steps(idx, program))
    same = all(r[k] == 0 for r in rows for k in OUTS)
    rep.note("every step the same bits in every company" if same else
             "some steps differ with their company (above)")
    rep.write(harness.out_dir("invariance", args.out), rows=rows, model=args.model,
              chunk=args.chunk, buckets=buckets, same=same)
    print("PASS: batch invariant" if same else "FAIL: not batch invariant")


if __name__ == "__main__":
    main()
