"""Atomic file writes: a file either appears whole or not at all (plans, reports, scales).

A neutral module below both search (plans) and report: each writes through it, neither imports the
other. Everything is written to a temporary sibling (same directory, hence same filesystem) and moved
into place with os.replace, which is atomic.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np

TEMP_PREFIX = ".tmp-"
# mkstemp/mkdtemp create private (0600/0700) entries; a report is meant to be read by others.
FILE_MODE = 0o644
DIR_MODE = 0o755


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write `data` to `path` via a temp file in the same directory; on failure nothing is left behind."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, temp_name = tempfile.mkstemp(dir=target.parent, prefix=f"{TEMP_PREFIX}{target.name}.")
    try:
        with os.fdopen(handle, "wb") as stream:
            stream.write(data)
            stream.flush()
            os.fsync(stream.fileno())
        os.chmod(temp_name, target.stat().st_mode & 0o777 if target.exists() else FILE_MODE)
        os.replace(temp_name, target)
    except BaseException:
        Path(temp_name).unlink(missing_ok=True)
        raise
    return target


def atomic_write_text(path: str | os.PathLike, text: str, encoding: str = "utf-8") -> Path:
    """Text version of atomic_write_bytes (newlines written as given, never translated)."""
    return atomic_write_bytes(path, text.encode(encoding))


def read_npz(path: str | os.PathLike, what: str) -> dict:
    """Every array of an .npz file by name; ValueError with one line (naming it as `what` file) when the
    file is missing or unreadable, so each caller can turn it into its own input error."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{what} file {p} does not exist")
    try:
        with np.load(p) as data:
            return {k: data[k] for k in data.files}
    except Exception as exc:  # noqa: BLE001 - any unreadable file is the user's input error
        raise ValueError(f"cannot read {what} file {p}: {' '.join(str(exc).split())}") from None
