"""Tests for kernjax.kernels.ffi: the extension, its registration, and the `mark` op."""

import ctypes
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from kernjax.kernels import ffi

DTYPES = [np.float32, ml_dtypes.bfloat16]
SHAPES = [(), (1,), (7,), (3, 5), (2, 3, 4), (0, 4)]


def _data(shape, dtype, seed=0):
    """Random values with a NaN, -0.0 and infinities mixed in where they fit."""
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    flat = x.reshape(-1)
    specials = np.array([np.nan, -0.0, np.inf, -np.inf], np.float32)
    flat[: min(flat.size, specials.size)] = specials[: flat.size]
    return x.astype(dtype)


def _bits(a):
    a = np.asarray(a)
    return a.view({2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def _on_cpu():
    """Runs on the CPU backend, whatever the default device: the host-slot
    tests below hand the op ordinary (unpinned) host memory."""
    return jax.default_device(jax.devices("cpu")[0])


def _assert_bitwise(out, expected):
    out, expected = np.asarray(out), np.asarray(expected)
    assert out.dtype == expected.dtype and out.shape == expected.shape
    np.testing.assert_array_equal(_bits(out), _bits(expected))


def test_extension_imports(monkeypatch):
    from kernjax import _ffi

    assert ffi.available()
    assert _ffi.jax_version() == jax.__version__
    # CUDA compiled in or not: the CUDA handlers are there exactly when it says so
    assert _ffi.has_cuda() is bool(_ffi.registrations()["cuda"])
    ffi.register()
    assert ffi._registered
    calls = []  # idempotent: a second call registers nothing again
    monkeypatch.setattr(jax.ffi, "register_ffi_target", lambda *a, **k: calls.append(a))
    ffi.register()
    assert calls == []


def test_missing_or_stale_extension_is_a_clear_error(monkeypatch):
    import types

    monkeypatch.setattr(ffi, "_registered", False)

    def missing(name):
        raise ImportError(f"No module named {name!r}")

    monkeypatch.setattr(ffi.importlib, "import_module", missing)
    assert not ffi.available()
    with pytest.raises(ffi.ExtensionError, match="pip install --no-build-isolation -e ."):
        ffi.register()

    stale = types.SimpleNamespace(jax_version=lambda: "0.0.1")
    monkeypatch.setattr(ffi.importlib, "import_module", lambda name: stale)
    assert not ffi.available()
    with pytest.raises(ffi.ExtensionError, match=r"built against jax 0\.0\.1"):
        ffi.mark(jnp.ones(2), 1)


def test_registrations():
    from kernjax import _ffi

    regs = _ffi.registrations()
    assert set(regs) == {"cpu", "cuda"}
    assert "kj_mark" in regs["cpu"]
    assert ("kj_mark" in regs["cuda"]) == _ffi.has_cuda()


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_mark_is_identity_under_jit(shape, dtype):
    x = _data(shape, dtype)
    out = jax.jit(ffi.mark)(x, jnp.array([3], jnp.int32))
    _assert_bitwise(out, x)
    _assert_bitwise(ffi.mark_reference(x, jnp.int32(3)), x)


def test_mark_eager_and_python_int_seq():
    x = _data((4, 4), np.float32)
    _assert_bitwise(ffi.mark(x, 5), x)
    _assert_bitwise(ffi.mark(x, np.int32(5)), x)


def test_mark_when_input_is_still_live():
    # x stays live after mark, so XLA cannot alias and the handler must copy.
    x = _data((16, 8), ml_dtypes.bfloat16)

    @jax.jit
    def f(x, seq):
        y = ffi.mark(x, seq)
        return y, x * 2

    y, x2 = f(x, jnp.int32(1))
    _assert_bitwise(y, x)
    _assert_bitwise(x2, jax.jit(lambda x: x * 2)(x))


def test_mark_writes_seq_to_host_slot():
    slot = np.zeros(4, np.int32)  # kept alive for the whole test
    addr = slot.ctypes.data
    traces = []

    @jax.jit
    def f(x, seq):
        traces.append(1)
        return ffi.mark(x, seq, slot=addr) + 1

    x = _data((8,), np.float32)
    with _on_cpu():
        for step in [1, 2, 7, -5, 2**31 - 1]:
            out = f(x, jnp.int32(step))
            jax.block_until_ready(out)
            assert slot[0] == step
            _assert_bitwise(out, x + 1)
    assert len(traces) == 1, "seq is an operand: changing it must not retrace"
    assert list(slot[1:]) == [0, 0, 0], "only one int32 is written"


def test_mark_publishes_values_into_entry_seq_mod_ring():
    """seq = [run, values...]: the values land in entry run mod ring (64-byte lines), run last;
    the other entries stay as they were (kernjax.runtime.tokens publishes the first token so)."""
    ring, words = 4, 16  # 1 + 5 int32 round up to one 64-byte line
    slot = np.zeros((ring, words), np.int32)

    @jax.jit
    def f(x, seq):
        return ffi.mark(x, seq, slot=slot.ctypes.data, ring=ring)

    with _on_cpu():
        for run in (1, 2, 5, 6):
            vals = np.arange(5, dtype=np.int32) * 10 + run
            x = _data((5,), np.float32)
            _assert_bitwise(jax.block_until_ready(f(x, jnp.asarray(np.r_[run, vals]))), x)
            assert slot[run % ring, 0] == run
            assert list(slot[run % ring, 1:6]) == list(vals)
    assert slot[0].tolist() == [0] * words and slot[3].tolist() == [0] * words
    assert list(slot[:, 6:].ravel()) == [0] * (ring * 10), "nothing past the values is written"


def test_wait_word_returns_once_the_word_is_reached_or_the_time_is_up():
    from kernjax import _ffi

    word = np.zeros(1, np.int32)
    word[0] = 7
    assert _ffi.wait_word(word.ctypes.data, 7, 5.0) == 7
    t = time.perf_counter()
    assert _ffi.wait_word(word.ctypes.data, 8, 0.05) == 7  # times out with what it saw
    assert 0.05 <= time.perf_counter() - t < 30  # after its time; only a hang takes 30 s


def test_mark_side_effect_survives_unused_result():
    slot = np.zeros(1, np.int32)

    @jax.jit
    def f(x, seq):
        ffi.mark(x, seq, slot=slot.ctypes.data)  # result dropped
        return x * 3

    with _on_cpu():
        jax.block_until_ready(f(jnp.ones(3), jnp.int32(42)))
    assert slot[0] == 42


def test_host_alloc_unmapped_slot():
    from kernjax import _ffi

    addr = _ffi.host_alloc(4)
    try:
        assert addr % 64 == 0
        value = ctypes.c_int32.from_address(addr)
        assert value.value == 0
        with _on_cpu():
            jax.block_until_ready(ffi.mark(jnp.ones(2), 9, slot=addr))
        assert value.value == 9
    finally:
        _ffi.host_free(addr)


@pytest.mark.parametrize(
    "seq, match",
    [
        (jnp.array([1.0], jnp.float32), "int32"),
        (np.array([1], np.int64), "int32"),
        (np.array([1], np.uint32), "int32"),
        (jnp.array([1], jnp.int16), "int32"),
        (True, "int32"),
        ("1", "int32"),
    ],
)
def test_bad_seq_dtype_is_a_clear_error(seq, match):
    with pytest.raises(TypeError, match=match):
        ffi.mark(jnp.ones(3), seq)


def test_bad_seq_shape_and_slot_are_clear_errors():
    with pytest.raises(ValueError, match="at least one element"):
        ffi.mark(jnp.ones(3), jnp.zeros((0,), jnp.int32))
    with pytest.raises(ValueError, match="ring must be a positive int"):
        ffi.mark(jnp.ones(3), 1, ring=0)
    with pytest.raises(ValueError, match="int32"):
        ffi.mark(jnp.ones(3), 2**31)
    with pytest.raises(ValueError, match="aligned"):
        ffi.mark(jnp.ones(3), 1, slot=0x1002)
    with pytest.raises(ValueError, match="64-bit"):
        ffi.mark(jnp.ones(3), 1, slot=-8)
    with pytest.raises(TypeError, match="int address"):
        ffi.mark(jnp.ones(3), 1, slot=1.5)


def test_export_roundtrip():
    x = _data((4, 6), ml_dtypes.bfloat16)

    def f(x, seq):
        return ffi.mark(x, seq) * 2

    exported = jax.export.export(
        jax.jit(f),
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("kj_mark")],
    )(jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct((1,), jnp.int32))
    blob = exported.serialize()
    restored = jax.export.deserialize(blob)
    out = restored.call(x, jnp.array([11], jnp.int32))
    _assert_bitwise(out, jax.jit(f)(x, jnp.array([11], jnp.int32)))
    reference = jax.jit(lambda x, seq: ffi.mark_reference(x, seq) * 2)
    _assert_bitwise(out, reference(x, jnp.array([11], jnp.int32)))


def test_export_for_cpu_and_cuda():
    # A program exported on a CPU-only host must still lower for CUDA.
    exported = jax.export.export(
        jax.jit(lambda x, seq: ffi.mark(x, seq)),
        platforms=("cpu", "cuda"),
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("kj_mark")],
    )(jax.ShapeDtypeStruct((3,), jnp.float32), jax.ShapeDtypeStruct((1,), jnp.int32))
    restored = jax.export.deserialize(exported.serialize())
    assert restored.platforms == ("cpu", "cuda")
    x = _data((3,), np.float32)
    _assert_bitwise(restored.call(x, jnp.array([1], jnp.int32)), x)


def test_cuda_mark():
    if jax.devices()[0].platform != "gpu":
        pytest.skip("needs a GPU")
    from kernjax import _ffi

    if not _ffi.has_cuda():
        pytest.skip("kernjax._ffi was built without CUDA")

    # Identity, aliased and not.
    for dtype in DTYPES:
        for shape in SHAPES:
            x = jnp.asarray(_data(shape, dtype))
            _assert_bitwise(jax.jit(ffi.mark)(x, jnp.int32(1)), x)
    x = jnp.asarray(_data((64, 32), ml_dtypes.bfloat16))
    y, x2 = jax.jit(lambda x, s: (ffi.mark(x, s), x + 0))(x, jnp.int32(1))
    _assert_bitwise(y, x)
    _assert_bitwise(x2, x)

    # Slot writes, in stream order, through pinned mapped host memory.
    addr = _ffi.host_alloc(4, mapped=True)
    try:
        value = ctypes.c_int32.from_address(addr)

        @jax.jit
        def f(x, seq):
            return ffi.mark(x * 2, seq, slot=addr) + 1

        for step in [1, 5, 123456]:
            out = f(x, jnp.int32(step))
            jax.block_until_ready(out)
            assert value.value == step
        _assert_bitwise(out, (x * 2) + 1)
    finally:
        _ffi.host_free(addr, mapped=True)

    # Memory the device cannot see is refused with a clear error, not a fault.
    bad = np.zeros(1, np.int32)
    with pytest.raises(Exception, match="pinned"):
        jax.block_until_ready(ffi.mark(x, 1, slot=bad.ctypes.data))
    _assert_bitwise(jax.jit(ffi.mark)(x, jnp.int32(2)), x)


def test_fa3_inside_or_outside_cuda_graphs_is_two_targets_the_lowering_table_picks():
    """kj_fa3 is registered twice: `kj_fa3`, which XLA may capture into its CUDA graphs, and
    `kj_fa3_ungraphed`, the same code without that trait; the lowering table's `fa3_graphs`
    picks the target the exported program calls, so the choice is in the program and its cut id."""
    import jax.numpy as jnp
    from jax import export

    from kernjax.artifact import UNSTABLE
    from kernjax.core import lowering
    from kernjax.kernels import attention

    if ffi.available() and ffi.has_cuda():
        import ctypes

        from kernjax import _ffi
        c = _ffi.registrations()["cuda"]
        get = ctypes.pythonapi.PyCapsule_GetPointer
        get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
        assert get(c["kj_fa3"], None) != get(c["kj_fa3_ungraphed"], None)
    S = jax.ShapeDtypeStruct
    args = (S((3, 128, 2, 2, 128), jnp.bfloat16), S((16, 4, 128), jnp.bfloat16),
            S((16,), jnp.int32), S((2,), jnp.int32), S((1, 2), jnp.int32))

    def text(graphs):
        with lowering.use(lowering.Lowering(fa3_graphs=graphs)):
            fn = jax.jit(lambda *a: attention.chunk_attention(*a, scale=0.1))
            return export.export(fn, platforms=["cuda"], disabled_checks=UNSTABLE)(
                *args).mlir_module()

    inside, outside = text(True), text(False)
    assert "@kj_fa3(" in inside and "kj_fa3_ungraphed" not in inside
    assert "@kj_fa3_ungraphed(" in outside


def test_a_stage_read_from_disk_registers_the_extension_targets(tmp_path):
    """A program read back from disk is never traced here, so nothing on the way registers
    kernjax's custom calls; reading a stage does. On the H200 a stage process once failed with
    "No FFI handler registered for kj_fa3" (bf16 attention on CUDA) without it."""
    import subprocess
    import sys

    if not ffi.available():
        pytest.skip("the extension is not built")
    subprocess.run([sys.executable, "-m", "kernjax", "cut", "--model", "qwen3-tiny", "--at", "2",
                    "--decode", "1", "--out", str(tmp_path / "cut")], check=True, capture_output=True)
    probe = ("import sys; from kernjax import artifact; artifact.read(sys.argv[1]); "
             "f = sys.modules['kernjax.kernels.ffi']; print(f._registered)")
    out = subprocess.run([sys.executable, "-c", probe, str(tmp_path / "cut" / "stage1")],
                         check=True, capture_output=True, text=True).stdout
    assert out.strip() == "True"


def test_the_flashattention_build_refuses_a_directory_that_is_not_a_checkout(tmp_path):
    """`scripts/fa3` with FA or CUTLASS pointing elsewhere says which, before compiling."""
    import os
    import subprocess
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    r = subprocess.run(["bash", str(repo / "scripts" / "fa3")], capture_output=True, text=True,
                       env={**os.environ, "FA": str(tmp_path), "CUTLASS": str(tmp_path)})
    assert r.returncode == 2 and f"FA={tmp_path} holds no hopper/" in r.stderr, r.stderr
    (tmp_path / "hopper").mkdir()
    (tmp_path / "hopper" / "flash_fwd_launch_template.h").write_text("")
    r = subprocess.run(["bash", str(repo / "scripts" / "fa3")], capture_output=True, text=True,
                       env={**os.environ, "FA": str(tmp_path), "CUTLASS": str(tmp_path)})
    assert r.returncode == 2 and f"CUTLASS={tmp_path} holds no include/cute" in r.stderr, r.stderr
