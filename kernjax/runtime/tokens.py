"""The first token on the host as soon as the device has it: the program publishes it itself.

PjRt hands outputs to the host through host callbacks: 1.4-1.6 ms of every 4B prefill on an H200
(docs/bitwise.md). The program ends with `ffi.publish` (`mark`, no JAX effect): the run's number
and tokens into a ring of host memory (pinned and mapped on a GPU) after all the run's work, in
stream order; the host waits on that word (`_ffi.wait_word`: GIL released, no driver call).
"""

from __future__ import annotations

import ctypes
import functools
import threading

import jax
import jax.numpy as jnp
import numpy as np

from kernjax.kernels import ffi

_IDS = iter(range(1, 64))  # kj_mark's slot ids in this process (csrc/kj.h)
RING = 64  # entries: runs in flight at once (a pipeline holds a few) before one is written over


@functools.cache
def ring(n: int, device: jax.Device) -> TokenRing:
    """The process's ring for `n` tokens a run: its id (in the HLO) follows no program count."""
    return TokenRing(n, device)


class TokenRing:
    """Where programs publish `n` tokens a run (`wrap`), and how the host reads them (`ring`)."""

    def __init__(self, n: int, device: jax.Device):
        self.n, self.stride, self.runs = n, -(-4 * (n + 1) // 64) * 64, 0
        self.lock = threading.Lock()  # `ring`'s are shared: the runners of one process, say
        ext = ffi._extension()
        # held for the process's life: a program issued before a close may still write it
        self.addr = ext.host_alloc(RING * self.stride, mapped=device.platform != "cpu")
        words = (ctypes.c_int32 * (RING * self.stride // 4)).from_address(self.addr)
        self.view = np.ctypeslib.as_array(words).reshape(RING, -1)
        self.slot = next(_IDS, None) or self.addr  # programs name it by id: one HLO everywhere
        ext.bind_slot(self.slot, self.addr)  # (an address, past 63, binds nothing: it names itself)
        self.wait_word = ext.wait_word

    @staticmethod
    def usable(device: jax.Device) -> bool:
        return ffi.available() and (device.platform == "cpu" or ffi.has_cuda())

    def wrap(self, call, leaf: int):
        """`call(*args)` as `f(*args, run)`: the `leaf`-th leaf of its outputs, the tokens,
        published into entry `run` (int32[1], from `next`) when the program gets there."""
        def publishing(*args):
            *args, run = args
            flat, tree = jax.tree.flatten(call(*args))
            tok = flat[leaf]
            seq = jnp.concatenate([run, tok.reshape(-1).astype(jnp.int32)])
            flat[leaf] = ffi.publish(tok, seq, slot=self.slot, ring=RING)
            return jax.tree.unflatten(tree, flat)
        return publishing

    def next(self) -> np.ndarray:
        """The next run's number, the operand `wrap`'s program takes."""
        with self.lock:
            self.runs = self.runs % (2**31 - 2) + 1
            return np.asarray([self.runs], np.int32)


class Published:
    """A program compiled from `TokenRing.wrap`: called as the program it wraps, it passes the
    next run's number and returns its tokens as a `Token`; the rest of the compiled API as is."""

    def __init__(self, compiled, ring: TokenRing, leaf: int):
        self.compiled, self.ring, self.leaf = compiled, ring, leaf

    def __call__(self, *args):
        run = self.ring.next()
        flat, tree = jax.tree.flatten(self.compiled(*args, run))
        flat[self.leaf] = Token(self.ring, flat[self.leaf], int(run[0]))
        return jax.tree.unflatten(tree, flat)

    def __getattr__(self, name):  # memory_analysis, as_text, ...
        return getattr(self.compiled, name)


class Token:
    """A run's `next_token`: `np.asarray(token)` waits for the run's entry in the ring and reads
    it; where the entry may be written over (a ring's worth of runs issued since) or never
    comes (the program failed), it reads the device array as PjRt hands it over."""

    def __init__(self, ring: TokenRing, array: jax.Array, run: int):
        self.ring, self.array, self.run, self._value = ring, array, run, None
        self.shape, self.dtype = array.shape, array.dtype

    def __array__(self, dtype=None, copy=None):
        if self._value is None:
            r, i = self.ring, self.run % RING
            while self._value is None and self._unwritten():
                if r.wait_word(r.addr + i * r.stride, self.run, 0.05) == self.run:
                    v = r.view[i, 1:1 + r.n].copy()
                    if not self._unwritten() or r.view[i, 0] != self.run:
                        break
                    self._value = v.reshape(self.shape).astype(self.dtype)
                elif self.array.is_ready() and r.view[i, 0] != self.run:
                    break  # the program failed: PjRt says why
            if self._value is None:
                self._value = np.asarray(self.array)
        return self._value if dtype is None else self._value.astype(dtype)

    def _unwritten(self) -> bool:
        """No run since that can write this run's entry has been issued."""
        return (self.ring.runs - self.run) % (2**31 - 2) < RING - 1

    def block_until_ready(self) -> Token:
        np.asarray(self)
        return self
