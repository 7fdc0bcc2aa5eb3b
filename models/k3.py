"""k3-mini: a Kimi-Linear / Kimi-K3-shaped hybrid (KDA + MLA + MXFP4 MoE) as a program of calls.

The structure of Kimi Linear (`../shared/reference/models.md` §2-§4) at small size:

- **Layers.** KDA everywhere but `mla_layers` (0-indexed; Kimi Linear: 3 KDA to 1 MLA, the last
  layer MLA). Layers `< dense_layers` have a dense SiLU MLP, the rest a MoE.
- **KDA layer** (§2.1): q/k/v projections; a depthwise causal conv of width `conv` with SiLU per
  stream, restarting at every sequence and continued across chunks from the sequence's conv tail;
  q and k L2-normed per head (float32); the decay `g = -exp(A_log) * softplus(f_b(f_a(x)) +
  dt_bias)` per channel; `beta = sigmoid(b_proj(x))`; the gated delta rule (`kernjax/kernels/kda.py`,
  chunked WY/UT form, chunk 64) from the sequence's recurrent state; `RMSNorm(o) * w *
  sigmoid(g_b(g_a(x)))`; o_proj.
- **MLA layer** (§3.2, NoPE): `models/mla.py` over a paged latent `[c_kv | k_pe]`.
- **MoE** (§3.3): sigmoid router with correction bias, top-k, renormalized and scaled by
  `routed_scale`, plus one shared expert (`models/moe.py`). Routed experts are checkpointed in
  MXFP4 (`...experts.{e}.w{1,2,3}.weight_packed` / `weight_scale`, the compressed-tensors
  names) and the program reads them in the GEMM shuffle layout (`mxfp4.shuffle`), which a
  derive program makes at load (`derived`; `kernjax/runtime/derive.py`).

**States.** Per MLA layer `kv.{i}` `[pages, 16, kv_lora + rope]` (paged, listed first); per KDA
layer `conv.{i}` `[slots, conv - 1, 3·H·K]` (the last inputs of q, k, v before the chunk) and
`kda.{i}` `[slots, H, K, V]` float32, one slot per live sequence (`models/seqstate.py`): a piece
that starts at position 0 starts them from zeros.

Calls: `embed`, `l0.input_norm`; per KDA layer `kda_proj`, `short_conv`, `kda`, `o_norm`,
`o_proj`; per MLA layer `q_proj`, `kv_a`, `kv_write`, `attn`, `o_proj`; then `post_attn_norm`,
the MLP (`gate_up`, `silu_mul`, `down_proj`) or `moe`, `next_input_norm`; then `lm_head`,
`sample` (and in the score program `score`).
"""

from __future__ import annotations

import dataclasses
import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np

from kernjax.core.trace import Program, Slot, call, trace

from kernjax.kernels import kda, mxfp4
from kernjax.kernels.reduce import rowmean

from . import mla, moe, seqstate
from .qwen3 import (HEAD_OUTPUTS, SCORE_OUTPUTS, add_norm, embed, gate_up, head, head_inputs,
                    input_norm, layer_of, linear, silu_mul)
from .qwen3 import random_weight as _qwen3_random

PAGE = mla.PAGE


def page(cfg) -> int:
    """Rows a KV page holds: 16 for every k3 model (its latent state, models/mla.py)."""
    return PAGE


FALLBACKS: dict[str, str] = {}


@dataclasses.dataclass(frozen=True)
class Config:
    name: str
    layers: int
    hidden: int
    vocab: int
    kda_heads: int
    kda_head_dim: int
    mla_layers: tuple[int, ...]
    mla_heads: int
    kv_lora: int
    nope: int
    rope: int
    v_dim: int
    intermediate: int  # the dense layers' MLP
    experts: int
    top_k: int
    moe_intermediate: int
    dense_layers: int = 1
    routed_scale: float = 2.446
    conv: int = 4
    eps: float = 1e-5
    max_positions: int = 1 << 20
    dtype: str = "bfloat16"


CONFIGS = {
    # CPU tests: 3 KDA layers and an MLA one, a dense first layer, 8 experts of 128.
    "k3-mini": Config("k3-mini", layers=4, hidden=128, vocab=512, kda_heads=2, kda_head_dim=64,
                      mla_layers=(3,), mla_heads=2, kv_lora=64, nope=32, rope=16, v_dim=32,
                      intermediate=256, experts=8, top_k=2, moe_intermediate=128,
                      max_positions=8192),
    # GPU benchmark: Kimi Linear's 3:1 schedule twice, K = V = 128 (FlashKDA's shape).
    "k3-mini-gpu": Config("k3-mini-gpu", layers=8, hidden=1024, vocab=32768, kda_heads=8,
                          kda_head_dim=128, mla_layers=(3, 7), mla_heads=8, kv_lora=256, nope=64,
                          rope=32, v_dim=64, intermediate=2816, experts=32, top_k=4,
                          moe_intermediate=512, max_positions=65536),
}


def config_from_hf(d: dict, name: str = "k3") -> Config:
    """A Config from this family's `config.json` (Kimi Linear's keys; `full_attn_layers` and
    `kda_layers` are 1-indexed there)."""
    la = d["linear_attn_config"]
    return Config(name, layers=d["num_hidden_layers"], hidden=d["hidden_size"],
                  vocab=d["vocab_size"], kda_heads=la["num_heads"], kda_head_dim=la["head_dim"],
                  mla_layers=tuple(i - 1 for i in la["full_attn_layers"]),
                  mla_heads=d["num_attention_heads"], kv_lora=d["kv_lora_rank"],
                  nope=d["qk_nope_head_dim"], rope=d["qk_rope_head_dim"], v_dim=d["v_head_dim"],
                  intermediate=d["intermediate_size"], experts=d["num_experts"],
                  top_k=d["num_experts_per_token"], moe_intermediate=d["moe_intermediate_size"],
                  dense_layers=d["first_k_dense_replace"],
                  routed_scale=float(d["routed_scaling_factor"]),
                  conv=la["short_conv_kernel_size"], eps=d["rms_norm_eps"],
                  max_positions=d.get("model_max_length", 1 << 20),
                  dtype=str(d.get("torch_dtype") or "bfloat16"))


def hf_config(cfg: Config) -> dict:
    """The `config.json` of `cfg`, in Kimi Linear's keys."""
    mla_1 = [i + 1 for i in cfg.mla_layers]
    return {"architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear",
            "hidden_size": cfg.hidden, "num_hidden_layers": cfg.layers, "vocab_size": cfg.vocab,
            "linear_attn_config": {"num_heads": cfg.kda_heads, "head_dim": cfg.kda_head_dim,
                                   "short_conv_kernel_size": cfg.conv,
                                   "full_attn_layers": mla_1,
                                   "kda_layers": [i for i in range(1, cfg.layers + 1)
                                                  if i not in mla_1]},
            "num_attention_heads": cfg.mla_heads, "num_key_value_heads": cfg.mla_heads,
            "q_lora_rank": None, "kv_lora_rank": cfg.kv_lora, "qk_nope_head_dim": cfg.nope,
            "qk_rope_head_dim": cfg.rope, "v_head_dim": cfg.v_dim, "mla_use_nope": True,
            "intermediate_size": cfg.intermediate, "num_experts": cfg.experts,
            "num_experts_per_token": cfg.top_k, "num_shared_experts": 1,
            "moe_intermediate_size": cfg.moe_intermediate,
            "first_k_dense_replace": cfg.dense_layers, "routed_scaling_factor": cfg.routed_scale,
            "moe_router_activation_func": "sigmoid", "moe_renormalize": True,
            "rms_norm_eps": cfg.eps, "model_max_length": cfg.max_positions,
            "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": cfg.dtype,
            "quantization": "mxfp4 routed experts (compressed-tensors weight_packed/weight_scale)"}


def _moe_layers(cfg: Config) -> list[int]:
    return [i for i in range(cfg.dense_layers, cfg.layers)]


def weight_shapes(cfg: Config) -> list[tuple[str, tuple[int, ...]]]:
    """Every checkpoint tensor in the program's dtype, by name, in call order (the MXFP4 expert
    sources are `source_shapes`)."""
    d, hk = cfg.hidden, cfg.kda_heads * cfg.kda_head_dim
    k = cfg.kda_head_dim
    out = [("model.embed_tokens.weight", (cfg.vocab, d))]
    for i in range(cfg.layers):
        p = f"model.layers.{i}."
        out.append((p + "input_layernorm.weight", (d,)))
        if i in cfg.mla_layers:
            a = p + "self_attn."
            h = cfg.mla_heads
            out += [(a + "q_proj.weight", (h * (cfg.nope + cfg.rope), d)),
                    (a + "kv_a_proj_with_mqa.weight", (cfg.kv_lora + cfg.rope, d)),
                    (a + "kv_a_layernorm.weight", (cfg.kv_lora,)),
                    (a + "kv_b_proj.weight", (h * (cfg.nope + cfg.v_dim), cfg.kv_lora)),
                    (a + "o_proj.weight", (d, h * cfg.v_dim))]
        else:
            a = p + "self_attn."
            out += [(a + f"{s}_proj.weight", (hk, d)) for s in "qkv"]
            out += [(a + f"{s}_conv1d.weight", (hk, 1, cfg.conv)) for s in "qkv"]
            out += [(a + "A_log", (1, 1, cfg.kda_heads, 1)), (a + "dt_bias", (hk,)),
                    (a + "f_a_proj.weight", (k, d)), (a + "f_b_proj.weight", (hk, k)),
                    (a + "b_proj.weight", (cfg.kda_heads, d)),
                    (a + "g_a_proj.weight", (k, d)), (a + "g_b_proj.weight", (hk, k)),
                    (a + "o_norm.weight", (k,)), (a + "o_proj.weight", (d, hk))]
        out.append((p + "post_attention_layernorm.weight", (d,)))
        if i < cfg.dense_layers:
            out += [(p + f"mlp.{s}_proj.weight", sh) for s, sh in
                    (("gate", (cfg.intermediate, d)), ("up", (cfg.intermediate, d)),
                     ("down", (d, cfg.intermediate)))]
        else:
            m, im = p + "block_sparse_moe.", cfg.moe_intermediate
            out += [(m + "gate.weight", (cfg.experts, d)),
                    (m + "gate.e_score_correction_bias", (cfg.experts,)),
                    (m + "shared_experts.gate_proj.weight", (im, d)),
                    (m + "shared_experts.up_proj.weight", (im, d)),
                    (m + "shared_experts.down_proj.weight", (d, im))]
    out += [("model.norm.weight", (d,)), ("lm_head.weight", (cfg.vocab, d))]
    return out


def _expert_shapes(cfg: Config) -> dict[str, tuple[int, int]]:
    d, im = cfg.hidden, cfg.moe_intermediate
    return {"w1": (im, d), "w3": (im, d), "w2": (d, im)}


def source_shapes(cfg: Config) -> list[tuple[str, tuple[int, ...], str]]:
    """The MXFP4 expert tensors of the checkpoint: `(name, shape, dtype)`, uint8."""
    out = []
    for i in _moe_layers(cfg):
        for e in range(cfg.experts):
            for w, (m, n) in _expert_shapes(cfg).items():
                b = f"model.layers.{i}.block_sparse_moe.experts.{e}.{w}."
                out += [(b + "weight_packed", (m, n // 2), "uint8"),
                        (b + "weight_scale", (m, n // mxfp4.BLOCK), "uint8")]
    return out


def random_weight(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """A float32 random tensor: norms near one, `A_log` and `dt_bias` in Kimi's ranges, matrices
    N(0, 0.02), the router's correction bias small."""
    if name.endswith("A_log"):
        return np.log(rng.uniform(1.0, 16.0, shape)).astype(np.float32)
    if name.endswith("dt_bias"):
        return rng.uniform(-4.0, 0.0, shape).astype(np.float32)
    if name.endswith("conv1d.weight"):
        return (0.3 * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)
    if name.endswith("e_score_correction_bias"):
        return (0.01 * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)
    return _qwen3_random(name, shape, rng)


def random_sources(cfg: Config, seed: int):
    """Yields `(name, uint8 array)` for every MXFP4 source: each expert matrix N(0, 0.02), drawn
    from a generator seeded by `(seed, crc32(its name))` and quantized (`mxfp4.quantize`)."""
    for i in _moe_layers(cfg):
        for e in range(cfg.experts):
            for w, shape in _expert_shapes(cfg).items():
                b = f"model.layers.{i}.block_sparse_moe.experts.{e}.{w}"
                rng = np.random.default_rng([seed, zlib.crc32(b.encode())])
                packed, scales = mxfp4.quantize(0.02 * rng.standard_normal(shape,
                                                                            dtype=np.float32))
                yield b + ".weight_packed", packed
                yield b + ".weight_scale", scales


def _sf_size(m: int, k: int) -> int:
    """Bytes of one matrix's scales in the 128x4 swizzle: rows padded to 128, blocks to 4."""
    return -(-m // 128) * 128 * (-(-(k // mxfp4.BLOCK) // 4) * 4)


def derived(cfg: Config) -> list:
    """The derive program: per MoE layer, GEMM1 (`[w3; w1]`, gated) and GEMM2 (`w2`) of every
    expert, from the checkpoint's MXFP4 sources into the shuffle layout `moe` reads, as
    `kernjax.core.staging.Recipe`s in call order."""
    from kernjax.kernels import ffi
    from kernjax.core.staging import Recipe

    # The kernel (csrc/mxfp4_shuffle.*) where the extension is built, else its JAX reference:
    # bitwise the same (tests/test_mxfp4.py).
    shuffle = ffi.mxfp4_shuffle if ffi.available() else mxfp4.shuffle
    d, im, n_e = cfg.hidden, cfg.moe_intermediate, cfg.experts
    def gemm1(*xs):  # w1 packed, w1 scales, w3 packed, w3 scales: n_e each
        w1p, w1s, w3p, w3s = (jnp.stack(xs[j * n_e:(j + 1) * n_e]) for j in range(4))
        return shuffle(jnp.concatenate([w3p, w1p], axis=-2),
                       jnp.concatenate([w3s, w1s], axis=-2), gated=True)

    def gemm2(*xs):
        return shuffle(jnp.stack(xs[:n_e]), jnp.stack(xs[n_e:]), gated=False)

    out = []  # gemm1 and gemm2 serve every layer: one derive program each
    for i in _moe_layers(cfg):
        b = f"model.layers.{i}.block_sparse_moe.experts."

        def src(w, m, k):
            return [(f"{b}{e}.{w}.weight_packed", (m, k // 2), "uint8") for e in range(n_e)] + \
                   [(f"{b}{e}.{w}.weight_scale", (m, k // mxfp4.BLOCK), "uint8")
                    for e in range(n_e)]

        out.append(Recipe(
            outputs=((b + "gemm1.weight_packed", (n_e, 2 * im, d // 2), "uint8"),
                     (b + "gemm1.weight_scale", (n_e, _sf_size(2 * im, d)), "uint8")),
            sources=tuple(src("w1", im, d) + src("w3", im, d)), fn=gemm1))
        out.append(Recipe(
            outputs=((b + "gemm2.weight_packed", (n_e, d, im // 2), "uint8"),
                     (b + "gemm2.weight_scale", (n_e, _sf_size(d, im)), "uint8")),
            sources=tuple(src("w2", d, im)), fn=gemm2))
    return out


def _l2norm(x):
    x32 = x.astype(jnp.float32)
    return x32 * jax.lax.rsqrt(jnp.sum(x32 * x32, axis=-1, keepdims=True) + 1e-6)


def program(cfg: Config, *, dtype: str, rows: int, seqs: int = 1, context: int = 4096,
            pages: int | None = None, slots: int | None = None, scores: bool = False) -> Program:
    """Traces the prefill forward of `cfg` for chunks of `rows` rows into a Program (the
    arguments of `prefill`)."""
    fn, inputs, outputs, slots = prefill(cfg, dtype=dtype, rows=rows, seqs=seqs,
                                         context=context, pages=pages, slots=slots, scores=scores)
    return trace(fn, inputs, outputs, rows=rows, slots=slots, layer_of=layer_of)


def prefill(cfg: Config, *, dtype: str, rows: int, seqs: int = 1, context: int = 4096,
            pages: int | None = None, slots: int | None = None, scores: bool = False):
    """The prefill forward as `(fn, inputs, outputs, slots)`, ready for `trace`.

    Args:
      cfg, dtype, rows, seqs, context, pages: as `qwen3.prefill` (pages of the MLA states).
      slots: per-sequence state slots, slot 0 never leased; by default `4 * seqs + 1`, so a
        pipeline can hold four items' sequences in flight.
      scores: also score every row against the `targets` fill (`qwen3.head`).
    """
    if context > cfg.max_positions:
        raise ValueError(f"context {context} is past the model's max positions "
                         f"{cfg.max_positions}")
    width = -(-context // PAGE)
    pages = pages or seqs * width + 1
    slots = slots or 4 * seqs + 1
    dt = jnp.dtype(dtype)
    L = cfg.layers
    H, K = cfg.kda_heads, cfg.kda_head_dim
    HK, W = H * K, cfg.conv
    mh, nope, rope, vd = cfg.mla_heads, cfg.nope, cfg.rope, cfg.v_dim
    kda_layers = [i for i in range(L) if i not in cfg.mla_layers]
    moe_w = {n: (s, dt) for r in derived(cfg) for n, s, dt in r.outputs}
    inputs = [Slot(n, "weight", dt.name, s) for n, s in weight_shapes(cfg)]
    inputs += [Slot(n, "weight", d_, s) for n, (s, d_) in moe_w.items()]
    inputs += [Slot(f"kv.{i}", "state", dt.name, (pages, PAGE, cfg.kv_lora + rope))
               for i in cfg.mla_layers]
    for i in kda_layers:
        inputs += [Slot(f"conv.{i}", "state", dt.name, (slots, W - 1, 3 * HK)),
                   Slot(f"kda.{i}", "state", "float32", (slots, H, K, K))]
    inputs += [Slot("tokens", "fill", "int32", (rows,)), Slot("positions", "fill", "int32", (rows,)),
               Slot("slots", "fill", "int32", (rows,)),
               Slot("cu_seqlens", "fill", "int32", (seqs + 1,)),
               Slot("seq_slots", "fill", "int32", (seqs,)),
               Slot("page_table", "table", "int32", (seqs, width))]
    states = [f"kv.{i}" for i in cfg.mla_layers] + \
        [n for i in kda_layers for n in (f"conv.{i}", f"kda.{i}")]
    inputs += head_inputs(rows, seqs, scores)
    outputs = HEAD_OUTPUTS + SCORE_OUTPUTS * scores + [(n, "state") for n in states]
    eps = cfg.eps
    scale = mla.softmax_scale(nope, rope)

    # ---- KDA ----
    def kda_proj(a, wq, wk, wv, wfa, wfb, wb, wga, wgb):
        qkv = jnp.concatenate([linear(a, wq), linear(a, wk), linear(a, wv)], axis=-1)
        return qkv, linear(linear(a, wfa), wfb), linear(a, wb), linear(linear(a, wga), wgb)

    def short_conv(tail, x, wq, wk, wv, positions, cu, seq_slots):
        """Depthwise causal conv + SiLU per channel of [q|k|v]; a row's earlier inputs are its
        own sequence's rows, then the sequence's tail (zeros when fresh)."""
        w = jnp.concatenate([wq, wk, wv], axis=0)[:, 0, :].astype(jnp.float32)  # [C, W]
        start = seqstate.initial(tail, seq_slots, positions, cu).astype(x.dtype)  # [S, W-1, C]
        seq = jnp.minimum(seqstate.row_sequence(cu, rows), seqs - 1)
        r = jnp.arange(rows)
        first = cu[seq]
        taps = []
        for back in range(W - 1, 0, -1):  # x_{p-back}, oldest first
            src = r - back
            inside = src >= first
            past = start[seq, jnp.clip((W - 1) - (first - src), 0, W - 2)]
            taps.append(jnp.where(inside[:, None], x[jnp.maximum(src, 0)], past))
        taps.append(x)
        win = jnp.stack(taps, axis=-1).astype(jnp.float32)  # [T, C, W]
        y = jax.nn.silu(jnp.sum(win * w[None], axis=-1)).astype(x.dtype)
        n = cu[1:] - cu[:-1]
        j = n[:, None] - (W - 1) + jnp.arange(W - 1)[None, :]  # [S, W-1]: row of the new tail
        new = jnp.where((j >= 0)[..., None], x[jnp.clip(cu[:-1, None] + j, 0, rows - 1)],
                        start[jnp.arange(seqs)[:, None], jnp.clip((W - 1) + j, 0, W - 2)])
        return seqstate.store(tail, seq_slots, cu, new), y

    def kda_call(state, y, f, b, a_log, dt_bias, positions, cu, seq_slots):
        q, k, v = (y[:, j * HK:(j + 1) * HK].reshape(rows, H, K) for j in range(3))
        q, k = _l2norm(q), _l2norm(k)
        g = (-jnp.exp(a_log.astype(jnp.float32).reshape(1, H, 1))
             * jax.nn.softplus((f + dt_bias).astype(jnp.float32).reshape(rows, H, K)))
        beta = jax.nn.sigmoid(b.astype(jnp.float32))
        h0 = seqstate.initial(state, seq_slots, positions, cu)
        # The chunked form in JAX everywhere but on CUDA GPUs, where the `kj_kda` kernel runs it
        # (csrc/kda.*: tested there against the float32 recurrence); chosen per platform, so the
        # traced program, and the cut id, are the same on every machine.
        o, final = jax.lax.platform_dependent(
            q, k, v, g, beta, cu, h0, default=functools.partial(kda.chunked, chunk=64),
            cuda=kda.flash)
        return seqstate.store(state, seq_slots, cu, final), o

    def o_norm(o, gate, w):
        o32 = o.astype(jnp.float32)
        o32 = o32 * jax.lax.rsqrt(rowmean(o32 * o32, keepdims=True) + eps)
        g = jax.nn.sigmoid(gate.astype(jnp.float32).reshape(rows, H, K))
        return (o32 * w.astype(jnp.float32) * g).astype(dt).reshape(rows, HK)

    # ---- MLA ----
    def q_proj(a, w):
        q = linear(a, w).reshape(rows, mh, nope + rope)
        return q[..., :nope], q[..., nope:]

    def kv_a(a, w, norm_w):
        return mla.latent(linear(a, w), norm_w, kv_lora=cfg.kv_lora, eps=eps)

    def kv_write(state, c_kv, k_pe, slots_):
        return mla.write(state, c_kv, k_pe, slots_)

    def attn(state, q_nope, q_pe, w_kv_b, positions, cu, page_table):
        o = mla.attend(state, q_nope, q_pe, w_kv_b, positions, cu, page_table, scale=scale)
        return o.reshape(rows, mh * vd)

    # ---- MLP / MoE ----
    def proj(x, w):
        return linear(x, w)

    def moe_call(m, w_router, bias, p1, s1, p2, s2, sg, su, sd):
        return moe.moe(m, w_router, bias, (p1, s1), (p2, s2), (sg, su, sd), top_k=cfg.top_k,
                       scale=cfg.routed_scale)

    input_norm_ = functools.partial(input_norm, eps=eps)
    add_norm_ = functools.partial(add_norm, eps=eps)

    def forward(x):
        W_ = lambda n: x[f"model.{n}"]  # noqa: E731
        item = (x["positions"], x["cu_seqlens"], x["seq_slots"])
        h = call("embed", embed)(W_("embed_tokens.weight"), x["tokens"])
        a, h = call("l0.input_norm", input_norm_)(h, W_("layers.0.input_layernorm.weight"))
        new = {}
        for i in range(L):
            p, c = f"layers.{i}.", f"l{i}."
            s = p + "self_attn."
            if i in cfg.mla_layers:
                qn, qp = call(c + "q_proj", q_proj)(a, W_(s + "q_proj.weight"))
                ckv, kpe = call(c + "kv_a", kv_a)(a, W_(s + "kv_a_proj_with_mqa.weight"),
                                                  W_(s + "kv_a_layernorm.weight"))
                kv = call(c + "kv_write", kv_write, state=1)(x[f"kv.{i}"], ckv, kpe, x["slots"])
                o = call(c + "attn", attn)(kv, qn, qp, W_(s + "kv_b_proj.weight"),
                                           x["positions"], x["cu_seqlens"], x["page_table"])
                new[f"kv.{i}"] = kv
            else:
                qkv, f, b, gate = call(c + "kda_proj", kda_proj)(
                    a, *(W_(s + f"{n}.weight") for n in ("q_proj", "k_proj", "v_proj", "f_a_proj",
                                                         "f_b_proj", "b_proj", "g_a_proj",
                                                         "g_b_proj")))
                tail, y = call(c + "short_conv", short_conv, state=1)(
                    x[f"conv.{i}"], qkv, *(W_(s + f"{n}_conv1d.weight") for n in "qkv"), *item)
                st, o = call(c + "kda", kda_call, state=1)(
                    x[f"kda.{i}"], y, f, b, W_(s + "A_log"), W_(s + "dt_bias"), *item)
                o = call(c + "o_norm", o_norm)(o, gate, W_(s + "o_norm.weight"))
                new[f"conv.{i}"], new[f"kda.{i}"] = tail, st
            y = call(c + "o_proj", proj)(o, W_(s + "o_proj.weight"))
            m, h = call(c + "post_attn_norm", add_norm_)(y, h, W_(p + "post_attention_layernorm"
                                                                 ".weight"))
            if i < cfg.dense_layers:
                g, u = call(c + "gate_up", gate_up)(m, W_(p + "mlp.gate_proj.weight"),
                                                    W_(p + "mlp.up_proj.weight"))
                f_ = call(c + "silu_mul", silu_mul)(g, u)
                y = call(c + "down_proj", proj)(f_, W_(p + "mlp.down_proj.weight"))
            else:
                e = p + "block_sparse_moe."
                y = call(c + "moe", moe_call)(
                    m, W_(e + "gate.weight"), W_(e + "gate.e_score_correction_bias"),
                    *(W_(e + f"experts.gemm{g_}.weight_{k_}") for g_ in (1, 2)
                      for k_ in ("packed", "scale")),
                    *(W_(e + f"shared_experts.{n}_proj.weight") for n in ("gate", "up", "down")))
            nxt = "norm.weight" if i == L - 1 else f"layers.{i + 1}.input_layernorm.weight"
            a, h = call(c + "next_input_norm", add_norm_)(y, h, W_(nxt))
        return {**head(x, a, x["lm_head.weight"], scores), **new}

    return forward, inputs, outputs, slots
