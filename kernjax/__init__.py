"""kernjax: pipeline-parallel prefill on JAX. A forward traced into calls, cut into stages that
reproduce the whole bit for bit.

The public surface, loaded on first use so that `kernjax cut` and the other shells do
not import their own module twice.

Importing kernjax sets XLA's flags (each GEMM's algorithm chosen untimed, so the whole program
and every stage, compiled in separate processes, pick the same kernel for the same call) and
points JAX's compilation cache at kernjax's cache before jax creates its backend
(`kernjax/runtime/xla.py`, docs/bitwise.md). Import kernjax before using jax's devices.
"""

from kernjax.runtime import xla as _xla

_xla.configure()

_PUBLIC = {**dict.fromkeys(("CutError", "Stage", "describe", "whole"), "kernjax.core.cut"),
           **dict.fromkeys(("Program", "Slot", "TraceError", "call", "trace"), "kernjax.core.trace")}


def __getattr__(name):
    if name in _PUBLIC:
        import importlib

        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'kernjax' has no attribute {name!r}")


def __dir__():
    return sorted(_PUBLIC)
