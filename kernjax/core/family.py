"""The contract every model family implements: what kernjax asks of a model, and nothing more.

A family is a module of `kernjax.models` (one per Hugging Face `model_type`) with these names; kernjax
reaches one through `kernjax.models.family(model_type)` or `kernjax.models.named(name)`, which
check it against `Family` once, so a family that lacks a name fails at once, naming it, not
halfway through a cut. Everything about a model (its configs, its checkpoint's tensor names, its
forward as calls, how its layers are numbered, which weights are derived at load) lives in the
family; kernjax's core never parses a call name.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol, runtime_checkable

from kernjax.core.staging import Recipe
from kernjax.core.trace import Program


@runtime_checkable
class Family(Protocol):
    CONFIGS: dict[str, Any]  # named configs, by the names `--model` takes
    FALLBACKS: dict[str, str]  # a tensor a checkpoint may omit -> the one read in its place
    Config: type  # a frozen dataclass with `name`, `dtype`, `vocab`, `layers`, ...

    def config_from_hf(self, d: dict, name: str = ...) -> Any:
        """The config of a Hugging Face `config.json`; a ValueError names what it cannot take."""

    def hf_config(self, cfg) -> dict:
        """The Hugging Face `config.json` of a config (random checkpoints write it)."""

    def weight_shapes(self, cfg) -> list[tuple[str, tuple[int, ...]]]:
        """The checkpoint's tensors in the model's dtype, by name."""

    def source_shapes(self, cfg) -> list[tuple[str, tuple[int, ...], str]]:
        """The checkpoint's tensors kept in their own dtype (MXFP4 bytes); [] if none."""

    def random_weight(self, name: str, shape: tuple[int, ...], rng) -> Any:
        """One random tensor of `weight_shapes` (float64 numpy; the writer casts it)."""

    def random_sources(self, cfg, seed: int) -> Iterable[tuple[str, Any]]:
        """The random tensors of `source_shapes`, in order."""

    def page(self, cfg) -> int:
        """Rows a KV page holds."""

    def program(self, cfg, *, dtype: str, rows: int, seqs: int = 1, context: int = 4096,
                pages: int | None = None, slots: int | None = None,
                scores: bool = False) -> Program:
        """The prefill forward traced into calls (`kernjax.core.trace.trace`, with `layer_of`);
        `slots` sizes per-sequence states, refused (ValueError) by a model that has none. Its
        head samples each sequence's next token by the `sampling` and `rng` fills and gives its
        log-probabilities (`kernjax.kernels.head`); with `scores` it also scores every row
        against the `targets` fill. A decode program is this program at rows = seqs."""

    def derived(self, cfg) -> list[Recipe]:
        """The derive program: weights the forward reads in another form than the checkpoint
        holds them, one `Recipe` per derive call; [] if none."""

    def layer_of(self, call_name: str) -> int | None:
        """The layer a call belongs to, or None (`Program.layers`)."""


NAMES = ("CONFIGS", "FALLBACKS", "Config", *(n for n, v in vars(Family).items()
                                            if isinstance(v, Callable) and not n.startswith("_")))


def check(module) -> None:
    """Refuses a family module that lacks a name of the contract, naming every one."""
    missing = [n for n in NAMES if not hasattr(module, n)]
    if missing:
        raise TypeError(f"model family `{module.__name__}` lacks {', '.join(missing)} of the "
                        "contract in kernjax/core/family.py")
