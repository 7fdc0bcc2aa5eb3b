"""The cut's property tests, after kern's `tests/cut.rs`.

Random call programs over values and state regions are cut at random points. A symbolic
interpreter (each call hashes its name and what it reads into what it writes) shows that every
accepted cut computes the whole: the outputs and every state's final version. Refusals happen only
for the documented reason, and some do happen. A numeric twin runs random JAX call programs through
the real export path: the stages composed are bitwise equal to the whole.
"""

from __future__ import annotations

import hashlib
from collections import Counter

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax import export

from kernjax.core.cut import CutError, cut, describe, whole
from kernjax.artifact import export_stage
from kernjax.core.trace import Slot, TraceError, call, trace
from kernjax.kernels.lower import as_function, graph_cuts

V = Slot("", "", "float32", (2,))


def _slot(name, role):
    return Slot(name, role, V.dtype, V.shape)


# --- random call programs -------------------------------------------------------------------


def _random_program(draw):
    """A random straight-line call program, kern's `random_manifest` on a jaxpr.

    Values are activations; `kv.r` are states, three calls per "layer" using region r = i // 3 as
    kern's generator does. Calls: `f1` (one value in), `f2` (two in, maybe two out), `w` (reads a
    weight), `sw` (writes a state: a new version), `sr` (reads a state's current version).
    """
    nstates = draw(st.integers(1, 3))
    inputs = [_slot("x", "fill")] + [_slot(f"w{i}", "weight") for i in range(3)]
    inputs += [_slot(f"kv.{r}", "state") for r in range(nstates)]
    n = 3 + draw(st.integers(0, 9))
    ops = [(draw(st.sampled_from(["f1", "f2", "w", "sw", "sr"])), draw(st.integers(0, 10**6)))
           for _ in range(n)]
    two_outputs = draw(st.booleans())

    def fwd(x):
        pick = np.random.default_rng(len(ops))
        vals = [call("in", lambda a: a * 2)(x["x"])]
        states = {f"kv.{r}": x[f"kv.{r}"] for r in range(nstates)}
        for i, (op, r) in enumerate(ops):
            reg = f"kv.{min(i // 3, nstates - 1)}"
            a = vals[r % len(vals)]
            b = vals[(r // 7) % len(vals)]
            name = f"c{i}.{op}"
            if op == "f1":
                vals.append(call(name, lambda a: a + 1)(a))
            elif op == "f2":
                vals.extend(call(name, lambda a, b: (a * b, a - b))(a, b))
            elif op == "w":
                vals.append(call(name, lambda a, w: a * w)(a, x[f"w{r % 3}"]))
            elif op == "sw":
                states[reg] = call(name, lambda s, a: s + a, state=1)(states[reg], a)
            else:
                vals.append(call(name, lambda s, a: s * a)(states[reg], a))
        del pick
        y = call("out", lambda a, b: (a + b, a * b))(vals[-1], vals[len(vals) // 2])
        out = {"y": y[0], **states}
        if two_outputs:
            out["z"] = y[1]
        return out

    outputs = [("y", "tokens")] + ([("z", "logits")] if two_outputs else [])
    outputs += [(f"kv.{r}", "state") for r in range(nstates)]
    return trace(fwd, inputs, outputs, rows=2)


def _h(*parts) -> bytes:
    return hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()


def _interpret(jaxpr, env):
    """Runs a jaxpr symbolically: each call's outputs hash its name, its reads and the output index."""
    env = dict(env)
    read = lambda v: v.val.tobytes() if isinstance(v, jex.Literal) else env[v]  # noqa: E731
    for e in jaxpr.eqns:
        h = _h(e.params["name"], *(read(v) for v in e.invars))
        for j, v in enumerate(e.outvars):
            env[v] = _h(h, j)
    return [read(v) for v in jaxpr.outvars]


def _run_whole(program):
    w = whole(program)
    ins = {s.name: _h("input", s.name) for s in program.inputs}
    outs = _interpret(w.jaxpr.jaxpr, dict(zip(w.jaxpr.jaxpr.invars, (ins[s.name] for s in w.inputs))))
    return dict(zip((s.name for s in w.outputs), outs))


def _run_stages(stages):
    ins, carry, got, written = {}, [], {}, Counter()
    for st_ in stages:
        jp = st_.jaxpr.jaxpr
        jex.check_jaxpr(jp)
        args = [_h("input", s.name) for s in st_.inputs] + carry
        assert len(jp.invars) == len(args), "a stage's jaxpr takes its inputs, then its arrivals"
        outs = _interpret(jp, dict(zip(jp.invars, args)))
        nd = len(st_.departures)
        carry = outs[:nd]
        if st_.index + 1 < len(stages):
            nxt = stages[st_.index + 1]
            assert [s.name for s in st_.departures] == [s.name for s in nxt.arrivals]
        for s, v in zip(st_.outputs, outs[nd:]):
            got[s.name] = v
            written[s.name] += 1
    assert all(c == 1 for c in written.values()), f"an output came from two stages: {written}"
    return got


def _check_random_cut(data, seen):
    program = _random_program(data.draw)
    n = len(program.calls)
    a = data.draw(st.integers(1, n - 1))
    at = [a]
    if a < n - 1 and data.draw(st.booleans()):
        at.append(data.draw(st.integers(a + 1, n - 1)))
    try:
        stages = cut(program, at)
    except CutError as e:
        assert all("a state region belongs to one stage" in r for r in e.reasons), \
            f"cut {at} of {program.calls} refused for an undocumented reason: {e}"
        seen["refused"] += 1
        return
    seen["cut"] += 1
    seen[f"stages={len(stages)}"] += 1
    seen["forwarded"] += any(s.forwarded for s in stages)
    want = _run_whole(program)
    got = _run_stages(stages)
    assert got == want, f"cut {at} of {program.calls} differs from the whole"
    # Each stage keeps only the inputs its calls read (or emits).
    for s in stages:
        used = {v for e in s.jaxpr.jaxpr.eqns for v in e.invars} | set(s.jaxpr.jaxpr.outvars)
        assert all(v in used for v in s.jaxpr.jaxpr.invars[:len(s.inputs)])


def test_every_accepted_cut_computes_the_whole():
    seen = Counter()

    @settings(max_examples=400, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.data())
    def check(data):
        _check_random_cut(data, seen)

    check()
    assert seen["cut"] > 200, seen
    assert seen["refused"] > 0, seen
    assert seen["stages=3"] > 0 and seen["forwarded"] > 0, seen


# --- refusals -------------------------------------------------------------------------------


def _chain(n=6):
    inputs = [_slot("x", "fill"), _slot("kv.0", "state")]

    def fwd(x):
        a = call("c0", lambda a: a + 1)(x["x"])
        s = call("c1.sw", lambda s, a: s + a, state=1)(x["kv.0"], a)
        a = call("c2.sr", lambda s, a: s * a)(s, a)
        for i in range(3, n):
            a = call(f"c{i}", lambda a: a * 3)(a)
        return {"y": a, "kv.0": s}

    return trace(fwd, inputs, [("y", "tokens"), ("kv.0", "state")], rows=2)


@pytest.mark.parametrize("at, why", [
    ([], "no cut point"),
    ([0], "at or before call 0 (`c0`)"),
    ([6], "past the last call 5 (`c5`)"),
    ([4, 4], "cut points 4 and 4 are not increasing"),
    ([5, 3], "cut points 5 and 3 are not increasing"),
    ([2], "state `kv.0` is touched by 2 stages (stage 0: call 1 (`c1.sw`); stage 1: call 2 (`c2.sr`))"),
])
def test_refusals_name_the_call(at, why):
    with pytest.raises(CutError) as e:
        cut(_chain(), at)
    assert why in str(e.value)


def test_every_reason_is_reported_together():
    with pytest.raises(CutError) as e:
        cut(_chain(), [0, 9])
    assert len(e.value.reasons) == 2


def test_an_output_before_the_last_stage_is_refused():
    def fwd(x):
        a = call("c0", lambda a: a + 1)(x["x"])
        b = call("c1", lambda a: a * 2)(a)
        return {"y": a, "z": b}

    p = trace(fwd, [_slot("x", "fill")], [("y", "tokens"), ("z", "logits")], rows=2)
    with pytest.raises(CutError, match=r"output `y` is made by call 0 \(`c0`\) in stage 0 of 2"):
        cut(p, [1])


def test_an_operation_outside_a_call_is_refused_at_trace():
    def fwd(x):
        return {"y": call("c0", lambda a: a + 1)(x["x"]) * 2}

    with pytest.raises(TraceError, match=r"equation 1 \(`mul`, after call `c0`\) is not a call"):
        trace(fwd, [_slot("x", "fill")], [("y", "tokens")], rows=2)


def test_the_same_cut_is_the_same_bytes():
    a, b = cut(_chain(), [3]), cut(_chain(), [3])
    assert a[0].cut_id == b[0].cut_id
    assert describe(_chain(), a) == describe(_chain(), b)
    assert cut(_chain(), [4])[0].cut_id != a[0].cut_id


def test_calls_lower_per_platform_from_one_jaxpr():
    """One jaxpr, two lowerings: `XLA_LATE` calls on the CPU; on a GPU each call's body inlined
    early between optimization barriers (docs/bitwise.md), so XLA:GPU optimizes inside a call and
    fuses nothing across it. Exporting for CUDA needs no GPU."""
    stage = whole(_chain())
    cpu = export_stage(stage, "cpu").mlir_module()
    gpu = export_stage(stage, "cuda").mlir_module()
    assert cpu.count('inlineable = "xla_late"') >= 6 and "optimization_barrier" not in cpu
    assert gpu.count("stablehlo.optimization_barrier") == 2 * 6 and "xla_late" not in gpu


def test_a_gpu_program_runs_as_three_cuda_graphs(monkeypatch):
    """On a GPU a program's calls after n/21 and 5n/21 of its n calls end in a no-op custom call
    that XLA keeps outside its CUDA graphs (`trace.graph_cuts`): three graphs, the first small,
    so the others' host work hides behind it. None on the CPU, none cut with `graph_cuts=False`."""
    assert graph_cuts(436) == {20, 103} and graph_cuts(6) == {0} and graph_cuts(2) == set()
    stage = whole(_chain())
    gpu = export_stage(stage, "cuda").mlir_module()
    assert gpu.count("@kj_mark") == 1 and "@kj_mark" not in export_stage(stage, "cpu").mlir_module()
    # experiments' unconstrained program: no barriers, the same cuts (it differs by barriers alone)
    free = jax.jit(as_function(stage.jaxpr, "cuda", fences=False)).trace(
        *[sl.spec() for sl in stage.inputs]).lower(lowering_platforms=("cuda",)).as_text()
    assert "optimization_barrier" not in free and "optimization_barrier" in gpu
    assert free.count("@kj_mark") == 1
    from kernjax.core.lowering import Lowering
    one = whole(_chain(), lowering=Lowering(graph_cuts=False))
    assert "@kj_mark" not in export_stage(one, "cuda").mlir_module()


# --- numeric twin ---------------------------------------------------------------------------

D = 16


def _numeric_program(draw, dtype):
    """A random JAX call program with real arithmetic: matmuls, gelu, rmsnorm, residuals, a state."""
    kinds = ["matmul", "gelu", "norm", "residual", "cube", "sw", "sr"]
    ops = [(draw(st.sampled_from(kinds)), draw(st.integers(0, 10**6))) for _ in range(draw(st.integers(4, 12)))]
    f = lambda n, role, shape: Slot(n, role, jnp.dtype(dtype).name, shape)  # noqa: E731
    inputs = [f("x", "fill", (8, D)), f("kv.0", "state", (16, D))]
    inputs += [f(f"w{i}", "weight", (D, D)) for i in range(3)] + [f("g", "weight", (D,))]
    slots = Slot("slots", "fill", "int32", (8,))
    inputs.append(slots)

    def fwd(x):
        vals, s = [call("in", lambda a: a * 1.5)(x["x"])], x["kv.0"]
        for i, (op, r) in enumerate(ops):
            a, b, name = vals[r % len(vals)], vals[(r // 11) % len(vals)], f"c{i}.{op}"
            if op == "matmul":
                vals.append(call(name, lambda a, w: a @ w)(a, x[f"w{r % 3}"]))
            elif op == "gelu":
                vals.append(call(name, lambda a: jax.nn.gelu(a, approximate=True))(a))
            elif op == "norm":
                vals.append(call(name, lambda a, g: g * (a * jax.lax.rsqrt(
                    jnp.mean(a.astype(jnp.float32) ** 2, -1, keepdims=True) + 1e-6)).astype(a.dtype))(a, x["g"]))
            elif op == "residual":
                vals.append(call(name, lambda a, b: a + b)(a, b))
            elif op == "cube":
                vals.append(call(name, lambda a, b: a + 0.0447 * a * a * a * b)(a, b))
            elif op == "sw":
                s = call(name, lambda s, a, i: s.at[i].set(a), state=1)(s, a, x["slots"])
            else:
                vals.append(call(name, lambda s, a, i: a * 0.5 + s[i])(s, a, x["slots"]))
        y = call("out", lambda a, b: jnp.tanh(a @ b.T))(vals[-1], vals[len(vals) // 2])
        return {"y": y, "kv.0": s}

    return trace(fwd, inputs, [("y", "logits"), ("kv.0", "state")], rows=8)


def _compiled(stage):
    exp = export.deserialize(export_stage(stage).serialize())
    return jax.jit(exp.call)


def _args(stage, values):
    return [values[s.name] for s in stage.inputs]


def _check_numeric(data, dtype, seen):
    program = _numeric_program(data.draw, dtype)
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31)))
    values = {s.name: jnp.asarray(rng.standard_normal(s.shape), s.dtype) for s in program.inputs
              if s.dtype != "int32"}
    values["slots"] = jnp.asarray(rng.permutation(16)[:8], jnp.int32)
    w = whole(program)
    want = _compiled(w)(*_args(w, values))
    n = len(program.calls)
    for a in sorted(set(data.draw(st.lists(st.integers(1, n - 1), min_size=1, max_size=4)))):
        at = [a] if a % 2 else sorted({a, data.draw(st.integers(1, n - 1))})
        try:
            stages = cut(program, at)
        except CutError:
            seen["refused"] += 1
            continue
        carry, got = [], {}
        for s in stages:
            out = _compiled(s)(*_args(s, values), *carry)
            carry = out[:len(s.departures)]
            got.update(zip((o.name for o in s.outputs), out[len(s.departures):]))
        for o, v in zip(w.outputs, want):
            assert np.asarray(got[o.name]).tobytes() == np.asarray(v).tobytes(), \
                f"{dtype} cut {at} of {program.calls}: `{o.name}` differs from the whole"
        seen["cut"] += 1


def test_numeric_twin_stages_are_bitwise_the_whole():
    seen = Counter()

    @settings(max_examples=60, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.data(), st.sampled_from(["float32", "bfloat16"]))
    def check(data, dtype):
        _check_numeric(data, dtype, seen)

    check()
    assert seen["cut"] > 50, seen


@given(st.lists(st.floats(0, 10, allow_nan=False), min_size=3, max_size=9), st.integers(2, 3),
       st.sets(st.integers(1, 8), max_size=3))
@settings(max_examples=60, deadline=None)
def test_balanced_points_minimize_the_longest_stage(ms, stages, banned):
    """`balanced` against brute force over every allowed set of points (`--at auto`)."""
    import itertools

    from kernjax.core.cut import balanced
    n = len(ms)
    allowed = [p for p in range(1, n) if p not in banned]
    combos = list(itertools.combinations(allowed, stages - 1))
    longest = lambda pts: max(sum(ms[a:b]) for a, b in zip([0, *pts], [*pts, n]))  # noqa: E731
    if not combos:
        with pytest.raises(CutError):
            balanced(ms, stages, frozenset(banned))
        return
    got = balanced(ms, stages, frozenset(banned))
    assert len(got) == stages - 1 and not set(got) & banned and got == sorted(set(got))
    assert longest(got) == pytest.approx(min(longest(c) for c in combos), abs=1e-9)
