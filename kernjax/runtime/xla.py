"""What every kernjax process sets up before jax makes its backend: one kernel choice per call in
every process of a cut, and compiled programs kept across restarts.

- **One GEMM choice in every process, untimed.** XLA:GPU picks each cuBLASLt GEMM's algorithm
  by timing candidates, and two processes compiling the same call pick differently (on an H200,
  jax 0.11.2: one or two of a 4B model's four GEMMs at 512 rows in each of three pairs,
  `experiments/autotune.py`), so whole and stages could differ.
  `--xla_gpu_exclude_nondeterministic_ops=true` makes its autotuner take each GEMM's first
  candidate (cuBLASLt's own heuristic) without timing: the same in every process and on every
  host, 3 s less to compile. Timed choices shared through JAX's cache (XLA's per-fusion autotune
  directory in it, one compile at a time) measured within run-to-run spread of these over the
  prefill table and hold on one host only (docs/bitwise.md, item 3).
- **No dot merging.** XLA's dot merger joins GEMMs that share an operand (gate and up; q, k, v)
  below 16 M elements (512 rows, not 8192) over the weights concatenated: a copy of ~100 MB of
  weights per layer and chunk (18 % of an 8k prefill in chunks of 512, docs/bitwise.md), its
  slices copies too across a call boundary. Off: `--xla_disable_hlo_passes=dot-merger`.
- **Compiled programs, kept.** JAX's persistent compilation cache (`jax/` under `cache_root()`)
  holds every program (JAX's default keeps those over 1 s only): a restarted stage loads it.
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

import os
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


UNTIMED = "--xla_gpu_exclude_nondeterministic_ops=true"


def configure() -> None:
    """Sets the XLA flags and the compilation cache; a no-op for what the user set already. The
    cache a kernjax parent set (`KERNJAX_XLA_SET`, inherited with its environment) is not the
    user's: this process's own (`KERNJAX_XLA_CACHE`, say) replaces it."""
    if (inherited := os.environ.get("KERNJAX_XLA_SET")) and \
            os.environ.get("JAX_COMPILATION_CACHE_DIR") == inherited:
        del os.environ["JAX_COMPILATION_CACHE_DIR"]
    flags = os.environ.get("XLA_FLAGS", "")
    flags += "" if "exclude_nondeterministic_ops" in flags else " " + UNTIMED
    flags += "" if "xla_disable_hlo_passes" in flags else " --xla_disable_hlo_passes=dot-merger"
    os.environ["XLA_FLAGS"] = flags.strip()
    jax, cache = sys.modules.get("jax"), ""  # unimported, jax reads the variable
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        pass
    elif jax is None:
        cache = os.environ["JAX_COMPILATION_CACHE_DIR"] = str(cache_root() / "jax")
    elif jax.config.jax_compilation_cache_dir is None:
        jax.config.update("jax_compilation_cache_dir", str(cache_root() / "jax"))
    if os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0") == "0" and jax:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)  # every program kept
    os.environ["KERNJAX_XLA_SET"] = cache


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
