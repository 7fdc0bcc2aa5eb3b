"""Parity with Hugging Face: kernjax's qwen3 logits against transformers' `Qwen3ForCausalLM`.

The goldens (`tests/goldens/qwen3_tiny_f32_hf.npz`) were made by `experiments/hf_goldens.py`
with transformers on the random `qwen3-tiny` checkpoint (seed 0, float32); its docstring says how
to regenerate them. They hold, per prompt, the token ids and the float32 logits at the last row
of every chunk of a multiple of 16 rows and at the prompt's last row.

Here the checkpoint is regenerated with `kernjax.weights.write_random` (it must be byte-identical
to the one the goldens were made from), the whole program is built once per chunk size in
float32, each prompt is prefilled chunk by chunk and every chunk's logits at a kept position are
compared. The measure, per compared row, is

    rel = max_j |ours_j - hf_j| / max_j |hf_j|      (j over the vocabulary)

which must be under 1e-4, and the argmax tokens must agree.
"""

import dataclasses
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from kernjax import models
from kernjax.runtime import derive
from kernjax import artifact as artifacts
from kernjax import weights
from kernjax.artifact import model_meta
from kernjax.core.cut import whole
from kernjax.core.item import item_shape
from kernjax.runtime.pipeline import Pipeline
from kernjax.runtime.runner import Runner, load_weights

GOLDENS = Path(__file__).parent / "goldens" / "qwen3_tiny_f32_hf.npz"
MODEL, SEED, DTYPE = "qwen3-tiny", 0, "float32"
TOL = 1e-4
# Rows per chunk: smaller than the longer prompts (several chunks each), and one chunk that
# covers every prompt whole.
CHUNKS = (16, 64, 160)

with np.load(GOLDENS) as _g:
    G = {k: _g[k] for k in _g.files}
LENGTHS = [int(n) for n in G["lengths"]]
CONTEXT = -(-max(LENGTHS) // 16) * 16


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return weights.write_random(MODEL, seed=SEED, dtype=DTYPE,
                                out=tmp_path_factory.mktemp("ckpt"), progress=False)


@pytest.fixture(scope="module")
def pipeline(ckpt, tmp_path_factory):
    """`pipeline(rows)`: the whole program of `rows` rows in float32, built once per size."""

    pipes: dict[int, Pipeline] = {}

    def get(rows: int) -> Pipeline:
        if rows not in pipes:
            fam, cfg = models.named(MODEL)
            program = fam.program(cfg, dtype=DTYPE, rows=rows, context=CONTEXT)
            path = artifacts.write(tmp_path_factory.mktemp(f"whole{rows}"), whole(program),
                                   model=model_meta(fam, cfg), checkpoint={"dir": str(ckpt)},
                                   dtype=DTYPE, item=item_shape(program, fam.page(cfg)),
                                   derive=fam.derived(dataclasses.replace(cfg, dtype=DTYPE)))
            art = artifacts.read(path)
            pipes[rows] = Pipeline([Runner(art, load_weights(art, ckpt))])
        return pipes[rows]

    return get


def _sha256s(ckpt: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(ckpt.glob("*.safetensors"))}


def check_checkpoint(ckpt: Path) -> None:
    want = json.loads(str(G["checkpoint_sha256"]))
    got = _sha256s(Path(ckpt))
    assert got == want, (
        f"write_random({MODEL!r}, seed={SEED}, dtype={DTYPE!r}) no longer makes the checkpoint "
        f"the goldens were made from (sha256 {got} != {want}): the random generator changed. "
        "Regenerate tests/goldens/qwen3_tiny_f32_hf.npz as experiments/hf_goldens.py says.")


def test_checkpoint_is_the_goldens_checkpoint(ckpt):
    check_checkpoint(ckpt)


def rel_err(ours: np.ndarray, hf: np.ndarray) -> float:
    """max |ours - hf| / max |hf| over the vocabulary."""
    return float(np.max(np.abs(ours - hf)) / np.max(np.abs(hf)))


@pytest.mark.parametrize("rows", CHUNKS)
@pytest.mark.parametrize("k", range(len(LENGTHS)), ids=[f"len{n}" for n in LENGTHS])
def test_logits_match_transformers(ckpt, pipeline, rows, k, record_property):
    check_checkpoint(ckpt)
    tokens, positions = G[f"tokens_{k}"], G[f"positions_{k}"]
    hf_logits, hf_argmax = G[f"logits_{k}"], G[f"argmax_{k}"]
    kept = {int(p): i for i, p in enumerate(positions)}
    pipe = pipeline(rows)
    pipe.reset()
    compared, errs, worst = [], [], 0.0
    end = 0
    for out in pipe.prefill(tokens.tolist(), chunk=rows):
        end = min(end + rows, len(tokens))
        p = end - 1  # the chunk's last row: the row its logits are for
        if p not in kept:
            continue
        i = kept[p]
        ours = np.asarray(out["logits"])[0].astype(np.float32)
        tok = int(np.asarray(out["next_token"])[0])
        e = rel_err(ours, hf_logits[i])
        worst = max(worst, e)
        compared.append(p)
        if not e < TOL:
            errs.append(f"position {p}: max|ours-hf|/max|hf| = {e:.3g} >= {TOL}")
        if tok != int(hf_argmax[i]):
            errs.append(f"position {p}: argmax {tok}, transformers {int(hf_argmax[i])}")
    record_property("worst_rel_err", worst)
    assert compared and compared[-1] == len(tokens) - 1, compared
    assert not errs, (f"prompt of {len(tokens)} tokens, chunks of {rows} rows (worst "
                      f"{worst:.3g}):\n" + "\n".join(errs))


def test_the_program_reads_q_k_v_as_one_weight_derived_at_load(ckpt, pipeline):
    """qwen3's `qkv_proj` is one GEMM (kern's layout): each layer's one weight is the
    checkpoint's q_proj, k_proj and v_proj stacked, and the checkpoint holds only those three."""
    fam, cfg = models.named(MODEL)
    program = fam.program(cfg, dtype=DTYPE, rows=CHUNKS[0], context=CONTEXT)
    for i in range(cfg.layers):  # one product, returning one buffer
        call = program.jaxpr.eqns[program.calls.index(f"l{i}.qkv_proj")]
        assert (str(call).count("dot_general"), len(call.outvars)) == (1, 1), i
    bound = pipeline(CHUNKS[0]).runners[0].weights
    shapes = dict(fam.weight_shapes(cfg))
    assert not any("qkv_proj" in n for n in shapes)
    assert not any(n.endswith((".q_proj.weight", ".k_proj.weight", ".v_proj.weight"))
                   for n in bound)
    for i in range(cfg.layers):
        a = f"model.layers.{i}.self_attn."
        want = [a + f"{s}_proj.weight" for s in "qkv"]
        hf = weights.load(ckpt, [(n, shapes[n], DTYPE) for n in want], progress=False)
        fused = np.asarray(bound[a + "qkv_proj.weight"])
        assert np.array_equal(fused, np.concatenate([hf[n] for n in want])), i


def test_the_derive_program_compiles_once_for_all_layers():
    """Loading costs one derive program, not one per layer: the layers' recipes share their
    function and (first fit) their sources' places, so the derive call's cache grows by one."""
    fam, cfg = models.named(MODEL)
    cfg = dataclasses.replace(cfg, layers=5, hidden=40)  # shapes no other test derives
    rng = np.random.default_rng(0)
    before = derive._call._cache_size()
    made, report = derive.run(fam.derived(cfg), lambda want: {
        n: rng.standard_normal(shape).astype(dtype) for n, shape, dtype in want})
    assert (derive._call._cache_size() - before, report.calls, len(made)) == (1, 5, 5)
