"""Per-run caches (never the user's), and shared helpers: the 7 chain prompts, a tokenizer."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import numpy as np
import pytest


def pytest_configure(config):
    """Random checkpoints and XLA's caches go to a per-run cache, never the user's: set before any
    test module imports kernjax, which points XLA at its cache then (`kernjax/runtime/xla.py`)."""
    os.environ["KERNJAX_CACHE"] = tempfile.mkdtemp(prefix="kjcache-")
    atexit.register(shutil.rmtree, os.environ["KERNJAX_CACHE"], ignore_errors=True)


# The longest files first (CPU seconds, 2026-12-02): with `--dist loadfile` each worker takes the
# next file when it is free, so the long ones started last no longer set the suite's end.
LONGEST = ["test_experiments.py", "test_serve.py", "test_k3.py", "test_cli.py", "test_chain.py",
           "test_attention_hopper.py", "test_cut.py", "test_serve_link.py"]


def pytest_collection_modifyitems(items):
    items.sort(key=lambda it: LONGEST.index(it.path.name) if it.path.name in LONGEST else 99)


@pytest.fixture
def procs():
    """Starts `kernjax serve` processes (tests/serving.py) and kills and reaps every one after
    the test, whether it passed or failed."""
    from tests.serving import Procs
    started = Procs()
    yield started
    started.stop()


def prompts(chunk: int, vocab: int, longest: int = 2049) -> list[list[int]]:
    """Seven prompts: 1, chunk-1, chunk, chunk+1 and 2*chunk+7 tokens, then 1000 and 2049 (or,
    with `longest` below 2049, longest//2 and longest)."""
    rng = np.random.default_rng(chunk)
    long = [1000, 2049] if longest >= 2049 else [longest // 2, longest]
    lengths = [1, chunk - 1, chunk, chunk + 1, 2 * chunk + 7, *long]
    return [rng.integers(0, vocab, n).tolist() for n in lengths]


def add_tokenizer(ckpt, vocab: int) -> None:
    """Writes a word-level `tokenizer.json` (`w0` .. `w{vocab-1}`, split on whitespace) into a
    checkpoint directory, so text prompts can be tested without a hub download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece()
    tok.save(str(ckpt / "tokenizer.json"))
