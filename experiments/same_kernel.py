"""Whether kernjax's Mosaic GPU kernels at a commit and in the tree are the same.

The GPU gates ran at some commit; a later change to `kernjax/kernels/attention_hopper.py` or
`kernjax/kernels/mlp_hopper.py` (an experimental option, a comment, a moved line) may leave the kernels the
default path compiles untouched. This lowers them for an H200 on this machine (no GPU needed: an
abstract device) from both versions of each file, the Hopper attention kernel for each config and
the MLP's fused GEMM, GEMM apart and silu·mul kernel at 512, 2048 and 8192 rows, and compares the
Mosaic modules without their debug locations (which follow the source lines) and without
`dump_basename` (a count of the process's lowerings). Same module, same kernel: the gates at REV
still hold for it. Exit status 0: every kernel the same; 1: one differs; 2: no such file at REV.

    python -m experiments.same_kernel 614aef7
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import jax
import jax.experimental.mosaic.gpu as mgpu
import jax.numpy as jnp
from jax._src.interpreters import mlir as jmlir
from jax._src.lib.mlir import ir

from kernjax.kernels import attention_hopper

REPO = Path(__file__).resolve().parents[1]
PATH = "kernjax/kernels/attention_hopper.py"
MLP = "kernjax/kernels/mlp_hopper.py"
CONFIGS = {"default": {}, "default, 2048 rows": {"rows": 2048},
           "overlap, turns": attention_hopper.VARIANTS["overlap-turns"]}


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(f"attention_hopper_{abs(hash(path))}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def modules_of(lowered) -> list[str]:
    """The Mosaic GPU modules in a lowered program, as text without debug locations."""
    found = []

    def walk(op):
        for region in op.regions:
            for block in region:
                for o in block:
                    if "mhlo.backend_config" in o.attributes:
                        config = ir.DictAttr(o.attributes["mhlo.backend_config"])
                        if "module" in config:
                            found.append(ir.StringAttr(config["module"]).value_bytes)
                    walk(o)

    walk(lowered.compiler_ir("stablehlo").operation)
    with jmlir.make_ir_context() as ctx:
        mgpu.dialect.register_dialect(ctx)  # its types; the serialized ops' dialect stays
        ctx.allow_unregistered_dialects = True  # unregistered, and prints as it came
        return [re.sub(r'mosaic_gpu.dump_basename = "[^"]*"', "",
                       ir.Module.parse(m).operation.get_asm(enable_debug_info=False)) for m in found]


def mosaic_module(mod, rows: int = 512, **kw) -> str:
    """The attention kernel's Mosaic GPU module as text, without debug locations: `mod` (a
    version of kernjax/kernels/attention_hopper.py) lowered for an H200 by the tree's `lower_for_h200`."""
    found = modules_of(attention_hopper.lower_for_h200(rows, fn=mod.chunk_attention, **kw))
    if len(found) != 1:
        raise SystemExit(f"expected one Mosaic GPU module, found {len(found)}")
    return found[0]


def mlp_modules(mod, rows: int) -> dict:
    """{kernel: module text} of `mod` (a version of kernjax/kernels/mlp_hopper.py) at qwen3-4b's MLP
    shapes, as the model's calls lower them (its knobs included): the fused GEMM, the GEMM
    writing gate and up, the silu·mul kernel apart."""
    S, bf = jax.ShapeDtypeStruct, jnp.bfloat16
    x, w, g = S((rows, 2560), bf), S((9728, 2560), bf), S((rows, 9728), bf)
    return {name: "\n".join(modules_of(attention_hopper.on_h200(lambda *a: fn(*a), *args)))
            for name, fn, args in [("fused", mod.fused_call, (x, w, w)),
                                   ("gate_up", mod.gate_up_call, (x, w, w)),
                                   ("silu_mul", mod.silu_mul_call, (g, g))]}


def _at(rev: str, path: str, d: str):
    """`path` at `rev` loaded as a module of its own, or None (said why) where it is not there."""
    try:
        old = subprocess.run(["git", "-C", str(REPO), "show", f"{rev}:{path}"], check=True,
                             capture_output=True, text=True).stdout
    except subprocess.CalledProcessError as e:
        print(f"same_kernel: no {path} at {rev!r}: {e.stderr.strip()}", file=sys.stderr)
        return None
    (Path(d) / Path(path).name).write_text(old)
    return _load(Path(d) / Path(path).name)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("rev", help="the commit to compare the tree's kernels with")
    a = ap.parse_args()
    differ = 0
    with tempfile.TemporaryDirectory() as d:
        then, then_mlp = _at(a.rev, PATH, d), _at(a.rev, MLP, d)
        if then is None or then_mlp is None:
            return 2
        now, now_mlp = _load(REPO / PATH), _load(REPO / MLP)
        pairs = [(name, functools.partial(mosaic_module, then, **kw),
                  functools.partial(mosaic_module, now, **kw)) for name, kw in CONFIGS.items()]
        pairs += [(f"MLP, {rows} rows", functools.partial(mlp_modules, then_mlp, rows),
                   functools.partial(mlp_modules, now_mlp, rows)) for rows in (512, 2048, 8192)]
        for name, before, after in pairs:
            try:
                old = before()
            except TypeError as e:  # an option the file did not have then
                print(f"{name}: not at {a.rev} ({e})")
                continue
            same = old == after()
            differ += not same
            print(f"{name}: {'the same module' if same else 'DIFFERENT'} at {a.rev} and in the tree")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
