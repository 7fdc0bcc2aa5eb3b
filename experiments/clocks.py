"""What the GPU's clock does under each kind of load: the ceiling MFU is counted against.

MFU counts against 989 TFLOP/s, the H200's dense bf16 peak: 132 SMs x 4096 FLOP per clock at
1830 MHz, the clock NVIDIA rates tensor throughput at (the top SM clock is 1980 MHz). A GPU held
at its power limit lowers its clock, and its peak with it. This samples `nvidia-smi` (SM
clock, power, temperature, the active clock-event reasons) every 20 ms while it runs, back to
back, for `--seconds` each:

  matmul-random  bf16 8192^3 products of N(0, 1) operands (JAX): the GEMM ceiling
  matmul-zeros   the same products of zeros: the same instructions, less power
  gemm-gate      qwen3-4b's gate product at 8192 rows (8192 x 2560 by 2560 x 9728), weights
                 N(0, 0.02)
  prefill        qwen3-4b prefill of one 8192-token prompt in one chunk, kernjax whole
                 (random N(0, 0.02) weights, as `experiments/prefill.py`)
  attention      the chunk-attention kernel alone, 8192 rows on 8192 keys (square causal)
  prefill-idle   the prefill one at a time, each after 3 s idle: a burst, as a benchmark that
                 times a few runs sees it

and prints per phase: TFLOP/s (median of the timed reps of 10 calls back to back, one
prefill), SM clock (median, 10th percentile),
power (mean), the clock-event reasons seen, and the peak at the median clock (989 TFLOP/s x
clock / 1830 MHz). It only reads the clocks; it sets nothing.

    python experiments/clocks.py --seconds 8 --out clocks.json
    python experiments/clocks.py --model qwen3-tiny --prompt 256 --size 256 --phases matmul-random,prefill --seconds 1  # CPU
"""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

PEAK, RATED_MHZ = 989e12, 1830.0  # 132 SMs x 4096 dense bf16 FLOP per clock x 1830 MHz
# nvidia-smi's clock-event reason bits, the ones alone (several at once print as the hex mask)
REASONS = {0: "none", 1: "idle", 2: "app-clocks", 4: "sw-power-cap", 8: "hw-slowdown",
           0x20: "sw-thermal", 0x40: "hw-thermal", 0x80: "hw-power-brake"}
QUERY = "timestamp,clocks.sm,power.draw,temperature.gpu,{}.active"


def sample(path: Path, every_ms: int = 20) -> subprocess.Popen | None:
    """nvidia-smi writing a sample of GPU 0 to `path` every `every_ms`; None without one."""
    if shutil.which("nvidia-smi") is None:  # a CPU smoke test: the phases without samples
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
    for line in path.read_text().splitlines():
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


def run_for(phase, seconds: float) -> dict:
    """Runs `phase` for `seconds` after two warm-ups: each timed rep is `inner` calls back to back
    (the host's sync amortized), `setup` (not timed) before each."""
    fn, flop, inner, setup = phase
    for _ in range(2):
        setup()
        jax.block_until_ready(fn())
    t0, times, spans = time.time(), [], []
    while time.time() - t0 < seconds:
        setup()
        a, wall = time.perf_counter(), time.time()
        for _ in range(inner - 1):
            fn()
        jax.block_until_ready(fn())
        times.append((time.perf_counter() - a) / inner)
        spans.append((wall, time.time()))
    ms = statistics.median(times) * 1e3
    return {"t0": t0, "t1": time.time(), "runs": len(times) * inner, "ms": ms,
            "all_ms": [t * 1e3 for t in times], "spans": spans,
            "tflop_s": flop / (ms / 1e3) / 1e12}


def _none():
    return None


def matmul(n: int, m: int, k: int, scale: float | None):
    """An (n, k) x (k, m) bf16 product: N(0, 1) times N(0, scale) operands, or zeros (None)."""
    k1, k2 = jax.random.split(jax.random.key(0))
    if scale is None:
        a, b = jnp.zeros((n, k), jnp.bfloat16), jnp.zeros((k, m), jnp.bfloat16)
    else:
        a = jax.random.normal(k1, (n, k), jnp.bfloat16)
        b = (jax.random.normal(k2, (k, m), jnp.float32) * scale).astype(jnp.bfloat16)
    f = jax.jit(lambda a, b: a @ b)
    return (lambda: f(a, b)), 2.0 * n * m * k, 10, _none


def prefill(model: str, s: int, idle: float = 0.0):
    import prefill as pf
    from kernjax import models
    args = pf.parse_args(["--model", model, "--prompts", str(s), "--chunks", "whole",
                          "--systems", "kernjax"])
    fam, cfg = models.named(args.model)
    weights = pf.random_weights(fam, cfg, args.dtype)
    tokens = {s: np.random.default_rng(0).integers(0, cfg.vocab, s).astype(np.int32)}
    system = pf.Kernjax("kernjax", fam, cfg, args, weights, tokens)
    h, _ = system.prepare(s, s)
    def setup():
        system.reset(h)
        time.sleep(idle)
    return (lambda: system.prefill(h)[1]), pf.flops(cfg, s), 1, setup


def attention():
    import attention as at
    scale = 128 ** -0.5
    fn = at.kernel_fn("hopper", at.CONFIGS["hopper"][0], scale, False)
    x = at.make_set(jax.random.key(0), 8192, 8192, 32, 8, 128, jnp.bfloat16)
    pairs = 8192 * 8193 / 2
    return (lambda: fn(*x)), 4 * 32 * 128 * pairs, 10, _none


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=8.0, help="per phase")
    ap.add_argument("--phases", default="prefill-idle,matmul-zeros,matmul-random,gemm-gate,"
                    "prefill,attention")
    ap.add_argument("--out", default=None, help="write the phases and every sample as JSON here")
    ap.add_argument("--model", default="qwen3-4b", help="the prefill's model (qwen3-tiny: a CPU "
                    "smoke test, with --size 256 --phases matmul-random,prefill)")
    ap.add_argument("--prompt", type=int, default=8192, help="the prefill's prompt, one chunk")
    ap.add_argument("--size", type=int, default=8192, help="the matmuls' n")
    args = ap.parse_args()
    n = args.size
    makers = {"matmul-random": lambda: matmul(n, n, n, 1.0),
              "matmul-zeros": lambda: matmul(n, n, n, None),
              # qwen3-4b's gate (or up) product at 8192 rows, weights N(0, 0.02) as prefill's
              "gemm-gate": lambda: matmul(n, n * 19 // 16, n * 5 // 16, 0.02),
              "prefill": lambda: prefill(args.model, args.prompt), "attention": attention,
              # one prefill at a time after 3 s idle, as a benchmark that times a few runs
              # sees the GPU: its power limit averages over time, so a burst runs faster
              "prefill-idle": lambda: prefill(args.model, args.prompt, idle=3.0)}
    path = Path(tempfile.mkdtemp()) / "smi.csv"
    smi = sample(path)
    phases = {}
    try:
        for name in args.phases.split(","):
            phase = makers[name]()
            time.sleep(1.0)  # a gap between phases in the samples
            phases[name] = run_for(phase, args.seconds)
            print(f"{name}: {phases[name]['runs']} runs, {phases[name]['ms']:.3f} ms, "
                  f"{phases[name]['tflop_s']:.1f} TFLOP/s", flush=True)
            del phase
    finally:
        time.sleep(0.3)
        if smi is not None:
            smi.terminate()
            smi.wait()
    samples = read_samples(path) if path.exists() else []
    if shutil.which("nvidia-smi"):
        print(subprocess.run(["nvidia-smi", "-i", "0", "--query-gpu=power.limit,"
                              "enforced.power.limit,power.max_limit,clocks.max.sm",
                              "--format=csv"], capture_output=True, text=True).stdout.strip())
    print(f"\n{len(samples)} nvidia-smi samples; {jax.devices()[0].device_kind}, jax {jax.__version__}")
    print("| phase | TFLOP/s | % of 989 | SM MHz median | p10 | W mean | C max | peak at median "
          "clock | % of it | reasons |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for name, p in phases.items():
        # samples while a timed rep ran; past the first second of a sustained phase (the clock
        # coming down)
        skip = 0.0 if name.endswith("-idle") else 1.0
        s = [x for x in samples if x[0] >= p["t0"] + skip
             and any(a <= x[0] <= b for a, b in p["spans"])]
        if not s:
            print(f"| {name} | {p['tflop_s']:.1f} | no samples |")
            continue
        mhz = sorted(x[1] for x in s)
        med, p10 = statistics.median(mhz), mhz[len(mhz) // 10]
        peak = PEAK * med / RATED_MHZ
        reasons = sorted({REASONS.get(int(x[4], 16), x[4]) if x[4].startswith("0x") else x[4]
                          for x in s})
        p.update(samples=len(s), mhz_median=med, mhz_p10=p10,
                 watts=statistics.fmean(x[2] for x in s), celsius=max(x[3] for x in s),
                 peak_at_clock=peak, reasons=reasons)
        print(f"| {name} | {p['tflop_s']:.1f} | {100 * p['tflop_s'] * 1e12 / PEAK:.1f} | "
              f"{med:.0f} | {p10:.0f} | {p['watts']:.0f} | {p['celsius']:.0f} | "
              f"{peak / 1e12:.0f} | {100 * p['tflop_s'] * 1e12 / peak:.1f} | {' '.join(reasons)} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"gpu": jax.devices()[0].device_kind,
                                              "jax": jax.__version__, "phases": phases,
                                              "samples": samples}, indent=1))


if __name__ == "__main__":
    main()
