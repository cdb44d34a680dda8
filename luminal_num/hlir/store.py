"""Weights by content key: each weight array knows a digest of what it holds, computed once.

Why: everything derived from a weight (its FP64 copy, its storage formats, Gemm operands, the GGUF
blocks it came from, the verdict cache's context) is cached under what the weight holds, never under
the identity of a numpy array: two arrays with equal bytes share every entry, a weight changed in its
file gets a new key (and so invalidates the verdict cache), a copy handed to another process (a
worker, a Ray node) finds the same entries, and nothing module-wide is keyed by `id()`.

A `WeightArray` is a read-only ndarray carrying its key. The key comes from the source where there is
one (a GGUF tensor's raw blocks, a safetensors byte range: `keyed(values, key)`), else from the
array's own bytes on first use (sha256, ~1 GB/s; the hardware-accelerated stdlib hash: blake2b runs at
a quarter of that here). Arrays derived from a weight (views, ufunc results) carry no key: they are
new values, keyed by their own bytes if anyone asks.
"""
from __future__ import annotations

import hashlib
import mmap
import os
import tempfile

import numpy as np

KEY_BYTES = 16  # a 128-bit digest: collisions are out of reach for any number of weights


class WeightArray(np.ndarray):
    """A read-only weight value with its content key (`content_key`)."""

    _key: str | None

    def __array_finalize__(self, obj) -> None:
        self._key = None  # views and copies are new values: keyed by their own bytes if asked

    def __array_wrap__(self, out, context=None, return_scalar=False):
        # arithmetic on a weight gives a plain array (no key, writable): only the weight itself is keyed
        out = out.view(np.ndarray)
        return out[()] if return_scalar else out

    def __reduce__(self):  # a weight sent to another process keeps its key (no rehash there)
        return (_rebuild, (np.asarray(self), self._key))

    @property
    def content_key(self) -> str:
        if self._key is None:
            self._key = digest(self)
        return self._key


def _rebuild(values: np.ndarray, key: str | None) -> WeightArray:
    return keyed(values, key)


def digest(a: np.ndarray, *parts: object) -> str:
    """Hex digest of an array's dtype, shape and bytes (plus `parts`, e.g. a source format's name)."""
    a = np.asarray(a)
    h = hashlib.sha256(f"{a.dtype.str}:{a.shape}:{parts!r}".encode())
    h.update(memoryview(np.ascontiguousarray(a)).cast("B"))
    return h.hexdigest()[: 2 * KEY_BYTES]


def derived_key(*parts: object) -> str:
    """The key of a value derived from keyed ones (a concatenation of weights): a digest of what names it."""
    return hashlib.sha256(repr(parts).encode()).hexdigest()[: 2 * KEY_BYTES]


def keyed(values: np.ndarray, key: str | None = None) -> WeightArray:
    """`values` as a read-only WeightArray (no copy); `key` when the caller knows the content's digest
    from its source, else computed from the bytes on first use."""
    if isinstance(values, WeightArray) and key in (None, values._key):
        return values
    out = np.asarray(values).view(WeightArray)
    out.flags.writeable = False
    out._key = key
    return out


def content_key(a) -> str:
    """The content key of a weight (its own) or of any other array (its bytes, hashed now)."""
    return a.content_key if isinstance(a, WeightArray) else digest(np.asarray(a))


SCRATCH_ENV = "LUMINAL_NUM_SCRATCH"  # where weights computed at load time are held (default: the temp dir)


def file_backed(values: np.ndarray) -> np.ndarray:
    """`values` copied into an unlinked temporary file and memory-mapped read-only: a weight computed at
    load time (a GGUF tensor's dequantization) then lives in page cache, not in the process's anonymous
    memory: forked workers share its pages, the kernel may drop and re-read them under pressure, and it
    is never written back. The file has no name, so nothing is left on disk, whatever the exit."""
    values = np.ascontiguousarray(values)
    if values.nbytes == 0:
        return values
    with tempfile.TemporaryFile(dir=os.environ.get(SCRATCH_ENV) or None) as f:
        f.write(memoryview(values).cast("B"))
        f.flush()
        return np.memmap(f, dtype=values.dtype, mode="r", shape=values.shape)  # the map keeps the file


def release_pages(a: np.ndarray) -> bool:
    """Drop this process's mapping of the file pages under `a` (a view of a read-only memory-mapped
    file): they stop counting in its resident set and are read again (from page cache or the file)
    if touched later. For a stage that streams a model layer by layer and will not come back soon.
    Returns False (and does nothing) for an array that is not such a view."""
    m = a
    while m is not None and not isinstance(getattr(m, "_mmap", None), mmap.mmap):
        m = getattr(m, "base", None)
    if m is None or not isinstance(m, np.ndarray) or m.flags.writeable:
        return False
    start_of_map = m.ctypes.data - (m.offset % mmap.ALLOCATIONGRANULARITY)
    lo = a.ctypes.data - start_of_map
    hi = lo + a.nbytes
    lo = -(-lo // mmap.PAGESIZE) * mmap.PAGESIZE  # whole pages inside the array only
    hi = hi // mmap.PAGESIZE * mmap.PAGESIZE
    if hi > lo and a.flags.c_contiguous:
        m._mmap.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
    return True
