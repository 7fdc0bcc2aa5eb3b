"""Roadmap K13 on the CPU: where `gate_up` and `silu_mul` run as one Mosaic GPU kernel on a GPU
(`models/mlp_hopper.py`, registered with `kernjax.trace.on_gpu`), and where they stay apart.

Exporting for CUDA needs no GPU, only an abstract H200 for the Pallas kernels. That the fused
kernel gives the bits of the pair apart is checked on the GPU (`experiments/fused_mlp.py`, the
chain cut between the two calls in `experiments/gpu_gate.sh`)."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import pytest

from kernjax.cut import cut, whole
from kernjax.stage import export_stage
from models import mlp_hopper, qwen3
from models.attention_hopper import abstract_h200

# qwen3-shaped, small: head_dim 128 (FlashAttention-3's), MLP 128 -> 256, 2 layers.
CFG = dataclasses.replace(qwen3.CONFIGS["qwen3-tiny"], name="k13", hidden=128, intermediate=256,
                          layers=2, head_dim=128)


def kernels(stage) -> int:
    """Mosaic GPU kernels in `stage` exported for CUDA (as on an H200)."""
    with abstract_h200(132):
        text = export_stage(stage, "cuda").mlir_module()
    return len(re.findall(r"custom_call @mosaic_gpu_v2", text))


def test_the_pair_is_one_kernel_in_a_program_and_its_two_halves_apart_across_a_cut():
    program = qwen3.program(CFG, dtype="bfloat16", rows=128, context=256)
    names = [e.params["name"] for e in program.jaxpr.jaxpr.eqns]
    g = names.index("l0.gate_up")
    assert names[g + 1] == "l0.silu_mul"
    assert kernels(whole(program)) == 2  # one fused kernel a layer
    a, b = cut(program, [g + 1])  # between gate_up and silu_mul of layer 0
    assert kernels(a) == 1  # the GEMM writing gate and up
    assert kernels(b) == 2  # silu·mul apart, then layer 1's fused kernel
    a, b = cut(program, [g])  # before gate_up: the pair stays whole in stage b
    assert (kernels(a), kernels(b)) == (0, 2)


def test_shapes_the_kernel_does_not_tile_keep_xla_everywhere():
    """64 rows is under a CTA's 128: XLA's lowering, in the whole program and in each stage."""
    program = qwen3.program(CFG, dtype="bfloat16", rows=64, context=256)
    g = [e.params["name"] for e in program.jaxpr.jaxpr.eqns].index("l0.gate_up")
    assert kernels(whole(program)) == 0
    assert [kernels(s) for s in cut(program, [g + 1])] == [0, 0]


@pytest.mark.parametrize("rows,f,k,dtype,ok", [
    (128, 256, 128, jnp.bfloat16, True), (8192, 9728, 2560, jnp.bfloat16, True),
    (64, 256, 128, jnp.bfloat16, False), (128, 192, 128, jnp.bfloat16, False),
    (128, 256, 96, jnp.bfloat16, False), (128, 256, 128, jnp.float32, False)])
def test_fits_asks_whole_tiles_of_bf16(rows, f, k, dtype, ok):
    """`fits` (x [rows, K], gate and up [F, K]); `silu_mul` apart runs its kernel for the rows
    and F its `gate_up` would have run the GEMM for, whatever K was."""
    S = jax.ShapeDtypeStruct
    assert mlp_hopper.fits(S((rows, k), dtype), S((f, k), dtype), S((f, k), dtype)) == ok
    silu = jax.eval_shape(mlp_hopper.silu_mul_call, S((rows, f), dtype), S((rows, f), dtype))
    assert (silu is not None) == (ok or k % 64 != 0 and dtype == jnp.bfloat16)  # K: gate_up's


def test_silu_mul_f32_rounds_once():
    g = jnp.asarray([-3.0, -0.5, 0.0, 0.7, 5.0], jnp.bfloat16)
    u = jnp.asarray([1.5, -2.0, 3.0, 0.25, -1.0], jnp.bfloat16)
    want = (g.astype(jnp.float32) * jax.nn.sigmoid(g.astype(jnp.float32))
            * u.astype(jnp.float32)).astype(jnp.bfloat16)
    assert jnp.array_equal(mlp_hopper.silu_mul_f32(g, u), want)
