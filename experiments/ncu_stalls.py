"""Where a kernel's warps wait, from Nsight Compute's source page (`gpu_gate.sh ncu` writes it as
logs/ncu-source.csv): the stall samples of the hottest loop body by instruction kind, and the
waits (wgmma, named barriers, mbarriers) anywhere in the kernel.

The hottest loop body is the set of instructions executed most often (every instruction of a
loop body runs the same number of times); a share is of the samples in that body.

    python -m experiments.ncu_stalls logs/ncu-source.csv
"""

from __future__ import annotations

import argparse
import collections
import csv

WAITS = ("DEPBAR", "BAR.SYNC", "BAR.ARV", "TRYWAIT")


def read(path: str) -> tuple[list[str], list[list[str]]]:
    rows = list(csv.reader(open(path)))
    header = next(i for i, r in enumerate(rows) if "Address" in r and "Source" in r)
    return rows[header], [r for r in rows[header + 1:] if len(r) == len(rows[header])]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv", help="Nsight Compute's source page as CSV (--page source --csv)")
    ap.add_argument("--top", type=int, default=14, help="instruction kinds to print")
    args = ap.parse_args(argv)
    head, rows = read(args.csv)
    col = {h: i for i, h in enumerate(head)}
    ex, samples = col["Instructions Executed"], col["Warp Stall Sampling (All Samples)"]
    reasons = [h for h in head if h.startswith("stall_") and "Not Issued" not in h]
    count = lambda r, c: int(r[c] or 0)  # noqa: E731
    kind = lambda r: r[1].split()[1 if r[1].split()[0].startswith("@") else 0]  # noqa: E731

    runs = collections.Counter(count(r, ex) for r in rows)
    hot = max(n for n, k in runs.items() if k >= 50)
    body = [r for r in rows if count(r, ex) == hot]
    total = sum(count(r, samples) for r in rows)
    in_body = sum(count(r, samples) for r in body)
    print(f"{total} samples; the hottest loop body: {len(body)} instructions run {hot} times "
          f"each, {in_body} samples ({100 * in_body / max(total, 1):.1f} %)\n")
    by_kind, n_kind = collections.Counter(), collections.Counter()
    why = collections.defaultdict(collections.Counter)
    for r in body:
        by_kind[kind(r)] += count(r, samples)
        n_kind[kind(r)] += 1
        for s in reasons:
            why[kind(r)][s.removeprefix("stall_")] += count(r, col[s])
    print("| instruction | in the body | samples | share % | main reasons |\n|---|---:|---:|---:|---|")
    for k, v in by_kind.most_common(args.top):
        top = ", ".join(f"{s} {n}" for s, n in why[k].most_common(2))
        print(f"| {k} | {n_kind[k]} | {v} | {100 * v / max(in_body, 1):.1f} | {top} |")
    print("\nwaits with over 100 samples (address, instruction, times run, samples):")
    for r in rows:
        if any(w in r[1] for w in WAITS) and count(r, samples) > 100:
            print(f"  {r[0][-5:]}  {r[1].strip()[:48]:48}  {count(r, ex):>7}  {count(r, samples):>6}")


if __name__ == "__main__":
    main()
