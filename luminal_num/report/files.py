"""Atomic file and directory writes: a report either appears whole or not at all.

Why: reports are read by people and by `audit`; a crash or an exception half-way through writing must
never leave a truncated CSV or a page pointing at a missing plot. Everything is written to a temporary
sibling (same directory, hence same filesystem) and moved into place with os.replace, which is atomic.
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
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
    """Yield a temp directory beside `path`; on success its files are moved into `path`, all or nothing,
    keeping `path`'s other files.

    Why besides atomic_dir: a report directory is shared (plan.json, audit files, the Pareto report);
    writing one report must not delete the others. The body (where rendering can fail) runs before any
    move; each replaced file is first moved aside into the staging folder, so if any move fails (or is
    interrupted) the files moved in are removed and the old ones put back: `path` holds exactly what it
    held before. Folders created for `path` are removed again on failure.
    """
    target = Path(path)
    created = _missing_dirs(target)
    try:
        with _staging_dir(target) as staging:
            yield staging
            _move_all(staging, target)
    except BaseException:
        for folder in created:  # innermost first; only the empty ones we made
            try:
                folder.rmdir()
            except FileNotFoundError:
                continue
            except OSError:
                break
        raise


def _missing_dirs(target: Path) -> list[Path]:
    """`target` and its ancestors that do not exist yet, innermost first."""
    out, p = [], target
    while not p.exists() and p != p.parent:
        out.append(p)
        p = p.parent
    return out


def _move_all(staging: Path, target: Path) -> None:
    """Move every file of `staging` into `target`; on any failure undo every move made."""
    backup = staging / f"{TEMP_PREFIX}old"
    staged = sorted(p for p in staging.iterdir() if p != backup)
    target.mkdir(parents=True, exist_ok=True)
    backup.mkdir()
    set_aside, moved_in = [], []
    try:
        for item in staged:
            dest = target / item.name
            if dest.exists() or dest.is_symlink():
                os.replace(dest, backup / item.name)
                set_aside.append(item.name)
            os.replace(item, dest)
            moved_in.append(dest)
    except BaseException:
        for dest in reversed(moved_in):
            dest.unlink(missing_ok=True)
        for name in reversed(set_aside):
            os.replace(backup / name, target / name)
        raise


def check_output_dir(path: str | os.PathLike, names: Iterable[str]) -> None:
    """Refuse, before any work, an output folder the files `names` cannot be created or replaced in:
    a file where a folder must be, a read-only folder or file system, a folder where a file goes.
    Writes nothing (a probe file would change the folder's mtime). Raises OutputDirError."""
    target = Path(path)
    existing = target
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        where = "it" if existing == target else str(existing)
        raise OutputDirError(f"output folder {target} cannot be created: {where} is a file, not a folder")
    readonly = bool(os.statvfs(existing).f_flag & os.ST_RDONLY)
    if readonly or not os.access(existing, os.W_OK | os.X_OK):
        raise OutputDirError(f"output folder {target} is not writable ({existing} is read-only)")
    if existing != target:
        return
    for name in names:
        dest = target / name
        if dest.is_dir() and not dest.is_symlink():
            raise OutputDirError(f"cannot replace {dest}: it is a folder")


class OutputDirError(OSError):
    """An output folder that cannot receive a command's files (checked before the work starts)."""


class OutputLocked(OSError):
    """Another command is writing into the same output folder."""


@contextmanager
def output_lock(path: str | os.PathLike) -> Iterator[None]:
    """One command at a time per output folder: an exclusive flock on a lock file beside it.

    The lock file lives beside the folder (in its nearest existing ancestor: it may not exist yet), named
    from the folder's resolved path, and is removed on release; a holder re-checks after locking that
    the file it locked is still the one on disk (a releaser may have unlinked it meanwhile).
    """
    target = Path(path).absolute()
    home = target.parent
    while not home.exists() and home != home.parent:
        home = home.parent
    digest = hashlib.sha256(str(target.resolve()).encode()).hexdigest()[:16]
    lock = home / f".luminal-num-{digest}.lock"
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, FILE_MODE)
    except OSError as exc:  # /proc, /sys: a folder that looks writable but takes no files
        raise OutputDirError(f"output folder {path} cannot hold files ({home}: {exc.strerror or exc})") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise OutputLocked(f"another luminal-num command is writing into {path}; wait for it to finish") from None
        try:
            same = os.fstat(fd).st_ino == os.stat(lock).st_ino
        except FileNotFoundError:
            same = False
        if not same:
            raise OutputLocked(f"another luminal-num command is writing into {path}; wait for it to finish")
        try:
            yield
        finally:
            lock.unlink(missing_ok=True)
    finally:
        os.close(fd)
