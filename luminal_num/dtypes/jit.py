"""The numba loops of dtypes (jit_loops: float8 codes, float32 rounding), loaded at first use: numba's
import costs ~0.7 s, paid only by a process that converts large arrays. LUMINAL_NUM_JIT=0 (the switch of
runtime.jit_gemm too) or a missing numba leaves the numpy paths, which give the same bits."""
from __future__ import annotations

import os
import threading
from typing import Callable

ENABLED = os.environ.get("LUMINAL_NUM_JIT", "1") != "0"
SPLIT_SIZE = 1 << 18  # elements from which a loop runs as two halves, one on a helper thread
THREADS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def loops():
    """The jit_loops module, or None."""
    if not ENABLED:
        return None
    try:
        from . import jit_loops
    except ImportError:
        return None
    return jit_loops


def halves(loop: Callable, arrays: tuple, *args) -> list:
    """[loop(*(x[lo:hi] for x in arrays), *args) for the two halves of the 1-D `arrays`] (one whole call below
    SPLIT_SIZE or on one core), the second half on a helper thread started and joined here: the loops
    are nogil and element-wise, so the halves write disjoint parts and give the bits of one call."""
    n = arrays[0].size
    if n < SPLIT_SIZE or THREADS < 2:
        return [loop(*arrays, *args)]
    mid = n // 2
    results: list = [None, None]
    errors: list[BaseException] = []

    def second() -> None:
        try:
            results[1] = loop(*(x[mid:] for x in arrays), *args)
        except BaseException as e:  # noqa: BLE001 (re-raised below)
            errors.append(e)
    helper = threading.Thread(target=second, daemon=True)
    helper.start()
    try:
        results[0] = loop(*(x[:mid] for x in arrays), *args)
    finally:
        helper.join()
    if errors:
        raise errors[0]
    return results
