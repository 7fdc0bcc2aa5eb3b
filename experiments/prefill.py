"""Prefill of one prompt on one GPU: kernjax (whole, 2 stages, unconstrained) against plain JAX
and Hugging Face transformers, at several prompt lengths and chunk sizes.

For each system, prompt length S (`--prompts`) and chunk setting (`--chunks`; `whole` is the whole
prompt in one chunk, and a chunk >= S is S): one untimed warm-up prefill of the whole prompt (after
compiling, which is timed on its own), then `--iters` timed prefills of all S tokens (more for a
short row: `--min_row_s` of them and their idle by the warm-up's time, at most 25), chunk after chunk, states zeroed between prefills (outside the clock) but never recompiled; the clock stops
when the host has the token: for the JAX systems, read from the ring their program published it
into after all its work (`kernjax.runtime.tokens`, as kernjax's runner reads it; `--publish 0`: after
`block_until_ready` of every output), for transformers after `torch.cuda.synchronize()`. The
median is the time to first token.

  kernjax                 `models.qwen3.program(rows=chunk, seqs=1, context)` as one stage
                          (`cut.whole` + `stage.export_stage`), jitted with its states donated
  kernjax-2stages         the same program `cut.cut` at a layer boundary (`--at`, default 18, or
                          the middle layer for smaller models), the stages run back to back per
                          chunk, stage 0's departures are stage 1's arrivals
  kernjax-unconstrained   the same program's jaxpr as `trace.as_function(fences=False)`: every
                          call inlined bare (kernjax's own kernels and CUDA graph cuts too), no
                          barriers, jitted
  jax-plain               a plain JAX Qwen3 forward (written below), attention through
                          `jax.nn.dot_product_attention(is_causal=True, implementation='cudnn')`;
                          one pass only (chunk >= S), since the public is_causal mask is top-left
                          aligned and wrong for a later chunk
  transformers            `Qwen3ForCausalLM` (random init, bf16, sdpa), a DynamicCache carried
                          across chunks, logits of the last row only

Programs are compiled once per (system, rows, context) and reused. A chunk program (rows < S) is
compiled once with the largest context and serves every prompt: attention (kernjax/kernels/attention.py)
visits only the key blocks the item's sequences reach, so the page table's width adds no work.
A one-pass program (rows = S) has context S. `--exact_context` compiles every program with
context = S instead (more compiles).

Writes `results.json`, `README.md` (after every row) and `mfu.png` (after every system) to
`--out` (default `<UTC date>-h200-prefill/` under `$OUT` when set, else experiments/results/;
`--replot DIR` rewrites README.md and mfu.png from DIR/results.json), prints a progress line per row and the table at the end. A failing row prints one line
and the run goes on. `--max_seconds` stops starting rows after that many seconds: each system
gets a share of the time left in proportion to its rows and programs (`share_weight`), and a
row predicted not to fit is skipped (said in the README). The timed prefills run back to back;
`--idle S` lets the GPU idle S seconds before each (one prompt's time to first token on a quiet
server: a GPU at its power limit runs a burst faster). Each row records the SM clock it ran at.
The README gives each system's time over kernjax's in the same run, and issue 6's goals checked
on them: read a change there, against an unchanged system (machines differ by 2-3 %).
`--interleave` runs the JAX systems by turns at each row (one prefill each per round, the order
rotated every round), so that those ratios are read under the same clocks and power.

    python experiments/prefill.py --max_seconds 480                        # H200, qwen3-4b
    python experiments/prefill.py --model qwen3-tiny --prompts 64,128 --chunks 32,whole --iters 1
"""

from __future__ import annotations

import os
import tempfile

# Before jax starts: JAX and torch share the GPU, so JAX allocates as it goes and leaves room.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75")
# kernjax keeps compiled programs in a cache (kernjax/runtime/xla.py); a fresh
# one per run, unless the caller names one, so that compile times are those of a cold machine.
_OWN_CACHE = not os.environ.get("KERNJAX_XLA_CACHE")
if _OWN_CACHE:
    os.environ["KERNJAX_XLA_CACHE"] = tempfile.mkdtemp(prefix="prefill-xla-")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import datetime  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import shlex  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
try:  # kernjax sets its XLA flags and caches before jax starts
    import kernjax  # noqa: F401
except ImportError:  # not installed: the checkout's own
    sys.path.insert(0, str(REPO))
    import kernjax  # noqa: F401
try:
    from kernjax import models
except ImportError:  # kernjax.models is models/ (setup.py maps it when installed)
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    import models
    sys.modules["kernjax.models"] = models
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import export  # noqa: E402
import numpy as np  # noqa: E402

import clocks  # noqa: E402  (experiments/clocks.py, this script's directory)
from kernjax.cli import parse_at  # noqa: E402
from kernjax.core.cut import cut, whole  # noqa: E402
from kernjax.core.item import Piece, chunks, item_shape, make_item  # noqa: E402
from kernjax.artifact import export_stage  # noqa: E402
from kernjax.core.trace import as_function  # noqa: E402
from kernjax.runtime import xla  # noqa: E402
from kernjax.runtime.tokens import Published, Token, TokenRing, ring as token_ring  # noqa: E402

SYSTEMS = ("kernjax", "kernjax-2stages", "kernjax-unconstrained", "jax-plain", "transformers")
# The order systems run in: cheap ones first (their unused share of --max_seconds goes to the
# later ones), torch last so JAX never has to give memory back to it.
RUN_ORDER = ("jax-plain", "kernjax-unconstrained", "kernjax", "kernjax-2stages", "transformers")
PEAK = 989e12  # H200 dense BF16 FLOP/s
MFU_GOALS = {"whole": 0.65, "2048": 0.55, "512": 0.45}  # issue 6, at 8k


def goal_checks(ms: dict, keys: list) -> list:
    """Issue 6's goals on one run's rows (`ms[(system, prompt, chunk)]`, chunk as text):
    [(what, met)] for those its rows can answer."""
    out = []
    for c, goal in MFU_GOALS.items():
        if r := ms.get(("kernjax", 8192, c)):
            out.append((f"8k, chunk {c}: {100 * r['mfu']:.2f} % MFU, goal {100 * goal:.0f} %",
                        r["mfu"] >= goal))
    one = [k for k in keys if k[1] == "whole"]
    for a, b, where, lo, hi in (("transformers", "kernjax", keys, 1.0, None),
                                ("jax-plain", "kernjax", one, 1.0, None),
                                ("kernjax", "kernjax-unconstrained", keys, 0.97, 1.03)):
        r = [ms[(a, p, c)]["ms"] / ms[(b, p, c)]["ms"] for p, c in where
             if (a, p, c) in ms and (b, p, c) in ms]
        if r:
            bound = f"within {lo:g}-{hi:g}" if hi else f">= {lo:g}"
            out.append((f"{a} / {b} (time) {bound} on {len(r)} rows"
                        + " in one chunk" * (where is one) + f": {min(r):.3f}-{max(r):.3f}",
                        min(r) >= lo and (hi is None or max(r) <= hi)))
    return out

warnings.filterwarnings("ignore", message="Some donated buffers were not usable")


def say(msg: str) -> None:
    print(msg, flush=True)


def one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:400]}"


# --------------------------------------------------------------------------------------- FLOPs

def flop_terms(cfg) -> tuple[float, float, float]:
    """`(a, b, c)` with FLOPs(S) = a S + b S^2 + c for one prefill of S tokens.

    a: 2 x the non-embedding weights (q, k, v, o, gate, up, down) per token; b: causal attention,
    QK^T and PV, 2 x 2 x layers x heads x head_dim x S^2 / 2; c: the lm_head of the last row.
    """
    q, kv = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    per_layer = 2 * cfg.hidden * q + 2 * cfg.hidden * kv + 3 * cfg.hidden * cfg.intermediate
    a = 2.0 * cfg.layers * per_layer
    b = 4.0 * cfg.layers * cfg.heads * cfg.head_dim / 2
    c = 2.0 * cfg.vocab * cfg.hidden
    return a, b, c


def flops(cfg, s: int) -> float:
    a, b, c = flop_terms(cfg)
    return a * s + b * s * s + c


# ------------------------------------------------------------------------------------ systems

@dataclasses.dataclass
class Part:
    """One jitted program and how to feed it: a whole program, a stage, or an unconstrained jit."""

    fn: object
    inputs: tuple  # Slots: weight, state, fill, table
    outputs: tuple  # (name, role)
    departures: int = 0


@dataclasses.dataclass
class Handle:
    """What one (system, rows, context) needs to run prefills: compiled parts, items, states."""

    parts: list
    items: list
    state_slots: list
    states: dict = dataclasses.field(default_factory=dict)
    extra: dict = dataclasses.field(default_factory=dict)


_CACHE_EVENTS = []  # JAX's persistent compilation cache's hit and miss events, as they come
jax.monitoring.register_event_listener(
    lambda event, **kw: _CACHE_EVENTS.append(event.rsplit("/", 1)[-1])
    if event in ("/jax/compilation_cache/cache_hits", "/jax/compilation_cache/cache_misses") else None)


PUBLISH = True  # --publish 0: the token through PjRt (copy_to_host_async), the A/B's other side


def _compile(fn, specs, rows, donate=(), token=None):
    """`(compiled, {lower_s, xla_s, cache})`: tracing and lowering to StableHLO, then XLA's
    compile; `cache`: whether JAX's persistent compilation cache had the program (hit, miss, or
    `-` when it was not asked: a program that compiles in under a second is not kept). With
    `token=(leaf, n)`, the program's `leaf`-th output leaf, n tokens, is published to the host
    as the runner's is (`Published`; every JAX system alike, unless --publish 0)."""
    ring = None
    if token is not None and PUBLISH and TokenRing.usable(jax.devices()[0]):
        ring = token_ring(token[1], jax.devices()[0])  # the process's, as the runner's
        fn, specs = ring.wrap(fn, token[0]), [*specs, jax.ShapeDtypeStruct((1,), jnp.int32)]
    t = time.perf_counter()
    lowered = jax.jit(fn, donate_argnums=tuple(donate)).lower(*specs)
    t1 = time.perf_counter()
    n = len(_CACHE_EVENTS)
    compiled = lowered.compile(xla.compile_options(rows))  # every JAX system: kernjax's options
    seen = _CACHE_EVENTS[n:]
    cache = "hit" if "cache_hits" in seen else "miss" if "cache_misses" in seen else "-"
    times = {"lower_s": t1 - t, "xla_s": time.perf_counter() - t1, "cache": cache}
    return (compiled if ring is None else Published(compiled, ring, token[0])), times


def _donate(slots) -> tuple[int, ...]:
    return tuple(i for i, s in enumerate(slots) if s.role == "state")


class JaxSystem:
    """Shared by the four JAX systems: weights on the device, items, states, prefill loop.

    `build(s, rows, ctx)` compiles a program and returns an entry `{parts, state_slots, shape,
    extra, info}`; entries are cached by (rows, context) and reused by every prompt they fit.
    """

    torch = False

    def __init__(self, name, fam, cfg, args, weights, tokens):
        self.name, self.fam, self.cfg, self.args = name, fam, cfg, args
        self.weights, self.tokens = weights, tokens
        self.page = args.page or fam.page(cfg)  # rows a KV page holds
        self.compiled: dict = {}
        self.notes: list = []
        self.exact_rows: set = set()  # chunk rows whose shared-context program failed to build

    def rows_ok(self, s, rows):
        return None

    def context(self, s, rows):
        shared = not self.args.exact_context and rows < s and rows not in self.exact_rows
        ctx = (self.args.shared_context or max(self.args.prompts)) if shared else s
        return -(-ctx // self.page) * self.page

    def has(self, s, rows):
        return (rows, self.context(s, rows)) in self.compiled

    def make_items(self, entry, s, rows):
        pages = tuple(range(1, -(-s // self.page) + 1))
        toks = self.tokens[s]
        return [{k: jax.device_put(v) for k, v in
                 make_item([Piece(toks[a:b], a, pages)], entry["shape"]).items()}
                for a, b in chunks(s, rows)]

    def prepare(self, s, rows):
        """A handle for prompt `s` in chunks of `rows`; `(handle, compile info or None)`."""
        ctx = self.context(s, rows)
        # Prompts run in ascending order and every context is >= its prompt: a program of a
        # context shorter than this prompt is never used again.
        for k in [k for k in self.compiled if k[1] < s]:
            self.compiled.pop(k)
        info = None
        entry = self.compiled.get((rows, ctx))
        if entry is None:
            try:
                entry = self.build(s, rows, ctx)
            except Exception as e:  # noqa: BLE001
                self.compiled[(rows, ctx)] = e
                exact = -(-s // self.page) * self.page
                if ctx == exact:
                    raise
                msg = (f"{self.name} rows {rows}: the program with the largest context {ctx} "
                       f"failed ({one_line(e)[:200]}); its rows use context = S instead")
                say(f"[{self.name}] {msg}")
                self.notes.append(msg)
                self.exact_rows.add(rows)
                return self.prepare(s, rows)
            self.compiled[(rows, ctx)] = entry
            info = entry["info"]
        elif isinstance(entry, BaseException):
            raise RuntimeError(f"its program failed to build before: {one_line(entry)}")
        h = Handle(entry["parts"], self.make_items(entry, s, rows), entry["state_slots"])
        h.extra.update(entry["extra"])
        return h, info

    def close(self):
        self.compiled.clear()
        gc.collect()

    def to_numpy(self, logits):
        return np.asarray(jnp.asarray(logits, jnp.float32)).reshape(-1)

    def reset(self, h):
        h.states.clear()
        for sl in h.state_slots:
            h.states[sl.name] = jnp.zeros(sl.shape, sl.dtype)
        jax.block_until_ready(h.states)

    def prefill(self, h):
        outs = {}
        for item in h.items:
            carry = []
            for p in h.parts:
                args = [self.weights[sl.name] if sl.role == "weight" else
                        h.states[sl.name] if sl.role == "state" else item[sl.name]
                        for sl in p.inputs]
                res = p.fn(*args, *carry)
                carry = list(res[:p.departures])
                for (name, role), v in zip(p.outputs, res[p.departures:]):
                    if role == "state":
                        h.states[name] = v
                    else:
                        outs[name] = v
        self.issued = time.perf_counter()  # every program issued: the rest is the GPU's
        return self._token(outs["next_token"], (outs, h.states)), outs["logits"]

    def _token(self, tok, rest) -> int:
        """The token on the host, as the runner gets it: read from the ring the program published
        it into, after all the program's work (`self.done`: the time to first token; then PjRt
        is waited for, untimed), or (--publish 0) copied when ready and waited for with all."""
        if isinstance(tok, Token):
            value = int(np.asarray(tok).reshape(-1)[0])
            self.done = time.perf_counter()
            jax.block_until_ready(rest)
            return value
        if jax.default_backend() != "cpu":  # no host round trip
            tok.copy_to_host_async()
        jax.block_until_ready(rest)
        return int(np.asarray(tok).reshape(-1)[0])

    def _program(self, rows, ctx):
        t = time.perf_counter()
        program = self.fam.program(self.cfg, dtype=self.args.dtype, rows=rows, seqs=1, context=ctx,
                                   **({"page_rows": self.page} if self.args.page else {}))
        return program, time.perf_counter() - t

    def _parts_of(self, stages, rows):
        parts, info = [], []
        for st in stages:
            t = time.perf_counter()
            exp = export_stage(st)
            t_export = time.perf_counter() - t
            slots = (*st.inputs, *st.arrivals)
            tok = [(len(st.departures) + i, int(np.prod(o.shape)))
                   for i, o in enumerate(st.outputs) if o.name == "next_token"]
            fn, times = _compile(exp.call, [sl.spec() for sl in slots], rows, _donate(st.inputs),
                                 tok[0] if tok else None)
            parts.append(Part(fn, tuple(st.inputs), tuple((o.name, o.role) for o in st.outputs),
                              len(st.departures)))
            info.append({"calls": len(st.calls), "export_s": t_export, **times})
        return parts, info


class Kernjax(JaxSystem):
    def build(self, s, rows, ctx):
        program, t_trace = self._program(rows, ctx)
        if self.name == "kernjax":
            stages = [whole(program)]
        else:
            stages = list(cut(program, parse_at(self.args.at_of(self.cfg), program.calls)))
        parts, info = self._parts_of(stages, rows)
        return {"parts": parts, "shape": item_shape(program, self.page),
                "state_slots": [sl for st in stages for sl in st.inputs if sl.role == "state"],
                "extra": {"points": list(stages[0].points), "jaxprs": [program.jaxpr]},
                "info": {"trace_s": t_trace, "parts": info}}


class Unconstrained(JaxSystem):
    def build(self, s, rows, ctx):
        program, t_trace = self._program(rows, ctx)
        inputs, outputs = program.inputs, [(o.name, o.role) for o in program.outputs]
        leaf = [n for n, _ in outputs].index("next_token")
        fn = as_function(program.jaxpr, export.default_export_platform(), fences=False)  # cuda
        compiled, times = _compile(fn, [sl.spec() for sl in inputs], rows, _donate(inputs),
                                   (leaf, 1))
        return {"parts": [Part(compiled, tuple(inputs), tuple(outputs))],
                "shape": item_shape(program, self.page),
                "state_slots": [sl for sl in inputs if sl.role == "state"], "extra": {},
                "info": {"trace_s": t_trace, "parts": [{"export_s": 0.0, **times}]}}


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
    def rows_ok(self, s, rows):
        if rows < s:
            return ("one pass only: the public is_causal mask is top-left aligned, wrong for a "
                    "chunk after the first")
        return None

    def context(self, s, rows):
        return s

    def build(self, s, rows, ctx):
        impl = self.args.plain_attention
        if impl == "auto":
            impl = None if jax.default_backend() == "cpu" else "cudnn"
        specs = ({n: jax.ShapeDtypeStruct(x.shape, x.dtype) for n, x in self.weights.items()},
                 jax.ShapeDtypeStruct((s,), jnp.int32))
        try:
            fn, times = _compile(plain_forward(self.cfg, s, self.args.dtype, impl), specs, s,
                                 token=(0, 1))
        except Exception as e:  # noqa: BLE001
            if impl != "cudnn" or self.args.plain_attention != "auto":
                raise
            say(f"[{self.name}] S={s}: cudnn attention failed ({one_line(e)}); using xla")
            self.notes.append(f"jax-plain S={s}: cudnn attention failed to compile "
                              f"({one_line(e)[:200]}); measured with implementation='xla'")
            impl = None
            fn, times = _compile(plain_forward(self.cfg, s, self.args.dtype, impl), specs, s,
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


class Transformers:
    """`Qwen3ForCausalLM` with random init, bf16, sdpa attention, a DynamicCache across chunks."""

    torch = True

    def __init__(self, name, fam, cfg, args, tokens):
        import torch
        import transformers
        from transformers import Qwen3Config, Qwen3ForCausalLM
        self.name, self.cfg, self.args, self.torch_mod = name, cfg, args, torch
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
        dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
        prev = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device(self.device):
                model = Qwen3ForCausalLM(config)
        finally:
            torch.set_default_dtype(prev)
        self.model = model.to(device=self.device, dtype=dtype).eval()
        self.attn = getattr(self.model.config, "_attn_implementation", "?")
        import inspect
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

    def rows_ok(self, s, rows):
        return None

    def has(self, s, rows):
        return True

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


# -------------------------------------------------------------------------------------- setup

def random_weights(fam, cfg, dtype):
    """Every checkpoint tensor, random on the device: N(0, 0.02), norms near one (boundaries.py),
    and the weights the program derives from them at load (qwen3's fused qkv_proj)."""
    key = jax.random.key(0)
    out = {}
    for i, (name, shape) in enumerate(fam.weight_shapes(cfg)):
        x = jax.random.normal(jax.random.fold_in(key, i), shape, jnp.float32) * 0.02
        out[name] = (x + 1.0 if len(shape) == 1 else x).astype(dtype)
        del x
    for r in fam.derived(dataclasses.replace(cfg, dtype=jnp.dtype(dtype).name)):
        made = jax.jit(r.fn)(*(out[n] for n, _, _ in r.sources))
        out.update(zip((n for n, _, _ in r.outputs), made if isinstance(made, tuple) else (made,)))
    jax.block_until_ready(out)
    return out


def git_commit() -> tuple[str, bool | None]:
    """`$KERNJAX_COMMIT` when set (a copied tree's git may name another commit), else git's."""
    if os.environ.get("KERNJAX_COMMIT"):
        return os.environ["KERNJAX_COMMIT"], False
    try:
        c = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                           text=True, timeout=10)
        if c.returncode != 0:
            return "unknown", None
        d = subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True,
                           text=True, timeout=10)
        return c.stdout.strip(), bool(d.stdout.strip())
    except (OSError, subprocess.SubprocessError):
        return "unknown", None


def machine() -> dict:
    m = {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
         "platform": platform.platform()}
    try:
        import jaxlib
        m["jaxlib"] = jaxlib.__version__
    except Exception:  # noqa: BLE001
        pass
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                            "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
        if r.returncode == 0:
            m["nvidia_smi"] = r.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                   if line.startswith("model name"))
        m["cpu"] = cpu
    except (OSError, StopIteration):
        pass
    return m


# ------------------------------------------------------------------------------------ results

class Results:
    def __init__(self, args, cfg, out: Path):
        self.out = out
        self.args, self.cfg = args, cfg
        now = datetime.datetime.now(datetime.timezone.utc)
        commit, dirty = git_commit()
        dev = jax.devices()[0]
        self.data = {
            "gpu": dev.device_kind, "date": now.date().isoformat(), "commit": commit,
            "jax": jax.__version__, "rows": [],
            "time": now.isoformat(timespec="seconds"), "dirty": dirty,
            "command": " ".join(shlex.quote(a) for a in ["python", *sys.argv]),
            "model": cfg.name, "dtype": args.dtype, "iters": args.iters,
            "idle": args.idle, "min_row_s": args.min_row_s,
            "interleave": bool(getattr(args, "interleave", False)),
            "backend": jax.default_backend(), "machine": machine(),
            "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "compile_options": {f"rows >= {xla.GRAPHS_BELOW_ROWS}":
                                xla.compile_options(xla.GRAPHS_BELOW_ROWS)},
            "publish": PUBLISH,
            "page": args.page or models.named(cfg.name)[0].page(cfg),
            "mem_fraction": os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION"),
            "flops": dict(zip(("a", "b", "c"), flop_terms(cfg))), "peak_flops": args.peak,
            "cut_at": args.at_of(cfg), "exact_context": args.exact_context,
            "xla_cache": os.environ.get("KERNJAX_XLA_CACHE"),
            "max_seconds": args.max_seconds,
            "compile_s": {}, "compile": [], "details": [], "skipped": [], "errors": [],
            "notes": [],
        }

    def add_row(self, system, s, label, ms, detail):
        f = flops(self.cfg, s)
        self.data["rows"].append({"system": system, "prompt": s, "chunk": label,
                                  "ms": round(ms, 4), "tok_s": round(s / (ms / 1e3), 2),
                                  "mfu": round(f / (ms / 1e3) / self.args.peak, 6)})
        self.data["details"].append({"system": system, "prompt": s, "chunk": label, **detail})

    def add_compile(self, system, s, rows, ctx, info, first_s):
        total = info["trace_s"] + sum(p["export_s"] + p["lower_s"] + p["xla_s"]
                                      for p in info["parts"])
        self.data["compile_s"].setdefault(system, {})[f"rows={rows},context={ctx}"] = round(total, 3)
        self.data["compile"].append({"system": system, "prompt": s, "rows": rows, "context": ctx,
                                     "total_s": round(total, 3), "first_prefill_s": round(first_s, 3),
                                     **{k: v for k, v in info.items() if k != "parts"},
                                     "parts": [{k: (round(v, 3) if isinstance(v, float) else v)
                                                for k, v in p.items()} for p in info["parts"]]})

    def write(self, plot=False):
        self.out.mkdir(parents=True, exist_ok=True)
        tmp = self.out / "results.json.tmp"
        tmp.write_text(json.dumps(self.data, indent=1) + "\n")
        tmp.replace(self.out / "results.json")
        (self.out / "README.md").write_text(self.readme())
        if plot:
            try:
                self.plot()
            except Exception as e:  # noqa: BLE001
                say(f"plot failed: {one_line(e)}")

    def table(self) -> str:
        lines = ["| system | prompt | chunk | ms | tok/s | MFU % | SM MHz, W | runs |",
                 "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for r, x in zip(self.data["rows"], self.data["details"]):
            c = x.get("clock")
            lines.append(f"| {r['system']} | {r['prompt']} | {r['chunk']} | {r['ms']:.2f} | "
                         f"{r['tok_s']:.0f} | {100 * r['mfu']:.2f} | "
                         + (f"{c['sm_mhz']:.0f}, {c['watts']:.0f} |" if c else "- |")
                         + f" {x.get('iters', '-')} |")
        return "\n".join(lines)

    def ratios(self) -> str:
        """kernjax against every other system measured in this run, row by row: a change is read
        from these (an unchanged system in the same call), not from ms against another day's
        table (machines differ by 2-3 %, docs/lessons.md); then issue 6's goals, checked."""
        ms = {(r["system"], r["prompt"], str(r["chunk"])): r for r in self.data["rows"]}
        keys = sorted({(p, c) for s, p, c in ms if s == "kernjax"},
                      key=lambda k: (k[0], k[1] == "whole", k[1].isdigit() and int(k[1])))
        others = [s for s in SYSTEMS[1:] if any(k[0] == s for k in ms)]
        if not keys or not others:
            return ""
        lines = ["| prompt | chunk | kernjax ms | MFU % | " + " | ".join(
                     f"{s} / kernjax" for s in others) + " |",
                 "|---:|---:|---:|---:|" + "---:|" * len(others)]
        for p, c in keys:
            k = ms[("kernjax", p, c)]
            lines.append(f"| {p} | {c} | {k['ms']:.2f} | {100 * k['mfu']:.2f} | " + " | ".join(
                f"{ms[(s, p, c)]['ms'] / k['ms']:.3f}" if (s, p, c) in ms else "-"
                for s in others) + " |")
        lines += ["", "Issue 6's goals on this run (ratios of times, as named):", ""]
        for text, ok in goal_checks(ms, keys):
            lines.append(f"- {text}: **{'met' if ok else 'not met'}**")
        return "\n".join(lines)

    def compile_table(self, key: str = "compile") -> str:
        lines = ["| system | prompt | rows | context | trace s | export s | lower s | XLA compile s "
                 "| persistent cache | total s | first prefill s |",
                 "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|"]
        for c in self.data.get(key, []):
            col = {k: " + ".join(f"{p.get(k, 0.0):.1f}" for p in c["parts"])
                   for k in ("export_s", "lower_s", "xla_s")}
            cache = " + ".join(p.get("cache", "-") for p in c["parts"])
            lines.append(f"| {c['system']} | {c['prompt']} | {c['rows']} | {c['context']} | "
                         f"{c['trace_s']:.1f} | {col['export_s']} | {col['lower_s']} | "
                         f"{col['xla_s']} | {cache} | {c['total_s']:.1f} | "
                         f"{c['first_prefill_s']:.2f} |")
        return "\n".join(lines)

    def readme(self) -> str:
        d, a = self.data, self.args
        a_, b_, c_ = flop_terms(self.cfg)
        m = d["machine"]
        lines = [f"# Prefill of one prompt: {d['model']} on {d['gpu']}", "",
                 "- **Question:** time to first token of one prompt of S tokens, prefilled in "
                 "chunks, for kernjax (whole program, 2 stages, unconstrained jit) against plain "
                 "JAX and Hugging Face transformers.",
                 f"- **Script:** `experiments/prefill.py` (commit `{d['commit']}`"
                 + (", tree with local changes" if d.get("dirty") else "") + ").",
                 f"- **Machine:** {d['gpu']} ({m.get('nvidia_smi', d['backend'])}); "
                 f"{m.get('cpus')} CPUs ({m.get('cpu', '?')}), host `{m.get('host')}`.",
                 f"- **Date:** {d['time']}. **Versions:** Python {m.get('python')}, jax "
                 f"{d['jax']}, jaxlib {m.get('jaxlib', '?')}"
                 + (f", torch {d['torch']}, transformers {d['transformers']} "
                    f"(attention `{d.get('transformers_attn')}`)" if d.get("torch") else "")
                 + ".",
                 f"- **XLA_FLAGS** (every JAX system, one process): `{d['xla_flags']}`; "
                 f"compile options (`kernjax.runtime.xla.compile_options(rows)`, each JAX program): "
                 f"`{d.get('compile_options', {})}`; the token published to the host by "
                 f"the program (`kernjax.runtime.tokens`, as the runner's): {d.get('publish', False)}; "
                 f"XLA_PYTHON_CLIENT_PREALLOCATE=false, MEM_FRACTION={d['mem_fraction']}.",
                 "- **Command:**", "", "```", d["command"], "```", "",
                 "## Result", "",
                 f"{d['model']}, {d['dtype']}, random weights; median of `runs` timed prefills "
                 f"of the whole prompt ({a.iters}" + (f", or more for a short row: at least "
                 f"{a.min_row_s:g} s of them and their idle by the warm-up's time, at most 25" if a.min_row_s
                 else "") + ") after one untimed warm-up (ms = time to first token)"
                 + (f", each after {a.idle:g} s idle" if a.idle else ", back to back")
                 + ("; the JAX systems interleaved: at each row they take turns, one prefill "
                    "each per round, the order rotated every round (`--interleave`)"
                    if d.get("interleave") else "")
                 + ". tok/s = S / time; MFU = FLOPs(S) / time / "
                 f"{a.peak / 1e12:.0f} TFLOP/s. SM MHz, W: the GPU's clock (median) and power "
                 "(mean) while the timed prefills ran (nvidia-smi every 100 ms, read only; its "
                 "power reading lags, so a short row reads low). The peak is rated at 1830 MHz; "
                 "a GPU at its power limit runs lower "
                 "(`experiments/results/2026-12-01-h200-clocks/`).", "", self.table(), ""]
        if ratios := self.ratios():
            lines += ["Each system's time over kernjax's, same prompt and chunk, this run:", "",
                      ratios, ""]
        if d["skipped"]:
            lines += ["Rows not measured:", ""]
            lines += [f"- {x['system']} S={x['prompt']} chunk={x['chunk']}: {x['why']}"
                      for x in d["skipped"]]
            lines.append("")
        if d["errors"]:
            lines += ["Rows that failed (nothing recorded for them):", ""]
            lines += [f"- {x['system']} S={x['prompt']} chunk={x['chunk']}: `{x['error']}`"
                      for x in d["errors"]]
            lines.append("")
        toks = [x for x in d["details"] if x.get("token") is not None]
        if toks:
            lines += ["Checks, not timings: the next token, and the largest absolute difference "
                      "of the last row's logits from jax-plain's (same weights and prompt; torch "
                      "has its own random weights, so none) and from the same system's first "
                      "chunk setting at that prompt (chunking changes the order of the "
                      "arithmetic, not the function). With random weights and a tied head the "
                      "token is mostly the prompt's last token, so the logits are the check.", "",
                      "| system | prompt | chunk | token | vs jax-plain | vs own chunk |",
                      "|---|---:|---:|---:|---:|---|"]
            for x in toks:
                diff, own = x.get("logits_diff"), x.get("self_diff")
                lines.append(f"| {x['system']} | {x['prompt']} | {x['chunk']} | {x['token']} | "
                             + ("-" if diff is None else f"{diff:.4g}") + " | "
                             + ("-" if not own else f"{own['max_abs']:.4g} (chunk {own['chunk']})")
                             + " |")
            lines.append("")
        lines += ["## Compile time", "",
                  "Per program (system, rows, context): tracing the forward into a kernjax "
                  "Program, `export_stage`, then `jax.jit(...).lower` (tracing for "
                  "kernjax-unconstrained and jax-plain) and XLA's `compile` of each part "
                  "(kernjax-2stages: stage 0 + stage 1); then the first (warm-up) prefill after "
                  "it. transformers compiles nothing; its first prefill is its warm-up.", "", self.compile_table(), ""]
        if d.get("compile_second"):
            lines += ["Second start (`--second_start`): the same kernjax programs built again by a "
                      "new process (`--compile_only`) with this run's caches, as a restarted stage "
                      "builds them: tracing and export again, then XLA's compile, which JAX's "
                      "persistent compilation cache answers if it holds the program (`persistent "
                      "cache`: hit or miss; nothing run, so no first prefill).", "",
                      self.compile_table("compile_second"), ""]
        lines += ["## How it was measured", "",
                  "- One prompt of S random tokens (seed 0, the same for every system), one "
                  f"sequence per item, pages of {d.get('page', 16)} rows (kernjax), ids "
                  f"1..S/{d.get('page', 16)}. "
                  "A chunk >= S is S: one pass of S rows; "
                  "two chunk settings that give the same rows at one S share a program and a "
                  "measurement.",
                  "- kernjax: `models.qwen3.program(rows=chunk, seqs=1, context)` (context "
                  "below), "
                  "`stage.export_stage(cut.whole(program))`, `jax.jit(exp.call, donate_argnums="
                  "states)`, AOT-compiled once per (rows, context). Items from "
                  "`item.make_item([Piece(chunk tokens, start, pages)])`, put on the device "
                  "before the clock. States zeroed between prefills (outside the clock), fed back "
                  "after every chunk; no block between chunks, one `block_until_ready` at the end.",
                  f"- kernjax-2stages: `cut.cut(program, parse_at('{d['cut_at']}'))` (calls "
                  f"{d.get('cut_points', '?')}), each stage exported and jitted with its states "
                  "donated, run back to back in this process per chunk.",
                  "- kernjax-unconstrained: the same program's jaxpr as `trace.as_function(jaxpr, "
                  "platform, fences=False)`, jitted directly: every call's body inlined bare, "
                  "kernjax's own kernels (`on_gpu`) in place, no barriers (XLA may fuse across "
                  "calls), the whole program's CUDA graph cuts (since 2026-12-04: host work, "
                  "no kernel), so that the two differ by the barriers only.",
                  "- jax-plain: a plain JAX Qwen3 (no paging, dense per-layer KV `[S, KV, D]` "
                  "returned as the cache), attention `jax.nn.dot_product_attention(is_causal=True, "
                  f"implementation={d.get('plain_attention', 'cudnn')!r})`. Only one-pass rows: the "
                  "public `is_causal` is top-left aligned (query i sees keys 0..i), so for a "
                  "later chunk, whose queries sit at positions after the keys already cached, it "
                  "would hide most of the context; a bottom-right mask needs an explicit mask "
                  "array, which is not the fused causal path.",
                  "- transformers: `Qwen3ForCausalLM(Qwen3Config(same shapes))`, random init, "
                  "sdpa, under `torch.inference_mode()`; one chunk = one forward with the cache "
                  "(`DynamicCache`, created by the first chunk) carried, logits of the last row "
                  "only; `torch.cuda.synchronize()` before the clock is read. Run last, its model "
                  "freed after.",
                  "- Programs are compiled once per (system, rows, context) and reused across "
                  "iterations, chunk settings with the same rows and prompts: "
                  + ("every program has context = S (`--exact_context`)." if d["exact_context"]
                     else "a chunk program (rows < S) is compiled once with context = the largest "
                     "prompt and serves every S (the attention in `kernjax/kernels/attention.py` visits "
                     "only the key blocks the item's sequence reaches, so the page table's width "
                     "adds no attention work; the states are sized for the largest prompt); a "
                     "one-pass program (rows = S) has context S, one per S.")
                  + " The compile table lists each program once, at the first prompt that used "
                  "it. Compiling runs with kernjax's XLA set-up (`kernjax/runtime/xla.py`: each GEMM's "
                  + ("algorithm chosen untimed" if "exclude_nondeterministic_ops=true" in
                     d.get("xla_flags", "") else "kernel timed by XLA (XLA_FLAGS above)")
                  + ", JAX's persistent compilation cache) in "
                  + ("a fresh directory for this run: every program's first compile is a "
                     "cold one." if d["xla_cache"] and "prefill-xla-" in
                     d["xla_cache"] else f"`{d['xla_cache']}`, set by the caller (maybe warm)."),
                  f"- FLOPs(S) = {a_:.4g}·S + {b_:.6g}·S² + {c_:.4g} (2 × non-embedding weights "
                  "per token; causal attention 2·2·layers·heads·head_dim·S²/2; the lm_head of "
                  "the last row). For qwen3-4b this is 7.267e9·S + 294912·S² + 0.778e9.",
                  "- `--max_seconds` "
                  + (f"{d['max_seconds']:.0f}" if d["max_seconds"] else "(off)")
                  + ": rows are started only while time is left; each system gets a share of "
                  "the time left in proportion to its distinct rows plus two for each program it "
                  "compiles, a row whose predicted time (the "
                  "longest compile so far when the row needs a new program, + 2 × the previous prefill of that chunk setting, or of a one-pass "
                  "row, scaled by (S/S_prev)²) does not fit is skipped, and iterations are cut to what fits "
                  "after the warm-up (at least one).",
                  "- Systems run in the order jax-plain, kernjax-unconstrained, kernjax, "
                  "kernjax-2stages, transformers (cheap ones first, so their unused time goes to "
                  "the later ones; torch last)."]
        lines += [f"- {n}" for n in d["notes"]]
        lines.append("")
        return "\n".join(lines)

    def plot(self):
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        series: dict = {}
        for r in self.data["rows"]:
            series.setdefault((r["system"], str(r["chunk"])), []).append((r["prompt"], r["mfu"]))
        fig, ax = plt.subplots(figsize=(9, 5.5))
        systems = sorted({s for s, _ in series})
        color = {s: f"C{i}" for i, s in enumerate(systems)}  # one colour a system
        style = {"whole": "-", "2048": "--", "512": ":"}  # one line style a chunk setting
        for (system, chunk), pts in sorted(series.items()):
            pts.sort()
            ax.plot([p for p, _ in pts], [100 * m for _, m in pts], marker="o",
                    color=color[system], linestyle=style.get(chunk, "-."),
                    label=f"{system}, chunk {chunk}")
        ax.set_xscale("log", base=2)
        prompts = sorted({r["prompt"] for r in self.data["rows"]})
        if prompts:
            ax.set_xticks(prompts, [str(p) for p in prompts])
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel(f"MFU % (of {self.args.peak / 1e12:.0f} TFLOP/s)")
        ax.set_title(f"prefill {self.data['model']} on {self.data['gpu']}")
        ax.grid(True, alpha=0.3)
        if series:
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(self.out / "mfu.png", dpi=120)
        plt.close(fig)


# ---------------------------------------------------------------------------------------- run

class Clock:
    def __init__(self, max_seconds):
        self.end = time.time() + max_seconds if max_seconds and max_seconds > 0 else math.inf

    def left(self):
        return self.end - time.time()


def grid(args, system, prompts):
    """`(S, label, rows)` of every row of `system`, S ascending, chunks in the given order."""
    out = []
    for s in prompts:
        for label in args.chunks:
            rows = s if label == "whole" or label >= s else label
            out.append((s, label, rows))
    return out


def share_weight(system_name, args, prompts):
    """A system's claim on `--max_seconds`: its distinct rows, and two more for each program it
    compiles (a compile, ~10 s for qwen3-4b on an H200, costs as much as running a few rows):
    jax-plain runs few rows but compiles one program for each of them."""
    g = grid(args, system_name, prompts)
    if system_name == "jax-plain":
        g = [x for x in g if x[2] == x[0]]
    programs = 0 if system_name == "transformers" else \
        len({rows if rows < s else ("one pass", s) for s, _, rows in g})
    return max(1, len({(s, rows) for s, _, rows in g}) + 2 * programs)


def skip_why(o, args, s, label, rows) -> str | None:
    """Why system `o` does not run this row (its own reason, or --skip), or None."""
    why = o.rows_ok(s, rows)
    if why is None and f"{o.name}:{s}:{label}" in args.skip:
        why = "skipped by --skip"
    return why


def logit_checks(o, s, label, lg, ref_logits, own) -> tuple:
    """`(diff, self_diff)` of a row's last logits: against jax-plain's at S (which its own first
    row sets), and against the system's first row at S (`own[(system, S)]`, set here)."""
    diff = self_diff = None
    if o.name == "jax-plain" and s not in ref_logits:
        ref_logits[s] = lg
    elif not o.torch and s in ref_logits and ref_logits[s].shape == lg.shape:
        diff = float(np.max(np.abs(lg - ref_logits[s])))
    if (o.name, s) in own:
        self_diff = {"chunk": own[(o.name, s)][0],
                     "max_abs": float(np.max(np.abs(lg - own[(o.name, s)][1])))}
    else:
        own[(o.name, s)] = (label, lg)
    return diff, self_diff


def row_detail(s, label, rows, times, first, token, checks, window, issue) -> dict:
    """A timed row's record: its runs, warm-up, token, logit checks, window and host issue."""
    detail = {"rows": rows, "chunks": len(chunks(s, rows)), "iters": len(times),
              "times_ms": [round(x * 1e3, 3) for x in times],
              "first_prefill_s": round(first, 3), "token": token, "logits_diff": checks[0],
              "self_diff": checks[1], "chunk_first": label, "window": window}
    if issue:  # the host's time to issue every program, median (the GPU runs meanwhile)
        detail["issue_ms"] = round(statistics.median(issue) * 1e3, 3)
    return detail


def warm_up(o, res: Results, s, rows, h, info) -> float:
    """The row's untimed first prefill, after which its compile (if it built one) is recorded,
    with the cut's points and plain JAX's attention: its seconds."""
    o.reset(h)
    t = time.perf_counter()
    o.prefill(h)
    first = time.perf_counter() - t
    if info is not None:
        res.add_compile(o.name, s, rows, sysobj_context(o, s, rows), info, first)
        if isinstance(h, Handle) and "points" in h.extra:
            res.data["cut_points"] = h.extra["points"]
        if "attention" in info:
            res.data["plain_attention"] = info["attention"]
    return first


def timed_prefill(o, h, idle: float) -> tuple:
    """One timed prefill from zeroed states after `idle` s: (seconds, the host's seconds to
    issue every program or None, token, logits)."""
    o.reset(h)
    time.sleep(idle)
    o.done = o.issued = None
    t = time.perf_counter()
    token, logits = o.prefill(h)
    done = (getattr(o, "done", None) or time.perf_counter()) - t
    issued = getattr(o, "issued", None)  # JAX systems: when the host had issued all
    return done, (issued - t if issued else None), token, logits


def run_system(sysobj, args, res: Results, prompts, clock: Clock, share_end: float, ref_logits):
    name = sysobj.name
    measured: dict = {}  # (S, rows) -> (ms, detail)
    history: list = []  # (S, chunk label or "one pass", prefill seconds)
    own: dict = {}  # (system, S) -> (chunk label, last row's logits) of its first row at S
    failed: dict = {}  # (S, rows) -> the chunk label whose row failed
    worst_compile = 0.0
    for s, label, rows in grid(args, name, prompts):
        tag = f"[{name}] S={s} chunk={label}"
        if why := skip_why(sysobj, args, s, label, rows):
            res.data["skipped"].append({"system": name, "prompt": s, "chunk": label, "why": why})
            say(f"{tag}: skipped ({why})")
            continue
        if (s, rows) in failed:
            why = f"same program and rows as chunk {failed[(s, rows)]}, which failed"
            res.data["skipped"].append({"system": name, "prompt": s, "chunk": label, "why": why})
            say(f"{tag}: skipped ({why})")
            continue
        if (s, rows) in measured:
            ms, detail = measured[(s, rows)]
            res.add_row(name, s, label, ms, {**detail, "same_as": detail["chunk_first"]})
            say(f"{tag}: rows {rows}, same program as chunk {detail['chunk_first']}: "
                f"{ms:.2f} ms")
            res.write()
            continue
        left = min(clock.left(), share_end - time.time())
        if clock.left() <= 0:
            why = "not started: --max_seconds reached"
        elif left <= 0:
            why = "not started: this system's share of --max_seconds is used"
        else:
            why = None
            kind = "one pass" if rows == s else label
            prev = [(ps, t) for ps, pk, t in history if pk == kind]
            need = 0.0 if sysobj.has(s, rows) else worst_compile
            if prev:
                ps, t = prev[-1]
                need += 2 * t * (s / ps) ** 2
            if need > left:
                why = (f"not started: predicted {need:.0f} s (compile + warm-up + 1 iter) > "
                       f"{max(left, 0):.0f} s left for this system")
        if why:
            res.data["skipped"].append({"system": name, "prompt": s, "chunk": label, "why": why})
            say(f"{tag}: {why}")
            continue
        h = None
        try:
            h, info = sysobj.prepare(s, rows)
            if args.compile_only:
                if info is not None:
                    res.add_compile(name, s, rows, sysobj_context(sysobj, s, rows), info, 0.0)
                    say(f"{tag}: compiled in {res.data['compile'][-1]['total_s']:.1f} s")
                continue
            first = warm_up(sysobj, res, s, rows, h, info)
            if info is not None:
                worst_compile = max(worst_compile, res.data["compile"][-1]["total_s"])
            left = min(clock.left(), share_end - time.time())
            # a short row gets more runs: --min_row_s of them and their idle, at most 25
            per_run = max(first + args.idle, 1e-9)
            iters = max(args.iters, min(25, math.ceil(args.min_row_s / per_run)))
            if math.isfinite(left):
                iters = max(1, min(iters, int(left // per_run)))
            times, spans, issue = [], [], []
            for _ in range(iters):
                wall = time.time()
                sec, issued, token, logits = timed_prefill(sysobj, h, args.idle)
                times.append(sec)
                issue += [issued] * (issued is not None)
                spans.append((wall, time.time()))
            ms = statistics.median(times) * 1e3
            diff, self_diff = logit_checks(sysobj, s, label, sysobj.to_numpy(logits), ref_logits,
                                           own)
            del logits
            detail = row_detail(s, label, rows, times, first, token, (diff, self_diff),
                                [spans[0][0], spans[-1][1]], issue)
            if s in args.profile and not sysobj.torch:
                detail["profile"] = profile_row(sysobj, h, res.out, f"{name}-{s}-{label}", tag)
            measured[(s, rows)] = (ms, detail)
            history.append((s, "one pass" if rows == s else label, statistics.median(times)))
            res.add_row(name, s, label, ms, detail)
            r = res.data["rows"][-1]
            comp = (f"compile {res.data['compile'][-1]['total_s']:.1f} s, "
                    if info is not None else "")
            say(f"{tag}: rows {rows} x {detail['chunks']}, {comp}first prefill {first:.2f} s, "
                f"{ms:.2f} ms median of {iters}, {r['tok_s']:.0f} tok/s, MFU "
                f"{100 * r['mfu']:.2f}%, token {token}"
                + ("" if diff is None else f", max|dlogits| vs jax-plain {diff:.4g}")
                + ("" if self_diff is None else
                   f", vs its chunk {self_diff['chunk']} {self_diff['max_abs']:.4g}"))
        except Exception as e:  # noqa: BLE001  (one row failing never stops the run)
            msg = one_line(e)
            res.data["errors"].append({"system": name, "prompt": s, "chunk": label, "error": msg})
            failed[(s, rows)] = label
            say(f"{tag}: FAILED {msg}")
        finally:
            if isinstance(h, Handle):
                h.states.clear()
                h.items.clear()
            h = None
            gc.collect()
        res.write()


def run_interleaved(sysobjs, args, res: Results, prompts, clock: Clock, ref_logits) -> None:
    """`--interleave`: each row's JAX systems take turns, one timed prefill each per round, the
    order rotated every round, so that a ratio between them is read under the same clocks and
    power (back to back, a GPU at its power limit drifts by 2-3 % within a call, and a system
    timed minutes after another sees another GPU). Each system's row is the median of its own
    runs, as in the sequential order; compile and warm-up as there, before the first round."""
    measured: dict = {}  # (S, rows) -> {system: (ms, detail)}
    own: dict = {}  # (system, S) -> (chunk label, last row's logits) of its first row at S
    waiting: list = []  # (S, recorded detail, logits): rows run before jax-plain's at S
    for s, label, rows in grid(args, None, prompts):
        if (s, rows) in measured:
            for name, (ms, detail) in measured[(s, rows)].items():
                res.add_row(name, s, label, ms, {**detail, "same_as": detail["chunk_first"]})
            continue
        members, handles, firsts = [], {}, {}
        for o in sysobjs:
            tag = f"[{o.name}] S={s} chunk={label}"
            why = skip_why(o, args, s, label, rows)
            if why is None and clock.left() <= 0:
                why = "not started: --max_seconds reached"
            if why:
                res.data["skipped"].append({"system": o.name, "prompt": s, "chunk": label,
                                            "why": why})
                say(f"{tag}: skipped ({why})")
                continue
            try:
                h, info = o.prepare(s, rows)
                firsts[o.name] = warm_up(o, res, s, rows, h, info)
                members.append(o)
                handles[o.name] = h
            except Exception as e:  # noqa: BLE001  (one system failing never stops the row)
                res.data["errors"].append({"system": o.name, "prompt": s, "chunk": label,
                                           "error": one_line(e)})
                say(f"{tag}: FAILED {one_line(e)}")
        if not members:
            continue
        per_round = sum(firsts[o.name] + args.idle for o in members)
        rounds = max(args.iters, min(25, math.ceil(args.min_row_s * len(members) / per_round)))
        if math.isfinite(clock.left()):
            rounds = max(1, min(rounds, int(clock.left() // per_round)))
        times = {o.name: [] for o in members}
        issue = {o.name: [] for o in members}
        logits, tokens, failed = {}, {}, set()
        start = time.time()
        for r in range(rounds):
            for o in members[r % len(members):] + members[:r % len(members)]:
                if o.name in failed:
                    continue
                h = handles[o.name]
                try:
                    sec, issued, tokens[o.name], logits[o.name] = timed_prefill(o, h, args.idle)
                    times[o.name].append(sec)
                    issue[o.name] += [issued] * (issued is not None)
                except Exception as e:  # noqa: BLE001
                    failed.add(o.name)
                    res.data["errors"].append({"system": o.name, "prompt": s, "chunk": label,
                                               "error": one_line(e)})
                    say(f"[{o.name}] S={s} chunk={label}: FAILED {one_line(e)}")
        window = [start, time.time()]
        measured[(s, rows)] = {}
        for o in members:
            if o.name in failed or not times[o.name]:
                continue
            lg = o.to_numpy(logits.pop(o.name))
            diff, self_diff = logit_checks(o, s, label, lg, ref_logits, own)
            ms = statistics.median(times[o.name]) * 1e3
            detail = row_detail(s, label, rows, times[o.name], firsts[o.name], tokens[o.name],
                                (diff, self_diff), window, issue[o.name])
            detail["interleaved"] = [m.name for m in members]
            if s in args.profile:
                detail["profile"] = profile_row(o, handles[o.name], res.out,
                                                f"{o.name}-{s}-{label}", f"[{o.name}] S={s}")
            measured[(s, rows)][o.name] = (ms, detail)
            res.add_row(o.name, s, label, ms, detail)
            if diff is None and o.name != "jax-plain":  # jax-plain's row may come later
                waiting.append((s, res.data["details"][-1], lg))
            r_ = res.data["rows"][-1]
            say(f"[{o.name}] S={s} chunk={label}: rows {rows}, {ms:.2f} ms median of "
                f"{len(times[o.name])} (interleaved with {len(members) - 1}), MFU "
                f"{100 * r_['mfu']:.2f}%, token {tokens[o.name]}"
                + ("" if diff is None else f", max|dlogits| vs jax-plain {diff:.4g}"))
        for x in [w for w in waiting if w[0] in ref_logits]:  # jax-plain's logits, now there
            waiting.remove(x)
            if ref_logits[x[0]].shape == x[2].shape:
                x[1]["logits_diff"] = float(np.max(np.abs(x[2] - ref_logits[x[0]])))
        for o in members:
            handles[o.name].states.clear()
            handles[o.name].items.clear()
        handles.clear()
        gc.collect()
        res.write()


def profile_row(sysobj, h, out: Path, stem: str, tag: str) -> dict | None:
    """One more prefill of the row under `jax.profiler.trace`: its GPU time by call
    (experiments/gpuprofile.py), printed, and written to `out/profile-<stem>.json`."""
    import gpuprofile as kprofile  # experiments/gpuprofile.py, this script's directory

    tmp = tempfile.mkdtemp(prefix="prefill-trace-")
    try:
        sysobj.reset(h)
        with jax.profiler.trace(tmp):
            sysobj.done = None
            t = time.perf_counter()
            sysobj.prefill(h)  # the run's own clock, as timed runs take it: not their span
            wall = ((getattr(sysobj, "done", None) or time.perf_counter()) - t) * 1e3
        texts = [getattr(p, "fn", p).as_text() for p in h.parts]  # jax-plain's is the Compiled
        prof = {"wall_ms": wall, **kprofile.summarize(tmp, texts, h.extra.get("jaxprs", ()))}
        try:  # the host beside the GPU: a late copy or launch at the end is in the wall clock
            prof["host"] = kprofile.host_timeline(tmp, kprofile.kernels(tmp))
        except Exception as e:  # noqa: BLE001
            prof["host"] = {"error": one_line(e)}
        try:  # the host's issue of each program, step by step
            prof["host_inside"] = kprofile.host_inside(tmp)
            prof["host_execute"] = kprofile.host_inside(tmp, "RawLoadedExecutable::Execute", 6, 10)
        except Exception as e:  # noqa: BLE001
            prof["host_inside"] = {"error": one_line(e)}
    except Exception as e:  # noqa: BLE001  (a profile is extra: the row stands without it)
        say(f"{tag}: profile failed: {one_line(e)}")
        return None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    (out / f"profile-{stem}.json").write_text(json.dumps(prof, indent=1) + "\n")
    say(f"{tag}: profile\n{kprofile.table(prof)}")
    return {k: v for k, v in prof.items() if k != "top_kernels"}


def second_start(args, res: Results) -> None:
    """Compiles the kernjax and kernjax-2stages programs of `--second_start`'s prompts again in a
    new process with this run's cache (JAX's persistent compilation cache): what a restarted
    stage pays. Recorded as `compile_second`."""
    systems = [x for x in ("kernjax", "kernjax-2stages") if x in args.systems]
    if not systems:
        return
    out = Path(tempfile.mkdtemp(prefix="prefill-second-"))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--compile_only", "--model", args.model,
           "--dtype", args.dtype, "--prompts", ",".join(map(str, args.second_start)),
           "--chunks", ",".join(map(str, args.chunks)), "--systems", ",".join(systems),
           "--max_seconds", "0", "--out", str(out),
           # the chunk programs this run compiled, not ones sized for the second start's prompts
           "--shared_context", str(args.shared_context or max(args.prompts))]
    if args.at:
        cmd += ["--at", args.at]
    if args.exact_context:
        cmd.append("--exact_context")
    say(f"second start: {' '.join(cmd[2:])}")
    t = time.time()
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                           env={**os.environ, "KERNJAX_XLA_CACHE": os.environ["KERNJAX_XLA_CACHE"]})
        if r.returncode:
            raise RuntimeError(f"exit {r.returncode}: {r.stderr.strip()[-300:]}")
        res.data["compile_second"] = json.loads((out / "results.json").read_text())["compile"]
        say(f"second start: {len(res.data['compile_second'])} programs in {time.time() - t:.0f} s")
    except Exception as e:  # noqa: BLE001  (an extra measurement: the run stands without it)
        res.data["notes"].append(f"second start failed: {one_line(e)}")
        say(f"second start failed: {one_line(e)}")
    finally:
        shutil.rmtree(out, ignore_errors=True)


def sysobj_context(sysobj, s, rows):
    return sysobj.context(s, rows) if hasattr(sysobj, "context") else s


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-4b")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--prompts", default="1024,4096,8192,32768", help="prompt lengths S")
    ap.add_argument("--chunks", default="512,2048,whole", help="chunk sizes; `whole` = S")
    ap.add_argument("--systems", default="all", help=f"comma-separated of {','.join(SYSTEMS)}")
    ap.add_argument("--iters", type=int, default=3, help="timed prefills per row (median)")
    ap.add_argument("--min_row_s", type=float, default=0.5, help="a row whose warm-up took t "
                    "seconds gets at least min_row_s / (t + idle) timed prefills (at most 25): a "
                    "15 ms row's median of 3 moved by 5 %% between tables")
    ap.add_argument("--page", type=int, default=0, help="rows a KV page holds in kernjax's "
                    "programs (default: the model's, `page(cfg)`: 128 for qwen3-4b); 16 for an "
                    "A/B against pages gathered before FlashAttention-3")
    ap.add_argument("--publish", type=int, default=1, help="1: every JAX system's program "
                    "publishes its token to the host itself, as kernjax's runner does "
                    "(`kernjax.runtime.tokens`), and a row's time ends when the host has it; 0: the "
                    "token through PjRt, its time ending when every output is ready (the A/B)")
    ap.add_argument("--idle", type=float, default=0.0,
                    help="seconds the GPU idles before each timed prefill: one prompt's time to "
                    "first token on a quiet server (a GPU at its power limit runs a burst "
                    "faster than back to back; experiments/results/2026-12-01-h200-clocks/)")
    ap.add_argument("--interleave", action="store_true",
                    help="the JAX systems take turns at each row, one timed prefill each per "
                    "round, the order rotated every round (ratios between them read under the "
                    "same clocks; --min_row_s counts per system); transformers after them, alone")
    ap.add_argument("--out", default=None,
                    help="default <UTC date>-h200-prefill/ in $OUT when set (the device "
                    "machine's), else in experiments/results/")
    ap.add_argument("--max_seconds", type=float, default=480,
                    help="start no row after this many seconds (0: no limit)")
    ap.add_argument("--at", default=None, help="the 2-stage cut (cli.parse_at syntax); default "
                    "18, or the middle layer of a model with fewer layers")
    ap.add_argument("--skip", default="", help="rows to skip: system:S:chunk,...")
    ap.add_argument("--exact_context", action="store_true",
                    help="context = S for every program (default: chunk programs are compiled "
                    "once with the largest prompt's context and shared by all prompts)")
    ap.add_argument("--shared_context", type=int, default=0,
                    help="the context of the shared chunk programs (default 0: the largest "
                    "prompt); --second_start passes this run's")
    ap.add_argument("--plain_attention", default="auto",
                    help="jax-plain's implementation: auto (cudnn, xla on the CPU), cudnn, xla")
    ap.add_argument("--profile", nargs="?", const="all", default="",
                    help="after each JAX row of these prompt lengths (comma-separated; alone: "
                    "every row), one more prefill under jax.profiler.trace: GPU time by call "
                    "(experiments/gpuprofile.py), printed and in profile-*.json")
    ap.add_argument("--second_start", default="",
                    help="prompt lengths (comma-separated) whose kernjax and kernjax-2stages "
                    "programs a second process compiles again at the end, with this run's "
                    "caches: the compile time of a restarted stage")
    ap.add_argument("--compile_only", action="store_true",
                    help="build (trace, export, compile) every row's program, run nothing: "
                    "what --second_start's process does")
    ap.add_argument("--peak", type=float, default=PEAK, help="peak FLOP/s for MFU")
    ap.add_argument("--xla_flags", default="", help="appended to XLA_FLAGS after kernjax's own")
    ap.add_argument("--replot", metavar="DIR", help="only rewrite DIR's README.md and mfu.png from "
                    "its results.json (alone, no other flag)")
    a = ap.parse_args(argv)
    a.prompts = sorted({int(x) for x in a.prompts.split(",") if x.strip()})
    a.chunks = [x.strip() if x.strip() == "whole" else int(x) for x in a.chunks.split(",")
                if x.strip()]
    a.systems = list(SYSTEMS) if a.systems == "all" else [x.strip() for x in a.systems.split(",")]
    bad = [x for x in a.systems if x not in SYSTEMS]
    if bad:
        ap.error(f"unknown systems {bad}; known: {', '.join(SYSTEMS)}")
    a.systems = [x for x in RUN_ORDER if x in a.systems]
    a.skip = {x.strip() for x in a.skip.split(",") if x.strip()}
    a.profile = set(a.prompts) if a.profile == "all" else \
        {int(x) for x in a.profile.split(",") if x.strip()}
    a.second_start = sorted({int(x) for x in a.second_start.split(",") if x.strip()})
    if a.shared_context and a.shared_context < max(a.prompts):
        ap.error(f"--shared_context {a.shared_context} is shorter than the longest prompt "
                 f"{max(a.prompts)}: give at least that, or 0 for the longest prompt")
    if a.page not in (0, 16, 128):
        ap.error(f"--page {a.page}: FlashAttention-3 (kj_fa3) takes pages of 16 (gathered) or "
                 "128 (read in place); give one of those, or 0 for the model's")
    if a.plain_attention == "xla":
        a.plain_attention = None
    at = a.at
    a.at_of = lambda cfg: at or ("18" if cfg.layers > 18 else str(cfg.layers // 2))
    return a


def replot(out: Path) -> None:
    """Rewrites README.md and mfu.png of a results directory from its results.json (for a
    machine without matplotlib: run this where it is installed)."""
    data = json.loads((out / "results.json").read_text())
    _, cfg = models.named(data["model"])
    res = Results.__new__(Results)
    res.out, res.cfg, res.data = out, cfg, data
    res.args = argparse.Namespace(iters=data["iters"], peak=data["peak_flops"],
                                  idle=data.get("idle", 0.0), min_row_s=data.get("min_row_s", 0))
    res.write(plot=True)
    say(f"rewrote {out}/README.md and mfu.png from results.json")


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "--replot":
        return replot(Path(sys.argv[2]))
    args = parse_args()
    global PUBLISH
    PUBLISH = bool(args.publish)
    if args.xla_flags:
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {args.xla_flags}".strip()
    fam, cfg = models.named(args.model)
    day = datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    base = Path(os.environ["OUT"]) if os.environ.get("OUT") else REPO / "experiments" / "results"
    out = Path(args.out) if args.out else base / f"{day}-h200-prefill"
    clock = Clock(args.max_seconds)
    t_start = time.time()

    def on_term(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)

    res = Results(args, cfg, out)
    smi_file = Path(tempfile.mkdtemp()) / "smi.csv"  # each row's SM clock and power, read only
    smi = clocks.sample(smi_file, every_ms=100)
    a_, b_, c_ = flop_terms(cfg)
    say(f"{cfg.name} {args.dtype} on {res.data['gpu']} ({jax.default_backend()}), jax "
        f"{jax.__version__}; prompts {args.prompts}, chunks {args.chunks}, systems "
        f"{args.systems}, iters {args.iters}, max_seconds {args.max_seconds or 'off'}; out {out}")
    say(f"FLOPs(S) = {a_:.4g} S + {b_:.6g} S^2 + {c_:.4g}"
        + (f" (qwen3-4b constants: 7.267e9, 294912, 0.778e9; ratios {a_ / 7.267e9:.4f}, "
           f"{b_ / 294912:.4f}, {c_ / 0.778e9:.4f})" if cfg.name == "qwen3-4b" else ""))
    say(f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')}")
    for s in args.prompts:
        if s > cfg.max_positions:
            res.data["notes"].append(f"S={s} is past max_position_embeddings "
                                     f"{cfg.max_positions}; its rows will fail")
    res.write()

    rng = np.random.default_rng(0)
    tokens = {s: rng.integers(0, cfg.vocab, s).astype(np.int32) for s in args.prompts}
    jax_systems = [x for x in args.systems if x != "transformers"]
    weights = None
    ref_logits: dict = {}
    left_rows = {x: share_weight(x, args, args.prompts) for x in args.systems}
    try:
        if jax_systems and not args.compile_only:
            t = time.perf_counter()
            weights = random_weights(fam, cfg, args.dtype)
            nbytes = sum(x.nbytes for x in weights.values())
            say(f"random weights on {jax.devices()[0]}: {len(weights)} tensors, "
                f"{nbytes / 2**30:.2f} GiB in {time.perf_counter() - t:.1f} s")
        classes = {"kernjax": Kernjax, "kernjax-2stages": Kernjax,
                   "kernjax-unconstrained": Unconstrained, "jax-plain": Plain}
        if args.interleave and jax_systems and not args.compile_only:
            objs = []
            try:
                objs = [classes[x](x, fam, cfg, args, weights, tokens) for x in jax_systems]
                # the JAX systems' share of --max_seconds, as they would have one after another
                sub = Clock(0)
                if math.isfinite(clock.left()):
                    share = clock.left() * sum(left_rows[x] for x in jax_systems) / sum(
                        left_rows.values())
                    sub.end = time.time() + share
                say(f"interleaved: {', '.join(jax_systems)}" + (
                    f", {sub.left():.0f} s of {clock.left():.0f} s left"
                    if math.isfinite(sub.left()) else ""))
                run_interleaved(objs, args, res, args.prompts, sub, ref_logits)
                for o in objs:
                    res.data["notes"] += o.notes
            finally:
                for o in objs:
                    o.close()
                objs = None
                gc.collect()
                res.write(plot=True)
            for x in jax_systems:
                left_rows.pop(x, None)
        for name in [x for x in args.systems if x in left_rows]:
            total = sum(left_rows[x] for x in args.systems if x in left_rows)
            share = clock.left() * left_rows[name] / total if math.isfinite(clock.left()) \
                else math.inf
            share_end = time.time() + share
            left_rows.pop(name)
            if clock.left() <= 0:
                for s, label, _ in grid(args, name, args.prompts):
                    res.data["skipped"].append({"system": name, "prompt": s, "chunk": label,
                                                "why": "not started: --max_seconds reached"})
                say(f"[{name}] not started: --max_seconds reached")
                res.write()
                continue
            say(f"[{name}] start" + (f", {share:.0f} s of {clock.left():.0f} s left"
                                     if math.isfinite(share) else ""))
            sysobj = None
            try:
                if name == "transformers":
                    if weights is not None:  # JAX keeps its pool; at least drop our arrays
                        weights.clear()
                        weights = None
                        gc.collect()
                    try:
                        sysobj = Transformers(name, fam, cfg, args, tokens)
                    except ImportError as e:
                        note = f"transformers skipped: {one_line(e)}"
                        res.data["notes"].append(note)
                        say(f"[{name}] {note}")
                        continue
                    res.data.update(torch=sysobj.versions["torch"],
                                    transformers=sysobj.versions["transformers"],
                                    transformers_attn=sysobj.versions["attn_implementation"],
                                    transformers_logits=sysobj.versions["logits_arg"])
                else:
                    sysobj = classes[name](name, fam, cfg, args, weights, tokens)
                run_system(sysobj, args, res, args.prompts, clock, share_end, ref_logits)
                res.data["notes"] += getattr(sysobj, "notes", [])
            except Exception as e:  # noqa: BLE001  (a system failing never loses the others)
                msg = one_line(e)
                res.data["errors"].append({"system": name, "prompt": None, "chunk": None,
                                           "error": msg})
                say(f"[{name}] FAILED {msg}")
            finally:
                if sysobj is not None:
                    try:
                        sysobj.close()
                    except Exception as e:  # noqa: BLE001
                        say(f"[{name}] close failed: {one_line(e)}")
                sysobj = None
                gc.collect()
                res.write(plot=True)
    except KeyboardInterrupt as e:
        res.data["notes"].append(f"interrupted ({e}); rows after it were not run")
        say(f"interrupted ({e}); writing what there is")
    finally:
        if args.second_start and not args.compile_only:
            second_start(args, res)
        res.data["wall_s"] = round(time.time() - t_start, 1)
        if smi:  # nvidia-smi writes its file in blocks: read once it has ended
            smi.terminate()
            smi.wait()
            samples = clocks.read_samples(smi_file)
            for x in res.data["details"]:
                x["clock"] = clocks.during(samples, [x["window"]]) if "window" in x else None
        res.write(plot=True)
        say(f"\nwrote {out}/results.json, README.md, mfu.png in {res.data['wall_s']:.0f} s")
        say(f"{cfg.name} {args.dtype} on {res.data['gpu']}; median ms of `runs`, "
            f"MFU of {args.peak / 1e12:.0f} TFLOP/s")
        say(res.table())
        if res.data["errors"]:
            say(f"{len(res.data['errors'])} failed: " + "; ".join(
                f"{x['system']} S={x['prompt']} chunk={x['chunk']}" for x in res.data["errors"]))
        if res.data["skipped"]:
            say(f"{len(res.data['skipped'])} skipped (README lists why)")
        if _OWN_CACHE:
            shutil.rmtree(os.environ["KERNJAX_XLA_CACHE"], ignore_errors=True)


if __name__ == "__main__":
    main()
