"""The command-line shells as a user meets them, through subprocesses: --help, messages and exit
codes, re-cutting into the same --out, Ctrl-C. Independent commands run four at a time."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from kernjax import models, weights

MODEL = "qwen3-tiny"
SMALL = ["--chunk", "16", "--context", "64", "--decode", "1"]  # one decode program: quicker cuts


def _cli(*args, cwd):
    return subprocess.run([sys.executable, "-m", "kernjax", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=300)


@contextlib.contextmanager
def _popen(args, cwd):
    """A process with its stdout and stderr piped; killed and reaped at the end, whatever the
    test did."""
    p = subprocess.Popen(args, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        yield p
    finally:
        if p.poll() is None:
            p.kill()
        p.communicate()


def _readline(p, seconds: float = 120) -> str:
    """The next line of `p`'s stdout ("" at its end); an AssertionError (with its stderr) if none
    comes within `seconds`."""
    got = []
    reader = threading.Thread(target=lambda: got.append(p.stdout.readline()), daemon=True)
    reader.start()
    reader.join(seconds)
    if not got:
        p.kill()
        raise AssertionError(f"no line within {seconds} s; stderr: {p.stderr.read()}")
    return got[0]


def _all(cmds: dict, cwd) -> dict:
    with ThreadPoolExecutor(4) as ex:
        futs = {k: ex.submit(_cli, *args, cwd=cwd) for k, args in cmds.items()}
        return {k: f.result() for k, f in futs.items()}


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """A 3-stage cut re-cut into 2 stages in `st/`, a cut `sw/` of a checkpoint since moved, a
    checkpoint of another model, a foreign directory; cwd for every command below."""
    t = tmp_path_factory.mktemp("cli")
    weights.write_random(MODEL, seed=0, dtype="bfloat16", out=t / "ck", progress=False)
    weights.write_random(MODEL, seed=0, dtype="bfloat16", out=t / "ck2", progress=False)
    made = _all({"three": ["cut", "--model", MODEL, "--at", "c1,2", "--out", "st", *SMALL],
                 "sw": ["cut", "--weights", "ck", "--at", "2", "--out", "sw", *SMALL],
                 "sw2": ["cut", "--weights", "ck2", "--at", "2", "--out", "sw2", *SMALL],
                 "s1": ["cut", "--model", MODEL, "--seed", "1", "--at", "2", "--out",
                        "s1", *SMALL]}, t)
    made["two"] = _cli("cut", "--model", MODEL, "--at", "2", "--out", "st", *SMALL, cwd=t)
    for p in made.values():
        assert p.returncode == 0, p.stderr
    (t / "ck").rename(t / "moved")
    shutil.copytree(t / "moved", t / "other")
    conf = json.loads((t / "other" / "config.json").read_text())
    (t / "other" / "config.json").write_text(json.dumps({**conf, "intermediate_size": 256}))
    for name in ("badcfg", "trunc", "badtok", "untied"):  # damaged copies of the checkpoint
        shutil.copytree(t / "moved", t / name)
    (t / "untied" / "config.json").write_text(json.dumps({**conf, "tie_word_embeddings": False}))
    (t / "badcfg" / "config.json").write_text(json.dumps({**conf, "hidden_size": "64"}))
    with open(t / "trunc" / "model.safetensors", "r+b") as f:
        f.truncate(3000)
    (t / "badtok" / "tokenizer.json").write_text("")
    shutil.copytree(t / "st", t / "badman")
    man = json.loads((t / "badman" / "stage1" / "manifest.json").read_text())
    (t / "badman" / "stage1" / "manifest.json").write_text(json.dumps(
        {k: v for k, v in man.items() if k != "cut"}))
    shutil.copytree(t / "st", t / "oldjax")
    (t / "oldjax" / "stage1" / "manifest.json").write_text(json.dumps({**man, "jax": "0.0.1"}))
    # ck2 rewritten with seed 1 after sw2 was cut from it; mixed: st's stage0 and whole, s1's stage1
    weights.write_random(MODEL, seed=1, dtype="bfloat16", out=t / "seed1", progress=False)
    (t / "seed1" / "model.safetensors").replace(t / "ck2" / "model.safetensors")
    shutil.copytree(t / "st", t / "mixed")
    shutil.rmtree(t / "mixed" / "stage1")
    shutil.copytree(t / "s1" / "stage1", t / "mixed" / "stage1")
    (t / "nonutf8.flags").write_bytes(b"--tokens=1\xff\n")
    (t / "foreign").mkdir()
    (t / "foreign" / "config.json").write_text("{}")
    (t / "one.txt").write_text("7\n")
    calls = models.named(MODEL)[0].program(models.named(MODEL)[1], dtype="float32", rows=64,
                                           context=256).calls
    (t / "prof.json").write_text(json.dumps({"model": MODEL, "rows": 64, "calls": [
        {"name": c, "ms": 15.0 if c == "embed" else 1.0} for c in calls]}))
    return t, made


def test_recut_replaces_the_previous_cut(work):
    t, made = work
    assert "(`embed` .. `embed`, 1 call)" in made["three"].stdout
    assert "writing st/stage0 (1 call, 3 programs)\n" in made["three"].stderr
    assert sorted(os.listdir(t / "st")) == ["stage0", "stage1", "whole"]
    assert "replacing the previous cut in st: stage0/, stage1/, stage2/, whole/" in \
        made["two"].stderr
    assert "wrote 2 stages and whole/ to st" in made["two"].stdout


HELP = {
    "kernjax": ["--model: the named model to cut: ", "qwen3-tiny-gqa5 (default: qwen3-tiny)",
                "--chunk: rows per chunk (default: 64)", "--out"],
    "cut": ["--at", "--out", "--model", "--weights", "--dtype", "--seed",
                    "--chunk: rows per run of the program (default: 512)", "(required)"],
    "run": ["--prompt", "--tokens", "--stages", "--model", "--weights", "--save"],
    "chain": ["--stages", "--prompts", "--chunk", "--weights"],
    "weights": ["kernjax weights random", "--model", "--out", "--seed"],
    "serve": ["--stage_dir", "--model", "--weights", "--dtype", "--seed", "--port",
                      "--log_dir", "--log_file", "at least 64 and at most 4096"],
    "timeline": ["--png", "--first", "--last"],
}


def test_help_lists_each_commands_own_flags(tmp_path):
    cmds = {m: [m if m != "kernjax" else "demo", "--help"] for m in HELP}
    cmds["short"] = ["weights", "--helpshort"]
    got = _all(cmds, tmp_path)
    for m, p in got.items():
        assert p.returncode == 0 and "flags:" in p.stdout, (m, p.stdout, p.stderr)
        assert "Try --helpfull" not in p.stdout + p.stderr and "--logtostderr" not in p.stdout, m
        for word in HELP.get(m, HELP["weights"]):
            assert word in p.stdout, (m, word, p.stdout)


def test_every_verbs_help_starts_with_its_usage_and_a_paragraph(tmp_path):
    """`kernjax VERB --help` and `python -m kernjax VERB --help` both open with `Usage: kernjax
    VERB` and a paragraph before the flags (serve's once opened with `flags:`, and under
    `python -m` with the docstring of kernjax/__main__.py)."""
    from kernjax.cli import VERBS
    script = os.path.join(os.path.dirname(sys.executable), "kernjax")
    assert os.path.isfile(script), f"no `kernjax` command beside {sys.executable}"
    cmds = {(how, v): ([script] if how == "script" else [sys.executable, "-m", "kernjax"]) +
            [v, "--help"] for how in ("script", "-m") for v in VERBS}
    with ThreadPoolExecutor(4) as ex:
        got = dict(zip(cmds, ex.map(lambda c: subprocess.run(
            c, capture_output=True, text=True, cwd=tmp_path, timeout=300), cmds.values())))
    for (how, verb), p in got.items():
        assert p.returncode == 0, (how, verb, p.stderr)
        usage, paragraph, *_ = p.stdout.split("\n\n")
        assert usage.startswith(f"Usage: kernjax {verb} "), (how, verb, p.stdout)
        assert paragraph.strip() and not paragraph.startswith("flags:"), (how, verb, p.stdout)


def test_model_flags_list_the_named_models_and_so_does_the_readme(tmp_path):
    """The --model flag of cut, run, serve, weights and demo lists every named model of the
    registry, and the README's sentence on the named models names exactly those."""
    got = _all({v: [v, "--help"] for v in ("cut", "run", "serve", "weights", "demo")}, tmp_path)
    for verb, p in got.items():
        help_ = " ".join(re.search(r"^  --model: (.*?)(?=^  --)", p.stdout, re.M | re.S)
                         .group(1).split())
        assert all(n in re.findall(r"[\w.-]+", help_) for n in models.names()), (verb, help_)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    readme = " ".join(open(os.path.join(root, "README.md"), encoding="utf-8").read().split())
    sentence = re.search(r"The named models .*?\.(?= )", readme).group(0)
    assert set(re.findall(r"`(\w[\w.-]*)`", sentence)) == set(models.names()), sentence


def test_kernjax_help_lists_the_verbs_and_an_unknown_verb_is_refused(tmp_path):
    from kernjax.cli import VERBS
    got = _all({"help": ["--help"], "bad": ["cutt", "--model", MODEL]}, tmp_path)
    assert got["help"].returncode == 0
    assert all(f"  {v} " in got["help"].stdout for v in VERBS), got["help"].stdout
    assert got["bad"].returncode == 2 and got["bad"].stderr.startswith(
        "error: `cutt` is not a verb of kernjax; the verbs are cut, run,"), got["bad"].stderr


REFUSALS = {
    "layers_out_of_order": (["cut", "--model", MODEL, "--at", "2,1", "--out", "x"],
                            "--at 2,1: layer 2 (call 26) and layer 1 (call 14) are not increasing"),
    "at_zero": (["cut", "--model", MODEL, "--at", "0", "--out", "x"],
                "--at 0: a cut before layer 0 leaves stage 0 without a layer; cut at a layer from "
                "1 to 3"),
    "foreign_out": (["cut", "--model", MODEL, "--at", "2", "--out", "foreign"],
                    "--out `foreign` holds config.json, which `kernjax cut` did not write"),
    "empty_tokens": (["run", "--model", MODEL, "--tokens", ""], "the prompt is empty"),
    "empty_prompt": (["run", "--model", MODEL, "--prompt", ""], "the prompt is empty"),
    "no_source": (["run", "--tokens", "5"], "no model given: pass --stages DIR"),
    "no_source_serve": (["serve"], "no model given: pass --stage_dir DIR"),
    "stages_too_low": (["run", "--stages", "st/stage0", "--tokens", "5"],
                       "`st/stage0` is one stage; --stages takes the cut directory that holds "
                       "it: `st`"),
    "stages_too_high": (["run", "--stages", ".", "--tokens", "5"],
                        "`.` holds no stage0/ .. directories; it holds cuts: pass one of "
                        "`badman`, `mixed`, `oldjax`, `s1`, `st`, `sw`, `sw2`"),
    "stages_missing": (["run", "--stages", "nowhere", "--tokens", "5"],
                       "--stages `nowhere` does not exist"),
    "weights_missing": (["run", "--weights", "nowhere", "--tokens", "5"],
                        "nowhere` does not exist"),
    "decode_bucket_missing": (["serve", "--stage_dir", "st/stage0", "--decode_bucket", "4",
                               "--port", "0"],
                              "--decode_bucket 4: the program's decode buckets are 1; give one "
                              "of them (`kernjax cut --decode` sets a cut's)"),
    "stage_dir_too_high": (["serve", "--stage_dir", "st"],
                           "`st` holds a cut, not one stage: name one of its stages, `st/stage0`"),
    "prompts_missing": (["chain", "--stages", "st", "--prompts", "nowhere"],
                        "--prompts `nowhere` does not exist"),
    "checkpoint_gone": (["run", "--stages", "sw", "--tokens", "5"],
                        "ck`, recorded by `sw/stage0` when it was cut, does not exist any more; "
                        "pass --weights"),
    "other_model": (["run", "--stages", "sw", "--weights", "other", "--tokens", "5"],
                    "checkpoint `other` is another model than the stages were cut for: "
                    "intermediate_size 256 (the stages: 128)"),
    "wrong_verb": (["weights", "randm", "--model", MODEL, "--out", "w"],
                   "the verb is random"),
    "no_verb": (["weights", "--model", MODEL, "--out", "w/"],
                "error: `kernjax weights` needs its verb, random: run `kernjax weights random "
                "--model qwen3-tiny --out w/`\n"),
    "wrong_verb_echoed": (["weights", "--seed", "2", "randm", "--model", MODEL, "--out", "w"],
                          "the verb is random: run `kernjax weights random --seed 2 --model "
                          "qwen3-tiny --out w`\n"),
    "tokens_other_digits": (["run", "--model", MODEL, "--tokens", "1 ١ 3"],
                            "--tokens `1 ١ 3`: `١` is not a token id; give token ids"),
    "zero_chunk": (["cut", "--model", MODEL, "--at", "1", "--out", "z", "--chunk", "0",
                    "--pages", "1"], "--chunk 0 must be at least 1; --pages 1 must be at least 2"),
    "slots_on_paged": (["cut", "--model", MODEL, "--at", "1", "--out", "z", "--slots",
                        "5"], "--slots: qwen3-tiny has no per-sequence states"),
    # damaged inputs
    "untied_without_head": (["cut", "--weights", "untied", "--at", "2", "--out", "z"],
                            "tensor `lm_head.weight` is missing from `"),
    "cut_config_contradicts": (["cut", "--weights", "other", "--at", "2", "--out", "z"],
                               "tensor `model.layers.0.mlp.gate_proj.weight` has shape [128, 64]; "
                               "the model expects [256, 64]"),
    "config_types": (["run", "--weights", "badcfg", "--tokens", "1"],
                     "config.json` gives hidden '64': sizes are integers"),
    "safetensors_cut_short": (["run", "--weights", "trunc", "--tokens", "1"],
                              "is not a safetensors file this reader can read"),
    "tokenizer_broken": (["run", "--weights", "badtok", "--prompt", "Hi"],
                         "is not a tokenizer the tokenizers library reads"),
    "manifest_field": (["run", "--stages", "badman", "--tokens", "1"],
                       "stage1/manifest.json` is malformed (KeyError: 'cut')"),
    "manifest_jax": (["run", "--stages", "oldjax", "--tokens", "1"],
                     "stage1` was exported by jax 0.0.1; this is jax"),
    "chunk_huge": (["cut", "--model", MODEL, "--at", "1", "--out", "z", "--chunk",
                    "10000000000000"], "--chunk 10000000000000 must be at least 1 and below 2^31"),
    "run_chunk_negative": (["run", "--model", MODEL, "--chunk", "-1", "--tokens", "1"],
                           "-1 is not an integer in the range [1, 2147483647]"),
    # absl's own flag parsing: a missing, malformed or unknown flag
    "flag_missing": (["cut", "--model", MODEL], "--at is required; --out is required"),
    "flag_malformed": (["cut", "--model", MODEL, "--at", "1", "--out", "z", "--chunk",
                        "abc"], "flag --chunk=abc: invalid literal"),
    "flag_unknown": (["serve", "--model", MODEL, "--transprot", "ipc"],
                     "Unknown command line flag 'transprot'. Did you mean: transport"),
    "flagfile_missing": (["cut", "--flagfile=missing.flags", "--out", "x"],
                         "error: Unable to open flagfile: [Errno 2] No such file"),
    "flagfile_not_utf8": (["run", "--flagfile=nonutf8.flags", "--model", MODEL],
                          "a --flagfile is not UTF-8 text (invalid start byte at byte 10)"),
    "seed_negative": (["cut", "--model", MODEL, "--seed", "-1", "--at", "2", "--out",
                       "x"], "flag --seed=-1: -1 is not"),
    "prompt_not_utf8": (["run", "--model", MODEL, "--prompt", "ab\udcffcd"],
                        "--prompt is not UTF-8 text (byte 2); pass UTF-8, or --tokens"),
    "save_nowhere": (["run", "--model", MODEL, "--tokens", "5", "--save", "no/dir/x"],
                     "--save no/dir/x: cannot write `no/dir/x.npz` (No such file or directory)"),
    "stages_of_two_checkpoints": (["run", "--stages", "mixed", "--tokens", "5"],
                                  "`mixed/stage1` was cut from random qwen3-tiny (seed 1, "
                                  "bfloat16), `mixed/stage0` from random qwen3-tiny (seed 0, "
                                  "bfloat16) (or it changed in between): one pipeline runs one "
                                  "checkpoint"),
    "chain_of_two_checkpoints": (["chain", "--stages", "mixed", "--prompts", "one.txt"],
                                 "`mixed/stage1` was cut from random qwen3-tiny (seed 1"),
    "checkpoint_changed": (["run", "--stages", "sw2", "--tokens", "5"],
                           "ck2` holds other tensors than when `sw2/stage0` was cut from it; "
                           "pass --weights"),
    "auto_without_profile": (["cut", "--model", MODEL, "--at", "auto", "--out", "z"],
                             "--at auto needs --profile FILE: per-call times from `python -m "
                             "experiments.calls --model qwen3-tiny --rows 512 --out FILE`, run "
                             "from the root of a kernjax clone"),
    "auto_other_rows": (["cut", "--model", MODEL, "--at", "auto", "--out", "z",
                         "--profile", "prof.json", "--chunk", "32"],
                        "times qwen3-tiny at 64 rows; this cut is qwen3-tiny at 32"),
}
WORKS = {
    # Even periods would cut at c19, between l1.kv_write and l1.attn, which splits kv.1: refused,
    # so the next best, c18.
    "auto_two": (["cut", "--model", MODEL, "--at", "auto", "--profile", "prof.json",
                  "--chunk", "64", "--context", "256", "--out", "auto"],
                 "--at auto: c18 (`l1.kv_write`); stage periods 32.000, 34.000 ms by the profile, "
                 "the longest 1.030 of even"),
    "chain_one": (["chain", "--stages", "st", "--prompts", "one.txt"],
                  "prompt 0: 1 token, 1 chunk, 4 decode steps: IDENTICAL\n"
                  "PASS: 1 prompt bitwise identical"),
    "text_on_random_weights": (["run", "--model", MODEL, "--prompt", "Hello"],
                               "prompt: 1 token; first token: "),
    "save_adds_npz": (["run", "--model", MODEL, "--tokens", "5", "--save", "last"],
                      "saved logits and token to last.npz"),
    "moved_with_weights": (["run", "--stages", "sw", "--weights", "moved", "--tokens",
                            "5 6"], "prompt: 2 tokens; first token: "),
}


@pytest.fixture(scope="module")
def ran(work):
    return _all({k: v[0] for k, v in {**REFUSALS, **WORKS}.items()}, work[0])


@pytest.mark.parametrize("name", REFUSALS)
def test_refusals_are_one_message_and_status_2(ran, work, name):
    p = ran[name]
    assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
    assert REFUSALS[name][1] in p.stderr, p.stderr
    assert "Traceback" not in p.stderr and "error: " in p.stderr, p.stderr
    assert (work[0] / "foreign" / "config.json").is_file() and not (work[0] / "x").exists()


@pytest.mark.parametrize("name", WORKS)
def test_commands_that_work_say_so_in_agreeing_words(ran, name):
    p = ran[name]
    assert p.returncode == 0, p.stderr
    assert WORKS[name][1] in p.stdout, p.stdout


def test_ctrl_c_is_one_line_and_status_130(work):
    """Interrupted while it reads its prompts (a FIFO nobody writes), chain says one line."""
    t = work[0]
    os.mkfifo(t / "fifo")
    with _popen([sys.executable, "-m", "kernjax", "chain", "--stages", "st", "--prompts", "fifo"],
                t) as p:
        deadline = time.monotonic() + 120
        while True:  # opening the write end succeeds once chain has opened the read end
            try:
                fd = os.open(t / "fifo", os.O_WRONLY | os.O_NONBLOCK)
                break
            except OSError:
                assert time.monotonic() < deadline and p.poll() is None, p.stderr.read()
                time.sleep(0.05)
        try:
            p.send_signal(2)
            out, err = p.communicate(timeout=60)
        finally:
            os.close(fd)
    assert p.returncode == 130 and err == "interrupted\n", (p.returncode, out, err)


SWALLOWS = """
import sys, time
from kernjax.cli import shell
def main_def():
    def main():
        print("ready", flush=True)
        while True:  # as a JAX GC callback does: the KeyboardInterrupt raised in it is lost
            try:
                time.sleep(0.05)
            except KeyboardInterrupt:
                pass
    return main
shell.run(main_def)
"""


def test_ctrl_c_ends_the_command_even_when_its_interrupt_is_swallowed(tmp_path):
    """Ctrl-C during a cut was lost once in five tries (the KeyboardInterrupt raised inside a
    JAX GC callback): a command ends within `shell.STOP_GRACE` seconds all the same."""
    with _popen([sys.executable, "-c", SWALLOWS], tmp_path) as p:
        assert _readline(p) == "ready\n"
        p.send_signal(2)
        # it ends (after STOP_GRACE, 5 s): swallowed for good, it would run on past the 60 s
        out, err = p.communicate(timeout=60)
    assert p.returncode == 130 and err == "interrupted\n", (p.returncode, out, err)


SWALLOWED_IN_CUT = """
import sys, time
from kernjax.cli import main
from kernjax import artifact as stage
real = stage._write
def write(path, st, **kw):
    real(path, st, **kw)
    if (next(iter(st.values())) if isinstance(st, dict) else st).index == 1:
        # stage1/ written, whole/ not yet: a KeyboardInterrupt here is lost
        print("ready", flush=True)
        while True:
            try:
                time.sleep(0.05)
            except KeyboardInterrupt:
                pass
stage._write = write
main(["cut", "--model", "qwen3-tiny", "--at", "2", "--out", "x", "--chunk", "16", "--context", "64"])
"""


def test_a_cut_whose_interrupt_is_swallowed_leaves_no_stage_and_the_next_cut_works(tmp_path):
    """Stages are written into a temporary directory inside --out and renamed into place only
    when all are written: a cut ended half-way (its interrupt lost in a JAX callback, then the
    process ended by the grace timer) leaves no stage directory, and the next cut clears the
    temporary one."""
    with _popen([sys.executable, "-c", SWALLOWED_IN_CUT], tmp_path) as p:
        while (line := _readline(p)) != "ready\n":
            assert line, p.stderr.read()
        assert [n for n in os.listdir(tmp_path / "x") if not n.startswith(".cut-")] == []
        half = [n for n in os.listdir(tmp_path / "x") if n.startswith(".cut-")]
        assert len(half) == 1 and "stage1" in os.listdir(tmp_path / "x" / half[0]), half
        p.send_signal(2)
        out, err = p.communicate(timeout=60)
    assert p.returncode == 130 and err.endswith("interrupted\n"), (p.returncode, out, err)
    assert [n for n in os.listdir(tmp_path / "x") if not n.startswith(".cut-")] == []
    again = _cli("cut", "--model", MODEL, "--at", "2", "--out", "x", *SMALL, cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    # the next cut cleared the temporary directory and wrote every stage
    assert sorted(os.listdir(tmp_path / "x")) == ["stage0", "stage1", "whole"], \
        os.listdir(tmp_path / "x")
    assert "wrote 2 stages and whole/ to x" in again.stdout, again.stdout
    from kernjax import artifact
    arts = [artifact.read(tmp_path / "x" / d) for d in ("stage0", "stage1", "whole")]  # verified
    assert [(a.index, a.stages) for a in arts] == [(0, 2), (1, 2), (0, 1)]


def test_a_cut_that_fails_while_writing_leaves_a_directory_the_next_cut_takes(tmp_path,
                                                                            monkeypatch, capsys):
    """A stage whose export fails (as k3's did once on a GPU) or Ctrl-C: what the cut wrote
    goes, and cutting again into the same --out works."""
    from kernjax import artifact as artifacts
    from kernjax.core.cut import cut, whole
    from kernjax.core.item import item_shape
    fam, cfg = models.named(MODEL)
    program = fam.program(cfg, dtype="float32", rows=16, context=64)
    stages = (*cut(program, [20]), whole(program))
    meta = dict(model=artifacts.model_meta(fam, cfg), checkpoint={"model": MODEL, "seed": 0,
                "dtype": "float32"}, dtype="float32", item=item_shape(program, fam.page(cfg)))
    real = artifacts._write

    def fails_on_stage1(path, st, **kw):
        if st.index != 1:
            return real(path, st, **kw)
        path.mkdir()
        (path / "program.jaxexport").write_bytes(b"half")  # as a failing export leaves it
        raise RuntimeError("export failed")

    monkeypatch.setattr(artifacts, "_write", fails_on_stage1)
    with pytest.raises(RuntimeError, match="export failed"):
        artifacts.write_cut(tmp_path, stages, meta)
    assert os.listdir(tmp_path) == []
    monkeypatch.setattr(artifacts, "_write", real)
    assert artifacts.previous_cut(tmp_path) == []
    artifacts.write_cut(tmp_path, stages, meta)
    assert sorted(os.listdir(tmp_path)) == ["stage0", "stage1", "whole"]


def test_every_flag_the_docs_show_a_command_with_exists(tmp_path):
    """README.md, docs/*.md and experiments/README.md show `kernjax VERB ... --flag`, `python -m
    kernjax.<module> ... --flag`, `python -m experiments.<name> ... --flag` and
    `experiments/<name>.py ... --flag` (the benchmark `experiments.<name>`): each command knows
    each flag its lines use (docs that match the code)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    docs = [os.path.join(root, "README.md"), os.path.join(root, "experiments", "README.md")] + [
        os.path.join(root, "docs", f) for f in sorted(os.listdir(os.path.join(root, "docs")))
        if f.endswith(".md")]
    used: dict[tuple, set] = {}
    for path in docs:
        for line in open(path, encoding="utf-8"):
            for m in re.finditer(r"\bkernjax (cut|run|chain|serve|weights|timeline|demo)\b|"
                                 r"python -m (kernjax(?:\.\w+)+|experiments\.\w+)|"
                                 r"\bexperiments/(\w+)\.py", line):
                verb, module, path = m.groups()
                cmd = ("-m", "kernjax", verb) if verb else ("-m", module or f"experiments.{path}")
                tail = re.match(r"[^`#|]*", line[m.end():]).group(0)
                used.setdefault(cmd, set()).update(re.findall(r"[\s[]--(\w+)", tail))
    assert {("-m", "kernjax", "cut"), ("-m", "kernjax", "serve")} <= set(used), used
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}

    def help_of(cmd):  # the benchmarks parse with argparse (peritem with absl: --help is its own)
        flag = "--help" if cmd[1].startswith("experiments") else "--helpfull"
        return subprocess.run([sys.executable, *cmd, flag], capture_output=True, text=True,
                              cwd=tmp_path, env=env, timeout=300).stdout

    with ThreadPoolExecutor(4) as ex:
        helps = dict(zip(used, ex.map(help_of, used)))

    def listed(flag, text):  # a boolean's --noX is its --[no]X; every absl program has --help
        bare = flag[2:] if flag.startswith("no") else None
        return flag in ("help", "helpfull") or re.search(rf"^\s+--(\[no\])?{flag}\b", text, re.M) \
            or (bare and re.search(rf"^\s+--\[no\]{bare}\b", text, re.M))

    missing = {" ".join(cmd): sorted(f for f in flags if not listed(f, helps[cmd]))
               for cmd, flags in used.items()}
    assert not any(missing.values()), missing
