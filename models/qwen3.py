"""Qwen3 dense (HF `Qwen3ForCausalLM`) as a program of calls, in kern's layout.

Calls: `embed`, `l0.input_norm`, then twelve per layer (`qkv_proj`, `q_norm`, `k_norm`, `rope`,
`kv_write`, `attn`, `o_proj`, `post_attn_norm`, `gate_up`, `silu_mul`, `down_proj`,
`next_input_norm`; the last layer's applies the final norm), then `lm_head` and `sample` (and in
the score program `score`). Layer
`i` starts at call `2 + 12 i`, so layer 18 of qwen3-4b starts at call 218, as in kern.

As in kern, `qkv_proj` is one GEMM: the program reads one weight per layer,
`self_attn.qkv_proj.weight` `[(heads + 2 kv_heads) head_dim, hidden]`, the checkpoint's
q_proj, k_proj and v_proj stacked in that order, which `derived` makes at load
(`kernjax/runtime/derive.py`); the checkpoint keeps the three HF tensors. The call returns one buffer
`qkv`, and its readers slice it inside their own calls: `q_norm` its q, `k_norm` its k,
`kv_write` its v (beside the roped k), so no slice is a buffer of its own between calls. On an
H200 at 8192 rows the three GEMMs of qwen3-4b took 0.368 ms a layer, the one 0.330 ms (roadmap
K6, seventh session); gate_proj and up_proj stay two weights: fused they measured no faster.

One run prefills one chunk of `rows` rows holding pieces of up to `seqs` sequences, split by
`cu_seqlens`; rows past `cu_seqlens[-1]` are padding. Each layer has its own paged KV state
`kv.i` of `[pages, page, 2, kv_heads, head_dim]` (`page(cfg)` rows a page: 128 at head_dim 128,
else 16); `kv_write` stores the chunk's keys and values at `slots` (page id · rows a page +
offset; an out-of-range slot drops a padding row), and `attn` reads every
earlier chunk of a row's sequence through `page_table`, causal by position, visiting only the key
blocks the item's sequences reach (`kernjax/kernels/attention.py`: plain JAX on the CPU; on CUDA GPUs
the kernel its `route` picks by dtype and shape, for any heads / kv_heads: FlashAttention-3 for
bf16 at head_dim 128, a Pallas Triton kernel for float32). Page 0 is never leased, so unused
page-table entries point at it. `lm_head` takes each sequence's last row of the
chunk, and `sample` picks its token (greedy, or drawn as the `sampling` and `rng` fills say):
after a prompt's last row, its next token. The score program's `score` gives every row's
log-probability of its `targets` fill and its top-K (`kernjax/kernels/head.py`).

The math follows `modeling_qwen3.py`: RMSNorm in f32 cast back before the weight, q/k norms over
head_dim before NeoX RoPE with cos/sin cast to the activation dtype, softmax in f32.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from kernjax.core.staging import Recipe
from kernjax.core.trace import Program, Slot, call, on_gpu, trace
from kernjax.kernels import dense_cuda, head as heads, mlp_hopper
from kernjax.kernels.reduce import rowmean
from kernjax.kernels.attention import chunk_attention, exact, page_size


def page(cfg: Config) -> int:
    """Rows a KV page holds for `cfg`: 128 for head_dim 128 (FlashAttention-3 reads each page in
    place), else 16 (`attention.page_size`)."""
    return page_size(cfg.head_dim)

# Tensors a checkpoint may omit, and what is read instead: none. A tied head is the embedding
# (`tie_word_embeddings`: the program reads no lm_head.weight); an untied one must be there.
FALLBACKS: dict[str, str] = {}


@dataclasses.dataclass(frozen=True)
class Config:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    rope_theta: float = 1_000_000.0
    eps: float = 1e-6
    tied: bool = True
    max_positions: int = 40960
    dtype: str = "bfloat16"


CONFIGS = {
    "qwen3-4b": Config("qwen3-4b", layers=36, hidden=2560, heads=32, kv_heads=8, head_dim=128,
                       intermediate=9728, vocab=151936),
    "qwen3-0.6b": Config("qwen3-0.6b", layers=28, hidden=1024, heads=16, kv_heads=8, head_dim=128,
                         intermediate=3072, vocab=151936),
    # A few layers, head_dim 32 != hidden / heads = 16, GQA group 2, tied embeddings.
    "qwen3-tiny": Config("qwen3-tiny", layers=4, hidden=64, heads=4, kv_heads=2, head_dim=32,
                         intermediate=128, vocab=512, rope_theta=10_000.0, max_positions=8192),
    # GQA groups that are not powers of two, as Qwen3-14B's 40 / 8 = 5 (tests/test_gqa.py): 6 heads
    # over 2 at head_dim 64 (pages of 16), 10 over 2 at head_dim 128 (pages of 128).
    "qwen3-tiny-gqa3": Config("qwen3-tiny-gqa3", layers=2, hidden=64, heads=6, kv_heads=2,
                              head_dim=64, intermediate=128, vocab=512, rope_theta=10_000.0,
                              max_positions=8192),
    "qwen3-tiny-gqa5": Config("qwen3-tiny-gqa5", layers=2, hidden=64, heads=10, kv_heads=2,
                              head_dim=128, intermediate=128, vocab=512, rope_theta=10_000.0,
                              max_positions=8192),
}

FILLS = ("tokens", "positions", "slots", "cu_seqlens")


def config_from_hf(d: dict, name: str = "qwen3") -> Config:
    """A Config from a Hugging Face `config.json` dict."""
    hidden, heads = d["hidden_size"], d["num_attention_heads"]
    if d.get("rope_scaling"):
        raise ValueError(f"config.json has rope_scaling {d['rope_scaling']}; kernjax implements "
                         "plain RoPE only")
    return Config(name, layers=d["num_hidden_layers"], hidden=hidden, heads=heads,
                  kv_heads=d.get("num_key_value_heads", heads),
                  head_dim=d.get("head_dim") or hidden // heads,
                  intermediate=d["intermediate_size"], vocab=d["vocab_size"],
                  rope_theta=float(d.get("rope_theta", 10000.0)), eps=d.get("rms_norm_eps", 1e-6),
                  tied=d.get("tie_word_embeddings", False),
                  max_positions=d.get("max_position_embeddings", 40960),
                  dtype=str(d.get("torch_dtype") or d.get("dtype") or "bfloat16"))


def hf_config(cfg: Config) -> dict:
    """The Hugging Face `config.json` of `cfg`, as transformers' Qwen3Config writes it."""
    return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
            "hidden_size": cfg.hidden, "num_hidden_layers": cfg.layers,
            "num_attention_heads": cfg.heads, "num_key_value_heads": cfg.kv_heads,
            "head_dim": cfg.head_dim, "intermediate_size": cfg.intermediate,
            "vocab_size": cfg.vocab, "rope_theta": cfg.rope_theta, "rope_scaling": None,
            "rms_norm_eps": cfg.eps, "tie_word_embeddings": cfg.tied,
            "max_position_embeddings": cfg.max_positions, "hidden_act": "silu",
            "attention_bias": False, "attention_dropout": 0.0, "use_sliding_window": False,
            "torch_dtype": cfg.dtype}


def weight_shapes(cfg: Config) -> list[tuple[str, tuple[int, ...]]]:
    """Every checkpoint tensor the forward reads or derives its weights from, by HF name, in
    call order (the program's own list is `program_weights`)."""
    d, q, kv = cfg.hidden, cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    out = [("model.embed_tokens.weight", (cfg.vocab, d))]
    for i in range(cfg.layers):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (d,)),
                (p + "self_attn.q_proj.weight", (q, d)),
                (p + "self_attn.k_proj.weight", (kv, d)),
                (p + "self_attn.v_proj.weight", (kv, d)),
                (p + "self_attn.q_norm.weight", (cfg.head_dim,)),
                (p + "self_attn.k_norm.weight", (cfg.head_dim,)),
                (p + "self_attn.o_proj.weight", (d, q)),
                (p + "post_attention_layernorm.weight", (d,)),
                (p + "mlp.gate_proj.weight", (cfg.intermediate, d)),
                (p + "mlp.up_proj.weight", (cfg.intermediate, d)),
                (p + "mlp.down_proj.weight", (d, cfg.intermediate))]
    out.append(("model.norm.weight", (d,)))
    if not cfg.tied:
        out.append(("lm_head.weight", (cfg.vocab, d)))
    return out


def program_weights(cfg: Config) -> list[tuple[str, tuple[int, ...]]]:
    """The weights the program reads, in call order: `weight_shapes` with each layer's q_proj,
    k_proj and v_proj replaced by their fused `qkv_proj` (`derived`)."""
    recipes = derived(cfg)
    fused = {r.sources[0][0]: r.outputs[0][:2] for r in recipes}  # at q_proj's place
    drop = {n for r in recipes for n, _, _ in r.sources[1:]}
    return [fused.get(n, (n, s)) for n, s in weight_shapes(cfg) if n not in drop]


def derived(cfg: Config) -> list:
    """The derive program: per layer, `self_attn.qkv_proj.weight` from the checkpoint's q_proj,
    k_proj and v_proj (concatenated along the output rows), in `cfg.dtype`, as
    `kernjax.core.staging.Recipe`s in call order."""
    d, dt = cfg.hidden, cfg.dtype
    rows = {s: n * cfg.head_dim for s, n in (("q", cfg.heads), ("k", cfg.kv_heads),
                                             ("v", cfg.kv_heads))}
    out = []
    for i in range(cfg.layers):
        a = f"model.layers.{i}.self_attn."
        out.append(Recipe(
            outputs=((a + "qkv_proj.weight", (sum(rows.values()), d), dt),),
            sources=tuple((a + f"{s}_proj.weight", (n, d), dt) for s, n in rows.items()),
            fn=_fuse_qkv))
    return out


def _fuse_qkv(wq, wk, wv):  # one function for every layer: one derive program (kernjax.runtime.derive)
    return jnp.concatenate([wq, wk, wv], axis=0)


def source_shapes(cfg: Config) -> list:
    """Tensors kept in their own dtype: none (every Qwen3 tensor is in the model's dtype)."""
    return []


def random_sources(cfg: Config, seed: int) -> list:
    return []


def random_weight(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """A float32 random tensor for `name`: norms near one, matrices N(0, 0.02) (HF's init)."""
    if name.endswith("norm.weight"):
        return (1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)
    return 0.02 * rng.standard_normal(shape, dtype=np.float32)


def rms(x, w, eps):
    """RMSNorm as HF computes it: in float32, cast back to x's dtype before the weight; the mean
    in an order that is the same for a row whatever rows run beside it (`reduce.rowmean`)."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(rowmean(x32 * x32, keepdims=True) + eps)
    return w * x32.astype(x.dtype)


def linear(x, w):
    """x @ wᵀ (w as a checkpoint stores it, [out, in]); float32 products in full precision. One
    row runs as two (`head.pad_rows`), so a row's bits do not depend on how many rows run with
    it (a one-row program, a decode step, gives the row what a chunk gives it)."""
    if x.ndim == 2 and x.shape[0] == 1:
        return linear(heads.pad_rows(x), w)[:1]
    return jnp.einsum("...i,oi->...o", x, w, precision=exact(x.dtype))


# Call bodies every dense block shares (k3.py uses them too); the norms take `eps` by partial.
def embed(table, tokens):
    return table[tokens]


def input_norm(h, w, *, eps):
    return rms(h, w, eps), h


def add_norm(y, h, w, *, eps):
    """The residual add, then the next RMSNorm: (normed, residual)."""
    h = h + y
    return rms(h, w, eps), h


def gate_up(m, wg, wu):
    return linear(m, wg), linear(m, wu)


def silu_mul(g, u):
    return jax.nn.silu(g) * u


# On Hopper, gate/up and silu·mul as one GEMM with silu·mul in its epilogue where no cut falls
# between them, the same GEMM and epilogue apart where one does (kernjax/kernels/mlp_hopper.py, K13).
on_gpu("gate_up", "silu_mul")(mlp_hopper.fused_call)
on_gpu("gate_up")(mlp_hopper.gate_up_call)
on_gpu("silu_mul")(mlp_hopper.silu_mul_call)
# On CUDA, q_norm, k_norm, rope and kv_write as one kernel where no cut falls among them, each
# alone on the same device code where one does, and the add_norms as one each (K14).
on_gpu("q_norm", "k_norm", "rope", "kv_write", rule=True)(dense_cuda.qk_group)
for _name, _rule in [("q_norm", dense_cuda.head_norm), ("k_norm", dense_cuda.head_norm),
                     ("rope", dense_cuda.rope), ("kv_write", dense_cuda.kv_write),
                     ("post_attn_norm", dense_cuda.add_norm), ("next_input_norm", dense_cuda.add_norm)]:
    on_gpu(_name, rule=True)(_rule)


def lm_head(a, w, cu_seqlens):
    """Logits of each sequence's last row of the chunk, one vocabulary slice at a time
    (`kernjax.kernels.head`)."""
    return heads.logits(a[jnp.maximum(cu_seqlens[1:] - 1, 0)], w, linear)


def sample(logits, sampling, rng):
    """Each sequence's next token, its log-probability and top-K (`kernjax.kernels.head`)."""
    return heads.sample(logits, sampling, rng)


def score(a, w, targets):
    """Every row's log-probability of its target and its top-K, a vocabulary slice at a time."""
    return heads.score(a, w, targets, linear)


def head_inputs(rows: int, seqs: int, scores: bool) -> list[Slot]:
    """The fills the head's calls read: each sequence's sampling parameters and counter key, and
    with `scores` each row's target token (`kernjax.core.item`)."""
    out = [Slot("sampling", "fill", "float32", (seqs, 4)), Slot("rng", "fill", "uint32", (seqs, 3))]
    return out + [Slot("targets", "fill", "int32", (rows,))] * scores


HEAD_OUTPUTS = [("next_token", "tokens"), ("logits", "logits"), ("logprob", "logprobs"),
                ("top_ids", "logprobs"), ("top_logprobs", "logprobs")]
SCORE_OUTPUTS = [("target_logprob", "logprobs"), ("row_top_ids", "logprobs"),
                 ("row_top_logprobs", "logprobs")]


def head(x, a, w, scores: bool) -> dict:
    """The calls after the last layer: `lm_head` and `sample`, then with `scores` `score`."""
    logits = call("lm_head", lm_head)(a, w, x["cu_seqlens"])
    out = dict(zip([n for n, _ in HEAD_OUTPUTS[:1] + HEAD_OUTPUTS[2:]],
                   call("sample", sample)(logits, x["sampling"], x["rng"])), logits=logits)
    if scores:
        out.update(zip([n for n, _ in SCORE_OUTPUTS], call("score", score)(a, w, x["targets"])))
    return out


def program(cfg: Config, *, dtype: str, rows: int, seqs: int = 1, context: int = 4096,
            pages: int | None = None, slots: int | None = None,
            page_rows: int | None = None, scores: bool = False) -> Program:
    """Traces the prefill forward of `cfg` for chunks of `rows` rows into a Program.

    Takes the arguments of `prefill`; `slots` is refused (Qwen3's states are all paged).
    """
    if slots is not None:
        raise ValueError(f"--slots: {cfg.name} has no per-sequence states (its states are "
                         "paged: size them with --pages)")
    return trace(*prefill(cfg, dtype=dtype, rows=rows, seqs=seqs, context=context, pages=pages,
                          page_rows=page_rows, scores=scores), rows=rows, layer_of=layer_of)


def layer_of(call_name: str) -> int | None:
    """The layer of a call: `l18.attn` is layer 18's; `embed`, `final_norm` and the head none."""
    head, dot, _ = call_name.partition(".")
    return int(head[1:]) if dot and head[:1] == "l" and head[1:].isdigit() else None


def prefill(cfg: Config, *, dtype: str, rows: int, seqs: int = 1, context: int = 4096,
            pages: int | None = None, page_rows: int | None = None, scores: bool = False):
    """The prefill forward of `cfg` as `(fn, inputs, outputs)`, ready for `trace`.

    Args:
      cfg: the model.
      dtype: weights, activations and KV dtype (`bfloat16` or `float32`).
      rows: rows per run (the chunk).
      seqs: sequences one run may hold (pieces split by `cu_seqlens`).
      context: the longest sequence, in tokens; sets the page table's width.
      pages: pages per KV state, page 0 included; by default room for `seqs` full contexts.
      page_rows: rows a page holds, by default `page(cfg)` (experiments compare 16 and 128).
      scores: also score every row against the `targets` fill (the `score` program).
    """
    if context > cfg.max_positions:
        raise ValueError(f"context {context} is past the model's max_position_embeddings "
                         f"{cfg.max_positions}")
    rows_a_page = page_rows or page(cfg)
    width = -(-context // rows_a_page)
    pages = pages or seqs * width + 1
    dt = jnp.dtype(dtype)
    L, H, KV, D = cfg.layers, cfg.heads, cfg.kv_heads, cfg.head_dim
    inputs = [Slot(n, "weight", dt.name, s) for n, s in program_weights(cfg)]
    inputs += [Slot(f"kv.{i}", "state", dt.name, (pages, rows_a_page, 2, KV, D)) for i in range(L)]
    inputs += [Slot("tokens", "fill", "int32", (rows,)), Slot("positions", "fill", "int32", (rows,)),
               Slot("slots", "fill", "int32", (rows,)),
               Slot("cu_seqlens", "fill", "int32", (seqs + 1,)),
               Slot("page_table", "table", "int32", (seqs, width))]
    inputs += head_inputs(rows, seqs, scores)
    outputs = HEAD_OUTPUTS + SCORE_OUTPUTS * scores
    outputs += [(f"kv.{i}", "state") for i in range(L)]
    eps, scale = cfg.eps, 1.0 / math.sqrt(D)
    inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(0, D, 2, dtype=np.int64).astype(np.float32) / D))

    def qkv_proj(a, w):
        return linear(a, w)

    # q, k and v are column ranges of qkv: [q | k | v], heads * D, KV * D and KV * D wide.
    def q_norm(qkv, w):
        return rms(qkv[:, : H * D].reshape(rows, H, D), w, eps)

    def k_norm(qkv, w):
        return rms(qkv[:, H * D: (H + KV) * D].reshape(rows, KV, D), w, eps)

    def rope(q, k, positions):
        f = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]
        emb = jnp.concatenate([f, f], axis=-1)
        cos, sin = jnp.cos(emb).astype(dt)[:, None, :], jnp.sin(emb).astype(dt)[:, None, :]

        def rot(x):
            x1, x2 = x[..., : D // 2], x[..., D // 2:]
            return x * cos + jnp.concatenate([-x2, x1], axis=-1) * sin

        return rot(q), rot(k)

    def kv_write(kv, k, qkv, slots):
        # Slots are distinct (kernjax.core.item), so the scatters promise unique indices: a GPU
        # stores each row once, no atomics. K and V go separately: no stacked copy.
        v = qkv[:, (H + KV) * D:].reshape(rows, KV, D)
        flat = kv.reshape(pages * rows_a_page, 2, KV, D)
        flat = flat.at[slots, 0].set(k, mode="drop", unique_indices=True)
        flat = flat.at[slots, 1].set(v, mode="drop", unique_indices=True)
        return flat.reshape(kv.shape)

    def attn(kv, q, positions, cu_seqlens, page_table):
        o = chunk_attention(kv, q, positions, cu_seqlens, page_table, scale=scale)
        return o.reshape(rows, H * D)

    def o_proj(o, w):
        return linear(o, w)

    def down_proj(x, w):
        return linear(x, w)

    input_norm_ = functools.partial(input_norm, eps=eps)
    add_norm_ = functools.partial(add_norm, eps=eps)

    def forward(x):
        W = lambda n: x[f"model.{n}.weight"]  # noqa: E731
        h = call("embed", embed)(W("embed_tokens"), x["tokens"])
        a, h = call("l0.input_norm", input_norm_)(h, W("layers.0.input_layernorm"))
        new = {}
        for i in range(L):
            p, c = f"layers.{i}.", f"l{i}."
            qkv = call(c + "qkv_proj", qkv_proj)(a, W(p + "self_attn.qkv_proj"))
            q = call(c + "q_norm", q_norm)(qkv, W(p + "self_attn.q_norm"))
            k = call(c + "k_norm", k_norm)(qkv, W(p + "self_attn.k_norm"))
            q, k = call(c + "rope", rope)(q, k, x["positions"])
            kv = call(c + "kv_write", kv_write, state=1)(x[f"kv.{i}"], k, qkv, x["slots"])
            o = call(c + "attn", attn)(kv, q, x["positions"], x["cu_seqlens"], x["page_table"])
            y = call(c + "o_proj", o_proj)(o, W(p + "self_attn.o_proj"))
            m, h = call(c + "post_attn_norm", add_norm_)(y, h, W(p + "post_attention_layernorm"))
            g, u = call(c + "gate_up", gate_up)(m, W(p + "mlp.gate_proj"), W(p + "mlp.up_proj"))
            f = call(c + "silu_mul", silu_mul)(g, u)
            y = call(c + "down_proj", down_proj)(f, W(p + "mlp.down_proj"))
            nxt = "norm" if i == L - 1 else f"layers.{i + 1}.input_layernorm"
            a, h = call(c + "next_input_norm", add_norm_)(y, h, W(nxt))
            new[f"kv.{i}"] = kv
        lm = x["lm_head.weight"] if not cfg.tied else W("embed_tokens")
        return {**head(x, a, lm, scores), **new}

    return forward, inputs, outputs
