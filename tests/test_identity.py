"""Kernel choice is part of a cut's identity: the lowering table in every manifest, hashed into the
cut id; stages exported under other choices are refused, naming the knob, by `run`, `chain`, a
pipeline and the head."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from kernjax.core import lowering
from kernjax.core.cut import cut, cut_id, table, whole
from kernjax import models

SMALL = ["--model", "qwen3-tiny", "--at", "2", "--chunk", "16", "--context", "64", "--decode", "1"]


def _kj(*args, cwd):
    return subprocess.run([sys.executable, "-m", "kernjax", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=300)


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    """One model cut at one point twice: with the default kernels and with two knobs changed;
    and a cut that mixes the first's stage 0 and whole/ with the second's stage 1."""
    t = tmp_path_factory.mktemp("identity")
    a = _kj("cut", *SMALL, "--out", "a", cwd=t)
    b = _kj("cut", *SMALL, "--out", "b", "--nodense_cuda", "--mlp_tile", "64x256", cwd=t)
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    shutil.copytree(t / "a", t / "mixed")
    shutil.rmtree(t / "mixed" / "stage1")
    shutil.copytree(t / "b" / "stage1", t / "mixed" / "stage1")
    (t / "p.txt").write_text("1 2 3\n")
    return t, a.stdout, b.stdout


def _manifest(d):
    return json.loads((d / "manifest.json").read_text())


def test_the_table_is_in_every_manifest_and_the_ids_differ(two):
    t, out_a, out_b = two
    ma, mb = _manifest(t / "a" / "stage0"), _manifest(t / "b" / "stage0")
    assert ma["lowering"] == table() and ma["lowering"]["dense_cuda"] is True
    assert mb["lowering"]["dense_cuda"] is False and mb["lowering"]["mlp_tile"] == "64x256"
    assert ma["lowering"]["routes"], "the registered on_gpu lowerings are in the table"
    assert ma["cut"]["id"] != mb["cut"]["id"]
    assert f"cut `{ma['cut']['id']}`" in out_a and f"cut `{mb['cut']['id']}`" in out_b
    for name in ("stage1", "whole"):  # every stage of one cut records the same table
        assert _manifest(t / "a" / name)["lowering"] == ma["lowering"]


def test_the_id_hashes_each_knob():
    fam, cfg = models.named("qwen3-tiny")
    program = fam.program(cfg, dtype="float32", rows=16, context=64)
    ids = {cut_id(program, [20], table(lowering.Lowering(**kw))) for kw in (
        {}, {"dense_cuda": False}, {"mlp_tile": "64x256"}, {"mlp_across": True},
        {"graph_cuts": False}, {"fa3_graphs": False})}
    assert len(ids) == 6
    assert cut(program, [20])[0].cut_id == cut_id(program, [20], table())
    assert whole(program, lowering=lowering.Lowering(graph_cuts=False)).lowering["graph_cuts"] \
        is False


@pytest.mark.parametrize("verb", ["chain", "run"])
def test_stages_of_other_kernel_choices_are_refused_naming_the_knob(two, verb):
    t, _, _ = two
    args = ["--prompts", "p.txt"] if verb == "chain" else ["--tokens", "1 2 3"]
    p = _kj(verb, "--stages", "mixed", *args, cwd=t)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "exported with different kernel choices (dense_cuda: True against False; " \
           "mlp_tile: '128x128' against '64x256')" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr


def test_a_whole_program_of_other_kernel_choices_is_refused_by_the_chain(two):
    t, _, _ = two
    shutil.copytree(t / "a", t / "otherwhole")
    shutil.rmtree(t / "otherwhole" / "whole")
    shutil.copytree(t / "b" / "whole", t / "otherwhole" / "whole")
    p = _kj("chain", "--stages", "otherwhole", "--prompts", "p.txt", cwd=t)
    assert p.returncode == 2 and "dense_cuda: False against True" in p.stderr, p.stderr


def test_the_head_refuses_a_stage_of_other_kernel_choices(two):
    """The head's check of a joining stage's Hello (its lowering table against its own)."""
    from types import SimpleNamespace

    from kernjax import artifact
    from kernjax.serve.head import Head
    t, _, _ = two
    head = SimpleNamespace(art=artifact.read(t / "a" / "stage0"))
    hello = {"stage": 1, "lowering": _manifest(t / "b" / "stage1")["lowering"],
             "cut": _manifest(t / "b" / "stage1")["cut"]["id"]}
    why = Head._refuse(head, hello, {})
    assert why.startswith("stage 1 and the head (stage 0) were exported with different kernel "
                          "choices (dense_cuda: False against True; "), why


def test_a_bad_knob_is_a_user_error(tmp_path):
    p = _kj("cut", *SMALL, "--out", "x", "--mlp_tile", "32x32", cwd=tmp_path)
    assert p.returncode == 2 and "--mlp_tile" in p.stderr and "Traceback" not in p.stderr
    with pytest.raises(ValueError, match="mlp_tile '32x32': give one of 128x128, 64x256"):
        lowering.Lowering(mlp_tile="32x32")
