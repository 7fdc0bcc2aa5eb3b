"""GQA groups that are not powers of two: Qwen3-14B has 40 heads over 8 kv heads (G = 5).

Every G Qwen3 allows (kv_heads dividing heads) traces, cuts and runs: on the CPU through
`blockwise`, on CUDA through the route `attention.route` picks by dtype and shape (every route
takes any G; `kernjax/kernels/attention.py`).

The models: `qwen3-tiny-gqa3` (6 heads over 2, head_dim 64, pages of 16) and `qwen3-tiny-gqa5`
(10 over 2, head_dim 128, pages of 128), random checkpoints (seed 0) in float32, cut at layer 1
with `kernjax cut`. Their logits are compared with transformers' `Qwen3ForCausalLM` on the same
checkpoints (`tests/goldens/qwen3_tiny_gqa{3,5}_f32_hf.npz`, made by `experiments/hf_goldens.py`,
whose docstring says how; the measure is `tests/test_parity.py`'s), and the two stages' logits and
tokens with the whole program's, bitwise, after every chunk.

The kernels alone at G = 3 and 5: the Triton kernel in Pallas interpret mode and the Mosaic GPU
kernel in its interpreter on the CPU, each lowered for an H200 in the program's cuda branch; on a
GPU (`gpu`), `attention.chunk_attention` in bf16 and float32 against `attention.reference`.
"""

from __future__ import annotations

import functools
import json
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernjax import artifact as artifacts
from kernjax import models
from kernjax.kernels import attention, attention_hopper, attention_pallas
from kernjax.runtime.pipeline import Pipeline
from kernjax.runtime.runner import Runner, checkpoint_dir, load_weights

from .test_attention import paged
from .test_parity import rel_err

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")

GOLDENS = Path(__file__).parent / "goldens"
MODELS = {"qwen3-tiny-gqa3": 3, "qwen3-tiny-gqa5": 5}  # name: heads / kv_heads
SEED, DTYPE, TOL = 0, "float32", 1e-4
# Rows a chunk: several chunks for every longer prompt, and one chunk that holds every prompt.
CHUNKS = (16, 160)
CONTEXT = 256  # the longest prompt (150) in whole pages of 128
gpu = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
cpu = pytest.mark.skipif(jax.default_backend() != "cpu", reason="the interpreters run on the CPU")


def goldens(model: str) -> dict:
    with np.load(GOLDENS / f"{model.replace('-', '_')}_f32_hf.npz") as g:
        return {k: g[k] for k in g.files}


def test_the_models_have_the_groups_their_names_say():
    for name, g in MODELS.items():
        _, cfg = models.named(name)
        assert cfg.heads == g * cfg.kv_heads and g & (g - 1), name
        made = json.loads(str(goldens(name)["config"]))
        assert (made["_name"], made["_seed"], made["num_attention_heads"],
                made["num_key_value_heads"], made["head_dim"]) == (
            name, SEED, cfg.heads, cfg.kv_heads, cfg.head_dim)


@pytest.fixture(scope="module")
def cuts(tmp_path_factory):
    """`cuts(model, chunk)`: `(whole, stages, checkpoint)`, the pipelines of `kernjax cut --model
    MODEL --at 1` in float32 at `chunk` rows, made once each."""
    made = {}

    def get(model: str, chunk: int):
        if (model, chunk) not in made:
            out = tmp_path_factory.mktemp(f"{model}-{chunk}")
            p = subprocess.run([sys.executable, "-m", "kernjax", "cut", "--model", model, "--at",
                                "1", "--dtype", DTYPE, "--chunk", str(chunk), "--seqs", "1",
                                "--context", str(CONTEXT), "--decode", "1", "--out", str(out)],
                               capture_output=True, text=True)
            assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
            arts = {n: artifacts.read(out / n) for n in ("whole", "stage0", "stage1")}
            ckpt = checkpoint_dir(arts["whole"].manifest["checkpoint"])
            cache: dict = {}

            def pipe(*names):
                return Pipeline([Runner(arts[n], load_weights(arts[n], ckpt, cache=cache))
                                 for n in names])

            made[model, chunk] = pipe("whole"), pipe("stage0", "stage1"), ckpt
        return made[model, chunk]

    return get


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("model", list(MODELS))
def test_the_cut_runs_and_matches_transformers(cuts, model, chunk, record_property):
    """Whole and cut at layer 1: the stages give the whole program's bits after every chunk, and
    the whole program transformers' logits (within 1e-4 of the largest) and argmax tokens."""
    from .test_parity import _sha256s

    g = goldens(model)
    whole, split, ckpt = cuts(model, chunk)
    assert _sha256s(ckpt) == json.loads(str(g["checkpoint_sha256"])), (
        f"write_random({model!r}, seed={SEED}, dtype={DTYPE!r}) no longer makes the checkpoint "
        f"the goldens were made from: regenerate them as experiments/hf_goldens.py says")
    errs, worst = [], 0.0
    for k, n in enumerate(int(n) for n in g["lengths"]):
        tokens, positions = g[f"tokens_{k}"], g[f"positions_{k}"]
        kept = {int(p): i for i, p in enumerate(positions)}
        whole.reset()
        split.reset()
        end, compared = 0, []
        for a, b in zip(whole.prefill(tokens.tolist(), chunk=chunk),
                        split.prefill(tokens.tolist(), chunk=chunk), strict=True):
            end = min(end + chunk, n)
            ours = np.asarray(a["logits"])
            tok = int(np.asarray(a["next_token"])[0])
            assert ours.tobytes() == np.asarray(b["logits"]).tobytes(), \
                f"prompt {k} ({n} tokens), chunk ending at {end}: the stages' logits differ"
            assert tok == int(np.asarray(b["next_token"])[0]), (k, end)
            if end - 1 not in kept:
                continue
            i = kept[end - 1]
            e = rel_err(ours[0].astype(np.float32), g[f"logits_{k}"][i])
            worst = max(worst, e)
            compared.append(end - 1)
            if not e < TOL:
                errs.append(f"prompt {k}, position {end - 1}: {e:.3g} >= {TOL}")
            if tok != int(g[f"argmax_{k}"][i]):
                errs.append(f"prompt {k}, position {end - 1}: argmax {tok}, transformers "
                            f"{int(g[f'argmax_{k}'][i])}")
        assert compared and compared[-1] == n - 1, (k, compared)
    record_property("worst_rel_err", worst)
    assert not errs, f"{model}, chunks of {chunk} (worst {worst:.3g}):\n" + "\n".join(errs)


# ---- the kernels alone ------------------------------------------------------------------------


def _lowered_targets(dtype, heads, kv_heads, d) -> set[str]:
    """The custom calls of `attention.chunk_attention`'s program lowered for an H200."""
    S = jax.ShapeDtypeStruct
    args = (S((9, attention.page_size(d), 2, kv_heads, d), dtype), S((64, heads, d), dtype),
            S((64,), jnp.int32), S((3,), jnp.int32), S((2, 4), jnp.int32))
    text = attention_hopper.on_h200(
        lambda *a: attention.chunk_attention(*a, scale=d ** -0.5), *args).as_text()
    return set(re.findall(r"custom_call @([\w$.]+)", text))


TARGETS = {"attention_fa3": "kj_fa3", "attention_hopper": "mosaic_gpu_v2",
           "attention_pallas": "__gpu$xla.gpu.triton"}


def test_every_group_qwen3_allows_has_a_cuda_route():
    """For 40 heads (Qwen3-14B) over each kv_heads dividing them, the route is by dtype and head_dim
    alone, the program traces on the CPU (the cuda branch too), and at G = 3 and 5 the program
    lowered for CUDA holds the route's kernel."""
    want = {("bfloat16", 128): "attention_fa3", ("bfloat16", 64): "attention_hopper",
            ("float16", 64): "attention_hopper", ("float32", 128): "attention_pallas",
            ("float32", 64): "attention_pallas", ("bfloat16", 80): "blockwise",
            ("float32", 96): "blockwise"}
    S = jax.ShapeDtypeStruct
    for kv_heads in [k for k in range(1, 41) if 40 % k == 0]:
        for (dtype, d), name in want.items():
            kv, q = (9, attention.page_size(d), 2, kv_heads, d), (32, 40, d)
            assert attention.route(dtype, q, kv) == name, (kv_heads, dtype, d)
            jax.make_jaxpr(lambda *a: attention.chunk_attention(*a, scale=0.125))(
                S(kv, dtype), S(q, dtype), S((32,), jnp.int32), S((3,), jnp.int32),
                S((2, 4), jnp.int32))
    for g in (3, 5):
        for (dtype, d), name in want.items():
            got = _lowered_targets(jnp.dtype(dtype), 2 * g, 2, d)
            assert got == ({TARGETS[name]} if name in TARGETS else set()), (g, dtype, d, got)
    with pytest.raises(ValueError, match="kv_heads dividing heads: 6 heads over 4"):
        attention.route("float32", (8, 6, 64), (9, 16, 2, 4, 64))


def _item(g, *, d, dtype, rows=96, kv_heads=2, pieces=((5, 17), (0, 0), (37, 60), (70, 1))):
    from .test_attention_pallas import make_item

    return make_item(np.random.default_rng(g), list(pieces), rows=rows, heads=g * kv_heads,
                     kv_heads=kv_heads, d=d, dtype=dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("g", [3, 5])
def test_the_triton_kernel_takes_any_group(g, dtype):
    """Pallas interpret mode: tiles of 128 slots (42 rows at G = 3, 25 at G = 5) and of 32 (a
    block_q of 8 at G = 3: 24 slots), several tiles a sequence, packed, padding rows zero."""
    from .test_attention_pallas import check, reference

    args = _item(g, d=32, dtype=dtype)
    ref = reference(args[0].astype(jnp.float32), args[1].astype(jnp.float32), *args[2:],
                    32 ** -0.5)
    assert attention_pallas.tile_rows(g) == ({3: 42, 5: 25}[g], 128)
    for block_q in (None, 8):
        out = attention_pallas.chunk_attention(*args, scale=32 ** -0.5, block_q=block_q,
                                               block_k=16, interpret=True)
        assert out.shape == args[1].shape and out.dtype == jnp.dtype(dtype)
        check(out, ref, args[3], 1e-5 if dtype == "float32" else 1e-2)


@cpu
@pytest.mark.parametrize("g", [3, 5])
def test_the_mosaic_gpu_kernel_takes_any_group(g):
    """Mosaic GPU's interpreter, race detector on: query head h reads kv head h // G."""
    from .test_attention_hopper import run
    from .test_attention_pallas import check, reference

    args = _item(g, d=64, dtype=jnp.bfloat16, rows=160, pieces=((70, 5), (0, 100), (0, 0)))
    out = run(args, block_kv=64)
    ref = reference(args[0].astype(jnp.float32), args[1].astype(jnp.float32), *args[2:],
                    64 ** -0.5)
    check(out, ref, args[3], 1e-2)


@gpu
@pytest.mark.parametrize("dtype,d", [("bfloat16", 128), ("bfloat16", 64), ("float32", 128),
                                     ("float32", 64)])
@pytest.mark.parametrize("g", [3, 5])
def test_gpu_any_group_matches_the_reference(g, dtype, d):
    """`attention.chunk_attention` on CUDA at 8 kv heads (Qwen3-14B's 40 heads at G = 5) takes the
    route `attention.route` names, whose kernel is in the compiled program, and matches
    `attention.reference`."""
    from kernjax.kernels import ffi

    name = attention.route(dtype, (512, 8 * g, d), (1, attention.page_size(d), 2, 8, d))
    assert name == {("bfloat16", 128): "attention_fa3", ("bfloat16", 64): "attention_hopper"}.get(
        (dtype, d), "attention_pallas")
    if name == "attention_fa3":
        ffi.register()
        if not ffi._extension().fa3_loaded():
            pytest.skip("FlashAttention-3 is not loaded (scripts/fa3 builds it)")
    page = attention.page_size(d)
    args = paged(np.random.default_rng(g * d), [1200, 1, 300], [200, 1, 300], kvh=8,
                 heads=8 * g, d=d, width=-(-1200 // page), dtype=dtype, rows=512, seqs=4,
                 page=page)
    fn = jax.jit(functools.partial(attention.chunk_attention, scale=d ** -0.5))
    hlo = fn.lower(*args).as_text()
    assert TARGETS[name] in hlo, (name, sorted(set(re.findall(r"custom_call @([\w$.]+)", hlo))))
    out = np.asarray(fn(*args).astype(jnp.float32))
    again = np.asarray(fn(*args).astype(jnp.float32))
    assert out.tobytes() == again.tobytes(), "run to run"
    f32 = [a.astype(jnp.float32) if a.dtype == dtype else a for a in args]
    ref = np.asarray(jax.jit(functools.partial(attention.reference, scale=d ** -0.5))(*f32))
    n = int(args[3][-1])
    assert not np.isnan(out).any() and not out[n:].any(), "padding rows must be zeros"
    err = np.linalg.norm(out[:n] - ref[:n]) / np.linalg.norm(ref[:n])
    assert err < (1e-5 if dtype == "float32" else 1e-2), err
