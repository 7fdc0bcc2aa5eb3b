"""k3-mini on the CPU (issue 9): the program against a whole-sequence reference, the chain gate
in 2 and 3 stages, packed = one sequence per item, and the derive program's staging and peak.

The reference (`reference` below) runs the whole prompt at once in float32 from the *logical*
weights: the conv over the full sequence, KDA's naive recurrence (`kda.naive`), MLA's naive form
with the whole score matrix, the MoE oracle on dequantized, unshuffled experts. The program runs
the same prompt chunk by chunk: conv tails and recurrent states carried in their sequence slots,
MLA through paged latents, experts read from the shuffled layout the derive program made.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernjax import models
from kernjax.runtime import derive
from kernjax.core import staging
from kernjax import artifact as artifacts
from kernjax.runtime.chain import chain
from kernjax.artifact import model_meta
from kernjax.core.cut import cut, whole
from kernjax.core.item import Piece, item_shape, make_item
from kernjax.runtime.pipeline import Pipeline
from kernjax.runtime.runner import Runner, checkpoint_dir, load_weights
from kernjax.weights import load
from kernjax.kernels import kda, mxfp4
from tests.conftest import prompts

FAM, CFG = models.named("k3-mini")
REF = {"model": CFG.name, "seed": 0, "dtype": CFG.dtype}


def _pipeline(tmp, program, stages, name, ckpt, cache):
    meta = dict(model=model_meta(FAM, CFG), checkpoint=REF, dtype=program.inputs[0].dtype,
                item=item_shape(program, FAM.PAGE))
    arts = [artifacts.read(artifacts.write(tmp / name / f"s{s.index}", s, **meta))
            for s in stages]
    return Pipeline([Runner(a, load_weights(a, ckpt, cache=cache)) for a in arts])


# ---- the chain gate ----

# Layer boundaries (layer 3 is MLA) and a cut inside a KDA layer, between its conv and the delta
# rule (each state stays with the call that reads it).
CUTS = {64: [["l2."], ["l1.", "l3."], ["l2.kda"]], 512: [["l2."], ["l1.", "l3."]]}


@pytest.mark.parametrize("chunk", sorted(CUTS))
def test_chain_in_2_and_3_stages(tmp_path, chunk):
    program = FAM.program(CFG, dtype=CFG.dtype, rows=chunk, context=2560)
    ckpt, cache = checkpoint_dir(REF), {}
    whole_pipe = _pipeline(tmp_path, program, [whole(program)], "whole", ckpt, cache)
    for at in CUTS[chunk]:
        idx = [next(i for i, c in enumerate(program.calls) if c.startswith(p)) for p in at]
        stages = cut(program, idx)
        split = _pipeline(tmp_path, program, stages, "cut" + "_".join(map(str, idx)), ckpt, cache)
        lines = []
        # prompts of up to 4 chunks and one row (the states cross 4 chunk boundaries): at chunk
        # 64, 33 chunks of 2049 tokens told no more and cost a third of the test
        ps = prompts(chunk, CFG.vocab, longest=4 * chunk + 1)
        assert chain(whole_pipe, split, ps, chunk=chunk, say=lines.append), \
            f"cut {at} chunk {chunk}:\n" + "\n".join(lines)
        assert lines[-1] == "PASS: 7 prompts bitwise identical"
    out = list(whole_pipe.prefill(list(range(1, 300)), chunk=chunk))[-1]
    assert np.isfinite(np.asarray(out["logits"], np.float32)).all()


# ---- against a whole-sequence reference (float32) ----

def _weights(dtype):
    """Random weights of k3-mini as the checkpoint holds them, and the derived experts."""
    ckpt = checkpoint_dir(REF)
    plain = load(ckpt, [(n, s, dtype) for n, s in FAM.weight_shapes(CFG)], progress=False)
    made, report = derive.run(FAM.derived(CFG), lambda want: load(ckpt, want, progress=False))
    return ckpt, plain, made, report


def _logical_experts(ckpt, layer):
    """w1, w3 [E, I, H] and w2 [E, H, I], dequantized from the checkpoint's MXFP4 sources."""
    out = []
    for w in ("w1", "w3", "w2"):
        base = [f"model.layers.{layer}.block_sparse_moe.experts.{e}.{w}." for e in range(CFG.experts)]
        m, k = (CFG.moe_intermediate, CFG.hidden) if w != "w2" else (CFG.hidden, CFG.moe_intermediate)
        got = load(ckpt, [(b + "weight_packed", (m, k // 2), "uint8") for b in base]
                   + [(b + "weight_scale", (m, k // 32), "uint8") for b in base], progress=False)
        out.append(np.stack([mxfp4.dequantize(got[b + "weight_packed"], got[b + "weight_scale"])
                             for b in base]).astype(np.float32))
    return out


def _rms(x, w, eps=CFG.eps):
    return w * (x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps))


def reference(w, ckpt, tokens):
    """Last-row logits of the whole prompt, float32, from logical weights."""
    from kernjax.models.moe import moe_reference
    f = lambda n: np.asarray(w[n], np.float32)  # noqa: E731
    T, H, K = len(tokens), CFG.kda_heads, CFG.kda_head_dim
    h = f("model.embed_tokens.weight")[tokens]
    a = _rms(h, f("model.layers.0.input_layernorm.weight"))
    for i in range(CFG.layers):
        p = f"model.layers.{i}."
        s = p + "self_attn."
        if i in CFG.mla_layers:
            hh, nope, rope, vd = CFG.mla_heads, CFG.nope, CFG.rope, CFG.v_dim
            q = (a @ f(s + "q_proj.weight").T).reshape(T, hh, nope + rope)
            c = a @ f(s + "kv_a_proj_with_mqa.weight").T
            ckv, kpe = _rms(c[:, :CFG.kv_lora], f(s + "kv_a_layernorm.weight")), c[:, CFG.kv_lora:]
            kv = (ckv @ f(s + "kv_b_proj.weight").T).reshape(T, hh, nope + vd)
            k = np.concatenate([kv[..., :nope], np.broadcast_to(kpe[:, None], (T, hh, rope))], -1)
            sc = np.einsum("thd,uhd->htu", q, k) * (nope + rope) ** -0.5
            sc = np.where(np.tril(np.ones((T, T), bool))[None], sc, -np.inf)
            pr = np.exp(sc - sc.max(-1, keepdims=True))
            pr /= pr.sum(-1, keepdims=True)
            o = np.einsum("htu,uhd->thd", pr, kv[..., nope:]).reshape(T, hh * vd)
        else:
            x = np.concatenate([a @ f(s + f"{n}_proj.weight").T for n in "qkv"], -1)
            cw = np.concatenate([f(s + f"{n}_conv1d.weight")[:, 0] for n in "qkv"])  # [C, W]
            xp = np.concatenate([np.zeros((CFG.conv - 1, x.shape[1]), np.float32), x])
            y = sum(cw[:, j] * xp[j:j + T] for j in range(CFG.conv))
            y = y / (1 + np.exp(-y))
            q, k, v = (y[:, j * H * K:(j + 1) * H * K].reshape(T, H, K) for j in range(3))
            q, k = (z / np.sqrt((z * z).sum(-1, keepdims=True) + 1e-6) for z in (q, k))
            fa = (a @ f(s + "f_a_proj.weight").T) @ f(s + "f_b_proj.weight").T
            g = -np.exp(f(s + "A_log").reshape(1, H, 1)) * np.logaddexp(
                0, (fa + f(s + "dt_bias")).reshape(T, H, K))
            beta = 1 / (1 + np.exp(-(a @ f(s + "b_proj.weight").T)))
            o, _ = kda.naive(q, k, v, g, beta, jnp.array([0, T], jnp.int32))
            o = np.asarray(o, np.float32)
            gate = ((a @ f(s + "g_a_proj.weight").T) @ f(s + "g_b_proj.weight").T).reshape(T, H, K)
            o = (_rms(o, f(s + "o_norm.weight")) / (1 + np.exp(-gate))).reshape(T, H * K)
        h = h + o @ f(s + "o_proj.weight").T
        m = _rms(h, f(p + "post_attention_layernorm.weight"))
        if i < CFG.dense_layers:
            g_, u = m @ f(p + "mlp.gate_proj.weight").T, m @ f(p + "mlp.up_proj.weight").T
            y = (g_ / (1 + np.exp(-g_)) * u) @ f(p + "mlp.down_proj.weight").T
        else:
            e = p + "block_sparse_moe."
            w1, w3, w2 = _logical_experts(ckpt, i)
            y = moe_reference(m, f(e + "gate.weight"), f(e + "gate.e_score_correction_bias"),
                              w1, w3, w2, tuple(f(e + f"shared_experts.{n}_proj.weight")
                                                for n in ("gate", "up", "down")),
                              top_k=CFG.top_k, scale=CFG.routed_scale)
        h = h + y
        nxt = "model.norm.weight" if i == CFG.layers - 1 else \
            f"model.layers.{i + 1}.input_layernorm.weight"
        a = _rms(h, f(nxt))
    return a[-1] @ f("lm_head.weight").T


def test_matches_a_whole_sequence_reference(tmp_path):
    """float32, chunks of 16 rows (a conv tail and a KDA state crossing three chunk edges, MLA
    over pages), against the float32 whole-sequence reference."""
    program = FAM.program(CFG, dtype="float32", rows=16, context=256)
    ckpt, w, _, _ = _weights("float32")
    pipe = _pipeline(tmp_path, program, [whole(program)], "whole32", ckpt, {})
    tokens = list(np.random.default_rng(0).integers(0, CFG.vocab, 45))
    got = np.asarray(list(pipe.prefill(tokens, chunk=16))[-1]["logits"][0], np.float64)
    want = reference(w, ckpt, np.asarray(tokens))
    err = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert err < 1e-4, err


# ---- packed prefill ----

def test_packed_16_sequences_give_the_first_tokens_of_one_per_item(tmp_path):
    """bf16, chunk 64: 16 prompts alone (one sequence per item) and packed 16 to an item
    (several chunks each, in rotating slots and rows): the same first tokens."""
    rows, seqs = 64, 16
    program = FAM.program(CFG, dtype=CFG.dtype, rows=rows, seqs=seqs, context=256)
    shape = item_shape(program, FAM.PAGE)
    art = artifacts.read(artifacts.write(tmp_path / "w", whole(program), model=model_meta(
        FAM, CFG), checkpoint=REF, dtype=CFG.dtype, item=shape))
    runner = Runner(art, load_weights(art, checkpoint_dir(REF)))
    rng = np.random.default_rng(1)
    lens = rng.integers(1, 30, seqs)
    ps = [rng.integers(0, CFG.vocab, n) for n in lens]
    pages = [tuple(range(1 + 4 * k, 5 + 4 * k)) for k in range(seqs)]

    def run(item):
        return np.asarray(runner.run(item, [])[1]["next_token"])

    alone = []
    for k, p in enumerate(ps):
        runner.reset()
        tok = None
        for a in range(0, len(p), 7):  # 7 rows a chunk
            tok = run(make_item([Piece(p[a:a + 7], a, pages[k], slot=k + 1)], shape))[0]
        alone.append(tok)
    runner.reset()
    packed, pos = {}, [0] * seqs
    while len(packed) < seqs:
        live = [k for k in range(seqs) if pos[k] < len(ps[k])]
        take = [(k, pos[k], ps[k][pos[k]:pos[k] + 4]) for k in live]  # 4 rows each
        out = run(make_item([Piece(t, a, pages[k], slot=seqs - k) for k, a, t in take], shape))
        for i, (k, a, t) in enumerate(take):
            pos[k] = a + len(t)
            if pos[k] == len(ps[k]):
                packed[k] = out[i]
    assert [packed[k] for k in range(seqs)] == alone


# ---- derive at load ----

def test_derive_stages_sources_first_fit_and_makes_the_shuffle_layout():
    ckpt, _, made, report = _weights(CFG.dtype)
    recipes = FAM.derived(CFG)
    nbytes = {n: int(np.prod(s)) * np.dtype(d).itemsize for r in recipes for n, s, d in r.sources}
    ws = staging.windows([[n for n, _, _ in r.sources] for r in recipes], nbytes)
    assert report.staging == staging.layout(ws).total
    assert report.widest == staging.peak_live(ws) <= report.staging
    # One derive call's sources at a time: staging is the widest call, not all the sources.
    assert report.staging < sum(nbytes.values()) / 2
    assert report.derived == sum(int(np.prod(s)) for r in recipes for _, s, _ in r.outputs)
    assert report.derived <= report.peak <= report.derived + report.staging  # measured: live arrays
    # The derived bytes are the shuffle of the checkpoint's bytes (the jnp reference).
    b = "model.layers.1.block_sparse_moe.experts."
    m, k = CFG.moe_intermediate, CFG.hidden
    src = load(ckpt, [(f"{b}{e}.{w}.weight_{x}", (m, k // 2) if x == "packed" else (m, k // 32),
                       "uint8") for e in range(CFG.experts) for w in ("w1", "w3")
                      for x in ("packed", "scale")], progress=False)
    st = lambda w, x: np.stack([src[f"{b}{e}.{w}.weight_{x}"] for e in range(CFG.experts)])  # noqa
    want = mxfp4.shuffle(np.concatenate([st("w3", "packed"), st("w1", "packed")], -2),
                         np.concatenate([st("w3", "scale"), st("w1", "scale")], -2), gated=True)
    assert np.asarray(made[b + "gemm1.weight_packed"]).tobytes() == np.asarray(want[0]).tobytes()
    assert np.asarray(made[b + "gemm1.weight_scale"]).tobytes() == np.asarray(want[1]).tobytes()
    assert jax.devices()[0] in made[b + "gemm1.weight_packed"].devices()


# ---- serving ----

def test_two_stage_serving_answers_like_the_single_process_server(tmp_path, procs):
    """k3-mini cut at layer 2 served as two processes (slots leased with pages by the head) and
    as one, on 7 prompts one at a time and all at once (packed): the same tokens, over the
    host transport and over shared memory."""
    import subprocess
    import sys

    from tests.serving import Pipeline
    from tests.test_serve import _complete, _metric, _tokens

    out = tmp_path / "cut"
    p = subprocess.run([sys.executable, "-m", "kernjax", "cut", "--model", "k3-mini", "--at", "2",
                        "--chunk", "32", "--seqs", "4", "--context", "512", "--decode", "1",
                        "--out", str(out)],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    rng = np.random.default_rng(7)
    ps = [rng.integers(0, CFG.vocab, n).tolist() for n in (1, 31, 32, 33, 65, 100, 150)]
    pipes = {}  # all three start at once
    for name, stages, extra in (("one", 1, ()), ("host", 2, ("--transport", "host")),
                                ("shm", 2, ("--transport", "shm"))):  # shm: the stages' programs
        (tmp_path / name).mkdir()                                      # move the activations
        pipes[name] = Pipeline(procs, out, tmp_path / name, stages=stages, extra=extra)
    for pipe in pipes.values():
        pipe.start_stages()
    want = _tokens(_complete(pipes["one"].ready().http, ps, concurrent=False, model="k3-mini"))
    for transport in ("host", "shm"):
        two = pipes[transport].ready()
        assert _tokens(_complete(two.http, ps, concurrent=False, model="k3-mini")) == want
        assert _tokens(_complete(two.http, ps, concurrent=True, model="k3-mini")) == want
        assert _metric(two.http, "kernjax_slots_in_use") == 0, "every slot back in the pool"


def test_a_stage_derives_only_what_its_calls_read(tmp_path):
    """Cut at layer 2: stage 0 (MoE layer 1) derives layer 1's two GEMM layouts, stage 1 (MoE
    layers 2 and 3) the other four, and neither reads the other's MXFP4 sources."""
    from kernjax.runtime import runner as runner_mod

    program = FAM.program(CFG, dtype=CFG.dtype, rows=64, context=256)
    meta = dict(model=model_meta(FAM, CFG), checkpoint=REF, dtype=CFG.dtype,
                item=item_shape(program, FAM.PAGE))
    seen = []  # per stage: (derive calls, source names read)
    real = runner_mod.derive.run

    def spy(recipes, read, **kw):
        names = []
        seen.append((len(recipes), names))
        return real(recipes, lambda want: (names.extend(n for n, _, _ in want), read(want))[1],
                    **kw)

    runner_mod.derive.run = spy
    try:
        at = next(i for i, c in enumerate(program.calls) if c.startswith("l2."))
        for st in cut(program, [at]):
            art = artifacts.read(artifacts.write(tmp_path / f"s{st.index}", st, **meta))
            made = sorted(n for n in load_weights(art, checkpoint_dir(REF)) if ".gemm" in n)
            assert {int(n.split(".")[2]) for n in made} == ({1} if st.index == 0 else {2, 3})
    finally:
        runner_mod.derive.run = real
    (calls0, read0), (calls1, read1) = seen
    assert (calls0, calls1) == (2, 4)
    assert read0 and all(".layers.1." in n for n in read0)
    assert read1 and not any(".layers.1." in n for n in read1)


def test_a_stage_exports_for_cuda_with_the_kda_kernel():
    """On a GPU, k3's KDA calls lower to the extension's kj_kda (platform_dependent), a custom
    call jax.export refuses unless told; the H200 chain gate failed on it once. Exporting for
    CUDA needs no GPU."""
    program = FAM.program(CFG, dtype=CFG.dtype, rows=64, context=2560)
    at = next(i for i, c in enumerate(program.calls) if c.startswith("l2."))
    for s in cut(program, [at]):
        cuda = artifacts.export_stage(s, "cuda").mlir_module()
        assert "kj_kda" in cuda
        assert "kj_kda" not in artifacts.export_stage(s, "cpu").mlir_module()
