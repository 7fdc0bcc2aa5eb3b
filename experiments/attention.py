"""Times the chunked-prefill attention kernels on a GPU: FlashAttention-3 through `kj_fa3`
(`kernjax/kernels/attention_fa3.py`, the route for bf16 with head_dim 128: `fa3-page128` on pages of 128
rows read in place, as qwen3-4b's are; `fa3-paged` on pages of 16, gathered first), the Mosaic GPU
kernel (`kernjax/kernels/attention_hopper.py`, f16 and head_dim 64) and the Pallas Triton one
(`kernjax/kernels/attention_pallas.py`, the route for float32).

One sequence per item: a chunk of C query rows at positions K-C .. K-1, so it attends over K keys
(H=32, KV=8, D=128, bf16, shuffled pages). FLOPs are 4 * H * D per causal (query, key) pair,
pairs = C * (K - C) + C * (C + 1) / 2. Each config is first checked against a float32 jnp
reference (rel. error < 1e-2, no NaN, run-to-run bitwise equal); then each timing is the median
over --reps of the mean of --inner back-to-back calls, rotating between --sets input sets (so
the keys and values are not all in L2). `--rounds N` times every config N times, the order
reversed every other round, and takes the median of the rounds: an A/B of a few per cent is
noise until it holds both ways (`docs/lessons.md`). With `nvidia-smi` present each row also
gets the SM clock its timed calls ran at (median of samples every 20 ms): the H200 here is held
at 700 W, so a row's rate follows its clock (`experiments/clocks.py`). Prints a table; --out
writes it as JSON, with the run's record (experiments/harness.py).

Anchors (`--kernel torch-cudnn,torch-flash,jax-cudnn`): the same function on dense tensors (the
keys gathered out of the pages first, one sequence), timed in the same rounds: torch's
`scaled_dot_product_attention` with `causal_lower_right` through its cuDNN or FlashAttention-2
backend, and `jax.nn.dot_product_attention(implementation="cudnn")`, whose `is_causal` is
top-left aligned and so right only for the square case (its chunk cases are skipped). They
read no page table; they say what a vendor kernel reaches on this GPU at the same moment.
`--kernel fa3` adds FlashAttention-3's forward (causal, dense, one sequence; bottom-right aligned
like the chunk), built by `scripts/fa3` with kernjax's own route and found where `kj_fa3` finds
it (`kernjax.kernels.ffi.fa3_path()`).

    python -m experiments.attention                      # each kernel's default config
    python -m experiments.attention --sweep --out attention.json
    python -m experiments.attention --kernel hopper,hopper-mbarrier --rounds 4
    python -m experiments.attention --kernel hopper,torch-cudnn --cases 8192:8192 --rounds 4
    python -m experiments.attention --kernel triton --interpret --small  # CPU smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp

from experiments import harness
from kernjax.kernels import attention_fa3
from kernjax.kernels import attention_hopper
from kernjax.kernels import attention_pallas

warnings.filterwarnings("ignore", message=".*Pallas Triton backend is deprecated.*")

PAGE = 16
CASES = [(512, 1024), (512, 8192), (2048, 8192), (512, 32768), (8192, 8192)]
SMALL_CASES = [(16, 32), (16, 80), (40, 64)]
# Per kernel, its configs; the first is the kernel's default.
# hopper: (block_q per compute warpgroup, block_kv, steps of keys/values in shared memory).
# triton: (block_q, block_k, num_warps, num_stages); for H/KV = 4 the tile is 4 * block_q tall.
# hopper-<name>: the kernel with the experimental options attention_hopper.VARIANTS[name]
# (mbarrier: the turns at a shared-memory mbarrier, the default until `3775424`; overlap,
# overlap-turns, overlap-named: FlashAttention-3's intra-warpgroup overlap, alone, with the turns
# at an mbarrier, with the turns one way; fma-exp, fma-exp-16: the last 32 or 16 key columns'
# exponentials by a polynomial on the FMA pipes).
CONFIGS = {
    "hopper": [(64, 128, 2), (64, 64, 2), (64, 64, 3), (64, 64, 4)],
    **{f"hopper-{v}": [(64, 128, 2), (64, 64, 3)] for v in attention_hopper.VARIANTS},
    "triton": [(32, 64, 8, 3), (32, 64, 8, 2), (32, 128, 8, 3), (32, 128, 8, 2), (16, 64, 4, 3),
               (64, 64, 8, 3)],
    "fa3-paged": [()],
    "fa3-page128": [()],
}
ANCHORS = ("torch-cudnn", "torch-flash", "jax-cudnn", "fa3")
CONFIGS.update({a: [()] for a in ANCHORS})
SMALL_CONFIGS = {"hopper": [(64, 64, 2)], "triton": [(8, 16, 4, 3), (16, 32, 4, 2)],
                 "fa3-paged": [()], "fa3-page128": [()],
                 **{a: [()] for a in ANCHORS}}
NAMES = {**{k: ("block_q", "block_kv", "steps") for k in CONFIGS if k.startswith("hopper")},
         "triton": ("block_q", "block_k", "num_warps", "num_stages"), "fa3-paged": (),
         "fa3-page128": (), **{a: () for a in ANCHORS}}
# fa3-page128: the same route on pages of 128 rows (head_dim 128's, qwen3's `page`), read in place;
# every other kernel and anchor reads the same keys from pages of 16 (fa3-paged: gathered first)
PAGE_OF = {"fa3-page128": 128}


def dense(k, kv, q, positions, cu, page_table):
    """The set's k keys and values gathered out of their pages: (q [C, H, D], k, v [K, KV, D])."""
    j, page = jnp.arange(k), kv.shape[1]
    keys = kv[page_table[0, j // page], j % page]
    return q, keys[:, 0], keys[:, 1]


def anchor_fn(kernel, scale, c, k):
    """(fn of a set, sync) for an anchor; None where it computes another function."""
    if kernel == "jax-cudnn":
        if c != k:
            return None  # top-left aligned: right only for the square case

        @jax.jit
        def attend(*x):
            q, kk, vv = dense(k, *x)
            return jax.nn.dot_product_attention(q[None], kk[None], vv[None], scale=scale,
                                                is_causal=True, implementation="cudnn")[0]
        return attend, jax.block_until_ready
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    fa3 = kernel == "fa3"
    if fa3:  # q [C, H, D], k and v [K, KV, D], o like q: FlashAttention's own layout
        import ctypes
        from kernjax.kernels import ffi
        lib = ctypes.CDLL(str(ffi.fa3_path()))  # scripts/fa3's library, as kj_fa3 finds it
        semaphore = torch.zeros(1, dtype=torch.int32, device="cuda")
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        gather = jax.jit(lambda *x: dense(k, *x))
    else:  # torch's [1, heads, rows, D]
        backend = {"torch-cudnn": SDPBackend.CUDNN_ATTENTION,
                   "torch-flash": SDPBackend.FLASH_ATTENTION}[kernel]
        gather = jax.jit(lambda *x: tuple(jnp.swapaxes(a, 0, 1)[None] for a in dense(k, *x)))
    cache = {}

    def attend(*x):
        key = id(x[0])  # the dense copies of each set, made once (not timed)
        if key not in cache:
            cache[key] = (x[0], [torch.from_dlpack(a) for a in gather(*x)])
        qt, kt, vt = cache[key][1]
        if fa3:
            o = torch.empty_like(qt)
            lse = torch.empty((qt.shape[1], c), dtype=torch.float32, device="cuda")
            ptr = ctypes.c_void_p
            rc = lib.kj_fa3_fwd(*(ptr(t.data_ptr()) for t in (qt, kt, vt, o, lse, semaphore)),
                                c, k, qt.shape[1], kt.shape[1], ctypes.c_float(scale), sms,
                                ptr(torch.cuda.current_stream().cuda_stream))
            if rc:
                raise RuntimeError(f"kj_fa3_fwd returned {rc}")
            return o
        with sdpa_kernel(backend):
            o = torch.nn.functional.scaled_dot_product_attention(
                qt, kt, vt, attn_mask=causal_lower_right(c, k), scale=scale, enable_gqa=True)
        return o

    def sync(o):
        torch.cuda.synchronize()
        return o

    def result(*x):  # [C, H, D] as a jax array, for the check against the reference
        o = attend(*x)
        return jnp.asarray((o if fa3 else o[0].transpose(0, 1)).float().cpu().numpy())
    attend.result = result
    return attend, sync


def kernel_fn(kernel, config, scale, interpret):
    """The kernel as a jitted function of a set; anchors are made by `anchor_fn`."""
    kw = dict(zip(NAMES[kernel], config))
    if kernel in ("fa3-paged", "fa3-page128"):
        return jax.jit(lambda *x: attention_fa3.chunk_attention(*x, scale=scale))
    if kernel.startswith("hopper"):
        if interpret:
            from jax.experimental.pallas import mosaic_gpu as plgpu
            kw["interpret"] = plgpu.InterpretGPUParams()
        kw.update(attention_hopper.VARIANTS.get(kernel.removeprefix("hopper-"), {}))
        return jax.jit(lambda *x: attention_hopper.chunk_attention(*x, scale=scale, **kw))
    return jax.jit(lambda *x: attention_pallas.chunk_attention(
        *x, scale=scale, interpret=interpret, **kw))


def make_set(key, c, k, heads, kv_heads, d, dtype, page=PAGE):
    """One item: a single sequence with c rows at positions k-c .. k-1, its k keys on shuffled
    pages of `page` rows (page 0 unused, NaN); the same keys and queries at any page."""
    n_pages = -(-k // 128) * 128 // page
    perm = jax.random.permutation(jax.random.fold_in(key, 0), n_pages) + 1
    keys = jax.random.normal(jax.random.fold_in(key, 1), (n_pages, page, 2, kv_heads, d), dtype)
    kv = jnp.full((n_pages + 1, *keys.shape[1:]), jnp.nan, dtype).at[perm].set(keys)
    q = jax.random.normal(jax.random.fold_in(key, 2), (c, heads, d), dtype)
    positions = jnp.arange(k - c, k, dtype=jnp.int32)
    cu = jnp.array([0, c], jnp.int32)
    page_table = perm.astype(jnp.int32)[None, :]
    return kv, q, positions, cu, page_table


def reference(kv, q, positions, cu, page_table, scale, rows_per_step=1024):
    """float32 jnp, one sequence, `rows_per_step` rows at a time (the scores fit in memory)."""
    g = q.shape[1] // kv.shape[3]
    k = int(positions[-1]) + 1
    j, page = jnp.arange(k), kv.shape[1]
    keys = kv[page_table[0, j // page], j % page].astype(jnp.float32)
    kk, vv = jnp.repeat(keys[:, 0], g, axis=1), jnp.repeat(keys[:, 1], g, axis=1)

    @jax.jit  # keys and values as arguments: as constants XLA would fold them, slowly
    def step(qs, pos, kk, vv):
        s = jnp.einsum("rhd,nhd->hrn", qs.astype(jnp.float32), kk,
                       precision=jax.lax.Precision.HIGHEST) * scale
        s = jnp.where(j[None, None, :] <= pos[None, :, None], s, -jnp.inf)
        return jnp.einsum("hrn,nhd->rhd", jax.nn.softmax(s, axis=-1), vv,
                          precision=jax.lax.Precision.HIGHEST)

    outs = [step(q[a:a + rows_per_step], positions[a:a + rows_per_step], kk, vv)
            for a in range(0, q.shape[0], rows_per_step)]
    return jnp.concatenate(outs)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernel", default="fa3-page128,fa3-paged,hopper,triton",
                    help="comma-separated: fa3-page128 (pages of 128, qwen3-4b's), fa3-paged "
                    "(pages of 16, gathered), hopper, triton, an anchor (torch-cudnn, "
                    "torch-flash, jax-cudnn, fa3) or an experimental hopper-<name> "
                    f"({', '.join(attention_hopper.VARIANTS)})")
    ap.add_argument("--sweep", action="store_true", help="time every config of CONFIGS")
    ap.add_argument("--config", default=None, help="one config, e.g. 64,128,2, for each kernel")
    ap.add_argument("--cases", default=None, help="C:K pairs, e.g. 512:8192,2048:8192")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=1, help="time every config this many times, "
                    "the order reversed every other round; the median of the rounds counts")
    ap.add_argument("--inner", type=int, default=5, help="calls per timed rep")
    ap.add_argument("--sets", type=int, default=3, help="input sets to rotate between")
    ap.add_argument("--interpret", action="store_true", help="Pallas interpret mode (CPU)")
    ap.add_argument("--small", action="store_true", help="tiny shapes (H=4, KV=2, D=64)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    a = ap.parse_args()

    heads, kv_heads, d = (4, 2, 64) if a.small else (32, 8, 128)
    dtype = jnp.bfloat16
    scale = d ** -0.5
    cases = CASES if not a.small else SMALL_CASES
    if a.cases:
        cases = [tuple(int(x) for x in p.split(":")) for p in a.cases.split(",")]
    kernels = a.kernel.split(",")
    unknown = [kn for kn in kernels if kn not in NAMES]
    if unknown:
        ap.error(f"--kernel {','.join(unknown)}: not a kernel; known: {', '.join(NAMES)}")
    table = SMALL_CONFIGS if a.small else CONFIGS
    if a.config:
        config = tuple(int(x) for x in a.config.split(","))
        configs = [(kn, config) for kn in kernels]
        if any(len(config) != len(NAMES[kn]) for kn in kernels):
            ap.error(f"--config {a.config}: " + "; ".join(
                f"{kn} takes {','.join(NAMES[kn])}" for kn in kernels))
    else:
        configs = [(kn, c) for kn in kernels for c in (table[kn] if a.sweep else table[kn][:1])]
    if a.small:
        a.reps, a.inner = min(a.reps, 2), 1
    if a.interpret and any(kn in ANCHORS or kn.startswith("fa3-") for kn in kernels):
        ap.error("--interpret: fa3-paged, fa3-page128 and the anchors (torch-*, jax-cudnn, fa3) "
                 "run on a GPU only")
    if any(kn.startswith("torch") or kn == "fa3" for kn in kernels):
        # before JAX takes 75 % of the GPU
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    print(f"backend {jax.default_backend()} ({jax.devices()[0].device_kind}), H={heads} "
          f"KV={kv_heads} D={d} bf16, interpret={a.interpret}", flush=True)
    smi_file = Path(tempfile.mkdtemp()) / "smi.csv"
    smi = harness.sample(smi_file)

    results = []
    for c, k in cases:
        pairs = c * (k - c) + c * (c + 1) // 2
        flops = 4 * heads * d * pairs
        by_page = {p: [make_set(jax.random.key(i), c, k, heads, kv_heads, d, dtype, p)
                       for i in range(a.sets)]
                   for p in {PAGE, *(PAGE_OF.get(kn, PAGE) for kn in kernels)}}
        ref = reference(*by_page[PAGE][0], scale)
        timed = []  # (row, fn) of each config that compiled and is right
        for kn, config in configs:
            sets = by_page[PAGE_OF.get(kn, PAGE)]
            sync = jax.block_until_ready
            if kn in ANCHORS:
                made = anchor_fn(kn, scale, c, k)
                if made is None:
                    print(f"C={c} K={k} {kn}: skipped (top-left causal: not the chunk's function)",
                          flush=True)
                    continue
                fn, sync = made
            else:
                fn = kernel_fn(kn, config, scale, a.interpret)
            name = f"{kn} {','.join(map(str, config))}".strip()
            row = dict(C=c, K=k, kernel=kn, **dict(zip(NAMES[kn], config)))
            results.append(row)
            result = getattr(fn, "result", fn)
            try:
                out = result(*sets[0])
                again = result(*sets[0])
                o32 = out.astype(jnp.float32)
                err = float(jnp.linalg.norm(o32 - ref) / jnp.linalg.norm(ref))
                nan = bool(jnp.isnan(o32).any())
                same = bool(jnp.all(out.view(jnp.uint16) == again.view(jnp.uint16)))
            except Exception as e:  # a config that does not compile is reported, not fatal
                row.update(error=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
                print(f"C={c} K={k} {name}: {row['error']}", flush=True)
                continue
            row.update(rel_err=err, nan=nan, bitwise_rerun=same, config=name)
            if err > 1e-2 or nan or not same:
                row.update(error="wrong result")
                print(f"C={c} K={k} {name}: WRONG rel_err={err:.2e} nan={nan} "
                      f"rerun_same={same}", flush=True)
                continue
            for x in sets:  # warm-up
                sync(fn(*x))
            timed.append((row, fn, sync, sets))
        # --rounds: every config timed once a round, the order reversed every other round (an
        # A/B under ~8 % changed sign with the order on the H200: docs/lessons.md)
        for rnd in range(a.rounds):
            for row, fn, sync, sets in (timed if rnd % 2 == 0 else timed[::-1]):
                times, wall = [], time.time()
                for r in range(a.reps):
                    t = time.perf_counter()
                    outs = [fn(*sets[(r * a.inner + i) % a.sets]) for i in range(a.inner)]
                    sync(outs[-1])
                    times.append((time.perf_counter() - t) / a.inner)
                row.setdefault("rounds_ms", []).append(statistics.median(times) * 1e3)
                row.setdefault("spans", []).append((wall, time.time()))
        for row, *_ in timed:
            ms = statistics.median(row["rounds_ms"])
            row.update(ms=ms, tflops=flops / (ms * 1e-3) / 1e12)
            each = "/".join(f"{flops / (x * 1e-3) / 1e12:.1f}" for x in row["rounds_ms"])
            print(f"C={c:5d} K={k:6d} {row['config']:18s}: {ms:8.3f} ms {row['tflops']:7.1f} "
                  f"TFLOP/s  rel_err {row['rel_err']:.1e}"
                  + (f"  (rounds: {each})" if a.rounds > 1 else ""), flush=True)

    samples = []
    if smi is not None:  # read once nvidia-smi has ended: it writes its file in blocks
        smi.terminate()
        smi.wait()
        samples = harness.read_samples(smi_file)
    shutil.rmtree(smi_file.parent, ignore_errors=True)
    for r in results:
        r["clock"] = harness.during(samples, r.pop("spans", []))
    print("\n|     C |      K | kernel, config     |       ms | TFLOP/s | SM MHz, W |")
    print("|------:|-------:|:-------------------|---------:|--------:|----------:|")
    for r in results:
        name = f"{r['kernel']} " + ",".join(str(r[n]) for n in NAMES[r["kernel"]])
        t = f"{r['ms']:8.3f} | {r['tflops']:7.1f}" if "ms" in r else f"{'-':>8} | {'error':>7}"
        ck = r.get("clock")
        ck = f"{ck['sm_mhz']:.0f}, {ck['watts']:.0f}" if ck else "-"
        print(f"| {r['C']:5d} | {r['K']:6d} | {name.strip():18s} | {t} | {ck:>9} |")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(record=harness.record(), device=jax.devices()[0].device_kind,
                           heads=heads, kv_heads=kv_heads, head_dim=d, results=results), f,
                      indent=1)
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
