"""`kernjax.kernels.attention_hopper.chunk_attention` (Mosaic GPU) on the CPU, in Mosaic GPU's interpreter.

The interpreter runs the three warpgroups as threads, simulates the TMA, the barriers and shared
memory, and with `detect_races` checks every shared-memory access for a missing happens-before.
It has no `run_state` and no wgmma with its left operand in registers, so the P @ V product goes
through shared memory there (the kernel's `interpret` branch); everything else is the kernel's
code. The GPU tests (`tests/test_attention_pallas.py`, `gpu`) run both kernels at Qwen3-4B shapes.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernjax.kernels import attention_hopper

from .test_attention_pallas import check, make_item, reference

INTERPRET = plgpu.InterpretGPUParams(detect_races=True)
# The interpreter's callbacks hung on the H200 (2026-11-30): its tests are for the CPU, the GPU
# runs the kernel itself.
cpu = pytest.mark.skipif(jax.default_backend() != "cpu", reason="the interpreter runs on the CPU")


def run(args, **kw):
    """The kernel in the interpreter; fails if the race detector saw a race."""
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as ipc

    out = attention_hopper.chunk_attention(*args, scale=args[1].shape[-1] ** -0.5,
                                           interpret=INTERPRET, **kw)
    out.block_until_ready()
    assert not ipc.get_races().races_found, "the race detector found a race (printed above)"
    return out


# (pieces, rows, block_kv): several tiles per sequence, several key steps (refilled slots),
# partial last pages and tiles, an empty sequence, padding rows.
CASES = {
    "packed": ([(70, 5), (0, 100), (130, 20), (0, 0)], 160, 64),
    "refills-block128": ([(300, 129), (16, 1)], 136, 128),
}


@cpu
@pytest.mark.parametrize("fma_exp", [0, 16], ids=["mufu", "fma-exp"])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_reference(case, fma_exp):
    """`fma_exp` (experimental): the last 16 columns' exponentials by `_exp2_fma`."""
    pieces, rows, block_kv = CASES[case]
    args = make_item(np.random.default_rng(len(case)), pieces, rows=rows, heads=4, kv_heads=2,
                     d=64, dtype=jnp.bfloat16)
    out = run(args, block_kv=block_kv, fma_exp=fma_exp)
    assert out.shape == (rows, 4, 64) and out.dtype == jnp.bfloat16
    ref = reference(args[0].astype(jnp.float32), args[1].astype(jnp.float32), *args[2:],
                    64 ** -0.5)
    check(out, ref, args[3], 1e-2)


@cpu
def test_batch_invariance():
    """A sequence alone, then packed after others (its rows in a different place within a tile,
    its tile meeting a longer one), in the same shapes: its rows are byte-identical."""
    rows, width = 192, 16
    x = (90, 70)
    outs = []
    for pieces in ([x, (0, 0)], [(10, 33), x]):
        rng = np.random.default_rng(3)
        kv1, q1, pos1, _, pt1 = map(np.asarray, make_item(
            rng, [x], rows=rows, heads=4, kv_heads=2, d=64, dtype=jnp.bfloat16, width=width))
        kv, q, pos, cu, pt = map(np.array, make_item(
            np.random.default_rng(len(outs)), pieces, rows=rows, heads=4, kv_heads=2, d=64,
            dtype=jnp.bfloat16, width=width))
        s = pieces.index(x)
        base = kv.shape[0]
        kv = np.concatenate([kv, kv1[1:]])
        pt[s] = np.where(pt1[0] > 0, pt1[0] + base - 1, 0)
        r = slice(int(cu[s]), int(cu[s + 1]))
        q[r], pos[r] = q1[:x[1]], pos1[:x[1]]
        out = run(tuple(map(jnp.asarray, (kv, q, pos, cu, pt))), block_kv=64)
        outs.append(np.asarray(out)[r])
    assert outs[0].tobytes() == outs[1].tobytes()


def _lowered_for_h200(rows=512, **kw) -> str:
    return attention_hopper.lower_for_h200(rows, **kw).as_text(debug_info=False)


def test_exp2_on_the_fma_pipes_is_within_its_bound():
    """`_exp2_fma` against float64 2^x: within 1.02e-4 relative down to -125, exactly 1 at 0, a
    normal number below 2^-124 from -125 down to -inf (where MUFU's gives 0)."""
    x = np.concatenate([np.random.default_rng(0).uniform(-130, 0, 200_000), [0, -0.5, -1e-9,
                                                                               -125, -np.inf]])
    got = np.asarray(jax.jit(attention_hopper._exp2_fma)(jnp.asarray(x, jnp.float32)), np.float64)
    x = x.astype(np.float32).astype(np.float64)
    ok = x > -125
    assert np.abs(got[ok] / np.exp2(x[ok]) - 1).max() < 1.02e-4 and got[-5] == 1.0
    assert np.all((got[~ok] > 0) & (got[~ok] < 2.0 ** -124))


def test_the_experimental_variants_lower_for_an_h200_and_the_interpreter_refuses_them():
    """`overlap=True`, alone and with `turns=True` (by an mbarrier or one way at named barriers),
    and `fma_exp` (experimental; checked and timed on the GPU by `gpu_gate.sh variant`) pass
    Mosaic GPU's layout inference here; the interpreter cannot run them, nor the named barriers
    of the GPU's default, and says so."""
    assert "mosaic_gpu" in _lowered_for_h200(overlap=True)
    assert "mosaic_gpu" in _lowered_for_h200(overlap=True, block_kv=64, steps=3)
    assert "mosaic_gpu" in _lowered_for_h200(overlap=True, turns=True)
    assert "mosaic_gpu" in _lowered_for_h200(fma_exp=32)
    one_way = _lowered_for_h200(overlap=True, turns=True, named=True)
    assert all(f"bar.{op} {b}, 256" in one_way for op in ("sync", "arrive") for b in (14, 15))
    S = jax.ShapeDtypeStruct
    args = (S((9, 16, 2, 2, 64), jnp.bfloat16), S((16, 4, 64), jnp.bfloat16),
            S((16,), jnp.int32), S((2,), jnp.int32), S((1, 4), jnp.int32))
    with pytest.raises(ValueError, match="overlap runs on a GPU only"):
        jax.eval_shape(lambda *a: attention_hopper.chunk_attention(
            *a, scale=1.0, overlap=True, interpret=True), *args)
    with pytest.raises(ValueError, match="named runs on a GPU only"):
        jax.eval_shape(lambda *a: attention_hopper.chunk_attention(
            *a, scale=1.0, named=True, interpret=True), *args)
    with pytest.raises(ValueError, match="with overlap only with turns"):
        jax.eval_shape(lambda *a: attention_hopper.chunk_attention(
            *a, scale=1.0, overlap=True, named=True), *args)
    with pytest.raises(ValueError, match="turns=True goes with overlap=True"):
        jax.eval_shape(lambda *a: attention_hopper.chunk_attention(
            *a, scale=1.0, turns=True), *args)


def test_lowers_to_mosaic_gpu():
    """The kernel lowers for an H200 on any machine (Mosaic GPU's own layout inference runs
    here); its custom call is `mosaic_gpu_v2`. On the GPU the warpgroups hand each other the
    turn at two named barriers, one way (`bar.sync` at its own, `bar.arrive` at the other's)."""
    text = _lowered_for_h200()
    assert "mosaic_gpu" in text
    assert all(f"bar.{op} {b}, 256" in text for op in ("sync", "arrive") for b in (14, 15))
    assert not re.findall(r"bar\.\w+ 1[45], 256", _lowered_for_h200(named=False))


def test_the_same_kernel_lowers_to_the_same_bytes_whatever_was_lowered_before():
    """JAX's persistent compilation cache keys a program by its text, the serialized kernel
    included: a module name numbered by how many kernels the process lowered before made a
    restarted process miss it (docs/lessons.md)."""
    first = _lowered_for_h200()
    _lowered_for_h200(rows=256)
    assert _lowered_for_h200() == first


def test_rejects_what_it_cannot_run():
    S = jax.ShapeDtypeStruct
    kv, q = S((9, 16, 2, 2, 32), jnp.bfloat16), S((16, 4, 32), jnp.bfloat16)
    small = (S((16,), jnp.int32), S((2,), jnp.int32), S((1, 4), jnp.int32))
    assert not attention_hopper.supports(jnp.float32, 128)
    assert not attention_hopper.supports(jnp.bfloat16, 32)
    with pytest.raises(ValueError, match="head_dim"):
        jax.eval_shape(lambda *a: attention_hopper.chunk_attention(*a, scale=1.0), kv, q, *small)
    kv64, q64 = S((9, 16, 2, 2, 64), jnp.bfloat16), S((16, 4, 64), jnp.bfloat16)
    for bad in (12, 128):
        with pytest.raises(ValueError, match="multiple of 8 below block_kv"):
            jax.eval_shape(lambda *a: attention_hopper.chunk_attention(
                *a, scale=1.0, fma_exp=bad), kv64, q64, *small)
