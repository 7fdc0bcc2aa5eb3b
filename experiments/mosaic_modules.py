"""The Mosaic GPU kernels of `models/mlp_hopper.py`, each as its module printed without debug
info, hashed: whether a change to the Python left a kernel alone (docs/lessons.md, thirty-eighth
session: the modules carry source lines, so the HLO text moves with any edit of the file).
Lowers for an H200 on any machine; runs nothing.

    python experiments/mosaic_modules.py --rows 512,2048,8192 > before.txt   # then after a change:
    python experiments/mosaic_modules.py --rows 512,2048,8192 | diff before.txt -
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kernjax  # noqa: E402,F401  (its XLA flags)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402


def modules(fn, *args) -> list[str]:
    """The Mosaic GPU modules `fn` lowers to for an H200, as text without locations (and without
    `dump_basename`, a counter of the process's lowerings)."""
    from jax.experimental.mosaic.gpu import core
    from models.attention_hopper import on_h200

    seen, serde = [], core._run_serde_pass

    def spy(module, **kw):
        if kw.get("serialize"):
            seen.append(re.sub(r'mosaic_gpu.dump_basename = "[^"]*"', "",
                               module.operation.get_asm(enable_debug_info=False)))
        return serde(module, **kw)

    core._run_serde_pass = spy
    try:
        on_h200(lambda *a: fn(*a), *args, num_cores=132)  # a new function: traced anew
    finally:
        core._run_serde_pass = serde
    return seen


def kernels(rows: int) -> dict:
    """{name: modules} of the fused GEMM, the GEMM apart and the silu·mul kernel at `rows`."""
    from models import mlp_hopper

    S, bf = jax.ShapeDtypeStruct, jnp.bfloat16
    x, w, g = S((rows, 2560), bf), S((9728, 2560), bf), S((rows, 9728), bf)  # qwen3-4b
    gemm = lambda fused: functools.partial(mlp_hopper.gemm, fused=fused,  # noqa: E731
                                           **mlp_hopper.tiling(rows))
    return {"fused": modules(gemm(True), x, w, w), "gate_up": modules(gemm(False), x, w, w),
            "silu_mul": modules(mlp_hopper.silu_mul_kernel, g, g)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="512,2048,8192")
    for rows in map(int, ap.parse_args().rows.split(",")):
        for name, texts in kernels(rows).items():
            digest = hashlib.sha256("\n".join(texts).encode()).hexdigest()[:16]
            print(f"{rows} {name} {len(texts)} {digest}", flush=True)


if __name__ == "__main__":
    main()
