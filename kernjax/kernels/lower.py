"""A program's (or a stage's) jaxpr lowered per platform: each call between barriers on a GPU,
or by a lowering of its own (`trace.on_gpu`), with CUDA graph cuts; as it is on the CPU.

The choices follow the lowering table under way (`kernjax.core.lowering.current()`), which the
artifact sets from the stage's manifest when it exports.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.extend.core as jex
import numpy as np

from kernjax.core import lowering
from kernjax.core.trace import _ON_GPU, states_of
from kernjax.kernels import ffi

GPU_PLATFORMS = ("cuda", "rocm")

# one jit per lowering table: a function lowered under other knobs is traced again, not reused
_jits = functools.cache(lambda fn, table: jax.jit(fn, inline=jax.Inline.JAX_LATE))


def _jit(fn: Callable) -> Callable:
    return _jits(fn, lowering.current())


def as_function(closed: jex.ClosedJaxpr, platform: str, *, fences: bool = True) -> Callable:
    """A program's (or a stage's) jaxpr as a function to jit and export for `platform`.

    On the CPU the jaxpr runs as it is, but for the state updates `_on_cpu` inlines. On a GPU
    every call runs as its body between two `optimization_barrier`s, inlined early: the barriers
    keep XLA:GPU from fusing across a call (what makes a cut exact there), and early inlining
    lets it compile the body fully; or a lowering of its own (`on_gpu`) between them.
    `fences=False`, for measurement only (experiments/): every body inlined bare, the same own
    lowerings and CUDA graph cuts (`graph_cuts`: host work, no kernel), no barrier, XLA free to
    fuse across calls: the unconstrained program the boundaries are measured against, which
    differs from the program by the barriers alone. No stage runs so.
    """
    if platform not in ("cpu", *GPU_PLATFORMS):  # `jax.default_backend()`'s "gpu" is not one
        raise ValueError(f"platform {platform!r}: give cpu, cuda or rocm (jax.export's names)")
    jp = closed.jaxpr
    gpu = platform in GPU_PLATFORMS
    fenced = [(_fenced(e) if gpu else _on_cpu(e)) if fences else jex.jaxpr_as_fun(e.params["jaxpr"])
              for e in jp.eqns]
    cuts = graph_cuts(len(jp.eqns)) if gpu else set()
    last_read = {id(v): j for j, e in enumerate(jp.eqns) for v in e.invars}  # each var's last
    last_read |= {id(v): len(jp.eqns) for v in jp.outvars}  # reader; outputs read after all

    def run(*args):
        env = dict(zip(jp.constvars, closed.consts)) | dict(zip(jp.invars, args))
        read = lambda v: v.val if isinstance(v, jex.Literal) else env[v]  # noqa: E731
        i = 0
        while i < len(jp.eqns):
            own = _own_lowering(jp, i, read, last_read, fences) if gpu else None
            last, outvars, vals = own or (i, jp.eqns[i].outvars, None)
            if vals is None:
                vals = fenced[i](*[read(v) for v in jp.eqns[i].invars])
            outs = [(v, x) for v, x in zip(outvars, vals) if not isinstance(v, jex.DropVar)]
            if cuts & set(range(i, last + 1)) and outs:  # its smallest result through a no-op
                j = min(range(len(outs)), key=lambda k: outs[k][1].size)  # the graphs stop at
                outs[j] = outs[j][0], ffi.publish(outs[j][1], 0, slot=0)
            env.update(outs)
            i = last + 1
        return [read(v) for v in jp.outvars]

    return run


def _own_lowering(jp: jex.Jaxpr, i: int, read: Callable, last_read: dict, fences: bool):
    """(the last call it covers, the results it gives, their values) of the longest registered
    run of `on_gpu` lowerings from call i that fits, or None: XLA's lowering."""
    short = lambda q: q.params["name"].rsplit(".", 1)[-1]  # noqa: E731
    for names, (fn, rule) in sorted(_ON_GPU.items(), key=lambda r: -len(r[0])):
        run = jp.eqns[i:i + len(names)]
        if tuple(map(short, run)) != names:
            continue
        made = {id(v) for e in run for v in e.outvars}
        args = list(run[0].invars) if len(run) == 1 else list(
            {id(v): v for e in run for v in e.invars if id(v) not in made}.values())
        outs = [v for e in run for v in e.outvars]
        exposed = tuple(last_read.get(id(v), -1) >= i + len(run) for v in outs)
        inner = len(outs) - len(run[-1].outvars)  # the results of the calls before the last
        chained = all(list(b.invars) == list(a.outvars) for a, b in zip(run, run[1:]))
        fn = fn(run, exposed) if rule else fn if chained and not any(exposed[:inner]) else None
        ins = [read(v) for v in args]
        if fn is not None and jax.eval_shape(fn := _jit(fn), *ins) is not None:
            vals = _fenced(run[-1], fn)(*ins) if fences else fn(*ins)
            vals = list(vals) if isinstance(vals, (tuple, list)) else [vals]
            given = exposed[:inner] + (True,) * len(outs)  # the last call's results all given
            return i + len(run) - 1, [v for v, x in zip(outs, given) if x], vals
    return None


GRAPH_SEGMENTS = (1, 4, 16)


def graph_cuts(calls: int) -> set[int]:
    """The calls of a GPU program after which XLA's CUDA graph ends and the next begins: three
    graphs of 1, 4 and 16 parts of its calls. A graph's host work before its first kernel (XLA
    updating it for the run's buffers) then hides behind the graph before, but for the first,
    small one: one graph a program made the whole program's first chunk 1.2 ms late at 512 rows
    (docs/bitwise.md). The cut is `ffi.publish` with no slot, an identity with no kernel, which
    XLA keeps outside its graphs; the lowering table's `graph_cuts=False` leaves one graph."""
    if not lowering.current().graph_cuts:
        return set()
    total, ends = sum(GRAPH_SEGMENTS), np.cumsum(GRAPH_SEGMENTS)[:-1]
    return {round(calls * int(e) / total) - 1 for e in ends} - {-1}


_MOVES = {"reshape", "broadcast_in_dim", "concatenate", "convert_element_type", "scatter",
          "select_n", "squeeze", "slice", "gather", "dynamic_slice", "dynamic_update_slice"}


def _on_cpu(eqn: jex.JaxprEqn) -> Callable:
    """A call on the CPU: as it is (`XLA_LATE`, its own computation); but a state's update that
    only moves values (no float arithmetic) is inlined, so XLA updates the state in place instead
    of copying it whole into the call: the pool's size, every item (docs/bitwise.md)."""
    body = eqn.params["jaxpr"]
    if states_of(eqn) and all(e.primitive.name in _MOVES or not any(
            jax.numpy.issubdtype(v.aval.dtype, jax.numpy.inexact) for v in e.outvars)
            for e in body.jaxpr.eqns):
        return jex.jaxpr_as_fun(body)
    params = eqn.primitive.get_bind_params(eqn.params)  # as jax's own eval_jaxpr binds it
    return lambda *args: eqn.primitive.bind(*args, **params)


def _fenced(eqn: jex.JaxprEqn, body: Callable | None = None) -> Callable:
    """Call `eqn` on a GPU: its body (or `body`, a lowering of its own) between two barriers,
    inlined early, under the call's name."""
    body = body or jex.jaxpr_as_fun(eqn.params["jaxpr"])

    def fenced(*args):
        return jax.lax.optimization_barrier(body(*jax.lax.optimization_barrier(args)))

    fenced.__name__ = fenced.__qualname__ = eqn.params["name"]
    return jax.jit(fenced, inline=jax.Inline.XLA_EARLY)
