"""Variants of csrc/dense.cu's HeadsKernel for experiments/heads_bench.cu: each a copy of dense.cu
with textual replacements (each must apply exactly once), written to OUT/<name>/dense.cu, then
compiled with the bench to OUT/<name>/bench (sm_90, nvcc here; no GPU needed to build). The
arithmetic is the same in every variant; the bench's hashes say whether the bytes are. `L*`
variants add experiments/heads_lean.cuh's kernel (its LEAN_* words filled in) for qk_rope's job.
Results: experiments/results/2026-12-03-h200-heads5/.

    python experiments/heads_variants.py build/hb [A,L6,...]   # then on the GPU:
    build/hb/<name>/bench 8192 200
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


# HeadsLean<kF>: each part's flags a template argument (experiments/heads_lean.cuh), the part of a
# step chosen by comparisons, every field read at a fixed offset; qk_rope's job runs it, the rest
# the kernel as is
LEAN_LAUNCH = ("  if (j.rows > 0) HeadsKernel<<<j.rows, 32 * kWarps, 0, stream>>>(j);",
               "  unsigned f = 0;\n  for (int t = 0; t < j.parts; ++t)\n"
               "    f |= unsigned(!!j.part[t].w | j.part[t].rope << 1 | !!j.part[t].dst << 2 | (j.part[t].half >= 0) << 3) << 4 * t;\n"
               "  if (j.rows > 0 && f == 0x8B7) HeadsLean<0x8B7><<<j.rows, 32 * kWarps, 0, stream>>>(j);\n"
               "  else if (j.rows > 0) HeadsKernel<<<j.rows, 32 * kWarps, 0, stream>>>(j);")
LEAN_AT = "// h + y, then its RMSNorm times w"
SINCOS = {"": "cos_s[threadIdx.x] = __float2bfloat16_rn(cosf(a));\n"
              "      sin_s[threadIdx.x] = __float2bfloat16_rn(sinf(a));",
          "sc": "float sv, cv;\n      sincosf(a, &sv, &cv);\n"
                "      cos_s[threadIdx.x] = __float2bfloat16_rn(cv);\n"
                "      sin_s[threadIdx.x] = __float2bfloat16_rn(sv);"}


def lean(blocks, sincos="", warp=0):
    text = open(os.path.join(HERE, "heads_lean.cuh")).read()
    text = text.replace("LEAN_BLOCKS", str(blocks)).replace("LEAN_SINCOS", SINCOS[sincos])
    text = text.replace("LEAN_WARP", str(warp))
    return [(LEAN_AT, text + "#define KJ_BENCH_FN HeadsLean<0x8B7>\n" + LEAN_AT), LEAN_LAUNCH]


def variants():
    b = lambda n: [(BOUNDS[0], BOUNDS[1].format(n))]
    return {"A": [], "B4": b(4), "B6": b(6), "S": STATIC, "S4": STATIC + b(4),
            "L4": lean(4), "L5": lean(5), "L6": lean(6), "L8": lean(8), "L5sc": lean(5, "sc"),
            "L6sc": lean(6, "sc"), "L5w": lean(5, warp=1), "L6w": lean(6, warp=1),
            "L4w": lean(4, warp=1)}


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
        kernel = "HeadsLean" if "HeadsLean" in src else "HeadsKernel"
        lines, on = [], False  # ptxas's report of the kernel the bench times
        for l in r.stderr.splitlines():
            on = (kernel in l) if "Function properties" in l or "Compiling" in l else on
            lines += [l.strip().removeprefix("ptxas info    : ")] if on and ("Used" in l or "spill" in l) else []
        print(name, "rc", r.returncode, "|", " | ".join(lines[:2]), flush=True)
        if r.returncode:
            print(r.stderr[-2000:])


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "build/hb",
         sys.argv[2].split(",") if len(sys.argv) > 2 else None)
