"""The output tiles of a grouped Gemm (runtime.numerics, runtime.jit_gemm) on threads of this call."""
from __future__ import annotations

import contextvars
import math
import os
import threading
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
    errors: list[BaseException] = []

    def work() -> None:
        for tile in todo:
            run_tile(*tile)

    def helper(context: contextvars.Context) -> None:
        try:
            context.run(work)
        except BaseException as e:  # noqa: BLE001 (re-raised in the caller)
            errors.append(e)
    # plain threads (a ThreadPoolExecutor per call cost ~0.2 ms more), each in a copy of the caller's context
    helpers = [threading.Thread(target=helper, args=(contextvars.copy_context(),), daemon=True)
               for _ in range(min(TILE_THREADS, len(tiles)) - 1)]
    for thread in helpers:
        thread.start()
    try:
        work()
    finally:
        for thread in helpers:
            thread.join()
    if errors:
        raise errors[0]  # a tile's exception
