"""transformers: Hugging Face's `Qwen3ForCausalLM` on torch, as most servers' prefill runs.

Random init (its own weights, seeded: not the JAX systems', so its logits are not compared),
bf16, sdpa attention, under `torch.inference_mode()`. A chunk is one forward with the cache
(`DynamicCache`, made by the first chunk) carried, logits of the last row only; the clock stops
after `torch.cuda.synchronize()`. The benchmark runs it last and frees it after, so JAX never
gives memory back to torch. Needs torch and transformers (not kernjax's dependencies): without
them `Transformers(...)` raises ImportError and the benchmark notes the system skipped.
"""

from __future__ import annotations

import gc
import inspect
import time

import numpy as np

from experiments.harness import say
from kernjax.core.item import chunks


class Transformers:
    """`Qwen3ForCausalLM` with random init, bf16, sdpa attention, a DynamicCache across chunks."""

    torch = True

    def __init__(self, name, fam, cfg, settings, tokens):
        import torch
        import transformers
        from transformers import Qwen3Config, Qwen3ForCausalLM
        self.name, self.cfg, self.settings, self.torch_mod = name, cfg, settings, torch
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.device == "cpu":
            say("[transformers] torch sees no CUDA device: running on the CPU")
        kw = dict(vocab_size=cfg.vocab, hidden_size=cfg.hidden,
                  intermediate_size=cfg.intermediate, num_hidden_layers=cfg.layers,
                  num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads,
                  head_dim=cfg.head_dim, rms_norm_eps=cfg.eps, tie_word_embeddings=cfg.tied,
                  max_position_embeddings=cfg.max_positions, attention_bias=False,
                  use_sliding_window=False, use_cache=True, attn_implementation="sdpa")
        try:
            config = Qwen3Config(rope_theta=cfg.rope_theta, **kw)
        except TypeError:  # a transformers that takes rope_parameters only
            config = Qwen3Config(**kw)
        t0 = time.perf_counter()
        torch.manual_seed(0)
        dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[settings.dtype]
        prev = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device(self.device):
                model = Qwen3ForCausalLM(config)
        finally:
            torch.set_default_dtype(prev)
        self.model = model.to(device=self.device, dtype=dtype).eval()
        self.attn = getattr(self.model.config, "_attn_implementation", "?")
        params = inspect.signature(self.model.forward).parameters
        self.keep = next((k for k in ("logits_to_keep", "num_logits_to_keep") if k in params), None)
        # transformers 5 renames the cache argument and output `past_key_values` to `cache`.
        self.cache_kw = "cache" if "cache" in params else "past_key_values"
        self.versions = {"torch": torch.__version__, "transformers": transformers.__version__,
                         "attn_implementation": self.attn, "logits_arg": self.keep or "lm_head",
                         "cache_arg": self.cache_kw}
        say(f"[transformers] torch {torch.__version__}, transformers {transformers.__version__}, "
            f"device {self.device}, attn_implementation {self.attn}, cache argument "
            f"`{self.cache_kw}`, logits `{self.keep or 'lm_head'}`, "
            f"{sum(p.numel() for p in self.model.parameters()) / 1e6:.1f} M parameters, "
            f"built in {time.perf_counter() - t0:.1f} s")
        self.tokens = {s: torch.as_tensor(np.asarray(t, np.int64), device=self.device)[None]
                       for s, t in tokens.items()}
        self.cache = {}
        self.issued = self.done = None

    def rows_ok(self, s, rows):
        return None

    def has(self, s, rows):
        return True

    def context(self, s, rows):
        return s

    def prepare(self, s, rows):
        key = (s, rows)
        first = key not in self.cache
        self.cache[key] = True
        return key, ({"trace_s": 0.0, "parts": [{"export_s": 0.0, "lower_s": 0.0, "xla_s": 0.0}]}
                     if first else None)

    def reset(self, h):
        pass

    def _sync(self):
        if self.device == "cuda":
            self.torch_mod.cuda.synchronize()

    def prefill(self, h):
        torch = self.torch_mod
        s, rows = h
        ids = self.tokens[s]
        with torch.inference_mode():
            cache = None
            for a, b in chunks(s, rows):
                kw = {self.cache_kw: cache, "use_cache": True}
                if self.keep:
                    out = self.model(input_ids=ids[:, a:b], **kw, **{self.keep: 1})
                    logits = out.logits[:, -1]
                else:
                    out = self.model.model(input_ids=ids[:, a:b], **kw)
                    logits = self.model.lm_head(out.last_hidden_state[:, -1])
                cache = getattr(out, self.cache_kw, None)
                if cache is None and b < s:
                    raise RuntimeError(f"the model returned no `{self.cache_kw}` to carry")
            tok = logits.argmax(-1)
            self._sync()
            return int(tok.reshape(-1)[0].item()), logits

    def to_numpy(self, logits):
        return logits.float().cpu().numpy().reshape(-1)

    def close(self):
        torch = self.torch_mod
        del self.model
        self.tokens.clear()
        gc.collect()
        if self.device == "cuda":
            torch.cuda.empty_cache()
