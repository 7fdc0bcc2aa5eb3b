"""Tests for kernjax.weights: random checkpoints, loading by name, ties, shards, dtypes, shell."""

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from kernjax import models, weights
from kernjax.weights import WeightError

MODEL = "qwen3-tiny"
FAM, CFG = models.named(MODEL)
SHAPES = dict(FAM.weight_shapes(CFG))
EMBED = "model.embed_tokens.weight"
Q0 = "model.layers.0.self_attn.q_proj.weight"
K0 = "model.layers.0.self_attn.k_proj.weight"


def _tensors(ckpt: Path) -> dict[str, np.ndarray]:
    out = {}
    for f in sorted(Path(ckpt).glob("*.safetensors")):
        with safe_open(f, framework="numpy") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def f32(tmp_path_factory):
    return weights.write_random(MODEL, seed=0, dtype="float32",
                                out=tmp_path_factory.mktemp("f32"), progress=False)


@pytest.fixture(scope="module")
def bf16(tmp_path_factory):
    return weights.write_random(MODEL, seed=0, dtype="bfloat16",
                                out=tmp_path_factory.mktemp("bf16"), progress=False)


# --- write_random ---------------------------------------------------------------------------

def test_write_random_is_deterministic(f32, tmp_path):
    again = weights.write_random(MODEL, seed=0, dtype="float32", out=tmp_path / "again",
                                 progress=False)
    assert _sha(again / "model.safetensors") == _sha(f32 / "model.safetensors")
    assert (again / "config.json").read_text() == (f32 / "config.json").read_text()
    modes = {f.name: f.stat().st_mode & 0o777 for f in again.iterdir()}
    assert len(set(modes.values())) == 1, modes  # the tensors as readable as the config
    other = weights.write_random(MODEL, seed=1, dtype="float32", out=tmp_path / "seed1",
                                 progress=False)
    a, b = _tensors(f32), _tensors(other)
    assert a.keys() == b.keys()
    assert all(not np.array_equal(a[k], b[k]) for k in a), "seed 1 repeats a seed-0 tensor"


def test_fingerprint_tells_checkpoints_of_one_shape_apart(f32, bf16, tmp_path):
    """The id the stages of a pipeline compare: the same tensors give the same id however the
    files split them; another seed, another dtype or one small tensor retrained give another."""
    seed1 = weights.write_random(MODEL, seed=1, dtype="float32", out=tmp_path / "seed1",
                                 progress=False)
    t = _tensors(f32)
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    names = sorted(t)
    halves = {"a.safetensors": names[::2], "b.safetensors": names[1::2]}
    for f, ns in halves.items():
        save_file({n: t[n] for n in ns[::-1]}, sharded / f)
    (sharded / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {n: f for f, ns in halves.items() for n in ns}}))
    norm = tmp_path / "norm"
    norm.mkdir()
    save_file({**t, "model.norm.weight": t["model.norm.weight"] + 1e-3},
              norm / "model.safetensors")
    ids = [weights.fingerprint(c) for c in (f32, sharded, seed1, bf16, norm)]
    assert ids[0] == ids[1] and len(set(ids)) == 4, ids
    assert all(re.fullmatch("[0-9a-f]{16}", x) for x in ids), ids  # 8 bytes in hex, for a log line


def test_tensor_bytes_do_not_depend_on_other_tensors(f32, tmp_path, monkeypatch):
    full = _tensors(f32)
    # The same model with a different subset of tensors, in reverse order.
    shapes = FAM.weight_shapes(CFG)
    keep = [s for i, s in enumerate(reversed(shapes)) if i % 3 != 1]
    monkeypatch.setattr(FAM, "weight_shapes", lambda cfg: keep)
    part = _tensors(weights.write_random(MODEL, seed=0, dtype="float32", out=tmp_path / "part",
                                         progress=False))
    assert sorted(part) == sorted(n for n, _ in keep) and len(part) < len(full)
    for name, x in part.items():
        assert x.tobytes() == full[name].tobytes(), name


def test_random_checkpoint_has_a_tokenizer_that_fits_the_vocabulary(f32, bf16, tmp_path):
    from tokenizers import Tokenizer
    assert (f32 / "tokenizer.json").read_bytes() == (bf16 / "tokenizer.json").read_bytes()
    tok = Tokenizer.from_file(str(f32 / "tokenizer.json"))
    assert 256 < tok.get_vocab_size() <= CFG.vocab
    text = "Hello, wörld! 日本語 \t\n ∑ 0x1F"
    ids = tok.encode(text, add_special_tokens=False).ids
    assert ids and max(ids) < CFG.vocab and tok.decode(ids) == text
    assert len(tok.encode("Hello").ids) == 1  # trained merges, not bytes only
    weights.write_tokenizer(tmp_path, 200)  # no byte-level tokenizer fits 200 ids
    assert not (tmp_path / "tokenizer.json").exists()


def test_cached_checkpoint_gains_its_tokenizer(f32, tmp_path, monkeypatch):
    monkeypatch.setenv("KERNJAX_CACHE", str(tmp_path))
    path = weights.random_checkpoint(MODEL, dtype="float32")
    assert (path / "tokenizer.json").read_bytes() == (f32 / "tokenizer.json").read_bytes()
    (path / "tokenizer.json").unlink()  # as cached before random checkpoints had one
    assert weights.random_checkpoint(MODEL, dtype="float32") == path
    assert (path / "tokenizer.json").read_bytes() == (f32 / "tokenizer.json").read_bytes()


def test_random_values_look_like_hf_init(f32):
    t = _tensors(f32)
    assert sorted(t) == sorted(SHAPES)
    for name, x in t.items():
        assert x.dtype == np.float32 and x.shape == SHAPES[name]
    assert abs(float(t[Q0].std()) - 0.02) < 0.002
    norm = t["model.norm.weight"]
    assert abs(float(norm.mean()) - 1.0) < 0.05
    conf = json.loads((f32 / "config.json").read_text())
    assert conf["model_type"] == "qwen3" and conf["torch_dtype"] == "float32"
    assert conf["tie_word_embeddings"] is True and "lm_head.weight" not in t


# --- load -----------------------------------------------------------------------------------

def test_load_by_name_reads_only_what_is_asked(f32):
    want = [(Q0, SHAPES[Q0], "float32"), (EMBED, SHAPES[EMBED], "float32")]
    got = weights.load(f32, want)
    assert sorted(got) == sorted([Q0, EMBED])
    full = _tensors(f32)
    for name, shape, _ in want:
        assert got[name].shape == shape and got[name].dtype == np.float32
        np.testing.assert_array_equal(got[name], full[name])


def test_missing_and_misshaped_tensors_are_named_in_one_error(f32):
    q_t = (SHAPES[Q0][1], SHAPES[Q0][0])  # transposed: [64, 128] for [128, 64]
    want = [(K0, SHAPES[K0], "float32"),
            ("model.layers.9.mlp.up_proj.weight", (128, 64), "float32"),  # missing
            (Q0, q_t, "float32")]
    with pytest.raises(WeightError) as e:
        weights.load(f32, want)
    msg = str(e.value)
    assert "`model.layers.9.mlp.up_proj.weight` is missing" in msg
    assert f"`{Q0}` has shape {list(SHAPES[Q0])}; the model expects {list(q_t)}" in msg
    assert K0 not in msg


def test_tied_lm_head_falls_back_to_the_embedding(f32):
    vd = SHAPES[EMBED]
    got = weights.load(f32, [("lm_head.weight", vd, "float32")], fallbacks={'lm_head.weight': EMBED})
    assert list(got) == ["lm_head.weight"]
    np.testing.assert_array_equal(got["lm_head.weight"], _tensors(f32)[EMBED])
    with pytest.raises(WeightError, match=r"`lm_head\.weight` is missing"):
        weights.load(f32, [("lm_head.weight", vd, "float32")])
    # Only lm_head falls back.
    with pytest.raises(WeightError, match=r"`model\.foo\.weight` is missing"):
        weights.load(f32, [("model.foo.weight", vd, "float32")], fallbacks={'lm_head.weight': EMBED})


def test_untied_lm_head_is_read_when_present(f32, tmp_path):
    t = _tensors(f32)
    head = np.arange(np.prod(SHAPES[EMBED]), dtype=np.float32).reshape(SHAPES[EMBED])
    save_file({**t, "lm_head.weight": head}, tmp_path / "model.safetensors")
    got = weights.load(tmp_path, [("lm_head.weight", SHAPES[EMBED], "float32")], fallbacks={'lm_head.weight': EMBED})
    np.testing.assert_array_equal(got["lm_head.weight"], head)


def test_sharded_checkpoint_loads(f32, tmp_path):
    t = _tensors(f32)
    names = sorted(t)
    shards = [names[0::3], names[1::3], names[2::3]]
    wm = {}
    for i, part in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({k: t[k] for k in part}, tmp_path / fname, metadata={"format": "pt"})
        wm.update(dict.fromkeys(part, fname))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": sum(x.nbytes for x in t.values())}, "weight_map": wm}))
    (tmp_path / "config.json").write_text((f32 / "config.json").read_text())
    assert not (tmp_path / "model.safetensors").exists()
    want = [(n, SHAPES[n], "float32") for n in names]
    got = weights.load(tmp_path, want + [("lm_head.weight", SHAPES[EMBED], "float32")],
                       fallbacks={'lm_head.weight': EMBED})
    assert sorted(got) == sorted(names + ["lm_head.weight"])
    for n in names:
        np.testing.assert_array_equal(got[n], t[n])
    np.testing.assert_array_equal(got["lm_head.weight"], t[EMBED])
    # A mis-shaped tensor in a later shard is still reported by name.
    with pytest.raises(WeightError, match=K0):
        weights.load(tmp_path, [(K0, (1, 2), "float32")])


def test_bf16_checkpoint_casts_to_float32_and_back(f32, bf16):
    conf = json.loads((bf16 / "config.json").read_text())
    assert conf["torch_dtype"] == "bfloat16"
    raw = _tensors(bf16)
    assert raw[Q0].dtype == np.dtype(ml_dtypes.bfloat16)
    want32 = [(n, s, "float32") for n, s in SHAPES.items()]
    want16 = [(n, s, "bfloat16") for n, s in SHAPES.items()]
    up = weights.load(bf16, want32)
    ref = _tensors(f32)
    for n in SHAPES:
        assert up[n].dtype == np.float32
        # bf16 -> f32 is exact: the bf16 checkpoint is the f32 one rounded to bf16.
        np.testing.assert_array_equal(up[n], ref[n].astype(ml_dtypes.bfloat16).astype(np.float32))
    down = weights.load(f32, want16)
    for n in SHAPES:
        assert down[n].dtype == np.dtype(ml_dtypes.bfloat16)
        assert down[n].tobytes() == raw[n].tobytes(), n
    same = weights.load(bf16, want16)
    assert same[Q0].tobytes() == raw[Q0].tobytes()


def test_a_directory_without_safetensors_is_a_clear_error(tmp_path):
    with pytest.raises(WeightError, match="neither model.safetensors nor"):
        weights.load(tmp_path, [(Q0, SHAPES[Q0], "float32")])


# --- read_config ----------------------------------------------------------------------------

def test_read_config(f32, bf16):
    fam, cfg = weights.read_config(f32)
    assert fam is FAM
    assert cfg == type(CFG)(**{**CFG.__dict__, "dtype": "float32"})
    assert weights.read_config(bf16)[1].dtype == "bfloat16"


def test_read_config_without_config_json_is_a_clear_error(tmp_path):
    with pytest.raises(WeightError, match="has no config.json.*Hugging Face checkpoint directory"):
        weights.read_config(tmp_path)
    with pytest.raises(WeightError, match="checkpoint `.*nowhere` does not exist"):
        weights.read_config(tmp_path / "nowhere")
    with pytest.raises(WeightError, match="checkpoint `.*nowhere` does not exist"):
        weights.load(tmp_path / "nowhere", [(Q0, SHAPES[Q0], "float32")])


# --- the shell ------------------------------------------------------------------------------

def _shell(*args, cwd):
    env = {**os.environ, "KERNJAX_CACHE": str(cwd / "cache")}
    return subprocess.run([sys.executable, "-m", "kernjax", "weights", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def test_shell_writes_a_random_checkpoint(tmp_path, bf16):
    out = tmp_path / "ckpt"
    r = _shell("random", "--model", MODEL, "--seed", "0", "--dtype", "bfloat16", "--out",
               str(out), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "wrote random qwen3-tiny" in r.stdout
    assert _sha(out / "model.safetensors") == _sha(bf16 / "model.safetensors")
    assert _sha(out / "tokenizer.json") == _sha(bf16 / "tokenizer.json")  # another process
    assert weights.read_config(out)[1].dtype == "bfloat16"


def test_shell_unknown_model_is_exit_2_without_traceback(tmp_path):
    r = _shell("random", "--model", "qwen3-nope", "--out", str(tmp_path / "x"), cwd=tmp_path)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "unknown model `qwen3-nope`" in r.stderr and MODEL in r.stderr
    assert "Traceback" not in r.stderr + r.stdout
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("index, words", [
    ("{not json", "is malformed (JSONDecodeError"),
    (b"\xff\xfe", "is malformed (UnicodeDecodeError"),
    ('{"metadata": {}}', "is malformed (KeyError: 'weight_map')"),
    ("[]", "is malformed (TypeError"),
    ('{"weight_map": ["a"]}', "weight_map is not a map of tensor names to file names"),
    ('{"weight_map": {"model.norm.weight": null}}', "weight_map is not a map"),
    ('{"weight_map": {"model.norm.weight": "../elsewhere/model.safetensors"}}',
     "weight_map is not a map"),
    ('{"weight_map": {"model.norm.weight": "gone.safetensors"}}',
     "names gone.safetensors, which"),
    ('{"weight_map": {"model.norm.weight": "fifo.safetensors"}}',
     "names fifo.safetensors, which"),
])
def test_a_broken_index_is_one_error_naming_it(tmp_path, index, words):
    """Found by a fuzzing pass: these were tracebacks, or (a FIFO shard) a hang no signal ended."""
    (tmp_path / "model.safetensors.index.json").write_bytes(
        index if isinstance(index, bytes) else index.encode())
    os.mkfifo(tmp_path / "fifo.safetensors")
    with pytest.raises(WeightError, match="model.safetensors.index.json") as e:
        weights.load(tmp_path, [("model.norm.weight", SHAPES["model.norm.weight"], "float32")])
    assert words in str(e.value), str(e.value)


def test_a_tensor_stored_in_a_dtype_the_model_cannot_read_as_is_refused(f32, tmp_path):
    t = _tensors(f32)
    save_file({**t, "x.packed": np.zeros((4, 4), np.float32), "x.f16": np.zeros(4, np.float16)},
              tmp_path / "model.safetensors")
    with pytest.raises(WeightError, match=r"`x\.packed` is stored as F32; the model reads it as "
                                          r"uint8"):
        weights.load(tmp_path, [("x.packed", (4, 4), "uint8")], shapes_only=True)
    with pytest.raises(WeightError, match=r"`x\.packed` is stored as F32"):
        weights.load(tmp_path, [("x.packed", (4, 4), "uint8")])
    got = weights.load(tmp_path, [("x.f16", (4,), "bfloat16")])  # a float is cast
    assert got["x.f16"].dtype == ml_dtypes.bfloat16


def test_a_failed_random_checkpoint_leaves_no_half_behind(tmp_path, monkeypatch):
    monkeypatch.setenv("KERNJAX_CACHE", str(tmp_path))

    def fail(*a, out, **k):
        Path(out).mkdir(parents=True)
        (Path(out) / "half").write_text("x")
        raise OSError("disk full")
    monkeypatch.setattr(weights, "write_random", fail)
    with pytest.raises(OSError, match="disk full"):
        weights.random_checkpoint(MODEL, seed=3)
    assert list((tmp_path / "random").iterdir()) == []  # the half written one is gone
