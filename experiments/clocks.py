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
                 (random N(0, 0.02) weights, as `python -m experiments.prefill`)
  attention      the chunk-attention kernel alone, 8192 rows on 8192 keys (square causal)
  prefill-idle   the prefill one at a time, each after 3 s idle: a burst, as a benchmark that
                 times a few runs sees it

and prints per phase: TFLOP/s (median of the timed reps of 10 calls back to back, one
prefill), SM clock (median, 10th percentile),
power (mean), the clock-event reasons seen, and the peak at the median clock (989 TFLOP/s x
clock / 1830 MHz). It only reads the clocks; it sets nothing. `--out DIR`: results.json (the
phases and every sample) and README.md.

    python -m experiments.clocks --seconds 8 --out clocks
    python -m experiments.clocks --model qwen3-tiny --prompt 256 --size 256 --phases matmul-random,prefill --seconds 1  # CPU
"""

from __future__ import annotations

import argparse
import statistics
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import kernjax  # noqa: F401  (its XLA flags and caches before jax starts)
import jax
import jax.numpy as jnp
import numpy as np

from experiments import harness
from experiments.harness import PEAK, RATED_MHZ, REASONS


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
    """kernjax's whole program (`experiments/systems.py`) on one prompt of `s` tokens."""
    from experiments import systems
    from kernjax import models

    fam, cfg = models.named(model)
    weights = systems.random_weights(fam, cfg, "bfloat16")
    tokens = {s: np.random.default_rng(0).integers(0, cfg.vocab, s).astype(np.int32)}
    system = systems.make("kernjax", fam, cfg, systems.Settings(context=s), weights, tokens)
    h, _ = system.prepare(s, s)

    def setup():
        system.reset(h)
        time.sleep(idle)
    return (lambda: system.prefill(h)[1]), systems.flops(cfg, s), 1, setup


def attention():
    from experiments import attention as at
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
    ap.add_argument("--out", default=None, help="a directory: results.json (the phases and every "
                    "sample) and README.md")
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
    bad = [p for p in args.phases.split(",") if p not in makers]
    if bad:
        ap.error(f"--phases: {', '.join(bad)} not of {', '.join(makers)}")
    report = harness.Report("The GPU's clock under each kind of load", __doc__.split("\n\n")[0])
    path = Path(tempfile.mkdtemp()) / "smi.csv"
    smi = harness.sample(path)
    phases = {}
    try:
        for name in args.phases.split(","):
            phase = makers[name]()
            time.sleep(1.0)  # a gap between phases in the samples
            phases[name] = run_for(phase, args.seconds)
            harness.say(f"{name}: {phases[name]['runs']} runs, {phases[name]['ms']:.3f} ms, "
                        f"{phases[name]['tflop_s']:.1f} TFLOP/s")
            del phase
    finally:
        time.sleep(0.3)
        if smi is not None:
            smi.terminate()
            smi.wait()
    samples = harness.read_samples(path)
    if shutil.which("nvidia-smi"):
        report.note(subprocess.run(["nvidia-smi", "-i", "0", "--query-gpu=power.limit,"
                                    "enforced.power.limit,power.max_limit,clocks.max.sm",
                                    "--format=csv"], capture_output=True, text=True).stdout.strip())
    report.note(f"{len(samples)} nvidia-smi samples; {jax.devices()[0].device_kind}, "
                f"jax {jax.__version__}")
    report.table("phase", "TFLOP/s", "% of 989", "SM MHz median", "p10", "W mean", "C max",
                 "peak at median clock", "% of it", "reasons", right="lrrrrrrrrl")
    for name, p in phases.items():
        # samples while a timed rep ran; past the first second of a sustained phase (the clock
        # coming down)
        skip = 0.0 if name.endswith("-idle") else 1.0
        s = [x for x in samples if x[0] >= p["t0"] + skip
             and any(a <= x[0] <= b for a, b in p["spans"])]
        if not s:
            report.row(name, f"{p['tflop_s']:.1f}", "no samples", *[""] * 7)
            continue
        mhz = sorted(x[1] for x in s)
        med, p10 = statistics.median(mhz), mhz[len(mhz) // 10]
        peak = PEAK * med / RATED_MHZ
        reasons = sorted({REASONS.get(int(x[4], 16), x[4]) if x[4].startswith("0x") else x[4]
                          for x in s})
        p.update(samples=len(s), mhz_median=med, mhz_p10=p10,
                 watts=statistics.fmean(x[2] for x in s), celsius=max(x[3] for x in s),
                 peak_at_clock=peak, reasons=reasons)
        report.row(name, f"{p['tflop_s']:.1f}", f"{100 * p['tflop_s'] * 1e12 / PEAK:.1f}",
                   f"{med:.0f}", f"{p10:.0f}", f"{p['watts']:.0f}", f"{p['celsius']:.0f}",
                   f"{peak / 1e12:.0f}", f"{100 * p['tflop_s'] * 1e12 / peak:.1f}",
                   " ".join(reasons))
    report.write(args.out and Path(args.out), phases=phases, samples=samples)


if __name__ == "__main__":
    main()
