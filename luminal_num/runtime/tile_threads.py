"""The output tiles of a grouped Gemm (runtime.numerics, runtime.jit_gemm) on threads of this call."""
from __future__ import annotations

import contextvars
import math
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

PARALLEL_MNK = 1 << 22  # a grouped Gemm with at least this much work (MiniLM's attention: 7.7M) uses threads
TILE_THREADS = min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


def for_each_tile(run_tile: Callable[[int, int], None], rows: range, cols: range, lead: tuple, m: int, n: int,
                   k: int) -> None:
    """run_tile(row, col) for every output tile: tiles are independent (disjoint outputs, read-only
    operands; numpy and single-threaded BLAS calls release the GIL), so a large Gemm runs them on
    TILE_THREADS threads, the caller and helpers started and joined within the call (no thread
    outlives it, so a later fork is safe), in copies of the caller's context (numpy's errstate).
    The bits do not depend on the order or the thread."""
    tiles = [(row, col) for row in rows for col in cols]
    if TILE_THREADS <= 1 or len(tiles) < 2 or math.prod(lead) * m * n * k < PARALLEL_MNK:
        for tile in tiles:
            run_tile(*tile)
        return
    todo = iter(tiles)  # shared by the workers (the caller is one): next() hands each tile out once

    def work() -> None:
        for tile in todo:
            run_tile(*tile)
    workers = min(TILE_THREADS, len(tiles))
    with ThreadPoolExecutor(workers - 1) as pool:  # helpers run in copies of the caller's context
        helpers = [pool.submit(contextvars.copy_context().run, work) for _ in range(workers - 1)]
        work()
        for done in helpers:
            done.result()  # re-raises a tile's exception
