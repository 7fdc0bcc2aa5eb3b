"""A kept run as a figure the docs can cite: `docs/figures/<name>/` with its data and its plot.

Takes a results directory's name on the `results` branch (`experiments/results/<name>/`, the
runs kept; experiments/README.md) and writes, from `git show results:...`, its `results.json` as
`data.json` and its `README.md`, then `plot.py`, a script that redraws `mfu.png` from `data.json`
with the harness's plotting (`harness.mfu_bars`: a bar of MFU per system in a group per (prompt,
chunk), as a prefill run's rows give them), and runs it once. A run whose rows carry no MFU
gets its data and README, no plot. Nothing else of the branch is read; the figure's files are
plain ones, to commit.

    python -m experiments.figures 2026-12-04-h200-prefill
    python docs/figures/2026-12-04-h200-prefill/plot.py      # redraw after editing it
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from experiments import harness

PLOT = '''"""Redraws mfu.png beside this file from data.json: MFU per (system, prompt, chunk), one
bar each, drawn by experiments/harness.py (`mfu_bars`). The data: `git show
{branch}:experiments/results/{name}/results.json`.

    python docs/figures/{figure}/plot.py
"""

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2]))  # the repository's root, for experiments.harness
from experiments import harness  # noqa: E402

data = json.loads((HERE / "data.json").read_text())
title = (f"prefill {{data['model']}} on {{data['gpu']}}, commit {{data['commit']}} "
         f"({{data['date']}})")
systems = ["kernjax", "kernjax-2stages", "kernjax-unconstrained", "jax-plain", "transformers"]
harness.mfu_bars(data["rows"], HERE / "mfu.png", title, data.get("peak_flops", harness.PEAK),
                 systems)
'''


def show(branch: str, path: str) -> str:
    """A file's text at `branch`; a ValueError says what is missing."""
    r = subprocess.run(["git", "-C", str(harness.REPO), "show", f"{branch}:{path}"],
                       capture_output=True, text=True)
    if r.returncode:
        raise ValueError(f"`{path}` is not on branch `{branch}`: {r.stderr.strip()}")
    return r.stdout


def figure(name: str, *, branch: str = "results", out: Path | None = None) -> Path:
    """Writes `docs/figures/<name>/` (or `out`) from the run `name` on `branch`; its path."""
    src = f"experiments/results/{name}"
    data = json.loads(show(branch, f"{src}/results.json"))
    dest = out or harness.REPO / "docs" / "figures" / name.replace("/", "-")
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "data.json").write_text(json.dumps(data, indent=1) + "\n")
    try:
        (dest / "README.md").write_text(show(branch, f"{src}/README.md"))
    except ValueError as e:
        harness.say(f"{e}; no README.md")
    rows = data.get("rows") if isinstance(data, dict) else None
    if not rows or not all({"system", "prompt", "chunk", "mfu"} <= set(r) for r in rows):
        harness.say(f"{name}: its rows carry no MFU per (system, prompt, chunk): no plot.py")
        return dest
    (dest / "plot.py").write_text(PLOT.format(branch=branch, name=name, figure=dest.name))
    subprocess.run([sys.executable, str(dest / "plot.py")], check=True)
    return dest


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("name", help="a directory of experiments/results/ on the branch, e.g. "
                    "2026-12-04-h200-prefill")
    ap.add_argument("--branch", default="results", help="the branch holding the runs")
    ap.add_argument("--out", default=None, help="default docs/figures/<name>/")
    a = ap.parse_args(argv)
    try:
        dest = figure(a.name, branch=a.branch, out=a.out and Path(a.out))
    except ValueError as e:
        ap.error(str(e))
    where = dest.relative_to(harness.REPO) if dest.is_relative_to(harness.REPO) else dest
    harness.say(f"wrote {where}: {', '.join(sorted(p.name for p in dest.iterdir()))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
