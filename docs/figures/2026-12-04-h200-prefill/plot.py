"""Redraws mfu.png beside this file from data.json: MFU per (system, prompt, chunk), one bar
each, drawn by experiments/harness.py (`mfu_bars`). The data: `git show
results:experiments/results/2026-12-04-h200-prefill/results.json`.

    python docs/figures/2026-12-04-h200-prefill/plot.py
"""

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2]))  # the repository's root, for experiments.harness
from experiments import harness  # noqa: E402

data = json.loads((HERE / "data.json").read_text())
title = f"prefill {data['model']} on {data['gpu']}, commit {data['commit']} ({data['date']})"
systems = ["kernjax", "kernjax-2stages", "kernjax-unconstrained", "jax-plain", "transformers"]
harness.mfu_bars(data["rows"], HERE / "mfu.png", title, data.get("peak_flops", harness.PEAK),
                 systems)
