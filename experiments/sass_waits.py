"""Where ptxas put a kernel's wgmma waits: for each `WARPGROUP.DEPBAR.LE gsb0, 0x1` (the wait for
all but the newest product group) in a SASS listing, the instructions up to the next `0x0` (the
wait for all), and the exponentials (MUFU.EX2) between the two and after the second. A softmax
that overlaps the product in flight has its MUFU.EX2 between the waits.

SASS of a PTX file on a machine without a GPU (ptxas 13.0 as on the device image; cuobjdump from
pip: `pip download --no-deps nvidia-cuda-cuobjdump`, unzip, `nvidia/cu13/bin` on PATH):

    ptxas -arch=sm_90a -O3 -v kernel.ptx -o kernel.cubin && cuobjdump -sass kernel.cubin > k.sass
    python -m experiments.sass_waits k.sass

The PTX of Mosaic GPU's kernels comes from `gpu_gate.sh dump`.
"""

from __future__ import annotations

import re
import sys


def listing(lines) -> list[tuple[str, str]]:
    """(address, instruction) per SASS line; ("FUNC", name) where a function starts."""
    out = []
    for line in lines:
        if m := re.match(r"\s*Function : (\S+)", line):
            out.append(("FUNC", m.group(1)))
        elif m := re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line):
            out.append((m.group(1), m.group(2).strip()))
    return out


def waits(ins: list[tuple[str, str]]) -> list[str]:
    out = []
    for i, (a, t) in enumerate(ins):
        if a == "FUNC":
            out.append(f"== {t[:90]}")
        elif "DEPBAR.LE gsb0, 0x1" in t:
            j = next((j for j in range(i + 1, len(ins)) if ins[j][0] == "FUNC"
                      or "DEPBAR.LE gsb0, 0x0" in ins[j][1]), len(ins))
            if j == len(ins) or ins[j][0] == "FUNC":
                out.append(f"  0x1 @{a}: no 0x0 after it")
                continue
            k = next((k for k in range(j + 1, len(ins)) if ins[k][0] == "FUNC"
                      or "HGMMA" in ins[k][1]), len(ins))
            ex = lambda xs: sum("MUFU.EX2" in x for _, x in xs)  # noqa: E731
            out.append(f"  0x1 @{a} -> 0x0 @{ins[j][0]}: {j - i - 1} instructions between, "
                       f"MUFU.EX2 {ex(ins[i:j])} between and {ex(ins[j:k])} after (to the next "
                       "HGMMA)")
    return out


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        print("\n".join(waits(listing(f))))
