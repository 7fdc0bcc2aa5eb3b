"""Stage artifacts: one directory per stage, `manifest.json` plus the stage's exported programs.

A stage runs several programs of one cut (`kernjax.core.cut.cut_all`): the prefill chunk
(`prefill`, the default), the same chunk scoring every row (`score`) and decode buckets
(`decode<B>`: B sequences of one row each). `write` serializes each with `jax.export` (StableHLO;
FFI targets are registered by the runtime before loading), once per distinct program (a stage
before the last runs the same program for `prefill` and `score`: one file), and writes a manifest
holding everything `kernjax cut` prints, per program its item shape, calls, slots and file, the
cut `{id, stage, stages}` and the checkpoint bound (`{dir, id}` with `weights.fingerprint`, or
`{model, seed, dtype}`); `whole/` is the uncut programs.

`read` verifies the artifact before anything runs: the format, the jax version that exported it
and the program's hash. The runtime then checks the weights against the manifest, and stages
refuse a peer with another cut id.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

import jax
from jax import export

from kernjax.core import lowering
from kernjax.kernels import ffi
from kernjax.core.cut import Stage
from kernjax.core.item import Shape
from kernjax.core.trace import Slot, jaxpr_text
from kernjax.kernels.lower import as_function

FORMAT = 3  # 3: several programs per stage; 2: the lowering table in the manifest and the cut id
PROGRAM = "program.jaxexport"  # the default program's file; another's is program-<name>.jaxexport
DEFAULT = "prefill"  # the program every stage has: the prefill chunk
# Custom calls jax.export refuses by default because their encoding may change between releases:
# Pallas' Triton and Mosaic GPU kernels, and the extension's own ops (kj_kda, which k3's KDA calls
# lower to on CUDA; kj_fa3, bf16 attention on CUDA; a dense layer's small calls, csrc/dense.cu;
# the edge ops of edged programs). An artifact
# is read only by the jax version and the extension that wrote it, so they are safe; naming a
# target a program lacks costs nothing.
UNSTABLE = [export.DisabledSafetyCheck.custom_call(name)
            for name in ("__gpu$xla.gpu.triton", "mosaic_gpu_v2", "kj_kda", "kj_fa3", "kj_fa3_ungraphed", "kj_mxfp4_shuffle",
                         "kj_mark", "kj_hold", "kj_recv", "kj_push", "kj_post", "kj_qk_rope",
                         "kj_head_norm", "kj_rope", "kj_kv_write", "kj_add_norm")]
# A stage of a cut also gets its program with the edge ops at its edges (kernjax/runtime/edge.py), for
# the transports that move activations on the device; its inputs end with the item's number.
EDGED = "edged.jaxexport"
# The derive program of the weights a stage derives at load, one file per distinct derive call
# (a layer's calls share one): a stage host runs them without the model's code.
DERIVE = "derive{}.jaxexport"


class ArtifactError(ValueError):
    """A stage directory that cannot be used as it is; the message says what to redo."""


@dataclasses.dataclass(frozen=True)
class Program:
    """One program of a stage artifact: its item shape, what it binds, receives, sends and
    returns, and its deserialized export (`edged`: with edge ops, the default program only)."""

    name: str
    item: Shape
    inputs: tuple[Slot, ...]
    arrivals: tuple[Slot, ...]
    departures: tuple[Slot, ...]
    outputs: tuple[Slot, ...]
    exported: export.Exported
    file: str
    edged: export.Exported | None = None

    @property
    def rows(self) -> int:
        return self.item.rows


@dataclasses.dataclass(frozen=True)
class Artifact:
    """A verified stage directory: its manifest and its programs, deserialized. The plain
    attributes (`inputs`, `item`, `exported` ...) are those of the default program."""

    path: Path
    manifest: dict
    programs: dict[str, Program]
    recipes: tuple = ()  # the derive program (`kernjax.core.staging.Recipe`s), read at `read`

    @property
    def default(self) -> Program:
        return self.programs[DEFAULT] if DEFAULT in self.programs else next(iter(self.programs.values()))

    @property
    def inputs(self) -> tuple[Slot, ...]:
        return self.default.inputs

    @property
    def arrivals(self) -> tuple[Slot, ...]:
        return self.default.arrivals

    @property
    def departures(self) -> tuple[Slot, ...]:
        return self.default.departures

    @property
    def outputs(self) -> tuple[Slot, ...]:
        return self.default.outputs

    @property
    def exported(self) -> export.Exported:
        return self.default.exported

    @property
    def edged(self) -> export.Exported | None:
        return self.default.edged

    @property
    def bound(self) -> tuple[Slot, ...]:
        """The weights and states of all its programs, each once (the programs share them)."""
        seen = {}
        for p in self.programs.values():
            for s_ in p.inputs:
                if s_.role in ("weight", "state"):
                    seen.setdefault(s_.name, s_)
        return tuple(seen.values())

    @property
    def index(self) -> int:
        return self.manifest["cut"]["stage"]

    @property
    def stages(self) -> int:
        return self.manifest["cut"]["stages"]

    @property
    def cut_id(self) -> str:
        return self.manifest["cut"]["id"]

    @property
    def lowering(self) -> dict:
        """The lowering table the program was exported with (`kernjax.core.lowering`)."""
        return self.manifest["lowering"]

    @property
    def dtype(self) -> str:
        return self.manifest["dtype"]

    @property
    def rows(self) -> int:
        return self.default.rows

    @property
    def item(self) -> Shape:
        """The shape of the items every stage of this cut takes in its default program."""
        return self.default.item


def _slots(xs) -> list[dict]:
    return [{"name": s.name, "role": s.role, "dtype": s.dtype, "shape": list(s.shape)} for s in xs]


def _unslots(xs) -> tuple[Slot, ...]:
    return tuple(Slot(d["name"], d["role"], d["dtype"], tuple(d["shape"])) for d in xs)


def export_stage(stage: Stage, platform: str | None = None, *,
                 edged: bool = False) -> export.Exported:
    """The stage's jaxpr exported for `platform` (default: this process's devices), each call
    lowered as that platform needs it (`kernels.lower.as_function`); `edged`: with its edge ops
    (`kernjax.runtime.edge.edged`: inputs, then the item's number; arrivals and departures on edges
    `index - 1` and `index`)."""
    platform = platform or export.default_export_platform()
    with lowering.use(lowering.Lowering.from_table(stage.lowering)):
        return _export(stage, platform, edged)


def _export(stage: Stage, platform: str, edged: bool) -> export.Exported:
    fn = as_function(stage.jaxpr, platform)
    specs = [s.spec() for s in (*stage.inputs, *stage.arrivals)]
    if edged:
        from kernjax.runtime import edge

        last = stage.index == stage.stages - 1
        fn = edge.edged(fn, stage.arrivals, stage.departures,
                        edge_in=stage.index - 1 if stage.index else None,
                        edge_out=None if last else stage.index)
        specs = [s.spec() for s in stage.inputs] + [jax.ShapeDtypeStruct((1,), "int32")]
    return export.export(jax.jit(fn), platforms=[platform], disabled_checks=UNSTABLE)(*specs)


def manifest(stages: dict[str, Stage], *, model: dict, checkpoint: dict, dtype: str) -> dict:
    """The stage's manifest without its programs' files: what it runs, binds, receives and sends,
    and which cut it belongs to."""
    st = stages[DEFAULT] if DEFAULT in stages else next(iter(stages.values()))
    return {
        "format": FORMAT,
        "jax": jax.__version__,
        "cut": {"id": st.cut_id, "stage": st.index, "stages": st.stages,
                "points": list(st.points)},
        "lowering": st.lowering,
        "model": model,
        "checkpoint": checkpoint,
        "dtype": dtype,
        "platform": export.default_export_platform(),
        "programs": {},
    }


def _entry(st: Stage, item: Shape) -> dict:
    return {"item": dataclasses.asdict(item),
            "calls": {"first": st.first, "end": st.end, "names": list(st.calls)},
            "inputs": _slots(st.inputs), "arrivals": _slots(st.arrivals),
            "departures": _slots(st.departures), "forwarded": list(st.forwarded),
            "outputs": _slots(st.outputs)}


def _as_set(stage, item) -> tuple[dict[str, Stage], dict[str, Shape]]:
    """A stage (one program) or a set of them, with their item shapes, as two dicts by name."""
    stages = stage if isinstance(stage, dict) else {stage.program: stage}
    items = item if isinstance(item, dict) else {n: item for n in stages}
    missing = [n for n in stages if n not in items]
    if missing:
        raise ValueError(f"no item shape for program(s) {', '.join(missing)}")
    return stages, items


def write(path: str | os.PathLike, stage, **meta) -> Path:
    """Writes a stage's artifact directory: `stage` is a Stage (one program) or a dict of the
    stage's programs by name (`cut_all`); `meta` is `model`, `checkpoint`, `dtype` and `item` (a
    Shape, or a dict by program). The directory is written beside `path` under a temporary name
    and renamed into place (a directory already at `path` is replaced): a reader never sees half
    an artifact."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=TEMP, dir=path.parent))
    try:
        _write(tmp / "a", stage, **meta)
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp / "a", path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def _write(path: Path, stage, *, item, derive=None, **meta) -> Path:
    path.mkdir(parents=True)
    stages, items = _as_set(stage, item)
    if derive is None:  # the family's derive program, its weights made in the stage's dtype
        derive = _family_derive(meta["model"], meta["dtype"])
    m = manifest(stages, **meta)
    # a program's slots -> the stages written with them and their files; a stage whose slots and
    # text are another's shares its file (its text printed only where the slots are the same)
    made: dict[str, list[tuple[Stage, str]]] = {}
    for name, st in stages.items():
        e = _entry(st, items[name])
        slots = json.dumps({k: e[k] for k in ("inputs", "arrivals", "departures", "outputs")})
        file = next((f for o, f in made.get(slots, ())
                     if jaxpr_text(o.jaxpr) == jaxpr_text(st.jaxpr)), None)
        if file is None:
            blob = bytes(export_stage(st).serialize())
            file = PROGRAM if not made else f"program-{name}.jaxexport"
            made.setdefault(slots, []).append((st, file))
            (path / file).write_bytes(blob)
            m.setdefault("files", {})[file] = hashlib.sha256(blob).hexdigest()
        e["file"] = file
        if name == DEFAULT and st.stages > 1:
            try:
                edged = bytes(export_stage(st, edged=True).serialize())
            except Exception as ex:  # noqa: BLE001  (the plain program serves; say what is missing)
                print(f"warning: stage {st.index}: its program with edge ops could not be "
                      f"exported ({type(ex).__name__}: {str(ex)[:200]}); the host transport "
                      "serves it, the device transports will refuse it", file=sys.stderr)
            else:
                (path / EDGED).write_bytes(edged)
                m["files"][EDGED] = hashlib.sha256(edged).hexdigest()
                e["edged"] = EDGED
        m["programs"][name] = e
    first = next(iter(stages.values()))
    m["derive"] = _write_derive(path, first, derive, [s for st in stages.values()
                                                     for s in st.inputs])
    (path / "manifest.json").write_text(json.dumps(m, indent=1) + "\n")
    return path


def _family_derive(model: dict, dtype: str) -> list:
    """The derive program of the family a manifest's `model` names (the cut's side, which has
    the model's code; a stage host reads the exported one)."""
    fam = importlib.import_module(f"kernjax.models.{model['family']}")
    return fam.derived(fam.Config(**{**model["config"], "dtype": dtype}))


def _write_derive(path: Path, stage: Stage, recipes, inputs=None) -> dict:
    """Exports the recipes (`kernjax.core.staging.Recipe`) whose outputs the stage's weights
    (`inputs`: of all its programs) hold, one file per distinct function and source shapes, and
    returns the manifest's entry."""
    from kernjax.weights import split_derived
    want = list({s.name: (s.name, s.shape, s.dtype) for s in (inputs or stage.inputs)
                 if s.role == "weight"}.values())
    _, used = split_derived(list(recipes), want)
    files, index, entries = [], {}, []
    platform = export.default_export_platform()
    for r in used:
        key = (r.fn, tuple((tuple(s), d) for _, s, d in r.sources))
        if key not in index:
            specs = [jax.ShapeDtypeStruct(tuple(s), d) for _, s, d in r.sources]
            blob = bytes(export.export(jax.jit(r.fn), platforms=[platform],
                                       disabled_checks=UNSTABLE)(*specs).serialize())
            name = DERIVE.format(len(files))
            (path / name).write_bytes(blob)
            index[key] = len(files)
            files.append({"file": name, "sha256": hashlib.sha256(blob).hexdigest()})
        entries.append({"outputs": [[n, list(s), d] for n, s, d in r.outputs],
                        "sources": [[n, list(s), d] for n, s, d in r.sources],
                        "program": index[key]})
    return {"files": files, "recipes": entries}


def recipes(art: Artifact) -> list:
    """The artifact's derive program as `Recipe`s whose functions are its exported derive calls."""
    return list(art.recipes)


def _recipes(path: Path, d: dict) -> tuple:
    from kernjax.core.staging import Recipe
    fns = []
    for f in d["files"]:
        blob = (path / f["file"]).read_bytes()
        if hashlib.sha256(blob).hexdigest() != f["sha256"]:
            raise ArtifactError(f"`{path / f['file']}` does not match the hash in its "
                                "manifest: re-run `kernjax cut`")
        fns.append(export.deserialize(blob).call)
    tup = lambda xs: tuple((n, tuple(s), dt) for n, s, dt in xs)  # noqa: E731
    return tuple(Recipe(tup(r["outputs"]), tup(r["sources"]), fns[r["program"]])
                 for r in d["recipes"])


def read(path: str | os.PathLike) -> Artifact:
    """Reads and verifies a stage directory.

    Raises:
      ArtifactError: naming the field that does not match and what to do.
    """
    path = Path(path)
    mpath = path / "manifest.json"
    if not mpath.is_file():
        subs = sorted(p.parent.name for p in path.glob("*/manifest.json"))  # a cut's directory
        if not path.exists():
            raise ArtifactError(f"`{path}` does not exist")
        if path.is_file():
            raise ArtifactError(f"`{path}` is a file; name the stage directory that holds it: "
                                f"`{path.parent}`")
        if subs:
            raise ArtifactError(f"`{path}` holds a cut, not one stage: name one of its stages, "
                                + ", ".join(f"`{path / n}`" for n in subs))
        raise ArtifactError(f"`{path}` has no manifest.json; make stage directories with "
                            "`kernjax cut`")
    try:
        m = json.loads(mpath.read_text())
    except json.JSONDecodeError as e:
        raise ArtifactError(f"`{mpath}` is not valid JSON ({e}); re-run `kernjax cut`") from e
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        got = f"format {m.get('format')!r}" if isinstance(m, dict) else f"a JSON {type(m).__name__}"
        raise ArtifactError(f"`{mpath}` holds {got}; this kernjax reads format {FORMAT}: "
                            "re-run `kernjax cut`")
    try:
        return _read(path, m)
    except ArtifactError:
        raise
    except (KeyError, TypeError, AttributeError, ValueError) as e:  # a field removed or changed
        raise ArtifactError(f"`{mpath}` is malformed ({type(e).__name__}: {str(e)[:120]}); "
                            "re-run `kernjax cut`") from None


def _read(path: Path, m: dict) -> Artifact:
    if m["jax"] != jax.__version__:
        raise ArtifactError(f"`{path}` was exported by jax {m['jax']}; this is jax "
                            f"{jax.__version__}: re-run `kernjax cut` with this jax")
    if m["platform"] != export.default_export_platform():
        raise ArtifactError(f"`{path}` was exported for `{m['platform']}`; this process "
                            f"runs on `{export.default_export_platform()}`: re-run `kernjax cut` here")
    if m["platform"] == "cuda":
        # A Mosaic GPU kernel's host code links against a runtime library that this import
        # points XLA at; a program read back from disk, never traced here, needs it all the same.
        importlib.import_module("jax.experimental.mosaic.gpu")
    try:  # likewise kernjax's own custom calls (kj_fa3, bf16 attention on CUDA; kj_kda)
        ffi.register()
    except ffi.ExtensionError:
        pass  # a program that calls one fails naming it; one that calls none runs
    files = {}
    for name, sha in m["files"].items():
        if not re.fullmatch(r"(program(-[\w.]+)?|edged)\.jaxexport", name):
            raise ValueError(f"file {name}")
        blob = (path / name).read_bytes()
        if hashlib.sha256(blob).hexdigest() != sha:
            raise ArtifactError(f"`{path / name}` does not match the hash in its manifest; the "
                                "artifact was changed or half-written: re-run `kernjax cut`")
        files[name] = export.deserialize(blob)
    programs = {}
    for name, e in m["programs"].items():
        programs[name] = Program(name, Shape(**e["item"]), _unslots(e["inputs"]),
                                 _unslots(e["arrivals"]), _unslots(e["departures"]),
                                 _unslots(e["outputs"]), files[e["file"]], e["file"],
                                 files[e["edged"]] if e.get("edged") else None)
    if not programs:
        raise ValueError("programs")
    art = Artifact(path, m, programs, _recipes(path, m["derive"]))
    # what later code reads of the manifest, read once here, where a bad field is reported
    if not (type(art.index) is int and type(art.stages) is int and isinstance(art.cut_id, str)
            and isinstance(art.dtype, str)
            and isinstance(m["model"]["config"], dict) and isinstance(m["checkpoint"], dict)
            and isinstance(m["lowering"], dict) and isinstance(m["derive"]["recipes"], list)):
        raise TypeError("cut, dtype, item, lowering, model or checkpoint")
    return art


def model_meta(fam, cfg) -> dict:
    """The manifest's `model`: the family, the config, the checkpoint-name fallbacks."""
    return {"family": fam.__name__.rsplit(".", 1)[-1], "name": cfg.name,
            "config": dataclasses.asdict(cfg), "hf": fam.hf_config(cfg),
            "fallbacks": fam.FALLBACKS}


def _cut_file(name: str) -> bool:
    return name in ("manifest.json", PROGRAM, EDGED) or bool(
        re.fullmatch(r"derive\d+\.jaxexport|program-[\w.]+\.jaxexport", name))
TEMP = ".cut-"  # the prefix of a cut's directory while it is written


def previous_cut(out: Path) -> list[str]:
    """The stage directories a previous cut wrote into `out`; refuses an `out` that holds
    anything a cut does not write. A cut's temporary directory left by a killed cut is removed."""
    out = Path(out)
    if not out.exists():
        return []
    if not out.is_dir():
        raise ValueError(f"--out `{out}` is a file; give a directory")
    ours, other = [], []
    for p in sorted(out.iterdir()):
        if p.name.startswith(TEMP) and p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
            continue
        mine = (re.fullmatch(r"stage\d+|whole", p.name) and p.is_dir()
                and all(_cut_file(f.name) for f in p.iterdir())
                and (p / "manifest.json").is_file()
                and '"cut"' in (p / "manifest.json").read_text(errors="replace"))
        (ours if mine else other).append(p.name + "/" * p.is_dir())
    if other:
        raise ValueError(f"--out `{out}` holds {', '.join(other[:5])}{' ...' * (len(other) > 5)}"
                         ", which `kernjax cut` did not write; cut into a new or empty directory")
    return ours


def write_cut(out: Path, stages, meta: dict, *, say=lambda msg: None) -> list[str]:
    """Writes `stages`' artifacts into `out`, replacing the previous cut there (`previous_cut`).
    Every stage is written into one temporary directory inside `out` first, then renamed into
    place: a write that fails, or a process killed, leaves the previous cut (or nothing) and
    never half a cut. Returns the directories' names."""
    from kernjax.core.cut import counted
    out = Path(out)
    old = previous_cut(out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=TEMP, dir=out))
    names = []
    try:
        for sts in stages:  # a Stage, or a stage's programs by name
            st = next(iter(sts.values())) if isinstance(sts, dict) else sts
            name = f"stage{st.index}" if st.stages > 1 else "whole"
            say(f"writing {out / name} ({counted(len(st.calls), 'call')}"
                + (f", {counted(len(sts), 'program')}" if isinstance(sts, dict) else "") + ")")
            _write(tmp / name, sts, **meta)
            names.append(name)
        if old:
            say(f"replacing the previous cut in {out}: {', '.join(old)}")
        for name in old:
            shutil.rmtree(out / name)
        for name in names:
            os.replace(tmp / name, out / name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return names


DECODE = (1, 4, 16, 64)  # the decode buckets a cut writes by default: B sequences of one row


def programs(fam, cfg, *, dtype: str, rows: int, seqs: int, context: int,
             pages: int | None = None, slots: int | None = None, decode=DECODE,
             score: bool = True) -> dict:
    """The programs of one cut (`kernjax.core.trace.Program`s by name): the prefill chunk of
    `rows` rows and `seqs` sequences, the same chunk scoring every row (`score`), and a decode
    program per bucket B of `decode` (`decode<B>`: B sequences of one row), all with the same
    states (pages, slots) and page tables."""
    from kernjax.core.item import item_shape
    first = fam.program(cfg, dtype=dtype, rows=rows, seqs=seqs, context=context, pages=pages,
                        slots=slots)
    same = dict(dtype=dtype, context=context, pages=item_shape(first, fam.page(cfg)).pages,
                slots=first.slots or None)
    out = {DEFAULT: first}
    if score:
        out["score"] = fam.program(cfg, rows=rows, seqs=seqs, scores=True, **same)
    for b in sorted(set(decode)):
        if b < 1:
            raise ValueError(f"decode bucket {b}: a bucket holds at least one sequence")
        out[f"decode{b}"] = fam.program(cfg, rows=b, seqs=b, **same)
    return out


def decode_buckets(programs) -> list[int]:
    """The decode buckets among `programs`' names (`decode<B>`, as `programs` makes them),
    smallest first."""
    return sorted(int(n[6:]) for n in programs if n.startswith("decode") and n[6:].isdigit())


def items(fam, cfg, progs: dict) -> dict:
    """Each program's item shape (`kernjax.core.item.Shape`), by name."""
    from kernjax.core.item import item_shape
    return {n: item_shape(p, fam.page(cfg)) for n, p in progs.items()}


def whole_artifact(fam, cfg, ref: dict, dtype: str, *, rows: int, seqs: int, context: int,
                   out: Path, lowering=None, decode=DECODE):
    """The uncut programs of a model (`programs`) as a verified one-stage artifact at `out`."""
    from kernjax.core.cut import whole_all
    progs = programs(fam, cfg, dtype=dtype, rows=rows, seqs=seqs, context=context, decode=decode)
    return read(write(out, whole_all(progs, lowering=lowering), model=model_meta(fam, cfg),
                      checkpoint=ref, dtype=dtype, item=items(fam, cfg, progs),
                      derive=fam.derived(dataclasses.replace(cfg, dtype=dtype))))


def stage_names(stages_dir: Path) -> list[str]:
    """The stage directories of a cut directory, in order; a path a level off says which to use."""
    if not stages_dir.is_dir():
        raise ValueError(f"--stages `{stages_dir}` does not exist" if not stages_dir.exists() else
                         f"--stages `{stages_dir}` is a file; give a `kernjax cut --out` directory")
    names = sorted((p.name for p in stages_dir.glob("stage*") if p.name[5:].isdigit()),
                   key=lambda n: int(n[5:]))
    if names:
        return names
    if (stages_dir / "manifest.json").is_file():
        up = (stages_dir if stages_dir.name else stages_dir.resolve()).parent
        raise ValueError(f"`{stages_dir}` is one stage; --stages takes the cut directory that "
                         f"holds it: `{up}`")
    cuts = sorted(str(p.parent) for p in stages_dir.glob("*/stage0"))
    raise ValueError(f"`{stages_dir}` holds no stage0/ .. directories; " + (
        f"it holds cuts: pass one of {', '.join(f'`{c}`' for c in cuts)}" if cuts else
        "make them with `kernjax cut --out DIR`"))
