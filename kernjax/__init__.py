"""kernjax: pipeline-parallel prefill on JAX. A forward traced into calls, cut into stages that
reproduce the whole bit for bit.

The public surface, loaded on first use so that `python -m kernjax.cut` and the other shells do
not import their own module twice.

Importing kernjax adds `--xla_gpu_deterministic_ops=true` to `XLA_FLAGS` before jax creates its
backend: it turns GPU autotuning off, so the whole program and every stage, compiled separately,
pick the same kernel for the same call (docs/bitwise.md). Import kernjax before using jax's devices.
"""

import os as _os

_DETERMINISTIC = "--xla_gpu_deterministic_ops=true"
if _DETERMINISTIC not in _os.environ.get("XLA_FLAGS", ""):
    _os.environ["XLA_FLAGS"] = f"{_os.environ.get('XLA_FLAGS', '')} {_DETERMINISTIC}".strip()

_PUBLIC = {
    "CutError": "kernjax.cut",
    "Stage": "kernjax.cut",
    "cut": "kernjax.cut",
    "describe": "kernjax.cut",
    "whole": "kernjax.cut",
    "Program": "kernjax.trace",
    "Slot": "kernjax.trace",
    "TraceError": "kernjax.trace",
    "call": "kernjax.trace",
    "trace": "kernjax.trace",
}


def __getattr__(name):
    if name in _PUBLIC:
        import importlib

        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'kernjax' has no attribute {name!r}")


def __dir__():
    return sorted(_PUBLIC)
