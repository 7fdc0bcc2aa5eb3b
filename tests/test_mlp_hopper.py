"""Roadmap K13 on the CPU: where `gate_up` and `silu_mul` run as one Mosaic GPU kernel on a GPU
(`models/mlp_hopper.py`, registered with `kernjax.trace.on_gpu`), and where they stay apart.

Exporting for CUDA needs no GPU, only an abstract H200 for the Pallas kernels. That the fused
kernel gives the bits of the pair apart is checked on the GPU (`experiments/fused_mlp.py`, the
chain cut between the two calls in `experiments/gpu_gate.sh`)."""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax import export

from kernjax import trace
from kernjax.cut import cut, whole
from kernjax.stage import UNSTABLE, export_stage
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


def test_the_kernel_is_traced_once_per_shapes_not_once_per_layer(monkeypatch):
    """Four layers, one shapes: the fused kernel's Python runs twice (the fit check, then the
    program's trace; jit's cache after), where it ran twice a layer (Mosaic GPU's lowering of
    36 kernels was 9 of the 10 s an 8k qwen3-4b program took to export)."""
    runs = []

    def counting(*args):
        runs.append(args[0].shape)
        return mlp_hopper.fused_call(*args)

    monkeypatch.delitem(trace._ON_GPU, ("gate_up", "silu_mul"))  # back after the test
    trace.on_gpu("gate_up", "silu_mul")(counting)
    # hidden 192: shapes no other test compiles, so jit's cache starts empty for them
    cfg = dataclasses.replace(CFG, name="k13x4", hidden=192, layers=4)
    program = qwen3.program(cfg, dtype="bfloat16", rows=128, context=256)
    assert kernels(whole(program)) == 4
    assert 1 <= len(runs) <= 2, runs


def test_the_unconstrained_program_keeps_the_kernels_and_drops_the_barriers():
    """`as_function(fences=False)` (experiments' unconstrained program): the same Mosaic
    kernels, and no `optimization_barrier` (XLA free to fuse across calls)."""
    program = qwen3.program(CFG, dtype="bfloat16", rows=128, context=256)
    specs = [s.spec() for s in program.inputs]
    texts = []
    for fences in (True, False):
        fn = trace.as_function(program.jaxpr, "cuda", fences=fences)
        with abstract_h200(132):
            texts.append(export.export(jax.jit(fn), platforms=["cuda"],
                                       disabled_checks=UNSTABLE)(*specs).mlir_module())
    fenced, free = (len(re.findall(r"custom_call @mosaic_gpu_v2", t)) for t in texts)
    assert fenced == free == 2
    assert "optimization_barrier" in texts[0] and "optimization_barrier" not in texts[1]
    # `jax.default_backend()` says "gpu", which would have run the CPU's lowering on a GPU
    with pytest.raises(ValueError, match="platform 'gpu': give cpu, cuda or rocm"):
        trace.as_function(program.jaxpr, "gpu", fences=False)


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


def _gemm_in_the_interpreter(fused, across, ctas, rounding="cvt"):
    """qwen3-shaped operands, small (x [256, 256], gate and up [256, 256]), through `gemm` in
    Mosaic GPU's interpreter with its race detector: 8 tiles of 128 x 64, 4 steps over K."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as ipc

    ks = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(ks[0], (256, 256), jnp.float32).astype(jnp.bfloat16)
    wg, wu = ((0.1 * jax.random.normal(kk, (256, 256), jnp.float32)).astype(jnp.bfloat16)
              for kk in ks[1:])
    out = mlp_hopper.gemm(x, wg, wu, fused=fused, tile_m=64, tile_n=128, tile_k=64, steps=2,
                          wg_n=False, minor=1, width=1, across=across, ctas=ctas,
                          rounding=rounding,
                          interpret=plgpu.InterpretGPUParams(detect_races=True))
    jax.block_until_ready(out)
    assert not ipc.get_races().races_found, "the race detector found a race (printed above)"
    return x, wg, wu, out


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the interpreter runs on the CPU")
@pytest.mark.parametrize("ctas", [2, 3])
def test_one_pipeline_across_a_ctas_tiles_gives_the_bits_of_one_a_tile(ctas):
    """`gemm(across=True)` (roadmap K15): the producer runs one pipeline over all of a CTA's tiles
    (Mosaic GPU's pipeline of pipelines: START, STEADY.., STOP), here 4 tiles a CTA, or 3, 3 and 2.
    Fused and apart, it writes the bits a pipeline a tile writes, with no race, and the fused
    product is silu_mul_f32 of gate and up apart."""
    outs = {}
    for fused in (True, False):
        x, wg, wu, one = _gemm_in_the_interpreter(fused, across=False, ctas=ctas)
        outs[fused] = _gemm_in_the_interpreter(fused, across=True, ctas=ctas)[3]
        assert all(bool(jnp.array_equal(a, b)) for a, b in zip(outs[fused], one))
    g, u = outs[False]
    for got, w in zip((g, u), (wg, wu)):  # within a bf16 step of float32's product
        want = x.astype(jnp.float32) @ w.T.astype(jnp.float32)
        assert bool(jnp.all(jnp.abs(got.astype(jnp.float32) - want)
                            <= jnp.abs(want) * 2.0 ** -7 + 1e-3))
    assert bool(jnp.array_equal(outs[True][0], mlp_hopper.silu_mul_f32(g, u)))


def _same_kernel():
    """experiments/same_kernel.py: the MLP's kernels as the model's calls lower them, for an H200
    (`mlp_modules`), and any lowering's Mosaic modules without locations (`modules_of`)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "experiments"))
    import same_kernel

    return same_kernel


def test_the_across_knob_changes_both_gemms_and_falls_back_where_it_cannot_apply(monkeypatch):
    """`KERNJAX_MLP_ACROSS=1`: the fused GEMM and the GEMM apart take four steps and one pipeline
    across a CTA's tiles, the silu·mul kernel apart is untouched; where the steps over K are not
    a multiple of four or an SM would get one tile, the kernel is the pipeline a tile's; a value
    it does not know is refused, saying which it takes."""
    from models.attention_hopper import on_h200

    sk = _same_kernel()
    S, bf = jax.ShapeDtypeStruct, jnp.bfloat16
    monkeypatch.setenv("KERNJAX_MLP_PINGPONG", "0")  # which comes first above 2048 rows
    assert mlp_hopper.across_tiles() is False
    default = sk.mlp_modules(mlp_hopper, 8192)
    monkeypatch.setenv("KERNJAX_MLP_ACROSS", "1")
    assert mlp_hopper.tiling(8192)["across"] and mlp_hopper.tiling(8192)["steps"] == 4
    knob = sk.mlp_modules(mlp_hopper, 8192)
    assert knob["fused"] != default["fused"] and knob["gate_up"] != default["gate_up"]
    assert knob["silu_mul"] == default["silu_mul"]
    for rows, k in [(128, 2560), (8192, 2624)]:  # 76 tiles, under two an SM; 41 steps over K
        x, w = S((rows, k), bf), S((9728, k), bf)
        t = mlp_hopper.tiling(rows)
        both = [sk.modules_of(on_h200(functools.partial(mlp_hopper.gemm, fused=True, **kw),
                                      x, w, w, num_cores=132))
                for kw in (t, dict(t, across=False))]
        assert both[0] == both[1], (rows, k)
    monkeypatch.setenv("KERNJAX_MLP_ACROSS", "yes")
    with pytest.raises(ValueError, match="KERNJAX_MLP_ACROSS='yes': give 0"):
        mlp_hopper.across_tiles()


def test_round_bf16_is_the_conversion_for_every_value_but_nan():
    """`round_bf16` (`gemm(rounding="int")`): integer rounding to bfloat16's nearest, ties to
    even, gives the bits of a conversion to bfloat16 and back for 2^21 random bit patterns and
    the edges (ties, subnormals, the largest finite, infinities); a NaN stays a NaN."""
    rng = np.random.default_rng(0)
    random = rng.integers(0, 2 ** 32, size=1 << 21, dtype=np.uint64).astype(np.uint32)
    bits = np.concatenate([random,
                           np.array([0, 0x80000000, 1, 0x007FFFFF, 0x00008000, 0x00018000,
                                     0x3F808000, 0x3F818000, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F800000,
                                     0xFF800000, 0x7F800001, 0x7FC00000, 0xFFFFFFFF], np.uint32)])
    v = jnp.asarray(bits.view(np.float32))
    got = np.asarray(jax.jit(mlp_hopper.round_bf16)(v))
    want = np.asarray(v.astype(jnp.bfloat16).astype(jnp.float32))
    nan = np.isnan(want)
    assert np.array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))
    assert np.isnan(got[nan]).all() and nan.sum() > 1000


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the interpreter runs on the CPU")
def test_the_fused_gemm_rounding_by_integers_gives_the_conversions_bits():
    """`gemm(rounding="int")`: the fused epilogue's gate and up rounded by `round_bf16` give the
    bits the conversion gives (in Mosaic GPU's interpreter, no race), across tiles too."""
    one = _gemm_in_the_interpreter(True, across=False, ctas=2)[3]
    for across in (False, True):
        out = _gemm_in_the_interpreter(True, across=across, ctas=2, rounding="int")[3]
        assert bool(jnp.array_equal(out[0], one[0]))


def test_the_round_knob_changes_the_fused_gemm_alone(monkeypatch):
    """`KERNJAX_MLP_ROUND=pack` rounds the fused GEMM's gate and up in pairs, one
    `cvt.rn.bf16x2.f32` for a gate and an up value of a thread (32 a 64 x 64 tile, two tiles a
    warpgroup at 8192 rows), where `cvt` (the default) converts each; the knob changes the
    fused GEMM's module and neither the GEMM apart nor the silu·mul kernel; a value it does not
    know is refused, saying which it takes, and so is a rounding `gemm` does not know."""
    sk = _same_kernel()
    assert not mlp_hopper.packed_round() and mlp_hopper.tiling(8192)["rounding"] == "cvt"
    default = sk.mlp_modules(mlp_hopper, 8192)
    assert "cvt.rn.bf16x2.f32" not in default["fused"]
    monkeypatch.setenv("KERNJAX_MLP_ROUND", "pack")
    knob = sk.mlp_modules(mlp_hopper, 8192)
    assert knob["fused"].count("cvt.rn.bf16x2.f32") == 64
    assert knob["gate_up"] == default["gate_up"] and knob["silu_mul"] == default["silu_mul"]
    monkeypatch.setenv("KERNJAX_MLP_ROUND", "int")
    with pytest.raises(ValueError, match="KERNJAX_MLP_ROUND='int': give cvt"):
        mlp_hopper.packed_round()
    monkeypatch.delenv("KERNJAX_MLP_ROUND")
    S, bf = jax.ShapeDtypeStruct, jnp.bfloat16
    with pytest.raises(ValueError, match="rounding 'even': give one of cvt, int, pack"):
        mlp_hopper.gemm(S((8192, 2560), bf), S((9728, 2560), bf), S((9728, 2560), bf),
                        fused=True, **dict(mlp_hopper.tiling(8192), rounding="even"))


def test_the_pingpong_knob_is_the_default_above_2048_rows(monkeypatch):
    """`KERNJAX_MLP_PINGPONG`: above 2048 rows the fused GEMM and the GEMM apart run
    `gemm_pingpong` (a kernel with its own barriers: no module of the shared pipeline's), at
    2048 rows and under `KERNJAX_MLP_PINGPONG=0` the shared pipeline; a value it does not know is
    refused, saying which it takes."""
    sk = _same_kernel()
    assert mlp_hopper.tiling(8192).get("pingpong") and not mlp_hopper.tiling(2048).get("pingpong")
    default = sk.mlp_modules(mlp_hopper, 8192)
    monkeypatch.setenv("KERNJAX_MLP_PINGPONG", "0")
    assert not mlp_hopper.tiling(8192).get("pingpong")
    shared = sk.mlp_modules(mlp_hopper, 8192)
    assert default["fused"] != shared["fused"] and default["gate_up"] != shared["gate_up"]
    assert default["silu_mul"] == shared["silu_mul"]
    monkeypatch.setenv("KERNJAX_MLP_PINGPONG", "on")
    with pytest.raises(ValueError, match="KERNJAX_MLP_PINGPONG='on': give 1"):
        mlp_hopper.pingpong()


def test_pingpong_asks_each_tile_an_even_number_of_phases_a_stage():
    """`gemm_pingpong`: a warpgroup skips the other's tile in each stage's barrier, whose phase
    each thread tracks by parity, so the steps over K must be an even multiple of the stages;
    40 steps take 5 or 4 stages, not 3 (Mosaic GPU's interpreter counts phases, not parities,
    and cannot run it: the GPU test below compares its bits)."""
    S, bf = jax.ShapeDtypeStruct, jnp.bfloat16
    from models.attention_hopper import on_h200

    x, w = S((8192, 2560), bf), S((9728, 2560), bf)
    for steps in (5, 4):
        on_h200(functools.partial(mlp_hopper.gemm_pingpong, fused=True, steps=steps), x, w, w,
                num_cores=132)
    with pytest.raises(ValueError, match="40 steps of 64, not an even multiple of 3 stages"):
        mlp_hopper.gemm_pingpong(x, w, w, fused=True, steps=3)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="runs the kernels on the GPU")
@pytest.mark.parametrize("rows", [8192, 2176])
def test_pingpong_on_the_gpu_gives_the_bits_of_the_shared_pipeline(rows):
    """On the GPU, at qwen3-4b's MLP shapes: `gemm_pingpong` (the model's tiling above 2048 rows) writes
    the bits of `gemm`'s shared pipeline, fused and apart, at 8192 rows (9728 tiles, 73 or 74 an
    SM) and 2176 (2584: 19 or 20), and the fused product is `silu_mul_f32` of gate and up apart."""
    ks = jax.random.split(jax.random.key(1), 3)
    x = jax.random.normal(ks[0], (rows, 2560), jnp.float32).astype(jnp.bfloat16)
    wg, wu = ((0.02 * jax.random.normal(kk, (9728, 2560), jnp.float32)).astype(jnp.bfloat16)
              for kk in ks[1:])
    t = dict(tile_m=128, tile_n=128, tile_k=64, steps=3, wg_n=True, minor=0, width=8)
    for fused in (True, False):
        shared = jax.jit(functools.partial(mlp_hopper.gemm, fused=fused, **t))(x, wg, wu)
        own = jax.jit(functools.partial(mlp_hopper.gemm, fused=fused, **mlp_hopper.tiling(8192)))(
            x, wg, wu)
        assert all(bool(jnp.array_equal(a, b)) for a, b in zip(own, shared)), (rows, fused)
        if not fused:
            assert bool(jnp.array_equal(mlp_hopper.fused_call(x, wg, wu),
                                        jax.jit(mlp_hopper.silu_mul_f32)(*own)))
