"""Model families kernjax can trace, installed as `kernjax.models`. All model knowledge lives here.

A family module provides `CONFIGS` (named configs), `config_from_hf(dict)`, `hf_config(cfg)`,
`weight_shapes(cfg)`, `random_weight(name, shape, rng)`, `FALLBACKS`, `page(cfg)` (rows a KV page
holds), and `prefill`/`program(cfg, *, dtype, rows, seqs, context, pages)`. A family whose checkpoint holds
weights in another form than its program reads also provides `derived(cfg)` (the derive program,
`kernjax/derive.py`; a float weight it makes is in `cfg.dtype`, which the loader sets to the
program's): qwen3 fuses q/k/v, k3 shuffles MXFP4 experts. Sources in the model's dtype are among
`weight_shapes`; sources kept in their own dtype are `source_shapes(cfg)`, drawn by
`random_sources(cfg, seed)`. kernjax reaches a family only through `family()` and `named()`.
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
    return importlib.import_module(f"{__name__}.{FAMILIES[model_type]}")


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
