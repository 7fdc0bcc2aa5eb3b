"""What every benchmark shares: the record of where it ran, its timing, the GPU's clocks, and the
writer of its results.

A benchmark prints as it goes and, given a directory, leaves `results.json` (its data with the
record below under `record`), `README.md` (the question, the record, its tables) and its plots
there. The record says what a number needs to be read again later: the date, the commit (and
whether the tree had local changes), the command, the GPU, the versions, the machine and the
XLA flags. `$KERNJAX_COMMIT`, when set, names the commit: a copied tree's git may name another.

Results go to `--out`, else `$OUT/<date>-<name>/` when `$OUT` is set (the device machine's),
else `experiments/results/<date>-<name>/`, which git ignores: the `results` branch holds the
runs kept (experiments/README.md).

Timing is by the host's clock around calls made to finish (`block_until_ready`), the median of
rounds: a change of a few per cent is noise until it holds both ways (docs/lessons.md). The
GPU's clock and power come from `nvidia-smi`, read only; MFU counts against the H200's rated
dense bf16 peak at 1830 MHz, which a GPU at its power limit does not hold.

Nothing here imports jax at import time: a benchmark may set the environment (the visible
GPUs, XLA's flags and caches) before jax starts.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "experiments" / "results"
PEAK, RATED_MHZ = 989e12, 1830.0  # H200 dense bf16: 132 SMs x 4096 FLOP per clock x 1830 MHz


def say(msg: str) -> None:
    print(msg, flush=True)


def one_line(e: BaseException) -> str:
    """An exception as one line of at most ~400 characters, for a row that failed."""
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:400]}"


def out_dir(name: str, given: str | os.PathLike | None = None) -> Path:
    """`given`, else `<UTC date>-<name>/` under `$OUT` when set, else under experiments/results/."""
    if given:
        return Path(given)
    day = datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    return (Path(os.environ["OUT"]) if os.environ.get("OUT") else RESULTS) / f"{day}-{name}"


def healthy(url: str, seconds: float = 600) -> bool:
    """Whether `url`/health answers 200 within `seconds` (a server starting: compiling, stages
    joining)."""
    import urllib.request

    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            if urllib.request.urlopen(f"{url}/health", timeout=2).status == 200:
                return True
        except OSError:
            time.sleep(0.5)
    return False


def module(name: str) -> list[str]:
    """The command line that runs the benchmark `experiments.<name>` in a new process."""
    return [sys.executable, "-m", f"experiments.{name}"]


def child_env(**extra: str) -> dict:
    """This process's environment with the repository first on PYTHONPATH (so that a child
    finds `experiments` from any directory), and `extra`."""
    path = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    return {**os.environ, "PYTHONPATH": path, **extra}


def lowering(text: str):
    """`--lowering key=value,...` as a `kernjax.core.lowering.Lowering`, its defaults for the
    knobs not named (empty: the defaults): booleans as true or false (1 or 0), `mlp_tile` as one
    of its tiles. Every bad pair is named in one ValueError."""
    import dataclasses

    from kernjax.core.lowering import DEFAULT, Lowering

    names = [f.name for f in dataclasses.fields(Lowering)]
    kw, bad = {}, []
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, eq, value = (x.strip() for x in part.partition("="))
        if not eq or key not in names:
            bad.append(f"`{part}` is not KNOB=VALUE with KNOB one of {', '.join(names)}")
        elif isinstance(getattr(DEFAULT, key), bool):
            truth = {"true": True, "1": True, "false": False, "0": False}.get(value.lower())
            if truth is None:
                bad.append(f"`{part}`: {key} takes true or false")
            kw[key] = truth
        else:
            kw[key] = value
    if bad:
        raise ValueError("--lowering: " + "; ".join(bad))
    return Lowering(**kw)


# ----------------------------------------------------------------------------------- timing

class Deadline:
    """The time left of a budget of `seconds` (none, or 0: unbounded)."""

    def __init__(self, seconds: float | None):
        self.end = time.time() + seconds if seconds and seconds > 0 else float("inf")

    def left(self) -> float:
        return self.end - time.time()


def fenced(f):
    """`f` between two `optimization_barrier`s, as kernjax lowers a call on a GPU."""
    import jax

    return lambda *a: jax.lax.optimization_barrier(f(*jax.lax.optimization_barrier(a)))


def timed(run, args, iters: int, rounds: int = 5) -> float:
    """Median ms of one call of `run(*args)` over `rounds` rounds of `iters` calls back to back,
    after one call to compile and warm up."""
    import jax

    jax.block_until_ready(run(*args))
    ts = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(iters):
            out = run(*args)
        jax.block_until_ready(out)
        ts.append((time.perf_counter() - t) / iters)
    return 1e3 * statistics.median(ts)


# ------------------------------------------------------------------------------- GPU clocks

# nvidia-smi's clock-event reason bits, the ones alone (several at once print as the hex mask)
REASONS = {0: "none", 1: "idle", 2: "app-clocks", 4: "sw-power-cap", 8: "hw-slowdown",
           0x20: "sw-thermal", 0x40: "hw-thermal", 0x80: "hw-power-brake"}
QUERY = "timestamp,clocks.sm,power.draw,temperature.gpu,{}.active"


def sample(path: Path, every_ms: int = 20) -> subprocess.Popen | None:
    """nvidia-smi writing a sample of GPU 0 to `path` every `every_ms`; None without one."""
    if shutil.which("nvidia-smi") is None:  # a CPU run: the benchmark without samples
        return None
    # the clock-event reasons were "throttle reasons" before driver 535
    reasons = "clocks_event_reasons" if subprocess.run(
        ["nvidia-smi", "--query-gpu=clocks_event_reasons.active", "--format=csv"],
        capture_output=True).returncode == 0 else "clocks_throttle_reasons"
    return subprocess.Popen(["nvidia-smi", "-i", "0", f"--query-gpu={QUERY.format(reasons)}",
                             "--format=csv,noheader,nounits", "-lms", str(every_ms), "-f", str(path)])


def read_samples(path: Path) -> list[tuple[float, float, float, float, str]]:
    """(epoch s, SM MHz, W, C, reasons) per sample; nvidia-smi's timestamps are local time."""
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        f = [x.strip() for x in line.split(",")]
        try:
            t = datetime.datetime.strptime(f[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
            out.append((t, float(f[1]), float(f[2]), float(f[3]), f[4]))
        except (ValueError, IndexError):
            continue
    return out


def during(samples, spans) -> dict | None:
    """The SM clock (median, MHz) and power (mean, W) of the samples taken within `spans`
    ((start, end) epoch seconds); None if none was."""
    s = [x for x in samples if any(a <= x[0] <= b for a, b in spans)]
    if not s:
        return None
    return {"sm_mhz": statistics.median(x[1] for x in s),
            "watts": round(statistics.fmean(x[2] for x in s), 1), "samples": len(s)}


# ------------------------------------------------------------------------------- the record

def git_commit() -> tuple[str, bool | None]:
    """`$KERNJAX_COMMIT` when set (a copied tree's git may name another commit), else git's
    short hash and whether the tree has local changes."""
    if os.environ.get("KERNJAX_COMMIT"):
        return os.environ["KERNJAX_COMMIT"], False
    try:
        c = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                           text=True, timeout=10)
        if c.returncode != 0:
            return "unknown", None
        d = subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True,
                           text=True, timeout=10)
        return c.stdout.strip(), bool(d.stdout.strip())
    except (OSError, subprocess.SubprocessError):
        return "unknown", None


def machine() -> dict:
    """The host: name, CPUs, Python, the platform, jaxlib, nvidia-smi's GPU line."""
    m = {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
         "platform": platform.platform()}
    try:
        import jaxlib
        m["jaxlib"] = jaxlib.__version__
    except ImportError:
        pass
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                            "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
        if r.returncode == 0:
            m["nvidia_smi"] = r.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        m["cpu"] = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                        if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return m


def record(gpu: str | None = None, argv: list[str] | None = None) -> dict:
    """Where and when a benchmark ran: date, time, commit, command, GPU (jax's device, unless
    given), backend, jax, the machine and XLA_FLAGS."""
    now = datetime.datetime.now(datetime.timezone.utc)
    commit, dirty = git_commit()
    rec = {"date": now.date().isoformat(), "time": now.isoformat(timespec="seconds"),
           "commit": commit, "dirty": dirty,
           "command": " ".join(shlex.quote(a) for a in ["python", *command(argv)]),
           "machine": machine(), "xla_flags": os.environ.get("XLA_FLAGS", "")}
    if gpu is None:
        import jax
        rec.update(gpu=jax.devices()[0].device_kind, backend=jax.default_backend(),
                   jax=jax.__version__)
    else:
        rec["gpu"] = gpu
    return rec


def command(argv: list[str] | None = None) -> list[str]:
    """This process's command line as one types it: `-m experiments.<name>` for a module."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    head = ["-m", spec.name] if spec is not None and spec.name else sys.argv[:1]
    return [*head, *(sys.argv[1:] if argv is None else argv)]


def record_lines(rec: dict) -> list[str]:
    """The record as the README's bullet lines."""
    m = rec.get("machine", {})
    return [f"- **Commit:** `{rec.get('commit')}`" + (", tree with local changes"
                                                      if rec.get("dirty") else "") + ".",
            f"- **Machine:** {rec.get('gpu')} ({m.get('nvidia_smi', rec.get('backend', '?'))}); "
            f"{m.get('cpus')} CPUs ({m.get('cpu', '?')}), host `{m.get('host')}`.",
            f"- **Date:** {rec.get('time')}. **Versions:** Python {m.get('python')}, jax "
            f"{rec.get('jax', '?')}, jaxlib {m.get('jaxlib', '?')}.",
            f"- **XLA_FLAGS:** `{rec.get('xla_flags', '')}`.",
            "- **Command:**", "", "```", rec.get("command", ""), "```"]


# ------------------------------------------------------------------------------- the writer

def write(out: Path, data: dict, readme: str | None = None, plots=()) -> None:
    """`data` as `out/results.json` (replaced whole, never half written), `readme` as
    `out/README.md`, and each `plot(data, out)` of `plots`; a plot that fails says so and the
    rest stands."""
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "results.json.tmp"
    tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")
    tmp.replace(out / "results.json")
    if readme is not None:
        (out / "README.md").write_text(readme)
    for plot in plots:
        try:
            plot(data, out)
        except Exception as e:  # noqa: BLE001  (a plot is extra: the results stand without it)
            say(f"plot failed: {one_line(e)}")


class Report:
    """A benchmark's tables, printed as they fill and written with its record (`write`)."""

    def __init__(self, title: str, question: str = "", gpu: str | None = None):
        self.title, self.question = title, question
        self.record = record(gpu)
        self.tables: list[dict] = []
        self.notes: list[str] = []

    def table(self, *columns: str, right: str = "") -> None:
        """Starts a table; `right`: one character a column, `r` for a number (aligned right)."""
        right = right or "l" * len(columns)
        self.tables.append({"columns": list(columns), "right": right, "rows": []})
        say("| " + " | ".join(columns) + " |")
        say("|" + "|".join("---:" if r == "r" else "---" for r in right) + "|")

    def row(self, *cells) -> None:
        """A row of the last table; floats as given (format them for print before)."""
        self.tables[-1]["rows"].append([str(c) for c in cells])
        say("| " + " | ".join(str(c) for c in cells) + " |")

    def note(self, text: str) -> None:
        self.notes.append(text)
        say(text)

    def readme(self) -> str:
        lines = [f"# {self.title}", ""]
        if self.question:
            lines += [f"- **Question:** {self.question}"]
        lines += record_lines(self.record) + [""]
        for t in self.tables:
            lines += ["| " + " | ".join(t["columns"]) + " |",
                      "|" + "|".join("---:" if r == "r" else "---" for r in t["right"]) + "|"]
            lines += ["| " + " | ".join(r) + " |" for r in t["rows"]] + [""]
        lines += [f"- {n}" for n in self.notes]
        return "\n".join(lines) + "\n"

    def write(self, out: Path | None, **data) -> None:
        """results.json (the record, the tables, the notes and `data`) and README.md in `out`;
        nothing when `out` is None."""
        if out is not None:
            write(Path(out), {"record": self.record, "tables": self.tables, "notes": self.notes,
                              **data}, self.readme())


# -------------------------------------------------------------------------------- the plots

def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def mfu_lines(rows: list[dict], path: Path, title: str, peak: float = PEAK) -> None:
    """MFU against prompt length, a line per (system, chunk): one colour a system, one line
    style a chunk setting. `rows`: dicts with system, prompt, chunk and mfu (a fraction)."""
    plt = _pyplot()
    series: dict = {}
    for r in rows:
        series.setdefault((r["system"], str(r["chunk"])), []).append((r["prompt"], r["mfu"]))
    fig, ax = plt.subplots(figsize=(9, 5.5))
    color = {s: f"C{i}" for i, s in enumerate(sorted({s for s, _ in series}))}
    style = {"whole": "-", "2048": "--", "512": ":"}
    for (system, chunk), pts in sorted(series.items()):
        pts.sort()
        ax.plot([p for p, _ in pts], [100 * m for _, m in pts], marker="o",
                color=color[system], linestyle=style.get(chunk, "-."),
                label=f"{system}, chunk {chunk}")
    ax.set_xscale("log", base=2)
    prompts = sorted({r["prompt"] for r in rows})
    if prompts:
        ax.set_xticks(prompts, [str(p) for p in prompts])
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel(f"MFU % (of {peak / 1e12:.0f} TFLOP/s)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    if series:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def mfu_bars(rows: list[dict], path: Path, title: str, peak: float = PEAK,
             systems: list[str] | None = None) -> None:
    """MFU as bars, a group per (prompt, chunk) in the rows' order, a bar per system in it (in
    the order of `systems`, else as the rows first name them), its value written above it.
    `rows`: dicts with system, prompt, chunk and mfu (a fraction)."""
    plt = _pyplot()
    groups = list(dict.fromkeys((r["prompt"], str(r["chunk"])) for r in rows))
    seen = list(dict.fromkeys(r["system"] for r in rows))
    order = [s for s in systems or [] if s in seen]
    systems = order + [s for s in seen if s not in order]
    mfu = {(r["system"], r["prompt"], str(r["chunk"])): r["mfu"] for r in rows}
    width = 0.8 / max(len(systems), 1)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.5 + 0.35 * len(groups) * len(systems)), 5))
    for i, s in enumerate(systems):
        xs = [g + (i - (len(systems) - 1) / 2) * width for g in range(len(groups))]
        ys = [100 * mfu.get((s, p, c), float("nan")) for p, c in groups]
        bars = ax.bar(xs, ys, width, label=s, color=f"C{i}")
        ax.bar_label(bars, fmt="%.1f", fontsize=6, padding=1)
    ax.set_xticks(range(len(groups)), [f"{p}\nchunk {c}" for p, c in groups], fontsize=7)
    ax.set_xlabel("prompt tokens, chunk")
    ax.set_ylabel(f"MFU % (of {peak / 1e12:.0f} TFLOP/s)")
    ax.set_title(title)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
