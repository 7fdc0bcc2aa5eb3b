"""The head's top-k in steps of 16 (`kernjax.kernels.head.top_k`) is `jax.lax.top_k`: the same
values and indices, ties broken by the lower index, whatever k."""

from __future__ import annotations

import jax
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kernjax.kernels.head import top_k


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 4), extra=st.integers(0, 60), k=st.integers(1, 40),
       levels=st.integers(2, 50), dead=st.integers(0, 20), seed=st.integers(0, 2**16))
def test_top_k_in_steps_is_laxs_top_k(rows, extra, k, levels, dead, seed):
    """Rows of few distinct values (many ties) with -inf at their front, as the online pass's
    first slice has them, and at least k entries above -inf."""
    rng = np.random.default_rng(seed)
    width = k + extra
    x = rng.integers(0, levels, (rows, dead + width)).astype(np.float32) / levels
    x[:, :dead] = -np.inf
    want = jax.lax.top_k(x, k)
    got = top_k(x, k)
    for w, g in zip(want, got, strict=True):
        assert np.asarray(w).tobytes() == np.asarray(g).tobytes()
