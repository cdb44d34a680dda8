"""Verdict tasks: pure functions of (program, inputs), run here or on a local process pool (error/executors.py
names the other executor, a Ray cluster).

A task is what any worker can compute from its arguments alone: a lowered Program, the inputs of each
calibration batch and their symbol bindings; its result is the program's outputs per batch. Weights
are the graph's, handed to the workers once when the pool starts (a fork shares them; nothing is
copied per task), so a distributed engine could take the same tasks with the weights it has.
"""
from __future__ import annotations

import multiprocessing as mp
import signal
import time
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np
from tqdm import tqdm

from ..codegen.llir import Program
from ..codegen.serialize import program_from_data, program_to_data
from ..hlir.weightcache import WEIGHTS
from ..quant.calibration import CALIBRATION, NO_HESSIANS, Hessians
from ..quant.stored import CONVERTED
from ..blas_threads import set_blas_threads
from ..runtime.cpu import CpuRuntime
from ..runtime.heap import trim_heap

Batch = Mapping[str, np.ndarray]

_WEIGHTS: Mapping[str, np.ndarray] = {}
NODE = "local"  # the progress bar's name for this machine
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
        with WEIGHTS.scanning():  # a whole-model run (hlir/weightcache.py)
            return [dict(r.outputs) for r in rt.run_many(task.batches, list(task.bindings))]
    finally:
        del rt
        trim_heap()  # the run's freed temporaries go back to the system, not into a fragmented heap


@dataclass
class TaskTimes:
    """What the executor's tasks cost: `own_s` the seconds they ran inside their workers, `turnaround_s`
    the seconds from dispatch to result at the driver (their difference is the executor's overhead)."""
    tasks: int = 0
    own_s: float = 0.0
    turnaround_s: float = 0.0
    retries: int = 0
    worker_extra_s: float = 0.0  # of the overhead, the workers' own share: inputs read, program decoded, outputs packed

    def add(self, own: float, turnaround: float, worker_extra: float = 0.0) -> None:
        self.tasks += 1
        self.own_s += own
        self.turnaround_s += turnaround
        self.worker_extra_s += worker_extra


@dataclass
class NodeCounts:
    running: int = 0
    done: int = 0


@dataclass
class TaskProgress:
    """Tasks queued at the driver, and running / done per node, shown as a second progress bar under the
    search's (nothing shown when disabled; the counts are kept either way)."""
    enabled: bool = False
    queued: int = 0
    nodes: dict[str, NodeCounts] = field(default_factory=dict)
    _bar: tqdm | None = None

    def submitted(self, n: int) -> None:
        self.queued += n
        self._show()

    def started(self, node: str) -> None:
        self.queued -= 1
        self.nodes.setdefault(node, NodeCounts()).running += 1
        self._show()

    def finished(self, node: str) -> None:
        self.nodes[node].running -= 1
        self.nodes[node].done += 1
        self._show(advance=1)

    def lost(self, node: str) -> None:
        """A task whose worker died goes back to the queue."""
        self.nodes[node].running -= 1
        self.queued += 1
        self._show()

    def text(self) -> str:
        per_node = " | ".join(f"{name}: {c.running} running, {c.done} done" for name, c in sorted(self.nodes.items()))
        return f"{self.queued} queued | {per_node}" if per_node else f"{self.queued} queued"

    def _show(self, advance: int = 0) -> None:
        if not self.enabled:
            return
        if self._bar is None:
            self._bar = tqdm(desc="tasks", unit="task", position=1, leave=False)
        self._bar.update(advance)
        self._bar.set_postfix_str(self.text(), refresh=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def worker_init(weights, cache_bytes: int | None = None, hessians: Hessians = NO_HESSIANS) -> None:
    global _WEIGHTS
    _WEIGHTS = weights
    CALIBRATION.install_for_process(hessians)  # GPTQ-filled weights convert under the compile's Hessians
    for cache in (WEIGHTS, CONVERTED):  # entries inherited from the parent count until evicted
        cache.resize(min(cache.budget_bytes, WORKER_CACHE_BYTES if cache_bytes is None else cache_bytes))
    set_blas_threads(1)  # one worker per core: BLAS threads on top only oversubscribe (luminal_num/blas_threads.py)


def run_caught(task: RunTask, weights: Mapping[str, np.ndarray] | None = None) -> tuple[object, float]:
    """(the task's outputs, or the runtime error it raised; the seconds it ran)."""
    t0 = time.perf_counter()
    try:
        out = run_task(task, weights)
    except (ValueError, FloatingPointError) as exc:
        out = exc
    return out, time.perf_counter() - t0


@dataclass(frozen=True)
class Fp32Exact:
    """An FP64 output whose every value is an FP32 value (what a CPU run's stored buffers hold), narrowed
    for the trip back to the driver: half the bytes through the pipe or the object store."""
    values: np.ndarray


def run_sent(data: dict, batches: Sequence[Mapping[str, object]], bindings, read=None) -> tuple[object, float, float]:
    """A task as a worker receives it (its program as LLIR data; its inputs as they travel, `read` turning them
    into arrays): (its outputs packed for the trip back, the seconds the run took, the seconds around it)."""
    t0 = time.perf_counter()
    out, own = run_caught(RunTask(program_from_data(data), read(batches) if read else tuple(batches), bindings))
    out = packed(out)
    return out, own, time.perf_counter() - t0 - own


def packed(out: object) -> object:
    """A task's outputs as a worker sends them: FP64 outputs that FP32 holds exactly travel as Fp32Exact."""
    if isinstance(out, Exception):
        return out
    return [{name: _narrowed(a) for name, a in batch.items()} for batch in out]


def unpacked(out: object) -> object:
    """The outputs as run_task returned them in the worker: Fp32Exact widened back (exactly)."""
    if isinstance(out, Exception):
        return out
    return [{name: a.values.astype(np.float64) if isinstance(a, Fp32Exact) else a for name, a in batch.items()}
            for batch in out]


def _narrowed(a: np.ndarray) -> np.ndarray | Fp32Exact:
    if a.dtype != np.float64:
        return a
    with np.errstate(over="ignore"):  # a value past FP32's range becomes inf, compares unequal and stays FP64
        narrow = a.astype(np.float32)
    # equal values give back every bit when widened (narrowing keeps a zero's sign and infinities); an array
    # holding NaN compares unequal and stays FP64 (its payload need not survive). One pass, no widened copy.
    if np.array_equal(narrow, a):
        return Fp32Exact(narrow)
    return a


def _run_data(args):
    return run_sent(*args)


class TaskPool:
    """`workers` processes (forked, so the weights are shared, not pickled); `workers <= 1` runs the
    tasks here, in order. Results come back in task order; a task's runtime error comes back as the
    exception it raised, for the caller to turn into a verdict."""

    def __init__(self, weights: Mapping[str, np.ndarray], workers: int = 2, cache_bytes: int | None = None,
                 hessians: Hessians = NO_HESSIANS, progress: TaskProgress | None = None):
        """`cache_bytes`: each worker's budget for each weight cache (default WORKER_CACHE_BYTES); `hessians`:
        the calibration Hessians GPTQ-filled weights are converted under (the compile's, installed here too)."""
        self.weights, self.workers = weights, workers
        self.times, self.progress = TaskTimes(), progress or TaskProgress()
        self._pool = None
        if workers > 1 and "fork" in mp.get_all_start_methods():
            # Ctrl-C held back while forking: a SIGINT inside os.fork's after-fork handlers is swallowed
            # ("Exception ignored"), and the compile it should stop runs to the end. Delivered right after;
            # the workers keep it blocked (the parent handles an interrupt and closes the pool).
            held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
            try:
                self._pool = mp.get_context("fork").Pool(workers, initializer=worker_init,
                                                     initargs=(weights, cache_bytes, hessians))
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, held)

    def map(self, tasks: Sequence[RunTask]) -> list:
        self.progress.submitted(len(tasks))
        width = 1
        if self._pool is None or len(tasks) < 2:
            runs = (run_caught(t, self.weights) for t in tasks)
        else:  # a Program holds enum members with callables: it travels as its LLIR data (what plans store)
            width = self.workers
            runs = self._pool.imap(_run_data, [(program_to_data(t.program), t.batches, t.bindings) for t in tasks],
                                   chunksize=1)
        out = []
        t0 = time.perf_counter()
        started = min(len(tasks), width)
        for _ in range(started):
            self.progress.started(NODE)
        for out_i, own, *extra in runs:
            out.append(unpacked(out_i))
            now = time.perf_counter()
            self.times.add(own, now - t0, *extra)  # in the pool: from the previous result (tasks overlap)
            t0 = now
            self.progress.finished(NODE)
            if started < len(tasks):
                started += 1
                self.progress.started(NODE)
        return out

    def close(self) -> None:
        self.progress.close()
        if self._pool is not None:
            self._pool.close()
            self._pool.join()
            self._pool = None

    def __enter__(self) -> "TaskPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
