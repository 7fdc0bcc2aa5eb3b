"""Hugging Face goldens for scoring and generation (`tests/test_goldens_generate.py`).

Runs transformers' `Qwen3ForCausalLM` (float32, eager attention) on a checkpoint over the prompts
of `experiments/hf_goldens.py` and writes, per prompt: every row's float32 `log_softmax`
log-probability of the prompt's next token and its top-5 ids (what a scoring request answers),
and the greedy continuation of `--new` tokens from `model.generate` (do_sample off), with each
generated token's log-probability and the margin between its top two logits (a margin near 0 is
where two implementations may rightly pick different tokens). It records the checkpoint's
safetensors hashes and the versions, as `hf_goldens.py` does.

Runs under a Python with torch and transformers (a separate venv, as `hf_goldens.py` says):

  kernjax weights random --model qwen3-tiny --seed 0 --dtype float32 --out CKPT_DIR
  torchvenv/bin/python -m experiments.hf_generate_goldens --checkpoint CKPT_DIR \\
      --out tests/goldens/qwen3_tiny_f32_hf_generate.npz
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
from transformers import Qwen3ForCausalLM

from experiments.hf_goldens import LENGTHS, PROMPT_SEED, prompts, save, sha256s

NEW = 16


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", required=True, help="a Hugging Face checkpoint directory")
    ap.add_argument("--out", required=True, help="the .npz file to write")
    ap.add_argument("--new", type=int, default=NEW, help="tokens to generate per prompt")
    args = ap.parse_args()
    ckpt = Path(args.checkpoint)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM.from_pretrained(ckpt, dtype=torch.float32,
                                             attn_implementation="eager")
    model.eval()
    out = {"lengths": np.asarray(LENGTHS, np.int32), "prompt_seed": np.int64(PROMPT_SEED),
           "new": np.int32(args.new)}
    for k, toks in enumerate(prompts(model.config.vocab_size)):
        ids = torch.as_tensor(toks[None].astype(np.int64))
        with torch.no_grad():
            lp = torch.log_softmax(model(ids).logits[0].to(torch.float32), dim=-1).numpy()
            gen = model.generate(ids, attention_mask=torch.ones_like(ids),
                                 max_new_tokens=args.new, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
        rows = np.arange(len(toks) - 1)
        out[f"tokens_{k}"] = toks
        out[f"scores_{k}"] = lp[rows, toks[1:]].astype(np.float32)
        out[f"top5_{k}"] = np.argsort(-lp[:-1], axis=-1, kind="stable")[:, :5].astype(np.int32)
        made = gen.sequences[0, len(toks):].numpy().astype(np.int32)
        logits = torch.stack(gen.logits)[:, 0].to(torch.float32)
        glp = torch.log_softmax(logits, dim=-1).numpy()
        top2 = np.sort(logits.numpy(), axis=-1)[:, -2:]
        out[f"generated_{k}"] = made
        out[f"generated_logprobs_{k}"] = glp[np.arange(len(made)), made].astype(np.float32)
        out[f"margin_{k}"] = (top2[:, 1] - top2[:, 0]).astype(np.float32)
        print(f"prompt {k}: {len(toks)} tokens; generated {made.tolist()}; least margin "
              f"{out[f'margin_{k}'].min():.3g}")
    out["checkpoint_sha256"] = np.asarray(json.dumps(sha256s(ckpt), sort_keys=True))
    save(out, args.out)


if __name__ == "__main__":
    main()
