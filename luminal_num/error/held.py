"""Arrays the judging caches keep for the rest of a compile: in memory up to a byte budget, past it in a file.

Why: the per-chunk verdicts keep what every chunk choice tried so far did (error/chunks.py: an exact
effect's deviation of the logits, each single knob's deviation of the chunk's exports), so a later
genome that reuses a choice composes it instead of running it. On a 30-layer LLM that is thousands of
arrays (a decode layer's exports include its whole KV cache), and held in memory they grew the compile
by ~200 MB a minute for as long as the search ran. Past `budget_bytes` an array is appended to an
unlinked scratch file and read back (a fresh copy, freed after use) when a composition needs it: the
same bits, so the verdicts and the chosen plan do not depend on the budget, and the page cache, not
the compile, holds what is not in use. Small arrays stay in memory (their bytes would not pay for the
read).
"""
from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass

import numpy as np

from ..hlir.store import SCRATCH_ENV

SMALL_BYTES = 64 << 10  # arrays below this stay in memory whatever the budget (a residual row, a scalar)


@dataclass(frozen=True)
class Spilled:
    """An array written to a HeldArrays scratch file: `load()` reads a fresh copy."""
    store: "HeldArrays"
    offset: int
    dtype: np.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    def load(self) -> np.ndarray:
        return self.store.read(self)


class HeldArrays:
    """`hold(a)`: `a` itself while the arrays held in memory stay within `budget_bytes` (None: no limit),
    else a Spilled handle; `load(v)` gives the array back either way."""

    def __init__(self, budget_bytes: int | None = None):
        self.budget_bytes = budget_bytes
        self.in_memory = 0  # bytes of the arrays held as themselves
        self.spilled = 0    # bytes written to the scratch file
        self.reads = 0      # spilled arrays read back
        self._file = None   # an unlinked temporary file, opened on the first spill

    def hold(self, a: np.ndarray) -> np.ndarray | Spilled:
        a = np.asarray(a)
        if a.nbytes < SMALL_BYTES or self.budget_bytes is None or self.in_memory + a.nbytes <= self.budget_bytes:
            self.in_memory += a.nbytes
            return a
        if self._file is None:
            self._file = tempfile.TemporaryFile(dir=os.environ.get(SCRATCH_ENV) or None)
        offset = self.spilled
        data = memoryview(np.ascontiguousarray(a)).cast("B")
        written = 0
        while written < len(data):  # pwrite may write less than asked (a signal, a full pipe of the kernel's)
            written += os.pwrite(self._file.fileno(), data[written:], offset + written)
        self.spilled += a.nbytes
        return Spilled(self, offset, a.dtype, a.shape)

    def read(self, s: Spilled) -> np.ndarray:
        out = np.empty(s.shape, s.dtype)
        buf = memoryview(out).cast("B") if out.nbytes else b""
        got = 0
        while got < s.nbytes:
            n = os.preadv(self._file.fileno(), [buf[got:]], s.offset + got)
            if n <= 0:
                raise OSError(f"the judging scratch file ended at {s.offset + got} of {s.offset + s.nbytes} bytes")
            got += n
        self.reads += 1
        return out


def load(value) -> np.ndarray:
    """The array a HeldArrays.hold() result stands for (a held array as it is, a spilled one read back)."""
    return value.load() if isinstance(value, Spilled) else value
