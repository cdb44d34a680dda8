"""Verdict tasks: pure functions of (program, inputs), run here or on a local process pool.

A task is what any worker can compute from its arguments alone: a lowered Program, the inputs of each
calibration batch and their symbol bindings; its result is the program's outputs per batch. Weights
are the graph's, handed to the workers once when the pool starts (a fork shares them; nothing is
copied per task), so a distributed engine could take the same tasks with the weights it has.
"""
from __future__ import annotations

import multiprocessing as mp
import signal
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from ..codegen.llir import Program
from ..codegen.serialize import program_from_data, program_to_data
from ..hlir.weightcache import WEIGHTS
from ..quant.calibration import CALIBRATION, NO_HESSIANS, Hessians
from ..quant.stored import CONVERTED
from ..runtime.blas_threads import set_blas_threads
from ..runtime.cpu import CpuRuntime
from ..runtime.heap import trim_heap

Batch = Mapping[str, np.ndarray]

_WEIGHTS: Mapping[str, np.ndarray] = {}
# A worker runs one chunk at a time, which reads one layer's weights (SmolLM2's largest, the embedding,
# is 113 MB widened): its caches of converted weights need far less than the whole process's budget,
# and each worker holding its own 2 x 4 GiB ran a 30-layer compile out of memory on 24 GB.
WORKER_CACHE_BYTES = 1 << 30


@dataclass(frozen=True)
class RunTask:
    program: Program
    batches: tuple[Batch, ...]
    bindings: tuple[Mapping[str, int], ...]


def run_task(task: RunTask, weights: Mapping[str, np.ndarray] | None = None) -> list[dict[str, np.ndarray]]:
    """The program's outputs on every batch (raises what the runtime raises, e.g. a REJECT overflow)."""
    rt = CpuRuntime(task.program, _WEIGHTS if weights is None else weights)
    try:
        return [dict(rt.run(b, bind).outputs) for b, bind in zip(task.batches, task.bindings)]
    finally:
        del rt
        trim_heap()  # the run's freed temporaries go back to the system, not into a fragmented heap


def _worker_init(weights, cache_bytes: int | None = None, hessians: Hessians = NO_HESSIANS) -> None:
    global _WEIGHTS
    _WEIGHTS = weights
    CALIBRATION.install_for_process(hessians)  # GPTQ-filled weights convert under the compile's Hessians
    for cache in (WEIGHTS, CONVERTED):  # entries inherited from the parent count until evicted
        cache.resize(min(cache.budget_bytes, WORKER_CACHE_BYTES if cache_bytes is None else cache_bytes))
    set_blas_threads(1)  # one worker per core: BLAS threads on top only oversubscribe (runtime/blas_threads.py)


def _run_data(args):
    data, batches, bindings = args
    try:
        return run_task(RunTask(program_from_data(data), batches, bindings))
    except (ValueError, FloatingPointError) as exc:
        return exc


class TaskPool:
    """`workers` processes (forked, so the weights are shared, not pickled); `workers <= 1` runs the
    tasks here, in order. Results come back in task order; a task's runtime error comes back as the
    exception it raised, for the caller to turn into a verdict."""

    def __init__(self, weights: Mapping[str, np.ndarray], workers: int = 2, cache_bytes: int | None = None,
                 hessians: Hessians = NO_HESSIANS):
        """`cache_bytes`: each worker's budget for each weight cache (default WORKER_CACHE_BYTES); `hessians`:
        the calibration Hessians GPTQ-filled weights are converted under (the compile's, installed here too)."""
        self.weights, self.workers = weights, workers
        self._pool = None
        if workers > 1 and "fork" in mp.get_all_start_methods():
            # Ctrl-C held back while forking: a SIGINT inside os.fork's after-fork handlers is swallowed
            # ("Exception ignored"), and the compile it should stop runs to the end. Delivered right after;
            # the workers keep it blocked (the parent handles an interrupt and closes the pool).
            held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
            try:
                self._pool = mp.get_context("fork").Pool(workers, initializer=_worker_init,
                                                     initargs=(weights, cache_bytes, hessians))
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, held)

    def map(self, tasks: Sequence[RunTask]) -> list:
        if self._pool is None or len(tasks) < 2:
            out = []
            for t in tasks:
                try:
                    out.append(run_task(t, self.weights))
                except (ValueError, FloatingPointError) as exc:
                    out.append(exc)
            return out
        # a Program holds enum members with callables: it travels as its LLIR data (what plans store)
        return self._pool.map(_run_data, [(program_to_data(t.program), t.batches, t.bindings) for t in tasks],
                              chunksize=1)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool.join()
            self._pool = None

    def __enter__(self) -> "TaskPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
