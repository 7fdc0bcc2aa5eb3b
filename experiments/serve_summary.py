"""The two-GPU serving results of issue 8 from `experiments/load.py` runs: one `results.json` with
`{"gpu", "date", "commit", "transport", "rows": [{"config", "metric", "value"}]}` and a README.

Each `--run KIND=DIR` names a load.py output directory:

  ttft        one prompt at a time (`--concurrency 1`, one prompt length): `ttft_ratio` = the
              2-stage pipeline's median time to first token over the whole program's
  throughput  packed prefill at several concurrencies: `throughput_ratio` at each, prompt
              tokens/s of 2 stages over whole
  unpacked    the same prompts cut with `--seqs 1` (one sequence per item) and the packed cut's
              pages (as many sequences live): `packed_gain` at each concurrency, the packed
              2-stage tokens/s over the unpacked ones, minus 1
  one_slot    the throughput run's prompts with `--edge_slots 1`: `slot_gain` at each concurrency
              both have, the 2-stage tokens/s with the throughput run's slots per edge over one
              slot, minus 1 (what running ahead of the next stage buys)

Every run must have answered every request with the whole program's token (load.py's `failures`
and `mismatches`); a run that did not is reported and its rows are left out.

Each `--transfer FILE` is an `experiments/transfer.py --out` file: `transfer_us` (time per item over
the edge), `link_bound_us` (its bytes over the link's bandwidth) and, with a throughput run,
`transfer_share`: that time over the 2-stage pipeline's item period (the slower stage's median
period at the run's highest concurrency, from its `timeline-cN.txt`).

    python -m experiments.serve_summary --run ttft=out/ttft-ipc --run throughput=out/serve2-ipc \\
        --run unpacked=out/serve2-ipc-seqs1 --transfer out/transfer-ipc.json \\
        --gpu "2x NVIDIA H200" --out results/2026-12-01-h200x2-serve
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

from experiments import harness


def load(d: Path) -> dict:
    data = json.loads((d / "results.json").read_text())
    bad = len(data.get("failures", [])) + len(data.get("mismatches", []))
    return {"rows": data["rows"], "meta": data.get("meta", {}), "bad": bad}


def item_period_ms(d: Path) -> float | None:
    """The slower stage's median item period at the run's highest concurrency (its
    `timeline-cN.txt`, `kernjax timeline`'s report), or None."""
    reports = sorted(d.glob("timeline-c*.txt"), key=lambda p: int(p.stem.split("-c")[-1]))
    if not reports:
        return None
    periods, table = [], False
    for line in reports[-1].read_text().splitlines():
        if line.startswith("stage  items  period"):
            table = True
        elif table and line.split() and line.split()[0].isdigit():
            periods.append(float(line.split()[2]))
        elif table:
            break
    return max(periods) if periods else None


def transfer_rows(files: list[Path], period_ms: float | None) -> list[dict]:
    out = []
    for f in files:
        t = json.loads(f.read_text())
        cfg = f"transfer {t['transport']}, {t['bytes_per_item']} B per item"
        if not t.get("check", False):
            out.append({"config": cfg, "metric": "transfer_check_failed", "value": 1.0})
            continue
        out.append({"config": cfg, "metric": "transfer_us", "value": round(t["us_per_item"], 3)})
        out.append({"config": cfg, "metric": "link_bound_us",
                    "value": round(t["link_bound_us"], 3)})
        if period_ms:
            out.append({"config": cfg + f", item period {period_ms:.3f} ms",
                        "metric": "transfer_share",
                        "value": round(t["us_per_item"] / (period_ms * 1e3), 4)})
    return out


KINDS = ("ttft", "throughput", "unpacked", "one_slot")


def rows_of(runs: dict) -> tuple[list[dict], list[str]]:
    out, notes = [], []
    by = {k: {(r["config"], r["concurrency"]): r for r in v["rows"]} for k, v in runs.items()}
    for k, v in runs.items():
        if v["bad"]:
            notes.append(f"{k}: {v['bad']} failed or mismatched requests; its rows are left out")
    ok = {k for k, v in runs.items() if not v["bad"]}
    if "ttft" in ok:
        argv = runs["ttft"]["meta"].get("argv", [])
        lens = argv[argv.index("--prompt_len") + 1] if "--prompt_len" in argv[:-1] else "?"
        cs = sorted({c for _, c in by["ttft"]})
        for c in cs:
            w, s = by["ttft"].get(("whole", c)), by["ttft"].get(("2 stages", c))
            if w and s:
                out.append({"config": f"prompts of {lens} tokens, concurrency {c}",
                            "metric": "ttft_ratio",
                            "value": round(s["ttft_p50_ms"] / w["ttft_p50_ms"], 4),
                            "whole_ms": w["ttft_p50_ms"], "stages_ms": s["ttft_p50_ms"]})
    if "throughput" in ok:
        for (config, c), s in sorted(by["throughput"].items()):
            w = by["throughput"].get(("whole", c))
            if config == "2 stages" and w:
                out.append({"config": f"packed, concurrency {c}", "metric": "throughput_ratio",
                            "value": round(s["prompt_tok_s"] / w["prompt_tok_s"], 4),
                            "whole_tok_s": w["prompt_tok_s"], "stages_tok_s": s["prompt_tok_s"]})
                u = by.get("unpacked", {}).get(("2 stages", c)) if "unpacked" in ok else None
                if u:
                    out.append({"config": f"2 stages, concurrency {c}", "metric": "packed_gain",
                                "value": round(s["prompt_tok_s"] / u["prompt_tok_s"] - 1, 4),
                                "packed_tok_s": s["prompt_tok_s"],
                                "unpacked_tok_s": u["prompt_tok_s"]})
                o = by.get("one_slot", {}).get(("2 stages", c)) if "one_slot" in ok else None
                if o:
                    n = runs["throughput"]["meta"].get("edge_slots")
                    out.append({"config": f"2 stages, concurrency {c}, {n} slots against 1",
                                "metric": "slot_gain",
                                "value": round(s["prompt_tok_s"] / o["prompt_tok_s"] - 1, 4),
                                "slots": n, "tok_s": s["prompt_tok_s"],
                                "one_slot_tok_s": o["prompt_tok_s"]})
    return out, notes


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", action="append", default=[], help="KIND=DIR (ttft, throughput, "
                    "unpacked, one_slot)")
    ap.add_argument("--transfer", action="append", default=[], type=Path,
                    help="an experiments/transfer.py --out file (repeatable)")
    ap.add_argument("--gpu", default="", help="the machine, in words")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    runs, dirs = {}, {}
    for r in a.run:
        kind, _, d = r.partition("=")
        if kind not in KINDS or not d:
            ap.error(f"--run {r!r}: give KIND=DIR with KIND one of {', '.join(KINDS)}")
        runs[kind], dirs[kind] = load(Path(d)), Path(d)
    transports = {v["meta"].get("transport", "host") for v in runs.values()}
    if len(transports) > 1:
        ap.error(f"the runs used different transports {sorted(transports)}: one summary each")
    rows, notes = rows_of(runs)
    rows += transfer_rows(a.transfer, item_period_ms(dirs["throughput"])
                          if "throughput" in dirs else None)
    # the device copy's git may name an older commit than its tree: gpu_gate.sh passes the tree's
    commit, _ = harness.git_commit()
    res = {"gpu": a.gpu, "date": datetime.date.today().isoformat(), "commit": commit,
           "transport": transports.pop() if transports else None, "rows": rows, "notes": notes,
           "runs": {k: v["meta"] for k, v in runs.items()}}
    lines = [f"# Two stages against the whole program, transport `{res['transport']}`", "",
             f"- Machine: {a.gpu or '?'}; date {res['date']}; commit `{commit}`.",
             "- Made by `experiments/serve_summary.py` from `experiments/load.py` runs:", ""]
    lines += [f"  - {k}: `{' '.join(v['meta'].get('argv', []))}`" for k, v in runs.items()]
    lines += ["", "| config | metric | value |", "|---|---|---:|"]
    lines += [f"| {r['config']} | {r['metric']} | {r['value']:.4f} |" for r in rows]
    lines += [f"- transfer: `{f}`" for f in a.transfer]
    lines += [""] + [f"- {n}" for n in notes]
    harness.write(Path(a.out), res, "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 1 if notes else 0


if __name__ == "__main__":
    raise SystemExit(main())
