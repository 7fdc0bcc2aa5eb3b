"""What the prefill benchmark times: a system, and kernjax's three.

A system runs rows (a prompt of S tokens in chunks of `rows`): `prepare(s, rows)` gives a handle
(programs compiled once per (rows, context) and reused by every prompt they fit, the row's items
on the device) and the compile's times the first time; `reset(h)` zeroes its states (outside the
clock); `prefill(h)` runs every chunk and returns (the next token on the host, the last row's
logits), setting `issued` when the host has issued every program and `done` when it has the
token; `rows_ok(s, rows)` says why a row cannot run (None: it can); `to_numpy(logits)`,
`close()`. Kernjax's systems are here; its peers (`experiments/peers/`) keep the same contract:

  kernjax                 `fam.program(rows=chunk, seqs=1, context)` as one stage
                          (`cut.whole` + `artifact.export_stage`), jitted with its states donated
  kernjax-2stages         the same program `cut.cut` at a layer boundary (`Settings.at`, default
                          18, or the middle layer of a smaller model), the stages run back to back
                          per chunk, stage 0's departures stage 1's arrivals
  kernjax-unconstrained   the same program's jaxpr as `lower.as_function(fences=False)`: every
                          call inlined bare (kernjax's own kernels and CUDA graph cuts too), no
                          barriers, jitted

Every JAX system compiles with kernjax's compile options and publishes its token to the host from
inside its program (`kernjax.runtime.tokens`, as kernjax's runner reads it) unless
`Settings.publish` is off; kernjax's programs are traced, exported and compiled under
`Settings.lowering` (`kernjax.core.lowering`).
"""

from __future__ import annotations

import dataclasses
import gc
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import export

from experiments.harness import one_line, say
from kernjax.artifact import export_stage
from kernjax.core import lowering as lowering_
from kernjax.core.cut import cut, points, whole
from kernjax.core.item import Piece, chunks, item_shape, make_item
from kernjax.kernels.lower import as_function
from kernjax.runtime import xla
from kernjax.runtime.tokens import Published, Token, TokenRing, ring as token_ring

SYSTEMS = ("kernjax", "kernjax-2stages", "kernjax-unconstrained", "jax-plain", "transformers")
# The order systems run in: cheap ones first (their unused share of --max_seconds goes to the
# later ones), torch last so JAX never has to give memory back to it.
RUN_ORDER = ("jax-plain", "kernjax-unconstrained", "kernjax", "kernjax-2stages", "transformers")


@dataclasses.dataclass(frozen=True)
class Settings:
    """How the systems build their programs (the benchmark's flags, resolved).

    context: the context of the shared chunk programs (the longest prompt); exact_context: every
    program's context is its prompt instead. page: rows a KV page holds in kernjax's programs (0:
    the model's). at: the 2-stage cut, as `kernjax cut --at`. plain_attention: jax-plain's
    `dot_product_attention` implementation (`auto`: cudnn, xla on the CPU; None: xla).
    """

    dtype: str = "bfloat16"
    context: int = 4096
    exact_context: bool = False
    page: int = 0
    at: str = "18"
    plain_attention: str | None = "auto"
    publish: bool = True
    lowering: lowering_.Lowering = lowering_.DEFAULT


def default_at(cfg) -> str:
    """The 2-stage cut of a model: layer 18, or its middle layer if it has 18 or fewer."""
    return "18" if cfg.layers > 18 else str(cfg.layers // 2)


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


def compile_program(fn, specs, rows, donate=(), token=None, publish=True):
    """`(compiled, {lower_s, xla_s, cache})`: tracing and lowering to StableHLO, then XLA's
    compile; `cache`: whether JAX's persistent compilation cache had the program (hit, miss, or
    `-` when it was not asked: a program that compiles in under a second is not kept). With
    `token=(leaf, n)` and `publish`, the program's `leaf`-th output leaf, n tokens, is published
    to the host as the runner's is (`Published`)."""
    ring = None
    if token is not None and publish and TokenRing.usable(jax.devices()[0]):
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
    """Shared by the JAX systems: weights on the device, items, states, the prefill loop.

    `build(s, rows, ctx)` compiles a program and returns an entry `{parts, state_slots, shape,
    extra, info}`; entries are cached by (rows, context) and reused by every prompt they fit.
    """

    torch = False

    def __init__(self, name, fam, cfg, settings: Settings, weights, tokens):
        self.name, self.fam, self.cfg, self.settings = name, fam, cfg, settings
        self.weights, self.tokens = weights, tokens
        self.page = settings.page or fam.page(cfg)  # rows a KV page holds
        self.compiled: dict = {}
        self.notes: list = []
        self.exact_rows: set = set()  # chunk rows whose shared-context program failed to build
        self.issued = self.done = None

    def rows_ok(self, s, rows):
        return None

    def context(self, s, rows):
        st = self.settings
        shared = not st.exact_context and rows < s and rows not in self.exact_rows
        ctx = st.context if shared else s
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
                with lowering_.use(self.settings.lowering):
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
        is waited for, untimed), or (publish off) copied when ready and waited for with all."""
        if isinstance(tok, Token):
            value = int(np.asarray(tok).reshape(-1)[0])
            self.done = time.perf_counter()
            jax.block_until_ready(rest)
            return value
        if jax.default_backend() != "cpu":  # no host round trip
            tok.copy_to_host_async()
        jax.block_until_ready(rest)
        return int(np.asarray(tok).reshape(-1)[0])

    def _compile(self, fn, specs, rows, donate=(), token=None):
        return compile_program(fn, specs, rows, donate, token, self.settings.publish)

    def _program(self, rows, ctx):
        t = time.perf_counter()
        program = self.fam.program(self.cfg, dtype=self.settings.dtype, rows=rows, seqs=1,
                                   context=ctx,
                                   **({"page_rows": self.settings.page} if self.settings.page
                                      else {}))
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
            fn, times = self._compile(exp.call, [sl.spec() for sl in slots], rows,
                                      _donate(st.inputs), tok[0] if tok else None)
            parts.append(Part(fn, tuple(st.inputs), tuple((o.name, o.role) for o in st.outputs),
                              len(st.departures)))
            info.append({"calls": len(st.calls), "export_s": t_export, **times})
        return parts, info


class Kernjax(JaxSystem):
    """kernjax (the whole program as one stage) and kernjax-2stages (cut at `Settings.at`)."""

    def build(self, s, rows, ctx):
        program, t_trace = self._program(rows, ctx)
        low = self.settings.lowering
        if self.name == "kernjax":
            stages = [whole(program, lowering=low)]
        else:
            stages = list(cut(program, points(self.settings.at, program), lowering=low))
        parts, info = self._parts_of(stages, rows)
        return {"parts": parts, "shape": item_shape(program, self.page),
                "state_slots": [sl for st in stages for sl in st.inputs if sl.role == "state"],
                "extra": {"points": list(stages[0].points), "jaxprs": [program.jaxpr]},
                "info": {"trace_s": t_trace, "parts": info}}


class Unconstrained(JaxSystem):
    """kernjax-unconstrained: the program's jaxpr jitted bare, no barriers (`fences=False`)."""

    def build(self, s, rows, ctx):
        program, t_trace = self._program(rows, ctx)
        inputs, outputs = program.inputs, [(o.name, o.role) for o in program.outputs]
        leaf = [n for n, _ in outputs].index("next_token")
        fn = as_function(program.jaxpr, export.default_export_platform(), fences=False)  # cuda
        compiled, times = self._compile(fn, [sl.spec() for sl in inputs], rows, _donate(inputs),
                                        (leaf, 1))
        return {"parts": [Part(compiled, tuple(inputs), tuple(outputs))],
                "shape": item_shape(program, self.page),
                "state_slots": [sl for sl in inputs if sl.role == "state"], "extra": {},
                "info": {"trace_s": t_trace, "parts": [{"export_s": 0.0, **times}]}}


def make(name, fam, cfg, settings: Settings, weights, tokens):
    """The system `name` (of SYSTEMS); transformers' raises ImportError without torch."""
    if name == "transformers":
        from experiments.peers.transformers import Transformers
        return Transformers(name, fam, cfg, settings, tokens)
    if name == "jax-plain":
        from experiments.peers.plain_jax import Plain
        return Plain(name, fam, cfg, settings, weights, tokens)
    cls = {"kernjax": Kernjax, "kernjax-2stages": Kernjax, "kernjax-unconstrained": Unconstrained}
    return cls[name](name, fam, cfg, settings, weights, tokens)
