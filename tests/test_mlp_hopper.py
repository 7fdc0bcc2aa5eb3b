"""Roadmap K13 on the CPU: where `gate_up` and `silu_mul` run as one Mosaic GPU kernel on a GPU
(`kernjax/kernels/mlp_hopper.py`, registered with `kernjax.core.trace.on_gpu`), and where they stay apart.

Exporting for CUDA needs no GPU, only an abstract H200 for the Pallas kernels. That the fused
kernel gives the bits of the pair apart is checked on the GPU (`experiments/fused_mlp.py`, the
chain cut between the two calls in `experiments/gpu_gate.sh`)."""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import pytest

from jax import export

from kernjax.core import lowering, trace
from kernjax.kernels import lower
from kernjax.core.cut import cut, whole
from kernjax.artifact import UNSTABLE, export_stage
from kernjax.kernels import mlp_hopper
from kernjax.models import qwen3
from kernjax.kernels.attention_hopper import abstract_h200

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
        fn = lower.as_function(program.jaxpr, "cuda", fences=fences)
        with abstract_h200(132):
            texts.append(export.export(jax.jit(fn), platforms=["cuda"],
                                       disabled_checks=UNSTABLE)(*specs).mlir_module())
    fenced, free = (len(re.findall(r"custom_call @mosaic_gpu_v2", t)) for t in texts)
    assert fenced == free == 2
    assert "optimization_barrier" in texts[0] and "optimization_barrier" not in texts[1]
    # `jax.default_backend()` says "gpu", which would have run the CPU's lowering on a GPU
    with pytest.raises(ValueError, match="platform 'gpu': give cpu, cuda or rocm"):
        lower.as_function(program.jaxpr, "gpu", fences=False)


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


def _within_a_bf16_step_of_float32(got, x, w) -> bool:
    """`got` (bf16, x times w transposed) within a bf16 step of float32's product."""
    want = jnp.dot(x.astype(jnp.float32), w.T.astype(jnp.float32), precision="highest")
    err = jnp.abs(got.astype(jnp.float32) - want)
    return bool(jnp.all(err <= jnp.abs(want) * 2.0 ** -7 + 1e-3))


def _gemm_in_the_interpreter(fused, across, ctas):
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
    assert _within_a_bf16_step_of_float32(g, x, wg) and _within_a_bf16_step_of_float32(u, x, wu)
    assert bool(jnp.array_equal(outs[True][0], mlp_hopper.silu_mul_f32(g, u)))


def _same_kernel():
    """experiments/same_kernel.py: the MLP's kernels as the model's calls lower them, for an H200
    (`mlp_modules`), and any lowering's Mosaic modules without locations (`modules_of`)."""
    from experiments import same_kernel

    return same_kernel


def test_the_across_knob_changes_both_gemms_and_falls_back_where_it_cannot_apply(monkeypatch):
    """The lowering table's `mlp_across`: the fused GEMM and the GEMM apart take four steps and one pipeline
    across a CTA's tiles, the silu·mul kernel apart is untouched; where the steps over K are not
    a multiple of four or an SM would get one tile, the kernel is the pipeline a tile's; a value
    that is not a boolean is refused."""
    from kernjax.kernels.attention_hopper import on_h200

    sk = _same_kernel()
    S, bf = jax.ShapeDtypeStruct, jnp.bfloat16
    assert mlp_hopper.across_tiles() is False
    default = sk.mlp_modules(mlp_hopper, 8192)
    monkeypatch.setattr(lowering, "_current", [lowering.Lowering(mlp_across=True)])
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
    with pytest.raises(ValueError, match="mlp_across 'yes': give true or false"):
        lowering.Lowering(mlp_across="yes")


def test_the_tile_knob_gives_64_by_128_wgmmas_above_2048_rows(monkeypatch):
    """The lowering table's `mlp_tile="64x256"`: above 2048 rows the fused GEMM and the GEMM apart take the
    warpgroups one above the other, 64 rows by 128 columns of gate and of up each (64 x 128
    wgmmas), on the same 128 x 128 CTA tile, so `fits` asks what it asked; at 2048 rows and
    below, and for the silu·mul kernel, nothing changes; a value it does not know is refused,
    saying which it takes."""
    sk = _same_kernel()
    assert not mlp_hopper.wide_tiles() and mlp_hopper.tiling(8192)["wg_n"]
    default = {rows: sk.mlp_modules(mlp_hopper, rows) for rows in (2048, 8192)}
    monkeypatch.setattr(lowering, "_current", [lowering.Lowering(mlp_tile="64x256")])
    t = mlp_hopper.tiling(8192)
    assert (t["tile_m"], t["tile_n"], t["wg_n"], t["steps"]) == (64, 256, False, 3)
    assert mlp_hopper._cta(t) == mlp_hopper._cta(dict(tile_m=128, tile_n=128, wg_n=True))
    wide = {rows: sk.mlp_modules(mlp_hopper, rows) for rows in (2048, 8192)}

    def shapes(text):
        return set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m64n\d+k16)", text))

    assert shapes(default[8192]["fused"]) == {"m64n64k16"}
    assert shapes(wide[8192]["fused"]) == shapes(wide[8192]["gate_up"]) == {"m64n128k16"}
    assert wide[2048] == default[2048]
    assert wide[8192]["fused"] != default[8192]["fused"]
    assert wide[8192]["gate_up"] != default[8192]["gate_up"]
    assert wide[8192]["silu_mul"] == default[8192]["silu_mul"]
    with pytest.raises(ValueError, match="mlp_tile '256x64': give one of 128x128, 64x256"):
        lowering.Lowering(mlp_tile="256x64")


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="runs the kernels on the GPU")
@pytest.mark.parametrize("tile", ["128x128", "64x256"])
def test_on_the_gpu_the_fused_call_is_its_halves_apart_at_8192_rows(monkeypatch, tile):
    """On the GPU at qwen3-4b's MLP shapes and 8192 rows (a tiling the chain gates, at 512 and 64
    rows, never run), under each `mlp_tile`: the fused call writes the bits of `gate_up`
    then `silu_mul` apart (what a cut between them runs), and gate and up are within a bf16 step
    of float32's products."""
    monkeypatch.setattr(lowering, "_current", [lowering.Lowering(mlp_tile=tile)])
    ks = jax.random.split(jax.random.key(2), 3)
    x = jax.random.normal(ks[0], (8192, 2560), jnp.float32).astype(jnp.bfloat16)
    wg, wu = ((0.02 * jax.random.normal(kk, (9728, 2560), jnp.float32)).astype(jnp.bfloat16)
              for kk in ks[1:])
    fused = jax.jit(mlp_hopper.fused_call)(x, wg, wu)
    g, u = jax.jit(mlp_hopper.gate_up_call)(x, wg, wu)
    assert bool(jnp.array_equal(fused, jax.jit(mlp_hopper.silu_mul_call)(g, u)))
    assert _within_a_bf16_step_of_float32(g, x, wg) and _within_a_bf16_step_of_float32(u, x, wu)
