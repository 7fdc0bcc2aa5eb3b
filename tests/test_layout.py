"""The layout's contracts, checked on the source: no import circle anywhere in the house, a pure
core, a library that never reaches into the command line, and a stage host that runs with no
model code importable."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

from tests.serving import HTTP, until

ROOT = Path(__file__).resolve().parent.parent


def _modules() -> dict[str, Path]:
    """Every module of the house by dotted name: kernjax/ and models/ (`kernjax.models`)."""
    out = {}
    for base, pkg in ((ROOT / "kernjax", "kernjax"), (ROOT / "models", "kernjax.models")):
        for p in base.rglob("*.py"):
            parts = list(p.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([pkg, *parts])] = p
    return out


def _main_block(node) -> bool:
    return (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
            and getattr(node.test.left, "id", None) == "__name__")


def _imports(name: str, path: Path, known) -> set[str]:
    """The house's modules `name` imports anywhere (functions too), but under
    `if __name__ == "__main__":`, which runs only as a program, never as an import."""
    tree = ast.parse(path.read_text())
    skip = {id(n) for b in ast.walk(tree) if _main_block(b) for n in ast.walk(b)}
    pkg = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    got = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            got |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = pkg.split(".")
                base = ".".join(up[:len(up) - node.level + 1] + ([base] if base else []))
            got.add(base)
            got |= {f"{base}.{a.name}" for a in node.names}
    # a module imports its packages' __init__ too; only the house's modules count
    return {m for m in got if m in known and m != name}


def _graph():
    mods = _modules()
    return {n: _imports(n, p, mods) for n, p in mods.items()}


def _cycles(graph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), or self-loops."""
    index, low, stack, on, out, n = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = n[0]
        n[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while (w := stack.pop()) != v:
                on.discard(w)
                comp.append(w)
            on.discard(v)
            comp.append(v)
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_circle_among_the_houses_modules():
    graph = _graph()
    assert "kernjax.core.cut" in graph and "kernjax.models.qwen3" in graph
    assert _cycles(graph) == []


def test_the_cycle_check_finds_a_circle():
    """The check itself: a circle of three made by hand is found."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_core_imports_only_the_core():
    """core/ is pure: no device, file, flag or clock: it imports no other part of the house and
    none of the modules that reach the world."""
    graph = _graph()
    world = {"os", "time", "absl", "absl.flags", "pathlib", "subprocess", "socket", "shutil"}
    for name, path in _modules().items():
        if not name.startswith("kernjax.core."):
            continue
        others = {m for m in graph[name] if not m.startswith("kernjax.core")}
        assert not others, f"{name} imports {sorted(others)}"
        tree = ast.parse(path.read_text())
        used = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        used |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert not used & world, f"{name} imports {sorted(used & world)}"


def test_the_library_never_imports_the_command_line():
    graph = _graph()
    bad = {n: sorted(m for m in deps if m.startswith("kernjax.cli"))
           for n, deps in graph.items() if not n.startswith("kernjax.cli")
           and n not in ("kernjax.__main__", "kernjax.cut")}
    assert not any(bad.values()), {n: d for n, d in bad.items() if d}


def test_kernels_and_models_reach_no_runtime_serve_or_cli():
    graph = _graph()
    for name, deps in graph.items():
        if name.startswith(("kernjax.kernels", "kernjax.models")):
            bad = [m for m in deps if m.startswith(("kernjax.runtime", "kernjax.serve",
                                                    "kernjax.cli", "kernjax.artifact"))]
            assert not bad, f"{name} imports {bad}"


NO_MODELS = """
import sys
class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name == "kernjax.models" or name.startswith("kernjax.models."):
            raise ImportError(f"{name}: a stage host imports no model code")
        return None
sys.meta_path.insert(0, Refuse())
from kernjax.cli import main
main(sys.argv[1:])
"""


def test_a_cut_runs_chains_and_serves_with_the_model_code_unimportable(tmp_path):
    """A cut of a checkpoint (its derive program in the artifact: qwen3 fuses q, k and v at
    load) runs, chains and serves one request with `kernjax.models` refused at import."""
    py = [sys.executable, "-m", "kernjax"]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    run = lambda *a: subprocess.run([*py, *a], cwd=tmp_path, capture_output=True, text=True,  # noqa: E731
                                    env=env, timeout=300)
    assert run("weights", "random", "--model", "qwen3-tiny", "--out", "ck").returncode == 0
    p = run("cut", "--weights", "ck", "--at", "2", "--out", "st", "--chunk", "16",
            "--context", "64", "--decode", "1")
    assert p.returncode == 0, p.stderr
    assert json.loads((tmp_path / "st" / "stage0" / "manifest.json").read_text())["derive"][
        "recipes"], "qwen3's fused qkv is derived at load"
    (tmp_path / "p.txt").write_text("1 2 3\n" + " ".join(map(str, range(40))) + "\n")
    blocked = lambda *a: subprocess.run([sys.executable, "-c", NO_MODELS, *a], cwd=tmp_path,  # noqa: E731
                                        capture_output=True, text=True, env=env, timeout=300)
    p = blocked("chain", "--stages", "st", "--prompts", "p.txt")
    assert p.returncode == 0 and "PASS: 2 prompts bitwise identical" in p.stdout, p.stderr
    p = blocked("run", "--stages", "st", "--tokens", "5 6 7")
    assert p.returncode == 0 and "first token" in p.stdout, p.stderr
    probe = blocked("run", "--model", "qwen3-tiny", "--tokens", "5")  # the probe refuses models
    assert probe.returncode != 0 and "a stage host imports no model code" in probe.stderr
    log = tmp_path / "serve.log"
    with log.open("w") as out:  # on a port it picks (--port 0), which its log names
        server = subprocess.Popen([sys.executable, "-c", NO_MODELS, "serve", "--stage_dir",
                                   "st/whole", "--port", "0"], cwd=tmp_path, env=env, stdout=out,
                                  stderr=subprocess.STDOUT)
    try:
        assert until(lambda: "serving" in log.read_text() or server.poll() is not None, 240) \
            and server.poll() is None, log.read_text()
        url = f"http://127.0.0.1:{HTTP.search(log.read_text()).group(1)}/v1/completions"
        body = json.dumps({"prompt": [5, 6, 7], "max_tokens": 1}).encode()
        req = urllib.request.Request(url, body, {"Content-Type": "application/json"})
        answer = json.loads(urllib.request.urlopen(req, timeout=60).read())
        assert len(answer["choices"]) == 1, answer
    finally:
        server.kill()
        server.wait()
