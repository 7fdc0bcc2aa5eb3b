"""Hugging Face goldens for the parity tests (`tests/test_parity.py`, `tests/test_gqa.py`).

Runs transformers' `Qwen3ForCausalLM` (float32, eager attention) on a checkpoint over fixed
prompts and writes, per prompt, the token ids and the logits (float32) and argmax at every
position `p` with `(p + 1) % 16 == 0` (the last row of every chunk of 16, 32, 64, ... rows) and at
the prompt's last position. It also records the sha256 of every safetensors file of the checkpoint
(the test regenerates the random checkpoint and checks it is byte-identical), the checkpoint's
`config.json` (for a random one, its model name and seed as `_name` and `_seed`) and the
transformers/torch versions that made the goldens.

Runs under a Python with torch and transformers, which kernjax itself does not need; a separate
venv keeps them apart. To regenerate `tests/goldens/qwen3_tiny_f32_hf.npz`:

  # 1. In the kernjax venv (from the repository root):
  kernjax weights random --model qwen3-tiny --seed 0 --dtype float32 --out CKPT_DIR
  # 2. In a venv with torch and transformers (made with Python 3.11):
  python -m venv torchvenv
  torchvenv/bin/pip install torch==2.13.0 transformers safetensors numpy
  torchvenv/bin/python -m experiments.hf_goldens --checkpoint CKPT_DIR \\
      --out tests/goldens/qwen3_tiny_f32_hf.npz

The committed goldens were made with exactly those commands (CKPT_DIR a temporary directory),
with torch 2.13.0 (CPU) and transformers 5.24.0.

The GQA goldens (`tests/goldens/qwen3_tiny_gqa3_f32_hf.npz`, `..._gqa5_...`: 6 heads over 2 and
10 over 2, `models/qwen3.py` CONFIGS) the same way, with `--model qwen3-tiny-gqa3` (`-gqa5`) in
step 1 and the matching `--out` in step 2; they were made with torch 2.13.0 (CPU, Python 3.11)
and transformers 5.25.0, which each file records.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import Qwen3ForCausalLM

# Prompt lengths, and the seed of the numpy generator that draws their token ids.
LENGTHS = (1, 7, 33, 100, 150)
PROMPT_SEED = 1234
# Logits are kept at the last row of every chunk of a multiple of this many rows.
EVERY = 16


def prompts(vocab: int) -> list[np.ndarray]:
    """The fixed prompts: token ids drawn uniformly from the vocabulary, one generator for all."""
    rng = np.random.default_rng(PROMPT_SEED)
    return [rng.integers(0, vocab, size=n, dtype=np.int64).astype(np.int32) for n in LENGTHS]


def kept_positions(n: int) -> np.ndarray:
    """Positions whose logits are kept for a prompt of `n` tokens."""
    return np.asarray(sorted({p for p in range(n) if (p + 1) % EVERY == 0} | {n - 1}), np.int32)


def sha256s(ckpt: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(ckpt.glob("*.safetensors"))}


def save(out: dict, path: str) -> None:
    """Writes the goldens `out` to `path` (.npz) with the versions that made them."""
    out["versions"] = np.asarray(json.dumps({"transformers": transformers.__version__,
                                             "torch": torch.__version__,
                                             "numpy": np.__version__}, sort_keys=True))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(path, **out)
    print(f"wrote {path} ({Path(path).stat().st_size} bytes)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", required=True, help="a Hugging Face checkpoint directory")
    ap.add_argument("--out", required=True, help="the .npz file to write")
    args = ap.parse_args()
    ckpt = Path(args.checkpoint)

    torch.manual_seed(0)
    model, info = Qwen3ForCausalLM.from_pretrained(
        ckpt, dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    model.eval()
    bad = {k: v for k, v in info.items() if v and k != "missing_keys"}
    missing = [k for k in info.get("missing_keys", ()) if k != "lm_head.weight"]
    if bad or missing:
        raise SystemExit(f"the checkpoint does not load cleanly into Qwen3ForCausalLM: {info}")
    cfg = json.loads((ckpt / "config.json").read_text())
    if cfg.get("tie_word_embeddings"):
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr(), \
            "lm_head is not tied to the embedding"
    theta = (getattr(model.config, "rope_parameters", None) or {}).get(
        "rope_theta", getattr(model.config, "rope_theta", None))
    assert theta == cfg["rope_theta"], \
        f"transformers read rope_theta {theta}, not {cfg['rope_theta']}"

    out = {"lengths": np.asarray(LENGTHS, np.int32), "prompt_seed": np.int64(PROMPT_SEED)}
    for k, toks in enumerate(prompts(model.config.vocab_size)):
        with torch.no_grad():
            logits = model(torch.as_tensor(toks[None].astype(np.int64))).logits[0]
        logits = logits.to(torch.float32).numpy()
        pos = kept_positions(len(toks))
        out[f"tokens_{k}"] = toks
        out[f"positions_{k}"] = pos
        out[f"logits_{k}"] = logits[pos].astype(np.float32)
        out[f"argmax_{k}"] = logits[pos].argmax(-1).astype(np.int32)
        print(f"prompt {k}: {len(toks)} tokens, kept {len(pos)} rows, last argmax "
              f"{int(out[f'argmax_{k}'][-1])}")
    out["checkpoint_sha256"] = np.asarray(json.dumps(sha256s(ckpt), sort_keys=True))
    out["config"] = np.asarray(json.dumps(cfg, sort_keys=True))
    save(out, args.out)


if __name__ == "__main__":
    main()
