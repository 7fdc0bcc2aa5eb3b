"""kernjax's custom ops, as XLA FFI handlers.

Every custom op is a typed XLA FFI handler written in C++ (csrc/*.cc) or CUDA (csrc/*.cu) and
compiled into one pybind11 extension, `kernjax._ffi`. Its `registrations()` returns
`{"cpu": {name: capsule}, "cuda": {name: capsule}}`; this module registers the cpu handlers with
jax.ffi.register_ffi_target, and the cuda ones too when the extension was built with nvcc
(setup.py; the "cuda" dict is otherwise empty). Registration happens at import when the extension
is usable; `register()` does it on demand, is idempotent, and raises `ExtensionError` when the
extension is missing or was built against another jax, since the FFI ABI is only promised for the
jax version it was built with.

Each op has a Python wrapper that checks dtypes and shapes up front, with messages that name the
argument; ops with a pure-JAX reference (`<op>_reference`) are tested bitwise against it.
Values that change from step to step (sequence numbers, positions, lengths) are operands, never
attributes: attributes are baked into the compiled executable, so a per-step attribute would
recompile every step. Attributes hold only what is fixed for the life of a program.

- `mark`: an identity on one buffer that also publishes a per-step sequence number, and values
  with it, into a host slot (`kernjax._ffi.host_alloc(nbytes, mapped=...)`, back through
  `host_free`; a CPU-only run may use any aligned numpy array), so a host thread sees how far a
  stage has run and what it made without a driver call (`kernjax.runtime.tokens`: the first token).
- `mxfp4_shuffle` moves MXFP4 experts into the layout a MoE GEMM reads (its reference is
  `kernjax/kernels/mxfp4.py: shuffle`; derive programs run it at load).
- `kj_fa3` (CUDA only) is the bf16 attention call through FlashAttention-3, loaded from
  `fa3_path()` (`kernjax/kernels/attention_fa3.py`, csrc/fa3.h).
- `kj_qk_rope`, `kj_head_norm`, `kj_rope`, `kj_kv_write`, `kj_add_norm` (CUDA only): a dense
  layer's small bf16 calls (csrc/dense.cu), lowered to by `kernjax/kernels/dense_cuda.py`'s rules.
- hold, recv, push and post, the edge ops of csrc/edge.h (kernjax/runtime/edge.py puts them into stage
  programs).
"""

from __future__ import annotations

import functools
import importlib
import operator
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import ShapedArray
from jax.extend.core import Primitive
from jax.interpreters import mlir

__all__ = ["ExtensionError", "available", "register", "has_cuda", "mark", "publish",
           "mark_reference", "mxfp4_shuffle", "hold", "recv", "push", "post"]

_REBUILD = "rebuild it with `pip install --no-build-isolation -e .`"
FA3_LIB = "build/fa3/libkj_fa3.so"

# jax platform name for each key of _ffi.registrations().
_PLATFORMS = {"cpu": "cpu", "cuda": "CUDA"}

_registered = False


class ExtensionError(RuntimeError):
    """The compiled extension kernjax._ffi is missing or unusable."""


def _extension():
    """The kernjax._ffi module, checked against the running jax."""
    try:
        ext = importlib.import_module("kernjax._ffi")
    except ImportError as e:
        raise ExtensionError(f"the kernjax._ffi extension could not be imported ({e}); "
                             f"{_REBUILD}") from e
    built = ext.jax_version()
    if built != jax.__version__:
        raise ExtensionError(f"kernjax._ffi was built against jax {built} but jax "
                             f"{jax.__version__} is running; {_REBUILD}")
    return ext


def available() -> bool:
    """Whether the extension imports and was built for the running jax."""
    try:
        _extension()
    except ExtensionError:
        return False
    return True


def register() -> None:
    """Registers every FFI target of kernjax._ffi with jax. Idempotent."""
    global _registered
    if _registered:
        return
    ext = _extension()
    for key, targets in ext.registrations().items():
        for name, capsule in targets.items():
            jax.ffi.register_ffi_target(name, capsule, platform=_PLATFORMS[key])
    if ext.has_cuda():  # never fails here: a program that needs kj_fa3 and runs without it
        ext.fa3_load(str(fa3_path()))  # fails, saying why it did not load and how to build it
    _registered = True


def fa3_path() -> Path:
    """Where kj_fa3 loads FlashAttention-3 from: $KERNJAX_FA3_LIB, else build/fa3/libkj_fa3.so
    beside the package (scripts/fa3 writes it there)."""
    env = os.environ.get("KERNJAX_FA3_LIB")
    return Path(env) if env else Path(__file__).resolve().parents[2] / FA3_LIB


def has_cuda() -> bool:
    """Whether the extension has its CUDA handlers compiled in."""
    return _extension().has_cuda()


def _check_seq(seq):
    """`seq` as a 1-D int32 array of one or more elements; a Python int is accepted."""
    if isinstance(seq, (int, np.integer)) and not isinstance(seq, bool):
        if not np.iinfo(np.int32).min <= int(seq) <= np.iinfo(np.int32).max:
            raise ValueError(f"mark: seq={int(seq)} does not fit in int32")
        seq = np.asarray(seq, np.int32)
    dtype = getattr(seq, "dtype", None)
    if dtype != np.int32:
        raise TypeError(
            f"mark: seq must be an int32 array (a per-step operand), got "
            f"{'dtype ' + str(dtype) if dtype is not None else type(seq).__name__}")
    if int(np.prod(np.shape(seq), dtype=np.int64)) < 1:
        raise ValueError(f"mark: seq must have at least one element, got shape {np.shape(seq)}")
    return jnp.reshape(seq, (-1,))


def _check_slot(slot) -> np.uint64:
    if isinstance(slot, jax.core.Tracer):
        raise TypeError("mark: slot is fixed at trace time: a Python int, not a traced value")
    try:
        slot = operator.index(slot)
    except TypeError:
        raise TypeError(f"mark: slot must be an int address, got {type(slot).__name__}") from None
    if not 0 <= slot < 2**64:
        raise ValueError(f"mark: slot={slot} is not a 64-bit address")
    if slot % 4 and slot >= 64:  # below 64: an id bound by _ffi.bind_slot (csrc/kj.h)
        raise ValueError(f"mark: slot={slot:#x} must be 4-byte aligned")
    return np.uint64(slot)


def mark(x, seq, *, slot: int = 0, ring: int = 1):
    """Returns `x` unchanged and, when it runs, writes `seq` into `slot`.

    x: any array; the output aliases it (input_output_aliases={0: 0}), so no copy is made when
      XLA can reuse the buffer.
    seq: the step's sequence number (a Python int), or an int32 array of it and the values
      published with it. An operand, so it may change every step without recompiling. seq[1:]
      is written to the slot's words 1.., then seq[0] to word 0, so a reader that sees seq[0]
      sees the values.
    slot: address of the int32 host slot, an id bound to one (`_ffi.bind_slot`, 1..63), or 0
      for none. On CPU any writable, aligned host memory will do; on GPU it must be pinned host
      memory mapped into the device (cudaHostAlloc with cudaHostAllocMapped). The caller keeps
      it alive while programs that use it may run.
    ring: with ring > 1, `slot` holds that many entries of whole 64-byte lines and this step
      writes entry seq[0] mod ring (kernjax/runtime/tokens.py).

    The op has a side effect, so XLA never removes or deduplicates it. It is not differentiable
    and has no batching rule.
    """
    x, seq, attrs = _mark_args(x, seq, slot, ring)
    return jax.ffi.ffi_call("kj_mark", jax.ShapeDtypeStruct(x.shape, x.dtype),
                            has_side_effect=True, input_output_aliases={0: 0})(x, seq, **attrs)


def publish(x, seq, *, slot: int, ring: int = 1):
    """`mark` with no JAX effect: a primitive whose custom call keeps its side effect for XLA, as
    the edge ops below, so a program served per item keeps jit's C++ dispatch. Its result must
    be used (a program's output), or JAX may drop it."""
    x, seq, attrs = _mark_args(x, seq, slot, ring)
    return _MARK.bind(x, seq, outs=(ShapedArray(x.shape, x.dtype),), **attrs)[0]


def _mark_args(x, seq, slot, ring):
    x, seq, slot = jnp.asarray(x), _check_seq(seq), _check_slot(slot)
    if isinstance(ring, bool) or not isinstance(ring, (int, np.integer)) or ring < 1:
        raise ValueError(f"mark: ring must be a positive int, got {ring!r}")
    register()
    return x, seq, {"slot": slot, "ring": np.int64(ring)}


def mark_reference(x, seq):
    """The JAX reference for `mark`: the identity on `x` (`seq` is checked)."""
    _check_seq(seq)
    return jnp.asarray(x)


def mxfp4_shuffle(packed, scales, *, gated: bool = False):
    """MXFP4 weights from the checkpoint layout into the GEMM layout (csrc/mxfp4_shuffle.*):
    `(packed u8[..., M, K/2], scales u8[..., M, K/32])` -> `(packed u8[..., M, K/2] with rows
    shuffled, scales u8[..., Mp*Kp] flat in the 128x4 swizzle)`; `gated` for a GEMM1 `[up; gate]`.
    Bitwise `kernjax/kernels/mxfp4.py: shuffle`, its JAX reference (byte gathers only)."""
    packed, scales = jnp.asarray(packed), jnp.asarray(scales)
    if packed.dtype != jnp.uint8 or scales.dtype != jnp.uint8:
        raise TypeError(f"mxfp4_shuffle: packed and scales are uint8, got {packed.dtype} and "
                        f"{scales.dtype}")
    if packed.ndim < 2 or scales.shape[:-1] != packed.shape[:-1] or \
            packed.shape[-1] * 2 != scales.shape[-1] * 32:
        raise ValueError(f"mxfp4_shuffle: packed [..., M, K/2] and scales [..., M, K/32] do not "
                         f"match: {packed.shape}, {scales.shape}")
    m, ks = packed.shape[-2], scales.shape[-1]
    if m % (64 if gated else 32):
        raise ValueError(f"mxfp4_shuffle: M = {m} must be a multiple of {64 if gated else 32}")
    register()
    flat = -(-m // 128) * 128 * (-(-ks // 4) * 4)
    call = jax.ffi.ffi_call("kj_mxfp4_shuffle", (
        jax.ShapeDtypeStruct(packed.shape, jnp.uint8),
        jax.ShapeDtypeStruct((*packed.shape[:-2], flat), jnp.uint8)))
    return call(packed, scales, gated=bool(gated))


# The edge ops (csrc/edge.h): `tok` is an int32[1] threaded through one stage's edge ops so that
# data dependence orders them; `item` is the item's sequence number, an int32[1] operand; `edge`
# names an edge this process has bound (kernjax.runtime.edge), `word` its arrived (0) or taken (1) word.
# Each is a primitive whose custom call has a side effect for XLA (never removed, merged or
# moved) and none for JAX: a program with JAX effects is called through Python, not jit's C++
# dispatch, which cost a 4B model's stage ~3 ms of host time an item (docs/lessons.md).
def _edge_op(target: str, aliases: dict[int, int]) -> Primitive:
    p = Primitive(target)
    p.multiple_results = True
    p.def_abstract_eval(lambda *avals, outs, **attrs: outs)
    p.def_impl(lambda *args, **params: jax.jit(functools.partial(p.bind, **params))(*args))
    lower = jax.ffi.ffi_lowering(target, has_side_effect=True, operand_output_aliases=aliases)
    mlir.register_lowering(p, lambda ctx, *args, outs, **attrs: lower(ctx, *args, **attrs))
    return p


_HOLD, _RECV = _edge_op("kj_hold", {0: 0}), _edge_op("kj_recv", {})
_MARK = _edge_op("kj_mark", {0: 0})  # publish
_PUSH, _POST = _edge_op("kj_push", {1: 0}), _edge_op("kj_post", {0: 0})
_TOK = ShapedArray((1,), jnp.int32)


def _edge_call(op, outs, *args, **attrs):
    register()
    for k, v in attrs.items():
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 0:
            raise TypeError(f"{op.name}: {k} must be a non-negative int fixed at trace time, "
                            f"got {v!r}")
    for a in args[:2] if op is not _PUSH else args[1:3]:
        if jnp.dtype(a.dtype) != jnp.int32 or a.shape != (1,):
            raise TypeError(f"{op.name}: tok and item are int32[1], got {a.dtype}{list(a.shape)}")
    return op.bind(*args, outs=outs, **{k: int(v) for k, v in attrs.items()})


def hold(tok, item, *after, edge: int, word: int):
    """Waits on the device until item `item`'s slot of `edge` is ready: its arrivals are in (word
    0), or the item `nslots` before it was taken (word 1). Runs after `after` (order only)."""
    return _edge_call(_HOLD, (_TOK,), tok, item, *after, edge=edge, word=word)[0]


def recv(tok, item, spec: jax.ShapeDtypeStruct, *, edge: int, index: int):
    """`(departure index of item `item`, read from its slot of `edge`, tok)`."""
    x = ShapedArray(spec.shape, spec.dtype)
    return tuple(_edge_call(_RECV, (x, _TOK), tok, item, edge=edge, index=index))


def push(x, tok, item, *, edge: int, index: int):
    """Writes `x`, departure `index` of item `item`, into its slot of `edge`; returns tok."""
    return _edge_call(_PUSH, (_TOK,), x, tok, item, edge=edge, index=index)[0]


def post(tok, value, *, edge: int, word: int):
    """Stores `value` into `edge`'s arrived (0) or taken (1) word, after what `tok` follows."""
    return _edge_call(_POST, (_TOK,), tok, value, edge=edge, word=word)[0]


try:
    register()
except ExtensionError:
    pass  # mark() and register() raise it again, with the same message.
