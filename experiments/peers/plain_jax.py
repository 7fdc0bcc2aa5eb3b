"""jax-plain: a plain JAX Qwen3 prefill, written here as a server without kernjax would write it.

One pass over the whole prompt, no paging, the per-layer KV cache dense (`[S, kv_heads,
head_dim]`) and returned as a server would keep it for decode; attention through
`jax.nn.dot_product_attention(is_causal=True, implementation='cudnn')` (`xla` on the CPU). Only
one-pass rows (chunk >= S): the public `is_causal` mask is top-left aligned (query i sees keys
0..i), so for a later chunk, whose queries sit after the keys already cached, it would hide most
of the context. It reads the same checkpoint names as kernjax's qwen3 family, so both run on one
set of random weights and their last logits are compared.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.harness import one_line, say
from experiments.systems import JaxSystem


def plain_forward(cfg, s: int, dtype, implementation):
    """A plain JAX Qwen3 prefill of one prompt of `s` tokens in one pass, no paging.

    Returns `fn(weights, tokens) -> (token, logits of the last row, [(k, v)] per layer)`, the
    per-layer KV cache dense, `[s, kv_heads, head_dim]`, as a server would keep it for decode.
    """
    L, H, KV, D = cfg.layers, cfg.heads, cfg.kv_heads, cfg.head_dim
    dt = jnp.dtype(dtype)
    inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(0, D, 2, dtype=np.float32) / D))

    def rms(x, w):
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + cfg.eps)
        return w * x32.astype(x.dtype)

    def rope(x, cos, sin):
        x1, x2 = x[..., : D // 2], x[..., D // 2:]
        return x * cos + jnp.concatenate([-x2, x1], axis=-1) * sin

    def fwd(w, tokens):
        f = jnp.arange(s, dtype=jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]
        emb = jnp.concatenate([f, f], axis=-1)
        cos = jnp.cos(emb).astype(dt)[None, :, None, :]
        sin = jnp.sin(emb).astype(dt)[None, :, None, :]
        embed = w["model.embed_tokens.weight"]
        h = embed[tokens][None]  # [1, s, hidden]
        cache = []
        for i in range(L):
            p = f"model.layers.{i}."
            W = lambda n: w[p + n + ".weight"]  # noqa: E731
            a = rms(h, W("input_layernorm"))
            q = (a @ W("self_attn.q_proj").T).reshape(1, s, H, D)
            k = (a @ W("self_attn.k_proj").T).reshape(1, s, KV, D)
            v = (a @ W("self_attn.v_proj").T).reshape(1, s, KV, D)
            q = rope(rms(q, W("self_attn.q_norm")), cos, sin)
            k = rope(rms(k, W("self_attn.k_norm")), cos, sin)
            o = jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                             implementation=implementation)
            h = h + o.reshape(1, s, H * D) @ W("self_attn.o_proj").T
            m = rms(h, W("post_attention_layernorm"))
            g = jax.nn.silu(m @ W("mlp.gate_proj").T) * (m @ W("mlp.up_proj").T)
            h = h + g @ W("mlp.down_proj").T
            cache.append((k[0], v[0]))
        a = rms(h[:, -1], w["model.norm.weight"])
        head = embed if cfg.tied else w["lm_head.weight"]
        logits = a @ head.T
        return jnp.argmax(logits, axis=-1).astype(jnp.int32), logits, cache

    return fwd


class Plain(JaxSystem):
    """`plain_forward` as a system: one program per prompt length, compiled as kernjax's are."""

    def rows_ok(self, s, rows):
        if rows < s:
            return ("one pass only: the public is_causal mask is top-left aligned, wrong for a "
                    "chunk after the first")
        return None

    def context(self, s, rows):
        return s

    def build(self, s, rows, ctx):
        want = self.settings.plain_attention
        impl = want
        if impl == "auto":
            impl = None if jax.default_backend() == "cpu" else "cudnn"
        specs = ({n: jax.ShapeDtypeStruct(x.shape, x.dtype) for n, x in self.weights.items()},
                 jax.ShapeDtypeStruct((s,), jnp.int32))
        dtype = self.settings.dtype
        try:
            fn, times = self._compile(plain_forward(self.cfg, s, dtype, impl), specs, s,
                                      token=(0, 1))
        except Exception as e:  # noqa: BLE001
            if impl != "cudnn" or want != "auto":
                raise
            say(f"[{self.name}] S={s}: cudnn attention failed ({one_line(e)}); using xla")
            self.notes.append(f"jax-plain S={s}: cudnn attention failed to compile "
                              f"({one_line(e)[:200]}); measured with implementation='xla'")
            impl = None
            fn, times = self._compile(plain_forward(self.cfg, s, dtype, impl), specs, s,
                                      token=(0, 1))
        return {"parts": [fn], "shape": None, "state_slots": [], "extra": {},
                "info": {"trace_s": 0.0, "parts": [{"export_s": 0.0, **times}],
                         "attention": impl or "xla"}}

    def make_items(self, entry, s, rows):
        return [jax.device_put(np.asarray(self.tokens[s], np.int32))]

    def prefill(self, h):
        tok, logits, cache = h.parts[0](self.weights, h.items[0])
        self.issued = time.perf_counter()
        value = self._token(tok, (logits, cache))
        del cache
        return value, logits
