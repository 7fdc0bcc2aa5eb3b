"""The device side: a stage artifact loaded, its weights bound by name, its states owned.

`Runner` jits the artifact's exported program once, with the states donated so their updates
happen in place, puts the kept weights on the device, allocates the states (zeros) and runs items:
fills and tables from the item, arrivals from the stage before, departures to the stage after.
Before anything compiles it checks the weights against the manifest, tensor by tensor.

The program is compiled when the stage opens, with the kernel choices every process of a cut
makes alike (`kernjax/runtime/xla.py`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import jax
import numpy as np

from kernjax.runtime import derive
from kernjax import artifact as artifacts
from kernjax import weights as ckpts
from kernjax.runtime import tokens
from kernjax.runtime import xla
from kernjax.core.item import make_item


class StageError(RuntimeError):
    """A running stage got input it cannot use; names the stage and the slot."""


def checkpoint_dir(ref: dict, where: str | Path = "the artifact") -> Path:
    """The directory a manifest's checkpoint reference names (made first, for random weights);
    `where` names the artifact in the message when the recorded directory is gone."""
    if "dir" in ref:
        if not Path(ref["dir"]).is_dir():
            raise artifacts.ArtifactError(
                f"checkpoint `{ref['dir']}`, recorded by `{where}` when it was cut, does not "
                "exist any more; pass --weights CHECKPOINT_DIR (or re-cut)")
        if "id" in ref and ckpts.fingerprint(ref["dir"]) != ref["id"]:
            raise artifacts.ArtifactError(
                f"checkpoint `{ref['dir']}` holds other tensors than when `{where}` was cut from "
                f"it; pass --weights {ref['dir']} to run on what it holds now, or re-cut")
        return Path(ref["dir"])
    return ckpts.random_checkpoint(ref["model"], seed=ref["seed"], dtype=ref["dtype"])


def load_weights(art: artifacts.Artifact, ckpt: Path, *, cache: dict | None = None) -> dict:
    """The artifact's weights from `ckpt`, cast to its dtype; `cache` shares tensors between stages."""
    want = [(s.name, s.shape, s.dtype) for s in art.bound if s.role == "weight"]
    cache = {} if cache is None else cache
    miss = [w for w in want if (str(ckpt), w[0], w[2]) not in cache]
    fallbacks = art.manifest["model"].get("fallbacks")
    if miss:
        ckpts.same_model(ckpt, art.manifest["model"])
    plain, recipes = ckpts.split_derived(artifacts.recipes(art), miss)
    got = ckpts.load(ckpt, plain, fallbacks=fallbacks) if miss else {}
    if recipes:  # weights derived at load: only those this stage's calls read
        got.update(derive.run(recipes, lambda want: ckpts.load(ckpt, want, progress=False))[0])
    for name, _, dtype in miss:
        cache[(str(ckpt), name, dtype)] = got[name]
    return {name: cache[(str(ckpt), name, dtype)] for name, _, dtype in want}


class Runner:
    """One stage on one device: bound weights, owned states, its programs jitted (the default
    at once, the others when first run)."""

    def __init__(self, art: artifacts.Artifact, weights: Mapping[str, np.ndarray], *,
                 device: jax.Device | None = None):
        self.art = art
        self.device = device or jax.devices()[0]
        errs = []
        for s in art.bound:
            if s.role != "weight":
                continue
            w = weights.get(s.name)
            if w is None:
                errs.append(f"weight `{s.name}` is not bound")
            elif tuple(w.shape) != s.shape or str(w.dtype) != s.dtype:
                errs.append(f"weight `{s.name}` is {w.dtype}{list(w.shape)}; the stage expects "
                            f"{s.dtype}{list(s.shape)}")
        if errs:
            raise StageError(f"stage {art.index} (`{art.path}`) cannot bind its weights:\n"
                             + "\n".join(f"  - {e}" for e in errs))
        self.weights = {s.name: jax.device_put(weights[s.name], self.device)
                        for s in art.bound if s.role == "weight"}
        self.states = {}
        self.reset()
        self.fns: dict[str, object] = {}  # a program file -> its compiled executable
        self.edged = None
        self.ring = None  # where the default program publishes its tokens (`tokens.TokenRing`)
        self.fn = self.compiled()

    def compiled(self, program: str = artifacts.DEFAULT):
        """Program `program`'s executable, compiled at its first use (programs of one file,
        one executable)."""
        p = self.program(program)
        if p.file not in self.fns:
            specs = [jax.ShapeDtypeStruct(s.shape, ckpts.np_dtype(s.dtype))
                     for s in (*p.inputs, *p.arrivals)]
            donate = tuple(i for i, s in enumerate(p.inputs) if s.role == "state")
            self.fns[p.file] = self._compile(p, p.exported, specs,
                                             [s.name for s in (*p.departures, *p.outputs)], donate)
        return self.fns[p.file]

    def program(self, name: str) -> artifacts.Program:
        p = self.art.programs.get(name)
        if p is None:
            raise StageError(f"stage {self.art.index} (`{self.art.path}`) has no program "
                             f"`{name}`; it has {', '.join(self.art.programs)}: re-cut with this "
                             "kernjax")
        return p

    def _compile(self, p, exported, specs, names, donate):
        """`exported` compiled for this stage: its states donated, `next_token` (of its outputs
        `names`) published to the host by the program (`kernjax.runtime.tokens`), CUDA graphs by its
        rows."""
        call, leaf = exported.call, None
        tok = [s for s in p.outputs if s.name == "next_token"]
        ring = (tokens.ring(int(np.prod(tok[0].shape)), self.device)
                if tok and tokens.TokenRing.usable(self.device) else None)
        if ring is not None:
            if p.name == self.art.default.name:
                self.ring = ring
            leaf = names.index("next_token")
            call, specs = ring.wrap(call, leaf), [*specs, jax.ShapeDtypeStruct((1,), np.int32)]
        fn = jax.jit(call, donate_argnums=donate).lower(*specs).compile(
            xla.compile_options(p.item.rows))
        return fn if leaf is None else tokens.Published(fn, ring, leaf)

    def reset(self) -> None:
        """Zeroes every state."""
        for s in self.art.bound:
            if s.role == "state":
                self.states[s.name] = jax.device_put(np.zeros(s.shape, ckpts.np_dtype(s.dtype)),
                                                     self.device)

    def memory(self) -> dict[str, int | None]:
        """Bytes the stage needs (weights, states), the device's peak so far (None where the
        allocator keeps no count), and what its program holds at once (XLA's memory analysis)."""
        need = lambda role: int(sum(s.nbytes for s in self.art.bound if s.role == role))  # noqa: E731
        stats = self.device.memory_stats() if hasattr(self.device, "memory_stats") else None
        m = (self.edged or self.fn).memory_analysis()  # the default program's
        return {"weights": need("weight"), "states": need("state"),
                "peak": (stats or {}).get("peak_bytes_in_use"),
                "program": int(m.argument_size_in_bytes + m.output_size_in_bytes
                               - m.alias_size_in_bytes + m.temp_size_in_bytes)}

    def warm(self, programs: Sequence[str] = (artifacts.DEFAULT,)) -> None:
        """Compiles `programs` by running an empty item through each: every row is padding, so
        no state changes."""
        for name in programs:
            p = self.program(name)
            arrivals = [np.zeros(s.shape, ckpts.np_dtype(s.dtype)) for s in p.arrivals]
            jax.block_until_ready(self.run(make_item([], p.item), arrivals, program=name))

    def run(self, item: Mapping[str, np.ndarray], arrivals: Sequence[jax.Array] = (), *,
            program: str = artifacts.DEFAULT) -> tuple[list[jax.Array], dict[str, jax.Array]]:
        """Runs one item through `program`; returns the departures and the non-state outputs by
        name."""
        art, p = self.art, self.program(program)
        if len(arrivals) != len(p.arrivals):
            raise StageError(f"stage {art.index} takes {len(p.arrivals)} arrivals in program "
                             f"`{program}`, got {len(arrivals)}")
        out = self.compiled(program)(*self._args(item, p), *arrivals)
        nd = len(p.departures)
        return list(out[:nd]), self._keep(out[nd:], p)

    def run_edged(self, item: Mapping[str, np.ndarray], k: int
                  ) -> tuple[dict[str, jax.Array], jax.Array]:
        """Issues item `k` through the program with edge ops (`kernjax.runtime.edge`): its arrivals come
        from, its departures go to the edges this process has bound. Returns at once: the
        non-state outputs, and a token that is ready when the item has run, its edge ops too."""
        self.compile_edged()
        out = self.edged(*self._args(item, self.art.default), np.asarray([k], np.int32))
        return self._keep(out[:-1], self.art.default), out[-1]

    def compile_edged(self) -> None:
        """Compiles the program with edge ops (once), without running it: running it would wait
        for the neighbours."""
        art = self.art
        if self.edged is None:
            if art.edged is None:
                raise StageError(f"stage {art.index} (`{art.path}`) has no program with edge "
                                 "ops: re-cut it with this kernjax")
            specs = [jax.ShapeDtypeStruct(s.shape, ckpts.np_dtype(s.dtype)) for s in art.inputs]
            specs.append(jax.ShapeDtypeStruct((1,), np.int32))
            donate = tuple(i for i, s in enumerate(art.inputs) if s.role == "state")
            self.edged = self._compile(art.default, art.edged, specs,
                                       [s.name for s in art.outputs] + ["-"], donate)

    def _keep(self, out, p: artifacts.Program) -> dict[str, jax.Array]:
        outputs = {}
        for s, v in zip(p.outputs, out, strict=True):
            if s.role == "state":
                self.states[s.name] = v
            else:
                outputs[s.name] = v
        tok = outputs.get("next_token")  # a tokens.Token where the program publishes it, else
        if isinstance(tok, jax.Array) and self.device.platform != "cpu":  # to the host when
            tok.copy_to_host_async()  # ready, no round trip
        return outputs

    def _args(self, item: Mapping[str, np.ndarray], p: artifacts.Program) -> list:
        art, args = self.art, []
        for s in p.inputs:
            if s.role == "weight":
                args.append(self.weights[s.name])
            elif s.role == "state":
                args.append(self.states[s.name])
            else:
                x = item.get(s.name)
                if x is None:
                    raise StageError(f"stage {art.index}: the item has no `{s.name}`")
                if tuple(x.shape) != s.shape or str(x.dtype) != s.dtype:
                    raise StageError(f"stage {art.index}: `{s.name}` is {x.dtype}{list(x.shape)};"
                                     f" program `{p.name}` takes {s.dtype}{list(s.shape)}")
                args.append(x)
        return args


def open_stage(path: str | Path, *, weights: str | Path | None = None, dtype: str | None = None,
               cache: dict | None = None) -> Runner:
    """Reads, verifies and loads a stage directory.

    Args:
      path: the stage directory.
      weights: a checkpoint directory overriding the one the artifact records.
      dtype: refused unless it is the artifact's dtype (the dtype is compiled in).
      cache: shared between stages of one process so a tensor is read once.
    """
    art = artifacts.read(path)
    if dtype and dtype != art.dtype:
        raise artifacts.ArtifactError(
            f"--dtype {dtype} contradicts `{path}`, which was cut for {art.dtype}; "
            f"drop --dtype or re-cut with --dtype {dtype}")
    ckpt = Path(weights) if weights else checkpoint_dir(art.manifest["checkpoint"], path)
    return Runner(art, load_weights(art, ckpt, cache=cache))
