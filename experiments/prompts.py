"""Writes the chain gate's seven prompts for a chunk size: 1, chunk-1, chunk, chunk+1, 2 chunk+7,
1000 and 2049 tokens of random ids (seeded by the chunk), one line of ids per prompt.

    python -m experiments.prompts --chunk 512 --vocab 151936 > prompts512.txt
"""

import argparse

import numpy as np

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--chunk", type=int, required=True)
    ap.add_argument("--vocab", type=int, required=True)
    a = ap.parse_args()
    rng = np.random.default_rng(a.chunk)
    for n in (1, a.chunk - 1, a.chunk, a.chunk + 1, 2 * a.chunk + 7, 1000, 2049):
        print(" ".join(map(str, rng.integers(0, a.vocab, n))))
