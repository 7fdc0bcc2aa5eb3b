"""The lowering table: every kernel route and knob a stage's program was exported with.

The jaxpr says what a program computes; the table says which kernels compute it on a GPU: a
dense layer's small calls as kernjax's CUDA kernels or XLA's fusions, the fused MLP GEMM's tiling,
where XLA's CUDA graphs end, whether FlashAttention-3 runs inside them, and the calls that have a
lowering of their own (`trace.on_gpu`, by name). Two programs with one jaxpr and two tables may
not agree bit for bit, so the table is part of a stage's identity: `kernjax cut` records it in
every manifest and hashes it into the cut id, and a pipeline, a chain and a head refuse stages
whose tables differ, naming the knob.

The knobs are `kernjax cut` options (`Lowering` fields; the defaults are the measured best). The
code that lowers reads them from `current()`, which an export sets with `use`. Pure: no device,
file, flag, clock or environment.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json

MLP_TILES = ("128x128", "64x256")


@dataclasses.dataclass(frozen=True)
class Lowering:
    """The knobs of a GPU lowering (the CPU lowers every call as XLA does, whatever they say).

    dense_cuda: a dense layer's q_norm, k_norm, rope, kv_write and add_norm as kernjax's own CUDA
      kernels (`csrc/dense.cu`), else XLA's fusions.
    mlp_tile: the fused gate_up·silu_mul GEMM's warpgroup tile above 2048 rows, `128x128` or
      `64x256` (`kernels/mlp_hopper.py`).
    mlp_across: that GEMM's pipeline across a CTA's tiles, four steps.
    graph_cuts: XLA's CUDA graph ends three times in a program (1, 4 and 16 parts of its calls),
      so a graph's host work hides behind the one before; else one graph.
    fa3_graphs: FlashAttention-3 (`kj_fa3`) runs inside XLA's CUDA graphs, else outside them.
    """

    dense_cuda: bool = True
    mlp_tile: str = "128x128"
    mlp_across: bool = False
    graph_cuts: bool = True
    fa3_graphs: bool = True

    def __post_init__(self):
        if self.mlp_tile not in MLP_TILES:
            raise ValueError(f"mlp_tile {self.mlp_tile!r}: give one of {', '.join(MLP_TILES)}")
        for f in ("dense_cuda", "mlp_across", "graph_cuts", "fa3_graphs"):
            if not isinstance(getattr(self, f), bool):
                raise ValueError(f"{f} {getattr(self, f)!r}: give true or false")

    def table(self, routes: dict[str, str] | None = None) -> dict:
        """The table a manifest records: the knobs and `routes`, the calls that have lowerings
        of their own (`trace.on_gpu`: joined call names to the function that lowers them)."""
        return {**dataclasses.asdict(self), "routes": dict(sorted((routes or {}).items()))}

    @classmethod
    def from_table(cls, table: dict) -> Lowering:
        return cls(**{f.name: table[f.name] for f in dataclasses.fields(cls)})


DEFAULT = Lowering()
_current = [DEFAULT]


def current() -> Lowering:
    """The table the lowering under way follows (`use`), else the defaults."""
    return _current[-1]


@contextlib.contextmanager
def use(lowering: Lowering | None):
    """Lowers everything inside the block by `lowering` (None: the defaults)."""
    _current.append(lowering or DEFAULT)
    try:
        yield
    finally:
        _current.pop()


def canonical(table: dict) -> bytes:
    """The table's bytes as the cut id hashes them: JSON, keys sorted, no spaces."""
    return json.dumps(table, sort_keys=True, separators=(",", ":")).encode()


def differences(a: dict, b: dict) -> list[str]:
    """`knob: A against B` for every knob (or route) on which two tables differ."""
    out = [f"{k}: {a.get(k)!r} against {b.get(k)!r}" for k in sorted(set(a) | set(b))
           if k != "routes" and a.get(k) != b.get(k)]
    ra, rb = a.get("routes", {}), b.get("routes", {})
    out += [f"route {k}: {ra.get(k)!r} against {rb.get(k)!r}" for k in sorted(set(ra) | set(rb))
            if ra.get(k) != rb.get(k)]
    return out


def refusal(what_a: str, a: dict, what_b: str, b: dict) -> str | None:
    """The message refusing two stages whose tables differ, naming each knob; None if equal."""
    diff = differences(a, b)
    if not diff:
        return None
    return (f"{what_a} and {what_b} were exported with different kernel choices ("
            + "; ".join(diff) + "): their bits may differ, so split = whole is not promised; "
            "cut again with the same `kernjax cut` options for every stage")
