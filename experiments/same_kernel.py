"""Whether the Hopper attention kernel's Mosaic GPU module at a commit and in the tree are the same.

The GPU gates ran at some commit; a later change to `models/attention_hopper.py` (an experimental
option, a comment, a moved line) may leave the kernel the default path compiles untouched. This
lowers `chunk_attention` for an H200 on this machine (no GPU needed: an abstract device) from both
versions of the file, for each config, and compares the Mosaic modules without their debug
locations (which follow the source lines). Same module, same kernel: the gates at REV still hold
for it. Exit status 0: every config the same; 1: one differs; 2: no such file at REV.

    python experiments/same_kernel.py 614aef7
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path

import jax.experimental.mosaic.gpu as mgpu
from jax._src.interpreters import mlir as jmlir
from jax._src.lib.mlir import ir

from kernjax.models import attention_hopper

REPO = Path(__file__).resolve().parents[1]
PATH = "models/attention_hopper.py"
CONFIGS = {"default": {}, "default, 2048 rows": {"rows": 2048},
           "overlap, turns": attention_hopper.VARIANTS["overlap-turns"]}


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(f"attention_hopper_{abs(hash(path))}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def mosaic_module(mod, rows: int = 512, **kw) -> str:
    """The kernel's Mosaic GPU module as text, without debug locations: `mod` (a version of
    models/attention_hopper.py) lowered for an H200 by the tree's `lower_for_h200`."""
    hlo = attention_hopper.lower_for_h200(rows, fn=mod.chunk_attention, **kw).compiler_ir(
        "stablehlo")
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

    walk(hlo.operation)
    if len(found) != 1:
        raise SystemExit(f"expected one Mosaic GPU module, found {len(found)}")
    with jmlir.make_ir_context() as ctx:
        mgpu.dialect.register_dialect(ctx)  # its types; the serialized ops' dialect stays
        ctx.allow_unregistered_dialects = True  # unregistered, and prints as it came
        return ir.Module.parse(found[0]).operation.get_asm(enable_debug_info=False)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("rev", help="the commit to compare the tree's kernel with")
    a = ap.parse_args()
    try:
        old = subprocess.run(["git", "-C", str(REPO), "show", f"{a.rev}:{PATH}"], check=True,
                             capture_output=True, text=True).stdout
    except subprocess.CalledProcessError as e:
        print(f"same_kernel: no {PATH} at {a.rev!r}: {e.stderr.strip()}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "attention_hopper.py").write_text(old)
        then, now = _load(Path(d) / "attention_hopper.py"), _load(REPO / PATH)
        differ = 0
        for name, kw in CONFIGS.items():
            try:
                before = mosaic_module(then, **kw)
            except TypeError as e:  # an option the file did not have then
                print(f"{name}: not at {a.rev} ({e})")
                continue
            same = before == mosaic_module(now, **kw)
            differ += not same
            print(f"{name}: {'the same module' if same else 'DIFFERENT'} at {a.rev} and in the tree")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
