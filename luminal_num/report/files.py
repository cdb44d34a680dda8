"""Atomic file and directory writes: a report either appears whole or not at all.

Why: reports are read by people and by `audit`; a crash or an exception half-way through writing must
never leave a truncated CSV or a page pointing at a missing plot. Everything is written to a temporary
sibling (same directory, hence same filesystem) and moved into place with os.replace, which is atomic.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ..files import DIR_MODE, FILE_MODE, TEMP_PREFIX, atomic_write_bytes, atomic_write_text  # noqa: F401


@contextmanager
def _staging_dir(target: Path) -> Iterator[Path]:
    """A fresh temp directory next to `target`; removed (with its contents) whatever happens."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f"{TEMP_PREFIX}{target.name}."))
    try:
        staging.chmod(DIR_MODE)
        yield staging
    finally:
        shutil.rmtree(staging, ignore_errors=True)


@contextmanager
def atomic_dir(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temp directory to write into; on success it REPLACES `path` (created if missing).

    An existing `path` is first moved aside, so the swap never exposes a mix of old and new files; if the
    swap itself fails the old directory is put back. On an exception in the body `path` is untouched.
    """
    target = Path(path)
    with _staging_dir(target) as staging:
        yield staging
        if not target.exists():
            os.replace(staging, target)
            return
        backup = Path(tempfile.mkdtemp(dir=target.parent, prefix=f"{TEMP_PREFIX}{target.name}.old."))
        try:
            os.replace(target, backup / target.name)
            try:
                os.replace(staging, target)
            except BaseException:
                os.replace(backup / target.name, target)
                raise
        finally:
            shutil.rmtree(backup, ignore_errors=True)


@contextmanager
def atomic_files(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temp directory; on success each file in it is moved into `path`, keeping `path`'s other files.

    Why besides atomic_dir: a report directory is shared (plan.json, audit files, the Pareto report);
    writing one report must not delete the others. Each move is atomic; the body (where rendering can
    fail) runs before any move, so a failed report changes nothing in `path`.
    """
    target = Path(path)
    with _staging_dir(target) as staging:
        yield staging
        target.mkdir(parents=True, exist_ok=True)
        for staged in sorted(staging.iterdir()):
            os.replace(staged, target / staged.name)
