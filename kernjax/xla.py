"""What every kernjax process sets up before jax makes its backend: one kernel choice per call in
every process of a cut, and compiled programs kept across restarts.

- **Autotuning, shared.** XLA:GPU autotunes each GEMM and fusion by timing candidates, so two
  processes compiling the same call may choose, and round, differently: whole and stages would
  differ. kernjax keeps autotuning (off costs 1.7-6x, docs/bitwise.md) and shares its results:
  XLA's per-fusion autotune cache is one directory per machine (`autotune/` under
  `cache_root()`); the first process to compile a fusion writes its choice, every later one
  reads it, under an exclusive file lock (`compile_lock`). On an H200 (jax 0.11.2) XLA wrote
  nothing there for a 0.6B model's programs, whose processes agreed anyway (docs/bitwise.md).
- **No dot merging.** XLA's dot merger joins GEMMs that share an operand (gate and up; q, k, v)
  below 16 M elements (512 rows, not 8192) over the weights concatenated: a copy of ~100 MB of
  weights per layer and chunk (18 % of an 8k prefill in chunks of 512, docs/bitwise.md), its
  slices copies too across a call boundary. Off: `--xla_disable_hlo_passes=dot-merger`.
- **Compiled programs, kept.** JAX's persistent compilation cache (`jax/` under `cache_root()`)
  holds every program that took over a second to compile: a restarted stage loads it.
- **No CUDA graphs for a program of 1024 rows or more** (`compile_options(rows)`): on an H200 a
  whole 4B model's graphs cost it 1.0 ms at 1k and 1.7-2.2 ms at 8k in one chunk, outside the
  GPU's span, and gained 5.7 ms at 8k in chunks of 512, where the host's issue nears the GPU's
  work (2026-12-02, docs/bitwise.md); serving's programs keep them (SKIP_TEMP, below).
- **Serving: CUDA graphs whose temporaries stay put** (`serving()`, by `kernjax.serve`): XLA
  updates every graph node whose buffers moved before each launch, and the temporaries move every
  call; SKIP_TEMP pins them (XLA's VMM allocator, which keeps no statistics). docs/serving.md.

Each is left alone when the user has set it (`XLA_FLAGS`, `JAX_COMPILATION_CACHE_DIR`).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import sys
from pathlib import Path


def cache_dir() -> Path:
    """kernjax's cache: `$KERNJAX_CACHE`, default `~/.cache/kernjax` (random checkpoints too)."""
    return Path(os.environ.get("KERNJAX_CACHE") or Path.home() / ".cache" / "kernjax")


def cache_root() -> Path:
    """`$KERNJAX_XLA_CACHE`, else `xla/` in `cache_dir()`."""
    if os.environ.get("KERNJAX_XLA_CACHE"):
        return Path(os.environ["KERNJAX_XLA_CACHE"])
    return cache_dir() / "xla"


AUTOTUNE_FLAG = "--xla_gpu_per_fusion_autotune_cache_dir"


def autotune_dir() -> Path:
    """The directory XLA's autotune results go to: the one `XLA_FLAGS` names (a parent's, say,
    inherited), else `autotune/` under `cache_root()`."""
    m = re.search(rf"{AUTOTUNE_FLAG}=(\S+)", os.environ.get("XLA_FLAGS", ""))
    return Path(m.group(1)) if m else cache_root() / "autotune"


def configure() -> None:
    """Sets the XLA flags and the compilation cache; a no-op for what the user set already. What
    a kernjax parent set (`KERNJAX_XLA_SET`, inherited with its environment) is not the user's:
    this process's own cache (`KERNJAX_XLA_CACHE`, say) replaces it."""
    flag, cache = (os.environ.get("KERNJAX_XLA_SET", "") + "\n\n").split("\n")[:2]
    flags = os.environ.get("XLA_FLAGS", "").replace(flag, "")
    if cache and os.environ.get("JAX_COMPILATION_CACHE_DIR") == cache:
        del os.environ["JAX_COMPILATION_CACHE_DIR"]
    flag, cache = "", ""
    if "autotune_cache_dir" not in flags:
        flag = f"{AUTOTUNE_FLAG}={cache_root() / 'autotune'}"
        flags += " " + flag
    if "xla_disable_hlo_passes" not in flags:
        flags += " --xla_disable_hlo_passes=dot-merger"
    os.environ["XLA_FLAGS"] = flags.strip()
    jax = sys.modules.get("jax")  # unimported, it reads the variable: a shell parses flags first
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        pass
    elif jax is None:
        cache = os.environ["JAX_COMPILATION_CACHE_DIR"] = str(cache_root() / "jax")
    elif jax.config.jax_compilation_cache_dir is None:
        jax.config.update("jax_compilation_cache_dir", str(cache_root() / "jax"))
    os.environ["KERNJAX_XLA_SET"] = f"{flag}\n{cache}"


GRAPHS_BELOW_ROWS = 1024  # a 4B model on an H200 (above); a smaller model's crossover lies higher


def compile_options(rows: int) -> dict:
    """No CUDA graphs on a GPU from `GRAPHS_BELOW_ROWS` rows an item, unless XLA_FLAGS chose."""
    import jax
    if (jax.default_backend() != "gpu" or rows < GRAPHS_BELOW_ROWS
            or "command_buffer" in os.environ.get("XLA_FLAGS", "")):
        return {}
    return {"xla_gpu_enable_command_buffer": ""}


def serving() -> None:
    """CUDA graphs whose temporaries stay put (see above); before jax makes its backend."""
    if "command_buffer_update_mode" not in (flags := os.environ.get("XLA_FLAGS", "")):
        os.environ["XLA_FLAGS"] = f"{flags} --xla_gpu_command_buffer_update_mode=SKIP_TEMP".strip()


@contextlib.contextmanager
def compile_lock():
    """Held while compiling on a GPU: one process at a time times and records new fusions."""
    import jax

    if jax.default_backend() != "gpu":
        yield
        return
    d = autotune_dir()
    d.mkdir(parents=True, exist_ok=True)
    with open(d / ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
