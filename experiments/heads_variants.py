"""Variants of csrc/dense.cu's HeadsKernel for experiments/heads_bench.cu: each a copy of dense.cu
with textual replacements (each must apply exactly once), written to OUT/<name>/dense.cu, then
compiled with the bench to OUT/<name>/bench (sm_90). The arithmetic is the same in every variant;
the bench's hashes say whether the bytes are.

    python experiments/heads_variants.py build/hb   # then on the GPU: build/hb/*/bench 8192 200
"""

import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(HERE, "..", "csrc", "dense.cu")

BOUNDS = ("__launch_bounds__(32 * kWarps, 5) HeadsKernel", "__launch_bounds__(32 * kWarps, {}) HeadsKernel")
# the parts chosen with static indices only (the kernel parameters' fields read at fixed
# offsets; a dynamic index makes a chain of dependent constant loads before each head's load)
STATIC = [
    ("    while (k < j.parts && s >= j.part[k].heads / 2) s -= j.part[k++].heads / 2;",
     "#pragma unroll\n    for (int t = 0; t < 3; ++t)\n"
     "      if (k == t && t < j.parts && s >= j.part[t].heads / 2) s -= j.part[t].heads / 2, k = t + 1;"),
    ("      const Part& p = j.part[k];", "      const Part p = k == 0 ? j.part[0] : k == 1 ? j.part[1] : j.part[2];"),
    ("    const Part& p = j.part[part[b]];",
     "    const Part p = part[b] == 0 ? j.part[0] : part[b] == 1 ? j.part[1] : j.part[2];"),
    ("  for (int k = 0; k < j.parts; ++k) rope |= j.part[k].rope;",
     "#pragma unroll\n  for (int k = 0; k < 3; ++k) rope |= k < j.parts && j.part[k].rope;"),
]


def variants():
    b = lambda n: [(BOUNDS[0], BOUNDS[1].format(n))]
    return {"A": [], "B4": b(4), "B6": b(6), "S": STATIC, "S4": STATIC + b(4)}


def main(out):
    text = open(SRC).read()
    inc = os.path.join(subprocess.check_output(
        [sys.executable, "-c", "import jaxlib, os; print(os.path.dirname(jaxlib.__file__))"],
        text=True).strip(), "include")
    only = sys.argv[2].split(",") if len(sys.argv) > 2 else None
    for name, reps in variants().items():
        if only and name not in only:
            continue
        src = text
        for old, new in reps:
            assert src.count(old) == 1, (name, old)
            src = src.replace(old, new)
        d = os.path.join(out, name)
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "dense.cu"), "w") as f:
            f.write(src)
        r = subprocess.run(["nvcc", "-arch=sm_90", "-O3", "-std=c++17", f"-I{inc}",
                            f'-DKJ_DENSE="{os.path.abspath(os.path.join(d, "dense.cu"))}"',
                            os.path.join(HERE, "heads_bench.cu"), "-o", os.path.join(d, "bench"),
                            "-Xptxas", "-v"], capture_output=True, text=True)
        lines, on = [], False  # ptxas's report of HeadsKernel only
        for l in r.stderr.splitlines():
            on = ("HeadsKernel" in l) if "Function properties" in l or "Compiling" in l else on
            lines += [l.strip().removeprefix("ptxas info    : ")] if on and ("Used" in l or "spill" in l) else []
        regs = lines[:2]
        print(name, "rc", r.returncode, "|", " | ".join(regs), flush=True)
        if r.returncode:
            print(r.stderr[-2000:])


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "build/hb")
