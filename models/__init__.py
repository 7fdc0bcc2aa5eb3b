"""Model families kernjax can trace, installed as `kernjax.models`. All model knowledge lives here.

Each family module implements `kernjax.core.family.Family` (checked when it is first reached):
its named configs, its checkpoint's tensors, its forward traced into calls with its layers
declared, and its derive program (`derived(cfg)`: weights the forward reads in another form than
the checkpoint holds them; a float weight it makes is in `cfg.dtype`, which the loader sets to the
program's): qwen3 fuses q/k/v, k3 shuffles MXFP4 experts. The kernels the forwards call live in
`kernjax/kernels/`. kernjax reaches a family only through `family()` and `named()`; a stage host
never does (its artifact carries the derive program).
"""

from __future__ import annotations

import importlib
from types import ModuleType

# The model `python -m kernjax` cuts: small enough for a CPU, big enough to have GQA and layers.
DEFAULT = "qwen3-tiny"

# HF `model_type` -> module in this package.
FAMILIES = {"qwen3": "qwen3", "kimi_linear": "k3"}


def family(model_type: str) -> ModuleType:
    """The family module for an HF `model_type`."""
    if model_type not in FAMILIES:
        raise ValueError(f"model_type `{model_type}` is not supported; kernjax knows "
                         f"{sorted(FAMILIES)}")
    module = importlib.import_module(f"{__name__}.{FAMILIES[model_type]}")
    from kernjax.core import family as contract
    contract.check(module)
    return module


def named(name: str):
    """`(family module, config)` for a named model such as `qwen3-tiny`."""
    for model_type in FAMILIES:
        fam = family(model_type)
        if name in fam.CONFIGS:
            return fam, fam.CONFIGS[name]
    known = sorted(n for t in FAMILIES for n in family(t).CONFIGS)
    raise ValueError(f"unknown model `{name}`; known models: {', '.join(known)}")


def names() -> list[str]:
    return sorted(n for t in FAMILIES for n in family(t).CONFIGS)
