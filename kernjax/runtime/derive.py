"""Weights derived at load: a model's derive program, run call by call through one staging area.

A checkpoint may hold a weight in a form the forward does not read (MXFP4 experts as written,
not in the layout the GEMM reads). A model names such weights with `derived(cfg)`: a list of
`Recipe`s, each one *derive call* that reads some checkpoint *sources* and returns some
program weights. Loading a stage runs only the recipes whose outputs its own calls read.

Every source lives in ONE staging allocation (a byte buffer on the device), only between its
first and last reader, at the offset `staging.layout` gives it (first fit), so peak memory is
the derived weights plus the widest live set of sources, not every source at once. Per call:
the sources whose window opens here are read from the checkpoint and copied into the buffer
(donated: updated in place), the call reads its sources as views of the buffer, and its outputs
stay on the device as the stage's weights.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kernjax.core import staging
from kernjax.core.staging import Recipe  # noqa: F401  (derive programs are lists of them)


@dataclasses.dataclass(frozen=True)
class Report:
    """What a derive run held: its staging allocation, the widest live set of sources, the
    derived bytes, and the most device bytes this run held after any call (measured)."""

    calls: int
    staging: int
    widest: int
    derived: int
    peak: int


def _nbytes(shape, dtype) -> int:
    return int(np.prod(shape)) * np.dtype(dtype).itemsize


@functools.partial(jax.jit, donate_argnums=0, static_argnums=2)
def _put(buf, data, offset: int):
    return jax.lax.dynamic_update_slice(buf, data, (offset,))


def _view(buf, offset: int, shape: tuple[int, ...], dtype: str):
    """Source bytes `[offset, offset + size)` of the staging buffer as `dtype[shape]` (inside the
    derive call's jit, so XLA reads them where they lie)."""
    n = _nbytes(shape, dtype)
    raw = jax.lax.slice(buf, (offset,), (offset + n,))
    item = np.dtype(dtype).itemsize
    if item == 1:
        return jax.lax.bitcast_convert_type(raw, dtype).reshape(shape)
    return jax.lax.bitcast_convert_type(raw.reshape(-1, item), dtype).reshape(shape)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _call(buf, fn, views):
    """One derive call; compiled once per `(fn, views)`: recipes that share their function and
    their sources' places (a layer's, with first fit) share one program."""
    return fn(*(_view(buf, *v) for v in views))


def run(recipes: Sequence[Recipe], read: Callable[[list], dict], *, device=None,
        align: int = 256) -> tuple[dict[str, jax.Array], Report]:
    """Runs `recipes` in order; `read(want)` returns host arrays for `[(name, shape, dtype)]`.

    Returns the derived arrays by name (on `device`) and the run's `Report`.
    """
    device = device or jax.devices()[0]
    src = {n: (s, d) for r in recipes for n, s, d in r.sources}
    ws = staging.windows([[n for n, _, _ in r.sources] for r in recipes],
                         {n: _nbytes(s, d) for n, (s, d) in src.items()})
    plan = staging.layout(ws, align=align)
    opens: dict[int, list[str]] = {}
    for w in ws:
        opens.setdefault(w.first, []).append(w.name)
    base = _live_bytes(device)
    buf = jax.device_put(jnp.zeros(max(plan.total, 1), jnp.uint8), device)
    out: dict[str, jax.Array] = {}
    peak = 0
    for k, r in enumerate(recipes):
        names = opens.get(k, [])
        got = read([(n, *src[n]) for n in names]) if names else {}
        for n in names:
            host = np.ascontiguousarray(got[n]).view(np.uint8).reshape(-1)
            buf = _put(buf, jax.device_put(host, device), plan.offsets[n])
        views = tuple((plan.offsets[n], tuple(s), d) for n, s, d in r.sources)
        res = _call(buf, r.fn, views)
        res = res if isinstance(res, tuple | list) else (res,)
        for (n, shape, dtype), v in zip(r.outputs, res, strict=True):
            if tuple(v.shape) != tuple(shape) or str(v.dtype) != dtype:
                raise ValueError(f"derive call {k} made `{n}` {v.dtype}{list(v.shape)}; the "
                                 f"model declares {dtype}{list(shape)}")
            out[n] = v
        jax.block_until_ready(list(out.values()))
        del res
        peak = max(peak, _live_bytes(device) - base)
    del buf
    derived = sum(v.nbytes for v in out.values())
    return out, Report(len(recipes), plan.total, staging.peak_live(ws), derived, peak)


def _live_bytes(device) -> int:
    """Bytes held on `device` between calls: the allocator's count where it keeps one (GPUs),
    else the bytes of every live array there. Both leave out a call's temporaries; the
    allocator's lifetime peak would also count whatever the process held before."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and "bytes_in_use" in stats:
        return stats["bytes_in_use"]
    return sum(a.nbytes for a in jax.live_arrays() if device in a.devices())
