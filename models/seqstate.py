"""Per-sequence states: one slot per live sequence (KDA's recurrent state, a short conv's tail).

Paged KV grows with a sequence; a recurrent state does not: each sequence owns one *slot* of a
state `[slots, ...]` for its whole life. The head leases the slot with the sequence's pages and
sends it with every piece (`seq_slots [seqs]` in the item, `kernjax/core/item.py`); slot 0 is never
leased, and an unused sequence entry holds `slots`, one past the end, so it reads zeros and
writes nothing. A piece that starts at position 0 is a fresh sequence: that is the head's word
to start from zeros, whatever the slot held before (a finished sequence's state stays behind
until the next one overwrites it). A cut keeps every state on the stage whose calls read it, so
each layer's slots live where the layer runs.
"""

from __future__ import annotations

import jax.numpy as jnp


def row_sequence(cu_seqlens, rows: int):
    """Each row's sequence index (`seqs` for padding rows past `cu_seqlens[-1]`)."""
    r = jnp.arange(rows)
    return jnp.searchsorted(cu_seqlens[1:], r, side="right").astype(jnp.int32)


def initial(state, seq_slots, positions, cu_seqlens):
    """Each sequence's starting state, `[seqs, ...]` float32: its slot's contents, or zeros for a
    fresh sequence (its piece starts at position 0), an empty one or an unused one."""
    slots = state.shape[0]
    seqs = seq_slots.shape[0]
    first = jnp.minimum(cu_seqlens[:-1], positions.shape[0] - 1)
    fresh = (positions[first] == 0) | (cu_seqlens[1:] == cu_seqlens[:-1])
    ok = (seq_slots >= 1) & (seq_slots < slots) & ~fresh
    got = state[jnp.clip(seq_slots, 0, slots - 1)].astype(jnp.float32)
    mask = ok.reshape((seqs,) + (1,) * (state.ndim - 1))
    return jnp.where(mask, got, 0.0)


def store(state, seq_slots, cu_seqlens, final):
    """`state` with each non-empty sequence's `final` `[seqs, ...]` written to its slot; empty and
    unused sequences write nothing (their slot is left as it was)."""
    slots = state.shape[0]
    empty = cu_seqlens[1:] == cu_seqlens[:-1]
    idx = jnp.where(empty | (seq_slots < 1), slots, seq_slots)  # out of range: dropped
    return state.at[idx].set(final.astype(state.dtype), mode="drop")
