"""The chain gate on the CPU: qwen3-tiny cut at every layer boundary and at mid-layer calls, in 2
and 3 stages, gives logits and tokens bitwise identical to the whole program after every chunk."""

from __future__ import annotations

import subprocess
import sys

import jax
import numpy as np
import pytest

from kernjax import models
from kernjax import artifact as artifacts
from kernjax.runtime import tokens
from kernjax import weights as ckpts
from kernjax.runtime.chain import chain
from kernjax.artifact import model_meta
from kernjax.core.cut import cut, whole
from kernjax.core.item import Piece, item_shape, make_item
from kernjax.runtime.pipeline import Pipeline
from kernjax.runtime.runner import Runner, checkpoint_dir, load_weights
from tests.conftest import add_tokenizer, prompts

FAM, CFG = models.named("qwen3-tiny")
CONTEXT = 2560
# Layer boundaries 1..3 (calls 14, 26, 38) and mid-layer calls: after l0.attn, inside layer 2's
# MLP, right before the final norm and before lm_head.
CUTS = {64: [[14], [26], [38], [8], [33], [49], [14, 38], [9, 32]],
        512: [[14], [26], [38], [10], [50], [26, 38], [3, 45]]}


@pytest.fixture(scope="module", params=sorted(CUTS))
def setup(request, tmp_path_factory):
    chunk = request.param
    program = FAM.program(CFG, dtype=CFG.dtype, rows=chunk, context=CONTEXT)
    ref = {"model": CFG.name, "seed": 0, "dtype": CFG.dtype}
    meta = dict(model=model_meta(FAM, CFG), checkpoint=ref, dtype=CFG.dtype,
                item=item_shape(program, FAM.page(CFG)))
    out = tmp_path_factory.mktemp(f"chain{chunk}")
    ckpt, cache = checkpoint_dir(ref), {}

    def pipeline(stages, name):
        arts = [artifacts.read(artifacts.write(out / name / f"s{s.index}", s, **meta))
                for s in stages]
        return Pipeline([Runner(a, load_weights(a, ckpt, cache=cache)) for a in arts])

    return chunk, program, pipeline, pipeline([whole(program)], "whole")


def test_stages_equal_whole_after_every_chunk(setup):
    chunk, program, pipeline, whole_pipe = setup
    lines = []
    for at in CUTS[chunk]:
        split = pipeline(cut(program, at), "cut" + "_".join(map(str, at)))
        ok = chain(whole_pipe, split, prompts(chunk, CFG.vocab), chunk=chunk, say=lines.append)
        assert ok, f"cut {at}, chunk {chunk}:\n" + "\n".join(lines)
    assert lines[-1] == "PASS: 7 prompts bitwise identical"
    assert "prompt 6: 2049 tokens, " + str(-(-2049 // chunk)) + " chunks: IDENTICAL" in lines


def test_the_program_publishes_its_token_to_the_host(setup):
    """`kernjax.runtime.tokens`: the last stage's program writes the run's number and token into its
    ring (no JAX effect, so jit's C++ dispatch stays); the host reads it there, and reads the
    device array where the entry may have been written over."""
    chunk, program, pipeline, whole_pipe = setup
    for r in (whole_pipe.runners[-1], pipeline(cut(program, [26]), "token").runners[-1]):
        arrivals = [np.zeros(s.shape, ckpts.np_dtype(s.dtype)) for s in r.art.arrivals]
        toks = np.arange(5, 5 + chunk, dtype=np.int32) % CFG.vocab
        item = make_item([Piece(toks, 0, tuple(range(1, chunk // FAM.page(CFG) + 1)))], r.art.item)
        for _ in range(2):
            _, outs = r.run(item, arrivals)
            tok = outs["next_token"]
            assert isinstance(tok, tokens.Token)
            got, want = np.asarray(tok), np.asarray(tok.array)
            assert got.dtype == np.int32 and got.shape == want.shape and np.array_equal(got, want)
            assert r.ring.view[tok.run % tokens.RING, 0] == tok.run
        specs = [jax.ShapeDtypeStruct(s.shape, ckpts.np_dtype(s.dtype))
                 for s in (*r.art.inputs, *r.art.arrivals)] + [jax.ShapeDtypeStruct((1,), np.int32)]
        names = [s.name for s in (*r.art.departures, *r.art.outputs)]
        traced = jax.make_jaxpr(r.ring.wrap(r.art.exported.call, names.index("next_token")))
        assert not traced(*specs).effects, "a JAX effect: the program would leave C++ dispatch"
        _, outs = r.run(item, arrivals)
        r.ring.runs += tokens.RING  # as if a ring's worth of runs went since: not read there
        r.ring.view[outs["next_token"].run % tokens.RING, 1:] = -7
        assert np.array_equal(np.asarray(outs["next_token"]), np.asarray(outs["next_token"].array))


_PUBLISHED_HLO = """
import hashlib, sys, jax, jax.numpy as jnp, numpy as np
from kernjax.runtime import tokens
for k in range(int(sys.argv[1])):  # programs built before, as a benchmark or a chain builds them
    ring = tokens.ring(2, jax.devices()[0])
    jax.jit(ring.wrap(lambda x: (x + k, jnp.argmin(x, axis=-1)), 1)).lower(
        jnp.ones((2, 4)), np.zeros(1, np.int32))
ring = tokens.ring(2, jax.devices()[0])
f = ring.wrap(lambda x: (x * 2, jnp.argmax(x, axis=-1).astype(jnp.int32)), 1)
text = jax.jit(f).lower(jnp.ones((2, 8)), np.zeros(1, np.int32)).as_text()
assert str(ring.addr) not in text and hex(ring.addr) not in text, "the ring's address in the HLO"
print(ring.slot, hashlib.sha256(text.encode()).hexdigest())
"""


def test_a_published_program_is_the_same_hlo_in_every_process():
    """The program names its ring by an id bound in each process, not by the ring's address, and
    the process has one ring a token count (`tokens.ring`), so a restarted stage compiles the same
    HLO whatever it built before and finds it in JAX's persistent cache (the address in it made
    every second start of a publishing program a miss: H200, 2026-12-02)."""
    runs = [subprocess.run([sys.executable, "-c", _PUBLISHED_HLO, n], capture_output=True,
                           text=True) for n in ("0", "3")]
    assert all(r.returncode == 0 for r in runs), [r.stderr[-2000:] for r in runs]
    (a,), (b,) = ([r.stdout.splitlines()[-1]] for r in runs)
    assert a == b and a.startswith("1 "), (a, b)


def test_chain_detects_a_difference(setup):
    """A stage whose down_proj weights are one ulp off makes the chain say DIFFERENT."""
    chunk, program, pipeline, whole_pipe = setup
    split = pipeline(cut(program, [26]), "tampered")
    r = split.runners[1]
    name = next(s.name for s in r.art.inputs if s.name.endswith("mlp.down_proj.weight"))
    w = np.asarray(r.weights[name]).copy()
    w.view(np.uint16)[...] += 1
    r.weights[name] = w
    lines = []
    assert not chain(whole_pipe, split, prompts(chunk, CFG.vocab)[:2], chunk=chunk, say=lines.append)
    assert "DIFFERENT" in lines[0] and lines[-1].startswith("FAIL")


def test_chain_refuses_a_pipeline_that_stops_a_chunk_early(setup):
    """The chunks are paired strictly: a split that gives one chunk fewer than the whole program
    (its chunks so far identical) is an error, not a shorter comparison that passes."""
    chunk, _, _, whole_pipe = setup
    prompt = prompts(chunk, CFG.vocab)[4]  # 2 * chunk + 7 tokens: 3 chunks
    whole_pipe.reset()
    got = list(whole_pipe.prefill(prompt, chunk=chunk))
    assert len(got) == 3

    class Short:  # the whole program's own chunks, less the last
        runners = whole_pipe.runners

        def reset(self):
            pass

        def prefill(self, tokens, *, chunk):
            return iter(got[:-1])

    lines = []
    with pytest.raises(ValueError, match="zip"):
        chain(whole_pipe, Short(), [prompt], chunk=chunk, say=lines.append)
    assert not any("PASS" in x for x in lines), lines


def _cli(*args, **kw):
    return subprocess.run([sys.executable, "-m", "kernjax", *args], capture_output=True, text=True, **kw)


def test_cli_cut_then_chain_passes(tmp_path):
    p = _cli("cut", "--model", "qwen3-tiny", "--at", "1,c32", "--out", str(tmp_path / "st"),
             "--chunk", "64", "--context", "2560", "--decode", "1")
    assert p.returncode == 0, p.stderr
    assert "stage 2: calls 32..51" in p.stdout and "into 3 stages" in p.stdout
    f = tmp_path / "prompts.txt"
    f.write_text("\n".join(" ".join(map(str, t)) for t in prompts(64, CFG.vocab)[:5]) + "\n")
    p = _cli("chain", "--stages", str(tmp_path / "st"), "--prompts", str(f), "--chunk", "32")
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines()[-1] == "PASS: 5 prompts bitwise identical"
    assert "prompt 3: 65 tokens, 3 chunks, 4 decode steps: IDENTICAL" in p.stdout


def test_cli_run_whole_and_stages_agree(tmp_path):
    """`run --model` builds its whole program for the prompt (one sequence, context rounded up to
    a page); a cut of that same shape must give the same bytes."""
    st = tmp_path / "st"
    prompt = prompts(16, CFG.vocab)[4]
    context = -(-len(prompt) // 16) * 16
    assert _cli("cut", "--model", "qwen3-tiny", "--at", "2", "--out", str(st), "--chunk",
                "16", "--seqs", "1", "--context", str(context), "--decode", "1").returncode == 0
    toks = " ".join(map(str, prompt))
    a = _cli("run", "--model", "qwen3-tiny", "--tokens", toks, "--chunk", "16",
             "--save", str(tmp_path / "a.npz"))
    b = _cli("run", "--stages", str(st), "--tokens", toks, "--save", str(tmp_path / "b.npz"))
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    za, zb = np.load(tmp_path / "a.npz"), np.load(tmp_path / "b.npz")
    assert za["logits"].dtype == np.float32 and za["logits"].shape == (CFG.vocab,)
    assert za["logits"].tobytes() == zb["logits"].tobytes()
    assert int(za["token"]) == int(zb["token"]) == int(np.argmax(za["logits"]))
    assert f"first token: {int(za['token'])}" in a.stdout


@pytest.mark.parametrize("args, message", [
    (["cut", "--model", "qwen3-tiny", "--at", "c7", "--out", "X"],
     "state `kv.0` is touched by 2 stages"),
    (["cut", "--model", "qwen3-tiny", "--at", "c51", "--out", "X"],
     "output `logits` is made by call 50 (`lm_head`) in stage 0 of 2"),
    (["cut", "--model", "qwen3-tiny", "--at", "c0", "--out", "X"],
     "cut point 0 is at or before call 0 (`embed`)"),
    (["cut", "--model", "qwen3-tiny", "--at", "9", "--out", "X"], "has no layer 9"),
    (["cut", "--model", "qwen3-tiny", "--at", "c99", "--out", "X"], "past the last call 51"),
    (["cut", "--model", "qwen3-tiny", "--at", "3,1", "--out", "X"], "not increasing"),
    (["cut", "--model", "nope", "--at", "1", "--out", "X"], "unknown model `nope`"),
    (["run", "--model", "qwen3-tiny", "--tokens", "1 2 99999"], "outside the vocabulary"),
    (["run", "--model", "qwen3-tiny", "--tokens", ""], "the prompt is empty"),
    (["run", "--model", "qwen3-tiny"], "exactly one of --prompt"),
    (["chain", "--stages", "nowhere", "--prompts", "nothing"], "nothing"),
])
def test_cli_refusals_exit_nonzero_with_a_message(args, message, tmp_path):
    p = _cli(*args, cwd=tmp_path)
    assert p.returncode == 2, p.stdout + p.stderr
    assert message in p.stderr and "Traceback" not in p.stderr, p.stderr


def test_dtype_contradicting_the_artifact_is_refused(tmp_path):
    st = tmp_path / "st"
    assert _cli("cut", "--model", "qwen3-tiny", "--at", "2", "--out", str(st), "--chunk",
                "16", "--context", "64", "--decode", "1").returncode == 0
    p = _cli("run", "--stages", str(st), "--tokens", "1 2 3", "--dtype", "float32")
    assert p.returncode == 2 and "--dtype float32 contradicts" in p.stderr, p.stderr
    f = tmp_path / "p.txt"
    f.write_text("1 2 3\n")
    p = _cli("chain", "--stages", str(st), "--prompts", str(f), "--dtype", "float32")
    assert p.returncode == 2 and "--dtype float32 contradicts" in p.stderr, p.stderr
    p = _cli("run", "--stages", str(st), "--tokens", " ".join(["1"] * 65))
    assert p.returncode == 2 and "context is 64" in p.stderr, p.stderr


def test_cli_run_text_prompt_goes_through_the_tokenizer(tmp_path):
    ckpt = tmp_path / "ckpt"
    assert _cli("weights", "random", "--model", "qwen3-tiny", "--out",
                str(ckpt)).returncode == 0
    add_tokenizer(ckpt, CFG.vocab)
    a = _cli("run", "--weights", str(ckpt), "--prompt", "w5 w6 w7", "--save",
             str(tmp_path / "a.npz"))
    b = _cli("run", "--weights", str(ckpt), "--tokens", "5 6 7", "--save",
             str(tmp_path / "b.npz"))
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    token = int(np.load(tmp_path / "b.npz")["token"])
    assert f"prompt: 3 tokens; first token: {token} 'w{token}'" in a.stdout, a.stdout
    assert np.load(tmp_path / "a.npz")["logits"].tobytes() == \
        np.load(tmp_path / "b.npz")["logits"].tobytes()


def test_the_same_cut_writes_the_same_bytes(tmp_path):
    for out in ("a", "b"):
        assert _cli("cut", "--model", "qwen3-tiny", "--at", "2", "--out",
                    str(tmp_path / out), "--chunk", "16", "--context", "64").returncode == 0
    for stage in ("stage0", "stage1", "whole"):
        for f in ("manifest.json", "program.jaxexport"):
            assert (tmp_path / "a" / stage / f).read_bytes() == \
                (tmp_path / "b" / stage / f).read_bytes(), f"{stage}/{f}"
