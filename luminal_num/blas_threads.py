"""The thread count of numpy's bundled OpenBLAS, set through its own C entry point.

A verdict pool runs one process per core; each worker's BLAS starting its own threads on top puts
2 x 2 threads on 2 cores, and OpenBLAS threads that wait for a busy core spin: a small FP64 matmul
took 7-48 ms with two threads on a loaded machine and 2-3 ms with one (8 x 1536 @ 1536 x 576).
A module of the package's top level, below every stage: the runtime, the judge, the compile and the FP64
teacher-forcing model (models/reference.py) all set it.
"""
from __future__ import annotations

import ctypes
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import numpy as np

_SET, _GET = "scipy_openblas_set_num_threads64_", "scipy_openblas_get_num_threads64_"


def bundled_openblas(*symbols: str) -> ctypes.CDLL | None:
    """numpy's bundled OpenBLAS (numpy.libs/libscipy_openblas64_*), the first that loads and has
    every one of `symbols`; None with another numpy build."""
    libs = Path(np.__file__).resolve().parent.parent / "numpy.libs"
    for path in sorted(libs.glob("libscipy_openblas64_*.so")):
        try:
            lib = ctypes.CDLL(str(path))
            for name in symbols:
                getattr(lib, name)
            return lib
        except (OSError, AttributeError):
            continue
    return None


_LIB = bundled_openblas(_SET, _GET)


def blas_threads() -> int | None:
    """The bundled OpenBLAS's thread count, or None when numpy was built against another BLAS."""
    return None if _LIB is None else int(getattr(_LIB, _GET)())


def set_blas_threads(n: int) -> bool:
    """Use n BLAS threads in this process from now on; False when this numpy's BLAS is not the bundled
    OpenBLAS (its own threading then stands)."""
    if n < 1:
        raise ValueError(f"BLAS threads must be >= 1, got {n}")
    if _LIB is None:
        return False
    fn = getattr(_LIB, _SET)
    fn.argtypes = [ctypes.c_int]
    fn(n)
    return True


@contextmanager
def one_blas_thread() -> Iterator[None]:
    """BLAS on one thread while the block runs (the count before is restored after). Why: OpenBLAS splits a
    small-M sgemm among its threads in ways that change the bits (a SmolLM2 decode chunk: 4283 of 4608
    outputs differ between 1 and 2 threads), and a verdict task must compute the same bits in the
    compiling process as in a pool worker or a Ray actor, which run one thread each."""
    before = blas_threads()
    set_blas_threads(1)
    try:
        yield
    finally:
        if before is not None:
            set_blas_threads(before)


SMALL_PRODUCT_ROWS = 256  # products with fewer rows than this run on one thread (a decode step's, a few prompts')


@contextmanager
def threads_for_rows(rows: int) -> Iterator[None]:
    """One BLAS thread for a product of fewer than SMALL_PRODUCT_ROWS rows, else the count as it is. Why: a
    small-M product gains nothing from a second thread and, beside another busy process, waits on it
    (bench: a 1B layer's 8 x 2048 @ 2048 x 8192 in FP64 blocks, 0.10 s on one thread, 1.85 s on two at
    load 4); an 800-row prefill product is faster on two (1.5 vs 1.9 s at that load)."""
    if rows >= SMALL_PRODUCT_ROWS:
        yield
        return
    with one_blas_thread():
        yield
