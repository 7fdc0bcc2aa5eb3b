"""Sums over a row whose bits do not depend on how many rows are summed beside it.

XLA's CPU backend emits a reduction over the minor axis by the array's whole shape: summing the
same row of 2,560 values alone and beside seven others gives different last bits (so does the
mean of squares of an RMSNorm, from 512 values and eight rows). A decode step holds one row per
sequence, a decode bucket several, a chunk hundreds: a row's log-probabilities and next token
must not follow the company it keeps. `rowsum` adds the two halves of the row until one value is
left (zeros pad it to a power of two): elementwise additions only, the same for a row whatever
the shape around it, at log2(n) passes over a shrinking row.

`rowsum` is the head's sum on every platform (`kernjax/kernels/head.py`, a few calls a program).
`rowmean` is the models' RMSNorm mean: the halving sum off CUDA, and on CUDA GPUs XLA's own
reduction (`jax.lax.platform_dependent`: one program, one cut id), whose per-row order the GPU
gate measures.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rowsum(x):
    """Σ over the last axis in a fixed order: halves added until one value is left."""
    n = x.shape[-1]
    p = 1 << max(n - 1, 0).bit_length()
    if p != n:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, p - n)])
    while x.shape[-1] > 1:
        h = x.shape[-1] // 2
        x = x[..., :h] + x[..., h:]
    return x[..., 0]


def rowmean(x, keepdims: bool = False):
    """The mean over the last axis: `rowsum` off CUDA, XLA's reduction on CUDA GPUs."""
    def tree(x):
        m = rowsum(x) / x.shape[-1]
        return m[..., None] if keepdims else m

    def xla(x):
        return jnp.mean(x, axis=-1, keepdims=keepdims)

    return jax.lax.platform_dependent(x, default=tree, cuda=xla)
