"""Discipline checks by contract: each part of the house within its size budget, and no model
knowledge outside the model families and the kernels written for their calls."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Lines per part (2026-12-06, at the layout by contract, plus ~10 % room); a part that grows past
# its budget says so here, with the reason, in the commit that grows it.
# 2026-12-07, scoring and generation: kernels/ +head.py and reduce.py (the programs' head: logits
# in slices, scores, sampling; row sums in a fixed order), serve/ +api.py (OpenAI's fields and
# answers) and the head's sequences, cli/ `run --max_tokens`, the artifact's program set.
BUDGETS = {
    "kernjax/core/*.py": 1600,  # trace, cut, item, pool, pack, batch, staging plan, lowering, family
    "kernjax/kernels/*.py": 2650,  # one wrapper per csrc/ op and the GPU kernels, beside their refs
    "kernjax/runtime/*.py": 1250,  # the only code that touches a device
    "kernjax/serve/*.py": 2800,  # the head, the API, HTTP, the wire, the stage process, the timeline
    "kernjax/cli/*.py": 1150,  # the shells
    "kernjax/*.py": 1100,  # the artifact, checkpoints, the package's own
    "csrc/*": 2190,  # the FFI handlers (csrc/fa3/glue.cu, compiled only against FA3, is apart)
}


def _lines(pattern: str) -> int:
    return sum(len(p.read_text().splitlines()) for p in ROOT.glob(pattern) if p.is_file())


def test_each_part_is_within_its_budget():
    over = {part: n for part, limit in BUDGETS.items() if (n := _lines(part)) >= limit}
    assert not over, f"over budget: {over} (budgets {BUDGETS})"


def test_kernjax_holds_no_model_knowledge():
    """A model name, an HF weight name or a layer path in kernjax/ (but kernels/, whose kernels
    are written for a family's calls) means the design is wrong."""
    bad = re.compile(r"qwen|layers\.|embed_tokens|self_attn|mlp\.|lm_head\.weight", re.I)
    hits = [f"{p.relative_to(ROOT)}:{k}: {line.strip()}"
            for p in sorted(ROOT.glob("kernjax/**/*.py")) if "kernels" not in p.parts
            for k, line in enumerate(p.read_text().splitlines(), 1) if bad.search(line)]
    assert not hits, "model knowledge in kernjax/:\n" + "\n".join(hits)
