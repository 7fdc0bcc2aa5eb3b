"""What every kernjax process sets up before jax makes its backend: one kernel choice per call in
every process of a cut, and compiled programs kept across restarts.

- **Autotuning, shared.** XLA:GPU autotunes each GEMM and fusion (cuBLAS algorithm, Triton
  tiling) by timing candidates, so two processes compiling the same call may choose differently
  and round differently: the whole program in one process and its stages in others would then
  differ. kernjax keeps autotuning (turning it off costs 1.7-6x, docs/bitwise.md) and shares its
  results: XLA's per-fusion autotune cache lives in one directory per machine
  (`autotune/` under `cache_root()`); the first process to compile a
  fusion times it and writes its choice, every later one reads it. Processes compile under an
  exclusive file lock (`compile_lock`), so two stages started together never time the same
  fusion at once.
- **No dot merging.** XLA's dot merger pass turns two GEMMs that share an operand (gate and
  up, q, k and v) into one over the weights concatenated, when the product is under 16 M
  elements: a chunk of 512 rows is, 8192 rows are not. The weights are parameters, so the
  concatenation is a copy of ~100 MB of weights in every layer of every chunk (18 % of an 8k
  prefill in chunks of 512 on an H200, docs/bitwise.md), and the merged product's slices are
  copies too where a call boundary keeps them apart. kernjax turns the
  pass off (`--xla_disable_hlo_passes=dot-merger`: the pass's name, not its class's).
- **Compiled programs, kept.** JAX's persistent compilation cache (`.../xla/jax`) holds every
  program that took over a second to compile (`jax/` under `cache_root()`), so a restarted stage
  loads instead of compiling.

- **Serving: CUDA graphs without address updates** (`serving()`, called by `kernjax.serve`
  before jax makes its backend). XLA runs a GPU program as CUDA graphs and, before each launch,
  updates every graph node whose buffer moved. The temporaries move from call to call, and they
  are in nearly every node: served, qwen3-4b's whole program spent 4.6 ms an item updating its
  graph (`experiments/load.py --trace`) and took 7.4 ms to issue an item. `--xla_gpu_command_buffer_update_mode=SKIP_TEMP` gives each program's
  temporaries fixed virtual addresses (XLA's VMM allocator): 3.7 ms per item, 1.3 with operands
  already on the device (one H200, `experiments/peritem.py --issue`). A served stage issues
  ahead of its device, so the host's issue sets its period where it exceeds the device's work.
  The VMM allocator keeps no statistics (the stage reports its program's memory from XLA's
  analysis instead), and maps the temporaries at every call: a program run alone and waited for
  took 11.3 ms instead of 10.6, so one-off runs (chains, benchmarks) keep the default.

Each is left alone when the user has set it (`XLA_FLAGS`, `JAX_COMPILATION_CACHE_DIR`).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path


def cache_dir() -> Path:
    """kernjax's cache: `$KERNJAX_CACHE`, default `~/.cache/kernjax` (random checkpoints too)."""
    return Path(os.environ.get("KERNJAX_CACHE") or Path.home() / ".cache" / "kernjax")


def cache_root() -> Path:
    """`$KERNJAX_XLA_CACHE`, else `xla/` in `cache_dir()`."""
    if os.environ.get("KERNJAX_XLA_CACHE"):
        return Path(os.environ["KERNJAX_XLA_CACHE"])
    return cache_dir() / "xla"


def autotune_dir() -> Path:
    return cache_root() / "autotune"


def configure() -> None:
    """Sets the XLA flags and the compilation cache; a no-op for what the user set already."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "autotune_cache_dir" not in flags:
        flags += f" --xla_gpu_per_fusion_autotune_cache_dir={autotune_dir()}"
    if "xla_disable_hlo_passes" not in flags:
        flags += " --xla_disable_hlo_passes=dot-merger"
    os.environ["XLA_FLAGS"] = flags.strip()
    import jax

    if not os.environ.get("JAX_COMPILATION_CACHE_DIR") and jax.config.jax_compilation_cache_dir is None:
        jax.config.update("jax_compilation_cache_dir", str(cache_root() / "jax"))


def serving() -> None:
    """CUDA graphs whose temporaries keep their addresses (see above); before jax's backend."""
    if "command_buffer_update_mode" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   " --xla_gpu_command_buffer_update_mode=SKIP_TEMP").strip()


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
