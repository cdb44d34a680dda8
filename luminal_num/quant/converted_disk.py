"""Converted weights on disk, beside the verdict cache: a weight quantized once is read back by later compiles.

Why: converting a weight to a storage format costs seconds per format on a 1B model (and a GPTQ fill far
more), and the in-memory cache (stored.ConvertedWeights) is bounded by the compile's memory budget, so a
search that revisits a format after evicting it, the next compile of the same model, and the pool's
workers (forked with this cache set) would each convert it again. Each entry is one weights file
(quant/weights_file.py: safetensors, content SHA-256, atomic write) holding the packed parts, named by a
digest of its key (the format, the weight's content key, and the fill with its Hessian's key), and
the key itself is recorded as the file's "graph hash": a file that is damaged, edited or renamed is
refused by the loader, reported in one line (ConvertedCacheWarning), converted again and rewritten.
The folder is kept within `max_bytes` (default DISK_BUDGET_BYTES): after a write, the entries used
least recently (a hit touches its file) are deleted until the rest fit.
"""
from __future__ import annotations

import hashlib
import os
import time
import warnings
from pathlib import Path

from .storage import Quantized, StorageFormat, StoredTensor
from .weights_file import WeightsFileError, load_weights, save_weights

_NAME = "w"  # the one tensor of an entry's file
DISK_BUDGET_BYTES = 4 << 30  # a 1B model's weights in about three storage formats


class ConvertedCacheWarning(RuntimeWarning):
    """A converted-weight file that could not be used (it is converted again): shown by the CLI."""


class ConvertedDisk:
    """Entries under `folder` (created on the first write)."""

    def __init__(self, folder: str | Path, max_bytes: int = DISK_BUDGET_BYTES):
        self.folder, self.max_bytes = Path(folder), max_bytes
        self.hits = self.writes = self.evicted = 0
        self._last_ns = 0
        self._held: int | None = None  # the folder's entry bytes as last listed plus this cache's writes since
        self.off = ""  # why writing stopped (a folder that cannot be written is reported once)

    def _path(self, key: tuple) -> tuple[Path, str]:
        tag = hashlib.sha256(repr(key).encode()).hexdigest()[:32]
        return self.folder / f"{tag}.safetensors", tag

    def load(self, key: tuple, fmt: StorageFormat, shape: tuple[int, ...]) -> tuple[StoredTensor, Quantized] | None:
        """The entry's conversion, packed and unpacked, or None when there is none (or it cannot be used:
        then a warning)."""
        path, tag = self._path(key)
        if not path.is_file():
            return None
        try:
            stored = load_weights(path, tag, expected={_NAME: (fmt, shape)}).tensors[_NAME]
            q = fmt.unpack(stored)
        except (WeightsFileError, ValueError) as exc:
            warnings.warn(ConvertedCacheWarning(f"converted-weight cache: {str(exc).splitlines()[0]}; "
                                                f"converting again"), stacklevel=3)
            return None
        self.hits += 1
        self._touch(path)  # used now: evicted last
        return stored, q

    def _touch(self, path: Path) -> None:
        """Mark `path` used now, strictly after this cache's previous use (a file system's clock ticks
        coarser than entries are used: equal times would order entries by their names)."""
        self._last_ns = max(time.time_ns(), self._last_ns + 1)
        try:
            os.utime(path, ns=(self._last_ns, self._last_ns))
        except OSError:  # deleted by another process meanwhile
            pass

    def save(self, key: tuple, packed: StoredTensor) -> None:
        """Write the entry (atomically); a folder that cannot be written costs the cache, not the compile."""
        if self.off:
            return
        path, tag = self._path(key)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            save_weights(path, {_NAME: packed}, tag, durable=False)  # verified on load: no fsync
        except OSError as exc:
            self.off = f"cannot write {path} ({exc.strerror or exc})"
            warnings.warn(ConvertedCacheWarning(f"converted-weight cache: {self.off}; continuing without it"),
                          stacklevel=3)
            return
        self.writes += 1
        self._touch(path)
        if self._held is not None:
            self._held += path.stat().st_size
        if self._held is None or self._held > self.max_bytes:  # the folder is listed once, then when over
            self._trim()

    def _trim(self) -> None:
        """Delete least-recently-used entries until the folder's entries fit max_bytes."""
        entries = []
        for p in self.folder.glob("*.safetensors"):
            try:
                st = p.stat()
            except OSError:  # deleted by another process meanwhile
                continue
            entries.append((st.st_mtime_ns, st.st_size, p))
        total = sum(size for _, size, _ in entries)
        for _, size, p in sorted(entries):
            if total <= self.max_bytes:
                break
            p.unlink(missing_ok=True)
            total -= size
            self.evicted += 1
        self._held = total
