"""`kernjax.kernels.attention_pallas.chunk_attention` against a dense reference.

On the CPU the kernel runs in Pallas interpret mode on small shapes (small D and blocks, so that
several q tiles and key blocks run); the lowering test checks that it lowers to a Triton call for
an H200 without one. The `gpu` tests run the real kernel at Qwen3-4B shapes on a GPU only, and
the same tests for the Mosaic GPU kernel (`kernjax/kernels/attention_hopper.py`) and for FlashAttention-3
through `kj_fa3` (`kernjax/kernels/attention_fa3.py`, the bf16 route: it needs `scripts/fa3`'s library).

Every slot of every page that holds no key of a sequence's context is NaN (page 0 included), so a
read past the context shows up as NaN in the output.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernjax.kernels import attention_fa3
from kernjax.kernels import attention_hopper
from kernjax.kernels.attention_pallas import chunk_attention

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")

PAGE = 16  # rows a page unless a test says otherwise; 128 is head_dim 128's (attention.page_size)
gpu = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")


def make_item(rng, pieces, *, rows, heads, kv_heads, d, dtype, width=None, order=None,
              page=PAGE):
    """A packed item. pieces: (prefix, chunk) per sequence; the chunk's rows are at positions
    prefix .. prefix+chunk-1 and its keys (like the prefix's) are already in the pages of `page`
    rows. Pages are shuffled; unused slots are NaN. `order` permutes the page ids (for a
    reproducible layout)."""
    seqs = len(pieces)
    need = [-(-(p + c) // page) for p, c in pieces]
    width = width or max(max(need), 1)
    pages = sum(need) + 1
    ids = order if order is not None else rng.permutation(np.arange(1, pages))
    kv = np.full((pages, page, 2, kv_heads, d), np.nan, np.float32)
    page_table = np.zeros((seqs, width), np.int32)
    cu = np.zeros(seqs + 1, np.int32)
    positions = np.zeros(rows, np.int32)
    at = 0
    for s, (prefix, chunk) in enumerate(pieces):
        page_table[s, :need[s]] = ids[at:at + need[s]]
        at += need[s]
        n = prefix + chunk
        j = np.arange(n)
        kv[page_table[s, j // page], j % page] = rng.standard_normal((n, 2, kv_heads, d))
        cu[s + 1] = cu[s] + chunk
        positions[cu[s]:cu[s + 1]] = prefix + np.arange(chunk)
    assert cu[-1] <= rows
    q = rng.standard_normal((rows, heads, d)).astype(np.float32)
    positions[cu[-1]:] = rng.integers(0, 1000, rows - cu[-1])  # padding rows: anything
    return (jnp.asarray(kv, dtype), jnp.asarray(q, dtype), jnp.asarray(positions),
            jnp.asarray(cu), jnp.asarray(page_table))


def reference(kv, q, positions, cu, page_table, scale):
    """float64 numpy: each sequence's rows over its keys 0..position, gathered by page table."""
    kv, q = np.asarray(kv, np.float64), np.asarray(q, np.float64)
    positions, cu, page_table = map(np.asarray, (positions, cu, page_table))
    rows, heads, d = q.shape
    g, page = heads // kv.shape[3], kv.shape[1]
    out = np.zeros_like(q)
    for s in range(len(cu) - 1):
        r = np.arange(cu[s], cu[s + 1])
        if not len(r):
            continue
        j = np.arange(positions[r].max() + 1)
        keys = kv[page_table[s, j // page], j % page]  # [n, 2, KV, D]
        k, v = np.repeat(keys[:, 0], g, axis=1), np.repeat(keys[:, 1], g, axis=1)
        sc = np.einsum("rhd,nhd->rhn", q[r], np.nan_to_num(k)) * scale
        sc = np.where(j[None, None, :] <= positions[r][:, None, None], sc, -np.inf)
        p = np.exp(sc - sc.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        out[r] = np.einsum("rhn,nhd->rhd", p, np.nan_to_num(v))
    return out


def check(out, ref, cu, tol):
    out = np.asarray(out.astype(jnp.float32), np.float64)
    assert not np.isnan(out).any()
    assert (out[int(cu[-1]):] == 0).all(), "padding rows must be exactly 0"
    err = np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30)
    assert err < tol, err


# (pieces, rows, heads, kv_heads, d, block_q, block_k, page)
CASES = {
    "one-seq": ([(0, 40)], 48, 4, 2, 32, 8, 16, 16),
    "packed-prefix-empty": ([(5, 17), (0, 0), (37, 20), (70, 1)], 48, 4, 2, 32, 8, 16, 16),
    "gqa4-long-prefix": ([(100, 9), (0, 16), (33, 30)], 64, 8, 2, 16, 4, 32, 16),
    "mha-blocks32": ([(20, 45), (63, 1)], 50, 2, 2, 32, 16, 32, 16),
    "all-padding": ([(10, 0), (0, 0)], 16, 4, 2, 32, 8, 16, 16),
    "pages-of-128": ([(200, 9), (0, 30), (120, 10)], 64, 4, 2, 16, 8, 32, 128),
}


@pytest.mark.parametrize("case,dtype", [(c, "float32") for c in CASES] + [
    (c, "bfloat16") for c in ("packed-prefix-empty", "gqa4-long-prefix", "mha-blocks32")])
def test_matches_reference(case, dtype):
    pieces, rows, heads, kv_heads, d, bq, bk, page = CASES[case]
    rng = np.random.default_rng(len(case))
    args = make_item(rng, pieces, rows=rows, heads=heads, kv_heads=kv_heads, d=d, dtype=dtype,
                     page=page)
    scale = d ** -0.5
    out = chunk_attention(*args, scale=scale, block_q=bq, block_k=bk, interpret=True)
    assert out.shape == (rows, heads, d) and out.dtype == jnp.dtype(dtype)
    # The reference sees the same (rounded) inputs.
    ref = reference(args[0].astype(jnp.float32), args[1].astype(jnp.float32), *args[2:], scale)
    check(out, ref, args[3], 1e-5 if dtype == "float32" else 1e-2)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_batch_invariance(dtype):
    """Sequence X (a chunk after a prefix) alone, then packed after and before other sequences,
    in the same shapes: its rows are byte-identical."""
    rows, heads, kv_heads, d = 64, 4, 2, 32
    x = (29, 27)
    layouts = [[x, (0, 0), (0, 0)], [(3, 11), (40, 13), x], [x, (50, 30), (0, 5)]]
    outs = []
    for pieces in layouts:
        rng = np.random.default_rng(7)  # X gets the same keys, values and queries each time
        args = make_item(rng, [x], rows=rows, heads=heads, kv_heads=kv_heads, d=d, dtype=dtype,
                         width=6)
        kv1, q1, pos1, _, pt1 = map(np.asarray, args)
        other = make_item(np.random.default_rng(len(outs)), pieces, rows=rows, heads=heads,
                          kv_heads=kv_heads, d=d, dtype=dtype, width=6)
        kv, q, pos, cu, pt = map(np.array, other)
        s = pieces.index(x)
        # Put X's pages at the end of the pool and its rows at its place in the item.
        base = kv.shape[0]
        kv = np.concatenate([kv, kv1[1:]])
        kv = np.concatenate([kv, np.full((64 - len(kv), *kv.shape[1:]), np.nan, kv.dtype)])
        pt[s] = np.where(pt1[0] > 0, pt1[0] + base - 1, 0)
        r = slice(int(cu[s]), int(cu[s + 1]))
        q[r], pos[r] = q1[:x[1]], pos1[:x[1]]
        out = chunk_attention(*map(jnp.asarray, (kv, q, pos, cu, pt)), scale=d ** -0.5,
                              block_q=8, block_k=16, interpret=True)
        outs.append(np.asarray(out)[r])
    for o in outs[1:]:
        assert o.tobytes() == outs[0].tobytes()


def test_lowers_to_triton():
    """The kernel lowers to a Triton custom call for an H200, on any machine."""
    dev = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=None, platform="gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=dev)
    S = jax.ShapeDtypeStruct
    args = (S((257, PAGE, 2, 8, 128), jnp.bfloat16), S((512, 32, 128), jnp.bfloat16),
            S((512,), jnp.int32), S((5,), jnp.int32), S((4, 64), jnp.int32))
    fn = jax.jit(lambda *a: chunk_attention(*a, scale=128 ** -0.5))
    with jax.sharding.use_abstract_mesh(mesh):
        text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in text


# ---- GPU: Qwen3-4B attention shapes (H=32, KV=8, D=128, bf16) -------------------------------


@functools.partial(jax.jit, static_argnames=("n", "g"))
def _reference_block(kv, pt_row, qs, pos, scale, *, n, g):
    """float32: rows `qs` at positions `pos` of one sequence over its keys 0..n-1 (masked by
    position; keys past the context are gathered from wherever and masked)."""
    j, page = jnp.arange(n), kv.shape[1]
    keys = kv[pt_row[jnp.minimum(j // page, pt_row.shape[0] - 1)], j % page]
    keys = jnp.nan_to_num(keys.astype(jnp.float32))
    k, v = jnp.repeat(keys[:, 0], g, axis=1), jnp.repeat(keys[:, 1], g, axis=1)
    hi = jax.lax.Precision.HIGHEST
    sc = jnp.einsum("rhd,nhd->hrn", qs.astype(jnp.float32), k, precision=hi) * scale
    sc = jnp.where(j[None, None, :] <= pos[None, :, None], sc, -jnp.inf)
    return jnp.einsum("hrn,nhd->rhd", jax.nn.softmax(sc, axis=-1), v, precision=hi)


def _gpu_reference(kv, q, positions, cu, page_table, scale, step=1024):
    """float32 jnp on the device, per sequence and `step` rows at a time; shapes are bucketed
    (rows to `step`, keys to a power of two) so that few programs are compiled."""
    g = q.shape[1] // kv.shape[3]
    out = np.zeros(q.shape, np.float32)
    cu_h, pos_h = np.asarray(cu), np.asarray(positions)
    for s in range(len(cu_h) - 1):
        for a in range(int(cu_h[s]), int(cu_h[s + 1]), step):
            b = min(a + step, int(cu_h[s + 1]))
            n = max(1024, 1 << int(pos_h[b - 1]).bit_length())
            qs = jnp.zeros((step, *q.shape[1:]), q.dtype).at[:b - a].set(q[a:b])
            pos = jnp.zeros(step, jnp.int32).at[:b - a].set(positions[a:b])
            o = _reference_block(kv, page_table[s], qs, pos, scale, n=n, g=g)
            out[a:b] = np.asarray(o[:b - a])
    return out


def _gpu_item(seed, pieces, rows, width=None, page=PAGE):
    """Like make_item, built on the device (contexts up to 32k would be slow from numpy)."""
    rng = np.random.default_rng(seed)
    need = [-(-(p + c) // page) for p, c in pieces]
    width = width or max(max(need), 1)
    pages = sum(need) + 1
    ids = rng.permutation(np.arange(1, pages))
    page_table = np.zeros((len(pieces), width), np.int32)
    cu = np.zeros(len(pieces) + 1, np.int32)
    positions = np.zeros(rows, np.int32)
    at = 0
    for s, (prefix, chunk) in enumerate(pieces):
        page_table[s, :need[s]] = ids[at:at + need[s]]
        at += need[s]
        cu[s + 1] = cu[s] + chunk
        positions[cu[s]:cu[s + 1]] = prefix + np.arange(chunk)
    key = jax.random.key(seed)
    kv = jax.random.normal(key, (pages, page, 2, 8, 128), jnp.bfloat16)
    kv = kv.at[0].set(jnp.nan)  # unused page-table entries point here
    q = jax.random.normal(jax.random.fold_in(key, 1), (rows, 32, 128), jnp.bfloat16)
    return kv, q, jnp.asarray(positions), jnp.asarray(cu), jnp.asarray(page_table)


GPU_ITEMS = {
    "2048-after-6144": ([(6144, 2048)], 2048),
    "512-after-32256": ([(32256, 512)], 512),
    "8192-two-seqs": ([(0, 4096), (100, 4000)], 8192),
    "16-packed": ([(0, 1), (31000, 63), (5, 64), (0, 0), (777, 512), (16, 1), (2048, 63),
                   (9000, 64), (1, 1), (4095, 30), (12, 16), (0, 0), (30000, 2), (64, 63),
                   (100, 17), (8192, 1)], 1024),
}


KERNELS = {"triton": chunk_attention, "hopper": attention_hopper.chunk_attention,
           "fa3": attention_fa3.chunk_attention, "fa3-page128": attention_fa3.chunk_attention,
           "triton-page128": chunk_attention}
PAGES = {k: 128 if k.endswith("page128") else PAGE for k in KERNELS}  # rows a page, by kernel
VARIANTS = {f"hopper-{k}": kw for k, kw in attention_hopper.VARIANTS.items()}
TRY_VARIANTS = bool(os.environ.get("KERNJAX_TRY_VARIANTS"))
if TRY_VARIANTS:  # experiments/gpu_gate.sh variant: the experiments' checks, in a device call of
    # their own (a kernel that deadlocks must not take the gates along)
    KERNELS.update({k: functools.partial(attention_hopper.chunk_attention, **kw)
                    for k, kw in VARIANTS.items()})


@gpu
@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("name", list(GPU_ITEMS))
def test_gpu_matches_reference(name, kernel):
    chunk_attention = KERNELS[kernel]
    pieces, rows = GPU_ITEMS[name]
    args = _gpu_item(len(name), pieces, rows, page=PAGES.get(kernel, PAGE))
    scale = 128 ** -0.5
    poison = jnp.full((rows, 32, 128), jnp.nan, jnp.bfloat16)  # likely reused for the output
    poison.block_until_ready()
    del poison
    out = chunk_attention(*args, scale=scale)
    again = chunk_attention(*args, scale=scale)
    assert np.asarray(out).tobytes() == np.asarray(again).tobytes(), "run to run"
    check(out, _gpu_reference(*args, scale), args[3], 1e-2)


@gpu
@pytest.mark.parametrize("name", list(GPU_ITEMS))
def test_gpu_hopper_turns_at_named_barriers_or_an_mbarrier_give_the_same_bits(name):
    """How the warpgroups take turns (`named`: one way at hardware barriers, the default; or
    meeting at a shared-memory mbarrier, as the interpreter runs it) does not change the sums."""
    args = _gpu_item(len(name), *GPU_ITEMS[name])
    outs = [attention_hopper.chunk_attention(*args, scale=128 ** -0.5, named=named)
            for named in (True, False)]
    assert np.asarray(outs[0]).tobytes() == np.asarray(outs[1]).tobytes()


@gpu
@pytest.mark.parametrize("kernel", list(KERNELS))
def test_gpu_batch_invariance(kernel):
    """One sequence alone and packed among others (same rows, seqs, width): same bytes."""
    chunk_attention = KERNELS[kernel]
    x = (3000, 300)
    page = PAGES.get(kernel, PAGE)
    rows, width = 1024, 4096 // page
    alone = _gpu_item(1, [x, (0, 0), (0, 0)], rows, width, page)
    packed = list(_gpu_item(2, [(500, 100), (2000, 77), x], rows, width, page))
    kv1, q1, pos1, _, pt1 = alone
    kv, q, pos, cu, pt = packed
    base = kv.shape[0]
    kv = jnp.concatenate([kv, kv1[1:]])
    pt = pt.at[2].set(jnp.where(pt1[0] > 0, pt1[0] + base - 1, 0))
    a, b = int(cu[2]), int(cu[3])
    q = q.at[a:b].set(q1[:x[1]])
    pos = pos.at[a:b].set(pos1[:x[1]])
    o1 = chunk_attention(*alone, scale=128 ** -0.5)
    o2 = chunk_attention(kv, q, pos, cu, pt, scale=128 ** -0.5)
    assert np.asarray(o1)[:x[1]].tobytes() == np.asarray(o2)[a:b].tobytes()
