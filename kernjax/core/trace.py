"""Calls and programs: a model's forward traced into a jaxpr whose top-level equations are calls.

A *call* is the unit a cut respects, as a kernel call is in a kern manifest. `call(name, fn)`
wraps `fn` in a nested `jax.jit` with `inline=jax.Inline.XLA_LATE`, so that traced it is exactly
one top-level `jit` equation whose `name` param is the call's name. The jaxpr (and so the cut id)
is the same on every platform; how a call is *lowered* is not (`as_function`, docs/bitwise.md):
on the CPU the `XLA_LATE` call itself, compiled as its own computation; on a GPU, where XLA
compiles an `XLA_LATE` body almost raw (no cuBLAS, one kernel per op), the body inlined early and
fenced by `optimization_barrier` on its inputs and outputs, so XLA optimizes inside the call and
fuses nothing across its edges. Either way no value keeps excess precision across a call, in the
whole program and in every stage alike.

A call that updates a state in place declares it with `state=k`: its first `k` arguments are
states and its first `k` results are their new versions. The declaration travels in the jaxpr
itself, as the nested jit's `donated_invars`, so the cut reads states from the jaxpr alone.

A `Program` is a traced forward plus, for every flat input and output, its name and role:

  inputs   `weight` (checkpoint name), `state` (`kv.0` ...), `fill` (`tokens`, `positions`, ...),
           `table` (`page_table`)
  outputs  `tokens`, `logits`, `logprobs`, `state` (the new version of the state of the same
           name)

Tracing needs shapes only (`jax.ShapeDtypeStruct`), never weights.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.extend.core as jex
import numpy as np


INPUT_ROLES = ("weight", "state", "fill", "table")
OUTPUT_ROLES = ("tokens", "logits", "logprobs", "state")


class TraceError(ValueError):
    """A forward that cannot be a program: the message names the equation and the fix."""


def call(name: str, fn: Callable, *, state: int = 0) -> Callable:
    """Returns `fn` as the call `name`: one top-level jaxpr equation, a compilation boundary.

    Args:
      name: the call's name, unique in its program (`l3.kv_write`).
      fn: the function; its first `state` arguments are states updated in place.
      state: how many leading arguments are states; the first `state` results are their
        new versions, in the same order.
    """

    def named(*args):
        return fn(*args)

    named.__name__ = named.__qualname__ = name
    return jax.jit(named, inline=jax.Inline.XLA_LATE, donate_argnums=tuple(range(state)))


@dataclasses.dataclass(frozen=True)
class Slot:
    """A named flat input or output of a program, with its role, dtype and shape."""

    name: str
    role: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize

    def spec(self) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(self.shape, np.dtype(self.dtype))


@dataclasses.dataclass(frozen=True)
class Program:
    """A traced forward: the closed jaxpr, its calls, and the name and role of each input and output.

    Made only by `trace`, which has checked that every top-level equation is a call.
    """

    jaxpr: jex.ClosedJaxpr
    inputs: tuple[Slot, ...]
    outputs: tuple[Slot, ...]
    calls: tuple[str, ...]
    rows: int
    slots: int = 0
    layers: tuple[int, ...] = ()  # the first call of each layer, as the model declares them

    def text(self) -> str:
        """The program as text: the jaxpr and the roles. Stable across processes; the cut id hashes it."""
        roles = "\n".join(f"{s.role} {s.name}" for s in (*self.inputs, *self.outputs))
        return f"{jaxpr_text(self.jaxpr)}\n{roles}\n"


_TEXTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def jaxpr_text(jaxpr: jex.ClosedJaxpr) -> str:
    """`str(jaxpr)`, printed once per jaxpr object (a cut hashes and compares its programs'
    texts several times; printing a model's jaxpr takes a good part of a second)."""
    text = _TEXTS.get(jaxpr)
    if text is None:
        text = _TEXTS[jaxpr] = str(jaxpr)
    return text


_ON_GPU: dict[tuple[str, ...], tuple[Callable, bool]] = {}  # names: (fn or rule, is a rule)


def on_gpu(*names: str, rule: bool = False) -> Callable:
    """Registers a GPU lowering for a run of calls named `….names[0]`, `….names[1]`, … in a row.
    A plain `fn` takes the run's outside arguments (in order of first use, each once: for one
    call, its arguments) and returns its last call's results, or None for shapes it does not
    suit (then XLA's); for several calls, it runs only where each call reads exactly the results
    of the one before and nothing after reads an earlier call's results. A `rule` gets the run's
    equations and, per result in order, whether anything after the run reads it, and returns
    such a function or None; it gives the results read of the calls before the last, then all of
    the last call's (as a plain fn). Jaxpr and cut id stay; a run gives its calls' own lowerings'
    bits. Plain fns are one jit for all their calls, inlined by JAX: traced and lowered once per
    shapes, not once per layer (Mosaic GPU's lowering of 36 kernels took 9 s)."""
    return lambda fn: _ON_GPU.setdefault(names, (fn, rule))


def routes() -> dict[str, str]:
    """The registered `on_gpu` lowerings as the lowering table records them: the joined call
    names to the function (module and name) that lowers them."""
    return {"+".join(names): f"{fn.__module__}.{fn.__qualname__}{' (rule)' if rule else ''}"
            for names, (fn, rule) in _ON_GPU.items()}


def is_call(eqn: jex.JaxprEqn) -> bool:
    return eqn.primitive.name == "jit" and eqn.params.get("inline") == jax.Inline.XLA_LATE


def states_of(eqn: jex.JaxprEqn) -> int:
    """How many leading arguments of a call are states it updates (its donated arguments)."""
    return sum(eqn.params["donated_invars"])


def trace(
    fn: Callable[[Mapping[str, jax.Array]], Mapping[str, jax.Array]],
    inputs: Sequence[Slot],
    outputs: Sequence[tuple[str, str]],
    *,
    rows: int,
    slots: int = 0,
    layer_of: Callable[[str], int | None] | None = None,
) -> Program:
    """Traces `fn` (a dict of named inputs to a dict of named outputs) into a Program.

    Args:
      fn: the forward; every operation it does must sit inside a `call`.
      inputs: the flat inputs in order, each with its role and abstract shape.
      outputs: `(name, role)` of each output, in order; `fn` must return exactly these names.
      rows: the rows one run of the program takes (the chunk); the cut reports bytes per row.
      slots: the sequence slots of its per-sequence states (`seq_slots` in `item.py`), slot 0
        never leased; 0 when it has none.
      layer_of: the model's word for which layer a call belongs to (its number, or None for a
        call outside the layers); layer k's first call is `Program.layers[k]`, where
        `kernjax cut --at K` cuts. Layers must be numbered 0, 1, ... in call order.
    """
    errs = [f"input `{s.name}` has role `{s.role}`; roles are {INPUT_ROLES}"
            for s in inputs if s.role not in INPUT_ROLES]
    errs += [f"output `{n}` has role `{r}`; roles are {OUTPUT_ROLES}"
             for n, r in outputs if r not in OUTPUT_ROLES]
    names = [s.name for s in inputs]
    errs += [f"input name `{n}` is used twice" for n in sorted({n for n in names if names.count(n) > 1})]
    if errs:
        raise TraceError("cannot trace:\n" + "\n".join(f"  - {e}" for e in errs))

    def flat(*args):
        out = fn(dict(zip(names, args)))
        if sorted(out) != sorted(n for n, _ in outputs):
            raise TraceError(f"the forward returned {sorted(out)}; the program declares "
                             f"{sorted(n for n, _ in outputs)}")
        return [out[n] for n, _ in outputs]

    closed = jax.make_jaxpr(flat)(*[s.spec() for s in inputs])
    jp = closed.jaxpr
    calls = []
    for k, e in enumerate(jp.eqns):
        if not is_call(e):
            errs.append(f"equation {k} (`{e.primitive.name}`, after call "
                        f"`{calls[-1] if calls else 'none'}`) is not a call: wrap it in `call()`")
            continue
        calls.append(e.params["name"])
    dup = sorted({c for c in calls if calls.count(c) > 1})
    errs += [f"call name `{c}` is used twice; a call's name must be unique" for c in dup]
    if jp.constvars:
        errs.append(f"the program closes over {len(jp.constvars)} constant arrays; "
                    "pass them as inputs or build them inside a call")
    if errs:
        raise TraceError("cannot trace:\n" + "\n".join(f"  - {e}" for e in errs))
    outs = tuple(Slot(n, r, str(v.aval.dtype), tuple(v.aval.shape))
                 for (n, r), v in zip(outputs, jp.outvars))
    layers = _layers(calls, layer_of)
    return Program(closed, tuple(inputs), outs, tuple(calls), rows, slots, layers)


def _layers(calls: Sequence[str], layer_of) -> tuple[int, ...]:
    starts: list[int] = []
    for k, c in enumerate(calls):
        n = layer_of(c) if layer_of else None
        if n is None or (starts and n == len(starts) - 1):
            continue
        if n != len(starts):
            raise TraceError(f"call `{c}` (call {k}) is in layer {n}, after layer "
                             f"{len(starts) - 1}: layers must come in order 0, 1, ...")
        starts.append(k)
    return tuple(starts)
