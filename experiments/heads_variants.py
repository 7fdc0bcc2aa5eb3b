"""Variants of csrc/dense.cu's HeadsKernel for experiments/heads_bench.cu: each a copy of dense.cu
with textual replacements (each must apply exactly once), written to OUT/<name>/dense.cu, then
compiled with the bench to OUT/<name>/bench (sm_90, nvcc here; no GPU needed to build). The
arithmetic is the same in every variant; the bench's hashes say whether the bytes are.
Results: `git show results:experiments/results/2026-12-03-h200-heads5/README.md`.

    python -m experiments.heads_variants build/hb [A,B4,...]   # then on the GPU:
    build/hb/<name>/bench 8192 200
"""

import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(HERE, "..", "csrc", "dense.cu")

BOUNDS = ("__launch_bounds__(32 * kWarps, 6) HeadsKernel", "__launch_bounds__(32 * kWarps, {}) HeadsKernel")


def variants():
    """The kernel as it is (A) and at other block budgets. The variants measured before the kernel
    became one a job's flags (`5823121`'s script: register budgets, static part selection,
    `heads_lean.cuh`, its frequencies by warp) are in experiments/results/2026-12-03-h200-heads5/."""
    b = lambda n: [(BOUNDS[0], BOUNDS[1].format(n))]
    return {"A": [], "B4": b(4), "B5": b(5), "B8": b(8)}


def sources(only=None) -> dict:
    """{name: the variant's dense.cu}; each replacement must apply exactly once."""
    text, out = open(SRC).read(), {}
    for name, reps in variants().items():
        if only and name not in only:
            continue
        src = text
        for old, new in reps:
            if src.count(old) != 1:
                raise ValueError(f"variant {name}: {old[:60]!r} is in dense.cu "
                                 f"{src.count(old)} times, not once: update the variant")
            src = src.replace(old, new)
        out[name] = src
    return out


def main(out, only=None):
    inc = os.path.join(subprocess.check_output(
        [sys.executable, "-c", "import jaxlib, os; print(os.path.dirname(jaxlib.__file__))"],
        text=True).strip(), "include")
    for name, src in sources(only).items():
        d = os.path.join(out, name)
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "dense.cu"), "w") as f:
            f.write(src)
        r = subprocess.run(["nvcc", "-arch=sm_90", "-O3", "-std=c++17", f"-I{inc}",
                            f'-DKJ_DENSE="{os.path.abspath(os.path.join(d, "dense.cu"))}"',
                            os.path.join(HERE, "heads_bench.cu"), "-o", os.path.join(d, "bench"),
                            "-Xptxas", "-v"], capture_output=True, text=True)
        lines, on = [], False  # ptxas's report of the kernel the bench times (kj_qk_rope's job)
        for l in r.stderr.splitlines():
            on = ("HeadsKernelILj2231E" in l) if "Function properties" in l or "Compiling" in l else on
            lines += [l.strip().removeprefix("ptxas info    : ")] if on and ("Used" in l or "spill" in l) else []
        print(name, "rc", r.returncode, "|", " | ".join(lines[:2]), flush=True)
        if r.returncode:
            print(r.stderr[-2000:])


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "build/hb",
         sys.argv[2].split(",") if len(sys.argv) > 2 else None)
