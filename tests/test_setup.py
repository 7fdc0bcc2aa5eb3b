"""scripts/setup run again with nothing changed builds nothing: it runs in a copy of the repository's
skeleton whose .venv/bin/python only records how it was called, so these tests see each pip call
the script makes (a real one builds the extension for minutes) and never touch the real .venv."""

from __future__ import annotations

import os
import shutil
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FAKE_PYTHON = """#!/bin/sh
echo "$*" >> "$(dirname "$0")/../../calls.log"
[ ! -e "$(dirname "$0")/../../fail" ]
"""


def _repo(tmp_path):
    """A skeleton of the repository, installed once as far as scripts/setup can tell."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(os.path.join(ROOT, "scripts", "setup"), tmp_path / "scripts" / "setup")
    for name in ("setup.py", "pyproject.toml"):
        shutil.copy(os.path.join(ROOT, name), tmp_path / name)
    (tmp_path / "csrc" / "fa3").mkdir(parents=True)
    for name in ("a.cc", "a.h", "a.cu", "fa3/glue.cu"):
        (tmp_path / "csrc" / name).write_text(f"// {name}\n")
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    for name in ("python", "kernjax"):
        (tmp_path / ".venv" / "bin" / name).write_text(FAKE_PYTHON)
        (tmp_path / ".venv" / "bin" / name).chmod(0o755)
    (tmp_path / "kernjax").mkdir()
    (tmp_path / "kernjax" / "_ffi.cpython-312-x86_64-linux-gnu.so").write_bytes(b"")
    return tmp_path


def _setup(repo, **env):
    """scripts/setup's output and the pip calls it made."""
    before = (repo / "calls.log").read_text() if (repo / "calls.log").exists() else ""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("KERNJAX_", "CUDA_"))}
    p = subprocess.run(["bash", "scripts/setup"], cwd=repo, capture_output=True, text=True,
                       env={**clean, **env}, timeout=60)
    after = (repo / "calls.log").read_text() if (repo / "calls.log").exists() else ""
    return p, after[len(before):].splitlines()


def test_a_second_setup_with_nothing_changed_runs_no_pip_and_says_so(tmp_path):
    repo = _repo(tmp_path)
    p, calls = _setup(repo)
    assert p.returncode == 0, p.stderr
    assert calls[-1] == "-m pip install -q --no-build-isolation -e .[test]", calls
    p, calls = _setup(repo)
    assert p.returncode == 0 and calls == [], (p.stderr, calls)
    assert p.stdout.startswith("kernjax in .venv is up to date"), p.stdout


def test_setup_installs_again_when_what_the_build_reads_changes(tmp_path):
    repo = _repo(tmp_path)
    assert _setup(repo)[0].returncode == 0
    (repo / "csrc" / "fa3" / "glue.cu").write_text("// scripts/fa3 builds it, not setup.py\n")
    assert _setup(repo)[1] == []
    changes = {
        "a header": lambda: (repo / "csrc" / "a.h").write_text("// changed\n"),
        "a new source": lambda: (repo / "csrc" / "b.cu").write_text("// new\n"),
        "pyproject.toml": lambda: (repo / "pyproject.toml").write_text(
            (repo / "pyproject.toml").read_text() + "\n# a change\n"),
        "the extension gone": lambda: next((repo / "kernjax").glob("_ffi*.so")).unlink(),
    }
    for what, change in changes.items():
        change()
        p, calls = _setup(repo)
        assert p.returncode == 0 and any("-e .[test]" in c for c in calls), (what, calls)
        if what == "the extension gone":  # the fake pip builds nothing: put the .so back
            (repo / "kernjax" / "_ffi.cpython-312-x86_64-linux-gnu.so").write_bytes(b"")
        assert _setup(repo)[1] == [], what
    assert any("-e .[test]" in c for c in _setup(repo, KERNJAX_NO_CUDA="1")[1])
    assert _setup(repo, KERNJAX_NO_CUDA="1")[1] == []


def test_a_failed_install_is_tried_again_by_the_next_setup(tmp_path):
    repo = _repo(tmp_path)
    (repo / "fail").touch()
    assert _setup(repo)[0].returncode != 0
    (repo / "fail").unlink()
    p, calls = _setup(repo)
    assert p.returncode == 0 and any("-e .[test]" in c for c in calls), calls
