"""Roadmap K14: a dense layer's small calls as csrc/dense.cu's kernels (kernjax/kernels/dense_cuda.py).

On the CPU: where a program exported for CUDA runs them (one `kj_qk_rope` a layer, its calls
apart where a cut falls among them, one `kj_add_norm` an add_norm call) and where XLA's lowerings
stay. On a GPU: the group gives the bits of its calls apart, the state's rows land where
jnp's `.at[]` puts them, the residual is XLA's bit for bit, and the rest within a bf16 step."""

import collections
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from kernjax.core.cut import cut, whole
from kernjax.artifact import UNSTABLE, export_stage
from kernjax.core import lowering
from kernjax.kernels import dense_cuda
from kernjax.models import qwen3
from kernjax.kernels.attention_hopper import abstract_h200

# qwen3-shaped, small: head_dim 128, hidden 256 (kj_add_norm's multiple), 2 layers.
CFG = dataclasses.replace(qwen3.CONFIGS["qwen3-tiny"], name="k14", hidden=256, intermediate=256,
                          layers=2, head_dim=128)
gpu = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")


@pytest.fixture(autouse=True)
def kernels_on(monkeypatch):
    monkeypatch.setattr(lowering, "_current", [lowering.Lowering(dense_cuda=True)])


def targets(stage) -> dict[str, int]:
    """The extension's dense kernels in `stage` exported for CUDA (as on an H200), by name."""
    with abstract_h200(132):
        text = export_stage(stage, "cuda").mlir_module()
    return dict(collections.Counter(re.findall(r"custom_call @(kj_(?:qk_rope|head_norm|rope|kv_write|add_norm))\b", text)))


def first(program, name: str) -> int:
    return [e.params["name"] for e in program.jaxpr.jaxpr.eqns].index(name)


def test_one_kernel_a_layer_for_the_four_calls_and_one_for_each_add_norm():
    program = qwen3.program(CFG, dtype="bfloat16", rows=64, context=256)
    assert targets(whole(program)) == {"kj_qk_rope": 2, "kj_add_norm": 4}


@pytest.mark.parametrize("after, a, b", [
    ("q_norm", {"kj_head_norm": 1}, {"kj_head_norm": 1, "kj_rope": 1, "kj_kv_write": 1}),
    ("k_norm", {"kj_head_norm": 2}, {"kj_rope": 1, "kj_kv_write": 1}),
    ("rope", {"kj_head_norm": 2, "kj_rope": 1}, {"kj_kv_write": 1}),
])
def test_a_cut_among_the_four_runs_each_alone(after, a, b):
    program = qwen3.program(CFG, dtype="bfloat16", rows=64, context=256)
    s0, s1 = cut(program, [first(program, f"l1.{after}") + 1])
    assert targets(s0) == {"kj_qk_rope": 1, "kj_add_norm": 2, **a}  # layer 0 whole
    assert targets(s1) == {"kj_add_norm": 2, **b}


@pytest.mark.parametrize("change, expect", [
    (dict(head_dim=64), {"kj_add_norm": 4}),  # head_dim 64: XLA's four calls
    (dict(hidden=320), {"kj_qk_rope": 2}),                # not a multiple of 256: XLA's norms
])
def test_shapes_the_kernels_do_not_take_keep_xla(change, expect):
    program = qwen3.program(dataclasses.replace(CFG, **change), dtype="bfloat16", rows=64,
                            context=256)
    assert targets(whole(program)) == expect


def test_float32_and_the_switch_off_keep_xla(monkeypatch):
    program = qwen3.program(CFG, dtype="float32", rows=64, context=256)
    eqns = {e.params["name"].split(".", 1)[1]: e for e in program.jaxpr.jaxpr.eqns
            if e.params["name"].startswith("l0.")}
    group = [eqns[n] for n in ("q_norm", "k_norm", "rope", "kv_write")]
    assert dense_cuda.qk_group(group, (False, False, True, False, True)) is None
    assert dense_cuda.add_norm([eqns["post_attn_norm"]], (True, True)) is None
    off = lowering.Lowering(dense_cuda=False)
    assert targets(whole(qwen3.program(CFG, dtype="bfloat16", rows=64, context=256),
                         lowering=off)) == {}


def test_the_rules_read_eps_columns_and_frequencies_from_the_bodies():
    program = qwen3.program(dataclasses.replace(CFG, eps=3e-5), dtype="bfloat16", rows=64,
                            context=256)
    with abstract_h200(132):
        text = export_stage(whole(program), "cuda").mlir_module()
    eps = {np.float32(e) for e in re.findall(r"eps = ([-+.0-9eE]+) : f32", text)}
    assert eps == {np.float32(3e-5)}, eps  # every norm of the program takes the model's
    eqns = {e.params["name"]: e for e in program.jaxpr.jaxpr.eqns}
    assert dense_cuda._col(eqns["l0.k_norm"].params["jaxpr"]) == CFG.heads * 128
    freq = dense_cuda._inv_freq(eqns["l0.rope"].params["jaxpr"])
    want = 1.0 / CFG.rope_theta ** (np.arange(0, 128, 2) / 128)
    np.testing.assert_allclose(freq, want, rtol=1e-6)


# --- on a GPU ---------------------------------------------------------------------------------

def _steps(a, b) -> float:
    """dense_calls.steps: the largest difference in bf16 steps of its head's largest value."""
    from experiments import dense_calls as dc

    return dc.steps(a, b)[0]


@gpu
@pytest.mark.parametrize("rows", [1, 63, 512, 2048])
def test_the_group_gives_the_bits_of_its_calls_apart_and_xla_within_a_step(rows):
    from experiments import dense_calls as dc

    calls, cfg = dc.layer0(rows)
    args = dc.inputs(rows, cfg, seed=rows)
    xla = jax.jit(dc.xla_group(calls))(*args)
    apart = jax.jit(dc.apart_group(calls))(*args)
    fused = jax.jit(dc.fused_group(calls))(*args)
    for f, p in zip(fused, apart):
        assert np.asarray(f).tobytes() == np.asarray(p).tobytes()
    q, kv = fused
    assert _steps(q, xla[0]) <= 2.0  # a sum that cancels keeps its terms' error
    assert _steps(kv, xla[1]) <= 2.0
    # the state: untouched but at the slots (the last row's slot -1 is the pool's last row, the
    # one after it past the end, dropped), as XLA's scatter leaves it
    flat, ref = (np.asarray(x).reshape(-1, 2 * cfg.kv_heads * 128) for x in (kv, xla[1]))
    n = flat.shape[0]
    moved = [s % n for s in np.asarray(args[5]).tolist() if -n <= s < n]
    keep = np.setdiff1d(np.arange(flat.shape[0]), moved)
    assert flat[keep].tobytes() == np.asarray(args[4]).reshape(flat.shape)[keep].tobytes()
    assert not np.isnan(np.asarray(q, np.float32)).any()


@gpu
@pytest.mark.parametrize("rows", [1, 100, 2048])
def test_add_norm_keeps_the_residual_bits_and_the_norm_within_a_step(rows):
    from experiments import dense_calls as dc

    calls, cfg = dc.layer0(rows)
    k = jax.random.split(jax.random.key(rows), 3)
    y, h = (jax.random.normal(kk, (rows, cfg.hidden)).astype("bfloat16") for kk in k[:2])
    w = (1 + 0.1 * jax.random.normal(k[2], (cfg.hidden,))).astype("bfloat16")
    body = jax.extend.core.jaxpr_as_fun(calls["post_attn_norm"].params["jaxpr"])
    rn, rs = jax.jit(body)(y, h, w)
    n, s = jax.jit(dense_cuda.add_norm([calls["post_attn_norm"]], (True, True)))(y, h, w)
    assert np.asarray(s).tobytes() == np.asarray(rs).tobytes()
    assert _steps(n, rn) <= 1.0


def test_a_run_sees_which_results_are_read_after_it_and_gives_only_those(monkeypatch):
    """`trace.on_gpu(..., rule=True)`: the rule gets each result's fate; its function takes the
    run's outside arguments once each and gives the read results, which replace the calls'."""
    from kernjax.core import trace
    from kernjax.kernels import lower
    from kernjax.core.trace import Slot, call

    seen = []

    def rule(eqns, exposed):
        seen.append(([e.params["name"] for e in eqns], exposed))
        return lambda v, w: (jnp.full_like(v, 7.0), jnp.full_like(w, 5.0))  # (ta's b, tb's c)

    monkeypatch.setitem(trace._ON_GPU, ("ta", "tb"), (rule, True))

    def fn(x):
        a, b = call("l.ta", lambda v, w: (v + w, v * 2))(x["v"], x["w"])
        c = call("l.tb", lambda p, w: p * 3 + w)(a, x["w"])
        return {"out": call("l.tc", lambda q, r: q + r)(c, b)}

    program = trace.trace(fn, [Slot("v", "fill", "float32", (4,)), Slot("w", "fill", "float32", (4,))],
                          [("out", "logits")], rows=4)
    spec = jax.ShapeDtypeStruct((4,), np.float32)
    text = export.export(jax.jit(lower.as_function(program.jaxpr, "cuda")), platforms=["cuda"],
                         disabled_checks=UNSTABLE)(spec, spec).mlir_module()
    assert seen == [(["l.ta", "l.tb"], (False, True, True))]
    consts = set(re.findall(r"dense<([0-9.e+]+)>", text))
    assert {"7.000000e+00", "5.000000e+00"} <= consts and "3.000000e+00" not in consts  # not tb's


def test_a_single_call_rule_gives_all_its_results_even_where_only_a_later_one_is_read(monkeypatch):
    """A one-call rule's function returns all of its call's results; where only the second is
    read after it, that one must get the second value (it once got the first: the results were
    matched to the read ones by position). The GPU program, run here on the CPU."""
    from kernjax.core import trace
    from kernjax.kernels import lower
    from kernjax.core.trace import Slot, call

    monkeypatch.setitem(trace._ON_GPU, ("td",), (
        lambda eqns, exposed: lambda v: (jnp.full_like(v, 7.0), jnp.full_like(v, 5.0)), True))

    def fn(x):
        u, s = call("l.td", lambda v: (v + 1, v * 2))(x["v"])
        return {"out": call("l.te", lambda q: q + 11)(s)}

    program = trace.trace(fn, [Slot("v", "fill", "float32", (4,))], [("out", "logits")], rows=4)
    out = jax.jit(lower.as_function(program.jaxpr, "cuda"))(np.zeros(4, np.float32))
    assert np.asarray(out[0]).tolist() == [16.0] * 4  # 5 + 11: the rule's second result
