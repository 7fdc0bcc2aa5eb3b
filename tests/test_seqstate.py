"""Per-sequence state slots (`models/seqstate.py`, `seq_slots` in `kernjax/core/item.py`).

A small program of calls carries two per-sequence states (a running sum per sequence, the shape
of a recurrent state or a conv tail) across chunks. Checked: against a numpy model of what each
sequence should see; a fresh sequence starts from zeros in a slot another sequence used before;
cut between the two states, the stages keep one state each and give the whole's bytes; packed
matches alone (within float32 rounding: a cumsum groups its additions by row
offset, so this toy model is not batch invariant; the real ones are, `tests/test_attention.py`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kernjax.core.cut import cut, whole
from kernjax.core.item import Piece, item_shape, make_item
from kernjax.artifact import export_stage
from kernjax.core.trace import Slot, call, trace
from kernjax.models import seqstate

ROWS, SEQS, SLOTS, D, V = 16, 3, 5, 4, 32


def program():
    inputs = [Slot("emb", "weight", "float32", (V, D)), Slot("w", "weight", "float32", (D, D)),
              Slot("run.0", "state", "float32", (SLOTS, D)),
              Slot("run.1", "state", "float32", (SLOTS, D)),
              Slot("tokens", "fill", "int32", (ROWS,)), Slot("positions", "fill", "int32", (ROWS,)),
              Slot("cu_seqlens", "fill", "int32", (SEQS + 1,)),
              Slot("seq_slots", "fill", "int32", (SEQS,)),
              Slot("page_table", "table", "int32", (SEQS, 2))]
    outputs = [("next_token", "tokens"), ("logits", "logits"), ("run.0", "state"),
               ("run.1", "state")]

    def running(state, h, positions, cu, seq_slots):
        """Each row: its sequence's starting state plus the sum of its rows so far."""
        start = seqstate.initial(state, seq_slots, positions, cu)
        seq = seqstate.row_sequence(cu, ROWS)
        onehot = (seq[:, None] == jnp.arange(SEQS)[None, :]).astype(jnp.float32)
        # Sums in row order within each sequence (a cumsum per sequence, exact in float32 here).
        y = jnp.cumsum(onehot[:, :, None] * h[:, None, :], axis=0)
        y = jnp.einsum("rs,rsd->rd", onehot, y + start[None])
        last = jnp.maximum(cu[1:] - 1, 0)
        return seqstate.store(state, seq_slots, cu, y[last]), y

    def fwd(x):
        h = call("embed", lambda t, e: e[t])(x["tokens"], x["emb"])
        s0, y = call("run0", running, state=1)(x["run.0"], h, x["positions"], x["cu_seqlens"],
                                                 x["seq_slots"])
        m = call("mix", lambda y, w: jnp.tanh(y @ w))(y, x["w"])
        s1, z = call("run1", running, state=1)(x["run.1"], m, x["positions"], x["cu_seqlens"],
                                                 x["seq_slots"])
        logits = call("head", lambda z, e, cu: z[jnp.maximum(cu[1:] - 1, 0)] @ e.T)(
            z, x["emb"], x["cu_seqlens"])
        tok = call("argmax", lambda lg: jnp.argmax(lg, -1).astype(jnp.int32))(logits)
        return {"next_token": tok, "logits": logits, "run.0": s0, "run.1": s1}

    return trace(fwd, inputs, outputs, rows=ROWS, slots=SLOTS)


class Runner:
    """Runs stages (or the whole) item by item in this process, keeping each stage's states."""

    def __init__(self, stages, weights):
        self.stages = stages
        self.fns = [jax.jit(export_stage(s).call) for s in stages]
        self.weights = weights
        self.states = {s.name: jnp.zeros(s.shape, s.dtype) for st in stages for s in st.inputs
                       if s.role == "state"}

    def run(self, item):
        carry, got = [], {}
        for st, fn in zip(self.stages, self.fns):
            args = [self.weights.get(s.name, self.states.get(s.name, item.get(s.name)))
                    for s in st.inputs]
            out = fn(*args, *carry)
            carry = out[:len(st.departures)]
            for o, v in zip(st.outputs, out[len(st.departures):]):
                (self.states if o.role == "state" else got)[o.name] = v
        return {k: np.asarray(v) for k, v in got.items()}


def test_slots_reach_the_item_shape_and_fill():
    p = program()
    shape = item_shape(p, 16)
    assert shape.slots == SLOTS
    item = make_item([Piece(np.arange(3), 0, (1,), slot=2)], shape)
    assert item["seq_slots"].tolist() == [2, SLOTS, SLOTS]


def test_initial_and_store():
    state = jnp.arange(4 * 2, dtype=jnp.float32).reshape(4, 2) + 1
    pos = jnp.array([5, 6, 0, 0, 7, 0], jnp.int32)
    cu = jnp.array([0, 2, 3, 3, 4], jnp.int32)  # seq 0: 2 rows at 5; 1: fresh; 2: empty; 3: at 7
    seq_slots = jnp.array([1, 2, 3, 4], jnp.int32)  # 4 is past the end (unused)
    got = np.asarray(seqstate.initial(state, seq_slots, pos, cu))
    assert got.tolist() == [[3, 4], [0, 0], [0, 0], [0, 0]]
    new = np.asarray(seqstate.store(state, seq_slots, cu, jnp.full((4, 2), 9.0)))
    assert new.tolist() == [[1, 2], [9, 9], [9, 9], [7, 8]]  # slot 3 (empty seq) untouched


def _prompts(rng):
    return [rng.integers(1, V, n) for n in (11, 7, 20)]


def _chunks(prompt, rows):
    return [(a, prompt[a:a + rows]) for a in range(0, len(prompt), rows)]


def _reference(emb, w, prompt):
    """numpy: running sums through the two states, one sequence."""
    y = np.cumsum(emb[prompt], axis=0, dtype=np.float32)
    z = np.cumsum(np.tanh(y @ w), axis=0, dtype=np.float32)
    return z[-1] @ emb.T


def test_stages_keep_their_states_and_equal_the_whole():
    p = program()
    shape = item_shape(p, 16)
    rng = np.random.default_rng(0)
    weights = {"emb": jnp.asarray(rng.standard_normal((V, D)), jnp.float32),
               "w": jnp.asarray(rng.standard_normal((D, D)) * 0.3, jnp.float32)}
    prompts = _prompts(rng)
    whole_run = Runner([whole(p)], weights)
    stages = cut(p, [3])  # after `mix`: run.0 on stage 0, run.1 on stage 1
    assert [sorted(s.name for s in st.inputs if s.role == "state") for st in stages] == \
        [["run.0"], ["run.1"]]
    split_run = Runner(stages, weights)

    # Alone: each prompt in its own slot, 6 rows a chunk; then a new prompt reuses slot 1.
    alone = {}
    for k, prompt in enumerate(prompts + [prompts[1]]):
        slot = 1 if k == 3 else k + 1
        for a, toks in _chunks(prompt, 6):
            item = make_item([Piece(toks, a, (1, 2), slot=slot)], shape)
            w_out, s_out = whole_run.run(item), split_run.run(item)
            for name in ("logits", "next_token"):
                assert w_out[name].tobytes() == s_out[name].tobytes()
        alone[k] = w_out["logits"][0]
        want = _reference(np.asarray(weights["emb"]), np.asarray(weights["w"]), prompt)
        np.testing.assert_allclose(alone[k], want, rtol=1e-4, atol=1e-4)
    # The reused slot started from zeros: the same answer as the first time.
    assert alone[3].tobytes() == alone[1].tobytes()

    # Packed: the three prompts in one item stream, 16 rows a chunk, slots 4, 3, 2.
    packed_run = Runner(stages, weights)
    queue = [(k, a, toks) for k, pr in enumerate(prompts) for a, toks in _chunks(pr, 5)]
    last = {}
    while queue:
        take, used, seen = [], 0, set()
        for q in list(queue):
            if q[0] not in seen and used + len(q[2]) <= ROWS and len(take) < SEQS:
                take.append(q)
                used += len(q[2])
                queue.remove(q)
            seen.add(q[0])
        item = make_item([Piece(t, a, (1, 2), slot=4 - k) for k, a, t in take], shape)
        out = packed_run.run(item)
        for i, (k, a, t) in enumerate(take):
            if a + len(t) == len(prompts[k]):
                last[k] = out["logits"][i]
    for k in range(3):
        np.testing.assert_allclose(last[k], alone[k], rtol=1e-5, atol=1e-5)
