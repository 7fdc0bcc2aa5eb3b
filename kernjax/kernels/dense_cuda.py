"""A dense layer's small bf16 calls on CUDA GPUs as kernels of kernjax's own (csrc/dense.cu, K14).

XLA runs `q_norm`, `k_norm`, `rope` and `kv_write` as seven memory-bound kernels, q written and
read back three times (4.27 ms of qwen3-4b's 8k prefill on an H200), and each `add_norm` call as
two. Here, registered with `kernjax.core.trace.on_gpu` (models/qwen3.py):

- the four calls in a row, where no cut falls among them, as one kernel (`kj_qk_rope`): qkv read
  once, q written once roped, k and v stored into the paged state;
- each of them alone where a cut does (`kj_head_norm`, `kj_rope`, `kj_kv_write`): the same device
  code per head, rounding where each call's result does, so the bits of the group;
- each `add_norm` call as one kernel (`kj_add_norm`).

A rule reads what the kernels need (eps, the heads' columns, the inverse frequencies) from the
calls' bodies and takes only bodies of the shape it knows (their primitives, in order), bf16 with
head_dim 128; anything else keeps XLA's lowering, as does `kernjax cut --nodense_cuda` (for A/B
runs; the jaxpr is the same either way, the cut id is not: the lowering table holds the choice). The
math is the bodies': their bits are not XLA's (a sum's order differs; within one bf16 step), and
every process of a cut runs these.
"""

from __future__ import annotations

import functools

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np

from kernjax.core import lowering
from kernjax.kernels import ffi  # noqa: F401  (registers the extension's handlers at import)

D = 128
_NORM = ("convert_element_type mul reduce_sum broadcast_in_dim div add rsqrt mul "
         "convert_element_type broadcast_in_dim mul")
# The same norm with its mean as `reduce.rowmean` (a fixed-order sum off CUDA, XLA's mean on CUDA,
# which the kernels implement): `platform_index cond` in the mean's place.
_NORM_ROWMEAN = ("convert_element_type mul platform_index cond add rsqrt mul "
                 "convert_element_type broadcast_in_dim mul")
_ROT = "slice slice mul neg concatenate mul add"
_SHAPES = {  # the primitives of each body the kernels implement, in order
    "q_norm": "slice reshape " + _NORM,
    "k_norm": "slice reshape " + _NORM,
    "rope": ("convert_element_type broadcast_in_dim broadcast_in_dim mul concatenate cos "
             "convert_element_type broadcast_in_dim sin convert_element_type broadcast_in_dim "
             f"{_ROT} {_ROT}"),
    "kv_write": " ".join(["slice reshape reshape", *["lt add select_n broadcast_in_dim "
                          "convert_element_type broadcast_in_dim broadcast_in_dim concatenate "
                          "scatter"] * 2, "reshape"]),
    "add_norm": "add " + _NORM,
}


def enabled() -> bool:
    """The lowering table's `dense_cuda` (`kernjax cut --nodense_cuda` turns these kernels off)."""
    return lowering.current().dense_cuda


def _body(eqn: jex.JaxprEqn, kind: str) -> jex.ClosedJaxpr | None:
    body = eqn.params["jaxpr"]
    shape = " ".join(e.primitive.name for e in body.jaxpr.eqns)
    bf16 = all(v.aval.dtype == jnp.bfloat16 for v in eqn.outvars)
    known = shape == _SHAPES[kind] or (
        _NORM in _SHAPES[kind] and shape == _SHAPES[kind].replace(_NORM, _NORM_ROWMEAN)
        and _cuda_mean(body))
    return body if known and bf16 else None


def _cuda_mean(body) -> bool:
    """Whether the body's mean is XLA's reduce on CUDA (`reduce.rowmean`'s cuda branch)."""
    cond = next(e for e in body.jaxpr.eqns if e.primitive.name == "cond")
    plats = cond.params.get("branches_platforms") or ()
    at = next((k for k, p in enumerate(plats) if p and "cuda" in p), None)
    if at is None:
        return False
    names = [e.primitive.name for e in cond.params["branches"][at].jaxpr.eqns]
    return names == ["reduce_sum", "broadcast_in_dim", "div"]


def _eps(body) -> float:
    return float(next(e.invars[1].val for e in body.jaxpr.eqns if e.primitive.name == "add"
                      and isinstance(e.invars[1], jex.Literal)))


def _col(body) -> int:  # the first column of the body's first slice
    return int(next(e.params["start_indices"][-1] for e in body.jaxpr.eqns
                    if e.primitive.name == "slice"))


def _heads(eqn, k=0) -> int | None:
    shape = eqn.outvars[k].aval.shape
    return shape[1] if len(shape) == 3 and shape[2] == D and shape[1] % 2 == 0 else None


def _inv_freq(body) -> tuple | None:
    c = [np.asarray(x) for x in body.consts]
    ok = len(c) == 1 and c[0].shape == (D // 2,) and c[0].dtype == np.float32
    return tuple(map(float, c[0])) if ok else None


def qk_group(eqns, exposed):
    """q_norm, k_norm, rope, kv_write as `kj_qk_rope`: q roped and the state, where nothing
    after reads the rest."""
    if not enabled() or exposed != (False, False, True, False, True):
        return None
    bodies = [_body(e, k) for e, k in zip(eqns, ("q_norm", "k_norm", "rope", "kv_write"))]
    if None in bodies or None in (h := _heads(eqns[0]), kv := _heads(eqns[1])):
        return None
    cols = (_col(bodies[0]), _col(bodies[1]), _col(bodies[3]))
    freq = _inv_freq(bodies[2])
    width, state = eqns[0].invars[0].aval.shape[-1], eqns[3].invars[0].aval.shape
    if cols != (0, h * D, (h + kv) * D) or width != (h + 2 * kv) * D or state[-3:] != (2, kv, D) \
            or freq is None:
        return None
    return _qk_rope(h, kv, _eps(bodies[0]), freq)


@functools.cache
def _qk_rope(heads, kv_heads, eps, freq):
    def run(qkv, wq, wk, positions, kv, slots):
        rows = qkv.shape[0]
        q, kv = jax.ffi.ffi_call("kj_qk_rope", (
            jax.ShapeDtypeStruct((rows, heads, D), qkv.dtype), jax.ShapeDtypeStruct(kv.shape, kv.dtype)),
            input_output_aliases={5: 1})(
                qkv, wq, wk, positions.astype(jnp.int32), jnp.asarray(freq, jnp.float32), kv,
                slots.astype(jnp.int32), heads=np.int64(heads), kv_heads=np.int64(kv_heads),
                eps=np.float32(eps))
        return q, kv
    return run


def head_norm(eqns, exposed):
    """q_norm or k_norm alone as `kj_head_norm`."""
    kind = eqns[0].params["name"].rsplit(".", 1)[-1]
    body, heads = _body(eqns[0], kind), _heads(eqns[0])
    if not enabled() or body is None or heads is None:
        return None
    return _head_norm(_col(body), heads, _eps(body))


@functools.cache
def _head_norm(col, heads, eps):
    def run(qkv, w):
        return jax.ffi.ffi_call("kj_head_norm", jax.ShapeDtypeStruct(
            (qkv.shape[0], heads, D), qkv.dtype))(
                qkv, w, col=np.int64(col), heads=np.int64(heads), eps=np.float32(eps))
    return run


def rope(eqns, exposed):
    """rope alone as `kj_rope`."""
    body = _body(eqns[0], "rope")
    freq = body and _inv_freq(body)
    if not enabled() or not freq or None in (_heads(eqns[0], 0), _heads(eqns[0], 1)):
        return None
    return _rope(freq)


@functools.cache
def _rope(freq):
    def run(q, k, positions):
        return tuple(jax.ffi.ffi_call("kj_rope", (jax.ShapeDtypeStruct(q.shape, q.dtype),
                                                  jax.ShapeDtypeStruct(k.shape, k.dtype)))(
            q, k, positions.astype(jnp.int32), jnp.asarray(freq, jnp.float32)))
    return run


def kv_write(eqns, exposed):
    """kv_write alone as `kj_kv_write`."""
    body = _body(eqns[0], "kv_write")
    if not enabled() or body is None:
        return None
    state, k = eqns[0].invars[0].aval.shape, eqns[0].invars[1].aval.shape
    if len(k) != 3 or k[2] != D or state[-2:] != k[1:] or state[-3] != 2:
        return None
    return _kv_write(_col(body))


@functools.cache
def _kv_write(v_col):
    def run(kv, k, qkv, slots):
        return jax.ffi.ffi_call("kj_kv_write", jax.ShapeDtypeStruct(kv.shape, kv.dtype),
                                input_output_aliases={0: 0})(
            kv, k, qkv, slots.astype(jnp.int32), v_col=np.int64(v_col))
    return run


def add_norm(eqns, exposed):
    """The residual add and the next norm as `kj_add_norm`: hidden a multiple of 256, <= 4096."""
    body = _body(eqns[0], "add_norm")
    shape = eqns[0].outvars[0].aval.shape
    if not enabled() or body is None or len(shape) != 2 or shape[1] % 256 or shape[1] > 4096:
        return None
    return _add_norm(_eps(body))


@functools.cache
def _add_norm(eps):
    def run(y, h, w):
        spec = jax.ShapeDtypeStruct(h.shape, h.dtype)
        return tuple(jax.ffi.ffi_call("kj_add_norm", (spec, spec))(y, h, w, eps=np.float32(eps)))
    return run
