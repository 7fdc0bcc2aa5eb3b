"""The edge ops in stage programs (kernjax/runtime/edge.py, csrc/edge.*) on the CPU.

A cut's stages get a second program that holds, receives, pushes and posts at its edges. Here the
stages of qwen3-tiny cut into 2 and 3 stages run those programs over shared-memory edges, and:
- the logits and tokens equal the whole program's, bit for bit, chunk after chunk;
- a stage issued before its arrivals exist waits on the device and finishes once they come;
- an upstream stage runs ahead by as many items as the edge has slots, and no further;
- a hold that waits too long fails with a message that names the edge (never a hang), an
  unbound edge and a departure of the wrong size are refused, and the whole program calls no
  edge op.
"""

from __future__ import annotations

import threading

import jax
import numpy as np
import pytest

from kernjax import models
from kernjax.runtime import edge
from kernjax.kernels import ffi
from kernjax import artifact as artifacts
from kernjax.artifact import model_meta
from kernjax.core.cut import cut, whole
from kernjax.core.item import Piece, chunks, item_shape, make_item
from kernjax.runtime.runner import Runner, checkpoint_dir, load_weights

pytestmark = pytest.mark.skipif(not ffi.available(), reason="kernjax._ffi is not built")

FAM, CFG = models.named("qwen3-tiny")
CHUNK, CONTEXT = 32, 256


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    program = FAM.program(CFG, dtype=CFG.dtype, rows=CHUNK, context=CONTEXT)
    ref = {"model": CFG.name, "seed": 0, "dtype": CFG.dtype}
    meta = dict(model=model_meta(FAM, CFG), checkpoint=ref, dtype=CFG.dtype,
                item=item_shape(program, FAM.page(CFG)))
    out = tmp_path_factory.mktemp("edge")
    ckpt, cache = checkpoint_dir(ref), {}

    def runners(stages, name):
        arts = [artifacts.read(artifacts.write(out / name / f"s{s.index}", s, **meta))
                for s in stages]
        return [Runner(a, load_weights(a, ckpt, cache=cache)) for a in arts]

    return program, runners


def items(n_tokens: int, seed: int) -> list[dict]:
    shape = item_shape(FAM.program(CFG, dtype=CFG.dtype, rows=CHUNK, context=CONTEXT), FAM.page(CFG))
    toks = np.random.default_rng(seed).integers(0, CFG.vocab, n_tokens).astype(np.int32)
    pages = tuple(range(1, -(-n_tokens // FAM.page(CFG)) + 1))
    return [make_item([Piece(toks[a:b], a, pages)], shape) for a, b in chunks(n_tokens, CHUNK)]


def edges_for(stages, nslots: int) -> list[edge.SharedEdge]:
    out = []
    for r in stages[:-1]:
        e = edge.SharedEdge(edge.Layout.of(r.art.departures, nslots))
        e.bind(r.art.index)
        out.append(e)
    return out


def close(edges) -> None:
    for e in edges:
        e.close(unlink=True)


@pytest.mark.parametrize("at,nslots", [([14], 2), ([9, 32], 1)])
def test_edged_stages_equal_whole_bit_for_bit(built, at, nslots):
    program, runners = built
    whole_r = runners([whole(program)], "whole")[0]
    stages = runners(cut(program, at), "c" + "_".join(map(str, at)))
    edges = edges_for(stages, nslots)
    try:
        k = 0
        for n_tokens, seed in ((70, 1), (32, 2), (1, 3)):
            whole_r.reset()
            for r in stages:
                r.reset()
            for it in items(n_tokens, seed):
                _, want = whole_r.run(it)
                for r in stages:
                    got, _ = r.run_edged(it, k)
                k += 1
                assert np.asarray(got["logits"]).tobytes() == np.asarray(want["logits"]).tobytes()
                assert np.array_equal(got["next_token"], want["next_token"])
        assert edges[-1].arrived == k and edges[-1].taken == k
    finally:
        close(edges)


def _run_in_thread(fn):
    box = {}

    def go():
        try:
            box["out"] = jax.block_until_ready(fn())
        except Exception as e:  # noqa: BLE001
            box["error"] = e

    t = threading.Thread(target=go, daemon=True)
    t.start()
    return t, box


one_stream = pytest.mark.skipif(
    jax.default_backend() == "gpu", reason="in one process both stages share one GPU stream, so "
    "a held stage blocks the one queued behind it; test_serve covers this across processes")


def _logits(edged) -> bytes:
    """The logits' bytes of what `run_edged` returned."""
    return np.asarray(edged[0]["logits"]).tobytes()


@one_stream
def test_downstream_waits_for_its_arrivals_and_upstream_runs_ahead_by_the_slots(built):
    """Stage 1 issued before its arrivals exist, and stage 0 issued for an item whose slot
    stage 1 still holds, each wait: still running half a second later (a wait cannot end
    early, however loaded the machine), and each then gives the whole program's logits, bit
    for bit, which a stage that read its slot early (empty, or overwritten by item 3) would not."""
    program, runners = built
    whole_r = runners([whole(program)], "whole")[0]
    s0, s1 = runners(cut(program, [14]), "c14")
    its = items(5 * CHUNK, 4)
    whole_r.reset()
    want = [np.asarray(whole_r.run(it)[1]["logits"]).tobytes() for it in its[:4]]
    s0.reset()
    s1.reset()
    edges = edges_for([s0, s1], 2)
    got = {}
    try:
        # stage 1 issued first: it waits on the device for item 0's arrivals
        t1, box1 = _run_in_thread(lambda: s1.run_edged(its[0], 0))
        t1.join(0.5)
        assert t1.is_alive() and "out" not in box1
        jax.block_until_ready(s0.run_edged(its[0], 0))
        t1.join(60)
        assert "out" in box1, box1.get("error")
        got[0] = _logits(box1["out"])
        # stage 0 runs items 1 and 2 into the two slots; item 3 would need item 1's slot back
        jax.block_until_ready(s0.run_edged(its[1], 1))
        jax.block_until_ready(s0.run_edged(its[2], 2))
        t0, box0 = _run_in_thread(lambda: s0.run_edged(its[3], 3))
        t0.join(0.5)
        assert t0.is_alive() and edges[0].arrived == 3
        got[1] = _logits(jax.block_until_ready(s1.run_edged(its[1], 1)))  # frees slot 1
        t0.join(60)
        assert "out" in box0, box0.get("error")
        assert edges[0].arrived == 4 and edges[0].taken == 2
        for k in (2, 3):  # drain, so nothing runs on the edge when it closes
            got[k] = _logits(jax.block_until_ready(s1.run_edged(its[k], k)))
    finally:
        close(edges)
    assert [got[k] == want[k] for k in range(4)] == [True] * 4


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="on a GPU a stalled hold traps, "
                    "which ends the process's CUDA context")
def test_a_hold_that_waits_too_long_fails_and_names_the_edge(built):
    program, runners = built
    _, s1 = runners(cut(program, [14]), "c14")
    edges = edges_for(runners(cut(program, [14]), "c14"), 2)
    edge.set_hold_timeout(0.3)
    try:
        with pytest.raises(Exception, match=r"kj_hold: edge 0's arrived word stayed at 0 .*"
                                            r"needs 1: the stage before stopped"):
            jax.block_until_ready(s1.run_edged(items(CHUNK, 5)[0], 0))
    finally:
        edge.set_hold_timeout(60)
        close(edges)


def test_unbound_edges_and_wrong_sizes_are_refused():
    tok = np.zeros(1, np.int32)
    with pytest.raises(Exception, match="edge 7 is not bound in this process"):
        jax.block_until_ready(jax.jit(lambda t: ffi.hold(t, t, edge=7, word=0))(tok))
    from kernjax.core.trace import Slot

    e = edge.SharedEdge(edge.Layout.of([Slot("x", "departure", "float32", (4,))], 2))
    e.bind(5)
    try:
        x = np.arange(8, dtype=np.float32)
        with pytest.raises(Exception, match="departure 0 is 32 bytes; the edge's slot holds 16"):
            jax.block_until_ready(jax.jit(
                lambda x, t: ffi.push(x, t, t, edge=5, index=0))(x, tok))
        # a push then a receive of the same item's slot give the bytes back
        y = np.arange(4, dtype=np.float32)
        for k in (0, 1, 2):
            jax.block_until_ready(jax.jit(lambda x, t: ffi.push(x, t, t, edge=5, index=0))(
                y + k, np.asarray([k], np.int32)))
        got, _ = jax.jit(lambda t: ffi.recv(t, t, jax.ShapeDtypeStruct((4,), np.float32), edge=5,
                                           index=0))(np.asarray([2], np.int32))
        assert np.array_equal(got, y + 2)  # slot 0 again, overwritten by item 2
    finally:
        e.close(unlink=True)


def test_the_whole_program_calls_no_edge_op_and_a_stage_calls_all(built):
    program, _ = built
    text = artifacts.export_stage(whole(program)).mlir_module()  # on a GPU kj_mark cuts graphs
    assert not any(f"kj_{op}" in text for op in ("hold", "recv", "push", "post"))
    s0, s1 = cut(program, [14])
    t0 = artifacts.export_stage(s0, edged=True).mlir_module()
    t1 = artifacts.export_stage(s1, edged=True).mlir_module()
    assert all(f"@kj_{op}" in t0 or f'"kj_{op}"' in t0 for op in ("hold", "push", "post"))
    assert all(f"@kj_{op}" in t1 or f'"kj_{op}"' in t1 for op in ("hold", "recv", "post"))
    assert "kj_recv" not in t0 and "kj_push" not in t1


def test_a_stage_whose_edged_program_fails_to_export_still_serves_and_says_so(built, tmp_path,
                                                                              monkeypatch, capsys):
    """The plain program is what the host transport runs: an edged export that fails costs only
    the device transports, with a warning at cut time and a clear refusal later."""
    program, _ = built
    real = artifacts.export_stage

    def flaky(stage, platform=None, *, edged=False):
        if edged:
            raise RuntimeError("no custom calls here")
        return real(stage, platform)

    monkeypatch.setattr(artifacts, "export_stage", flaky)
    s0, _ = cut(program, [14])
    meta = dict(model=model_meta(FAM, CFG), checkpoint={"model": CFG.name, "seed": 0,
                                                        "dtype": CFG.dtype},
                dtype=CFG.dtype, item=item_shape(program, FAM.page(CFG)))
    art = artifacts.read(artifacts.write(tmp_path / "s0", s0, **meta))
    assert "could not be exported (RuntimeError: no custom calls here)" in capsys.readouterr().err
    assert art.edged is None and "edged" not in art.manifest
    r = Runner(art, load_weights(art, checkpoint_dir(meta["checkpoint"])))
    with pytest.raises(Exception, match="has no program with edge ops: re-cut it"):
        r.run_edged(items(CHUNK, 6)[0], 0)
