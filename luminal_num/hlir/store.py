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

Weights mapped from files can be streamed (`STREAMING`, turned on by the memory plan when holding them all
does not fit the budget): a reader gives a weight's pages back after its last read (`release_points`).
"""
from __future__ import annotations

import hashlib
import mmap
import os
import tempfile
from contextlib import contextmanager
from typing import Iterable, Iterator, Mapping

import numpy as np
from numpy.lib.array_utils import byte_bounds

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
            STREAMING.after_read(self)  # hashed whole: a streaming compile gives its pages back
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


def file_backed(values: np.ndarray, dtype=None) -> np.ndarray:
    """`values` (converted to `dtype`, default its own) copied into an unlinked temporary file and
    memory-mapped read-only: a weight computed at load time (a GGUF tensor's dequantization, a BF16 checkpoint's
    FP32 widening) then lives in page cache, not in the process's anonymous memory: forked workers share its
    pages, the kernel may drop and re-read them under pressure (a streaming compile gives them back after each
    read), and it is never written back. The conversion goes WRITE_BLOCK bytes of rows at a time, so loading a
    weight never holds its converted copy whole. The file has no name: nothing is left on disk, whatever the exit."""
    values = np.asarray(values)
    dtype = values.dtype if dtype is None else np.dtype(dtype)
    if values.size == 0:
        return values.astype(dtype)
    rows = values.reshape(values.shape[0] if values.ndim else 1, -1)
    step = max(1, WRITE_BLOCK // max(1, rows.shape[1] * dtype.itemsize))
    with tempfile.TemporaryFile(dir=os.environ.get(SCRATCH_ENV) or None) as f:
        for start in range(0, rows.shape[0], step):
            f.write(memoryview(np.ascontiguousarray(rows[start:start + step], dtype=dtype)).cast("B"))
        f.flush()
        return np.memmap(f, dtype=dtype, mode="r", shape=values.shape)  # the map keeps the file


WRITE_BLOCK = 64 << 20  # bytes of converted rows file_backed holds at once


def _mapping(a: np.ndarray) -> np.ndarray | None:
    """The read-only memory-mapped array `a` is a view of (its `_mmap` set), else None."""
    m = a
    while m is not None and not isinstance(getattr(m, "_mmap", None), mmap.mmap):
        m = getattr(m, "base", None)
    if m is None or not isinstance(m, np.ndarray) or m.flags.writeable:
        return None
    return m


def is_file_backed(a) -> bool:
    """Whether `a` is a view of a read-only memory-mapped file (its pages can be released and read again)."""
    return isinstance(a, np.ndarray) and _mapping(a) is not None


def release_pages(a: np.ndarray) -> bool:
    """Drop this process's mapping of the file pages under `a` (a view of a read-only memory-mapped
    file): they stop counting in its resident set and are read again (from page cache or the file)
    if touched later. For a stage that streams a model layer by layer and will not come back soon.
    Only pages wholly inside `a` go (a page it shares with a neighbouring tensor stays); `a` may be
    any dense view (a transposed weight: its bytes are one range). Returns False (and does nothing)
    for an array that is not such a view."""
    m = _mapping(a) if isinstance(a, np.ndarray) else None
    if m is None:
        return False
    start_of_map = m.ctypes.data - (m.offset % mmap.ALLOCATIONGRANULARITY)
    low, high = byte_bounds(a)
    lo = low - start_of_map
    hi = high - start_of_map
    lo = -(-lo // mmap.PAGESIZE) * mmap.PAGESIZE  # whole pages inside the array only
    hi = hi // mmap.PAGESIZE * mmap.PAGESIZE
    if hi > lo and high - low == a.nbytes:  # dense: no gap of another tensor's bytes inside the range
        m._mmap.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
    return True


class Streaming:
    """Whether readers of a whole model give a file-backed weight's pages back after its last read
    (memory.MemoryPlan.streaming sets it for a compile whose weights do not fit its budget). Off, a
    process that read every weight once keeps every page it touched mapped: its resident set holds the
    whole model. On, it holds what it is reading (a layer, the largest weight), and a page read again
    comes back from page cache, or from the disk when the page cache was short.

    Readers that know their own last reads (a CPU run's last-reader map, an FP64 evaluation's) release
    there and, while they run (`by_last_reader`), a read inside them (a weight converted to its stored
    format, hashed for its key) leaves the release to them: it must not drop a page a later kernel of
    the same run reads. Anywhere else such a read releases right after itself (`after_read`)."""

    def __init__(self) -> None:
        self.on = False
        self.released = 0  # bytes of arrays whose pages were given back (statistics)
        self._runs = 0     # readers with their own last-reader map now running

    @contextmanager
    def set_to(self, on: bool) -> Iterator[None]:
        """The policy `on` while the block runs, then as it was."""
        old, self.on = self.on, on
        try:
            yield
        finally:
            self.on = old

    @contextmanager
    def by_last_reader(self) -> Iterator[None]:
        """A reader that releases by its own last-reader map runs in the block: after_read waits for it."""
        self._runs += 1
        try:
            yield
        finally:
            self._runs -= 1

    def release(self, arrays: Iterable[np.ndarray]) -> None:
        """Release each file-backed array's pages (streaming on; a no-op off or for anonymous arrays)."""
        if not self.on:
            return
        for a in arrays:
            if release_pages(a):
                self.released += a.nbytes

    def after_read(self, a) -> None:
        """A whole weight was just read outside a run (converted, hashed): its pages go back (streaming on)."""
        if self.on and not self._runs and isinstance(a, np.ndarray):
            self.release((a,))


STREAMING = Streaming()  # the process's policy (forked workers inherit it)


def release_points(last_read: Mapping[str, int], arrays: Mapping[str, np.ndarray]) -> dict[int, list[np.ndarray]]:
    """Position -> the file-backed arrays to release after it: each array after the last read of any
    array sharing bytes with it (a tied or sliced weight read later keeps its pages until then).
    `last_read`: name -> position of its last read; `arrays`: name -> its value."""
    spans = sorted((*byte_bounds(arrays[n]), pos, n) for n, pos in last_read.items()
                   if n in arrays and is_file_backed(arrays[n]) and arrays[n].nbytes)
    out: dict[int, list[np.ndarray]] = {}
    group: list[str] = []
    end, last = -1, -1
    for lo, hi, pos, name in [*spans, (None, None, -1, None)]:
        if group and (lo is None or lo >= end):  # a region no later array overlaps: released as one
            out.setdefault(last, []).extend(arrays[n] for n in group)
            group, end, last = [], -1, -1
        if lo is None:
            break
        group.append(name)
        end, last = max(end, hi), max(last, pos)
    return out
