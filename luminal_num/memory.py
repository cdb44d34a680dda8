"""The compile's memory budget: how many workers it runs and how much each cache of derived weights holds.

Why a plan and not fixed sizes: what a compile occupies is the model's weights (once, shared with
forked workers), each process's own baseline, and the caches of values derived from weights (FP64
copies, storage formats, Gemm operands), which would otherwise grow until they hold every weight in
every form. The plan gives each cache what the model can use of it (a few copies of its weights),
bounded by a share of the budget, and fewer workers when the budget cannot hold two; a budget that
cannot hold even one process with the model's largest weights is refused up front, with one line
naming what it needed, instead of the compile being killed half way.

A model whose weights do not fit the budget beside the caches compiles when they are file-backed
(memory-mapped checkpoints): the plan turns streaming on (`MemoryPlan.streaming`, hlir.store.STREAMING),
every whole-model reader gives a weight's pages back after its last read, and the floor counts what one
process holds at once (the largest layer's weights and the largest weight) instead of every weight.

Between stages (`MemoryPlan.check`) the compile compares what its process tree occupies now (PSS,
so pages shared with forked workers count once) plus what the next stage will add (its estimate)
with the budget, and stops with one line naming the stage and the memory it needed when they do
not fit, before the stage allocates anything.
"""
from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from contextlib import contextmanager
from typing import Iterator, Mapping

import numpy as np

from .error.reference import SPILL
from .hlir.store import STREAMING, is_file_backed
from .hlir.weightcache import WEIGHTS
from .quant.stored import CONVERTED
from .runtime.heap import trim_heap

GiB = 1 << 30
PROCESS_BASE = int(1.2 * GiB)   # the compiling process without weights (Python, egglog, numba, the e-graphs)
WORKER_BASE = int(0.45 * GiB)   # a forked worker's own pages (its runtime, one chunk's buffers)
WORKER_CACHE_MAX = GiB          # a worker runs one chunk at a time: one layer's weights in a few forms
# largest weights (FP32) kept free beside the caches. Measured on a 1B shape (its 1 GB LM head): a cache entry
# being made (its input form and its output), and a run's hold on a form the cache has since evicted (a run keeps
# each buffer until its last reader): at 2 the compile peaked one head above its plan
TRANSIENT = 3
MIN_CACHE = 2   # largest weights the caches must hold together (a weight's stored form and its Gemm operand)
# the least in-memory share of each store that spills past its share (the FP64 chunk boundaries, the judging
# deviations): below it every array would go to a file. Above it each gets budget / 16, at most a quarter of what
# the budget leaves past the floor (a tight budget spills more instead of refusing the search stage)
KEPT_MIN = 64 << 20
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": GiB, "T": 1 << 40}


class MemoryBudgetError(RuntimeError):
    """The budget cannot hold a stage; the message names the stage and the memory it needs."""


def parse_size(text: str) -> int:
    """'16G', '512M', '2.5G', '17179869184' -> bytes (powers of 1024)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(i?B)?\s*", str(text), re.IGNORECASE)
    if m is None:
        raise ValueError(f"memory size {text!r}: expected a number with an optional K/M/G/T suffix, e.g. 16G")
    size = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    if size <= 0:
        raise ValueError(f"memory size {text!r} must be positive")
    return size


def available_bytes() -> int:
    """The machine's available memory now (MemAvailable), or 8 GiB where /proc/meminfo is missing."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * GiB


def _gb(n: int) -> str:
    return f"{n / 1e9:.1f} GB"


@dataclass(frozen=True)
class MemoryPlan:
    budget: int             # bytes the compile (its process and workers) may occupy
    weights: int            # the model's weights as FP32 (resident once: workers share the parent's pages)
    largest: int            # the largest weight as FP32
    workers: int            # pool processes running chunk tasks (1: none, tasks run in the compiling process)
    weight_cache: int       # the compiling process's cache of values derived from weights (hlir.weightcache)
    converted_cache: int    # its cache of weights in storage formats (quant.stored)
    worker_cache: int       # each worker's budget for each of those two caches
    boundary: int = 2 << 30  # FP64 chunk-boundary values kept in memory before the rest spill to files
    judging: int = 1 << 30   # deviations the per-chunk verdicts keep in memory before the rest go to a file
    streaming: bool = False  # file-backed weights' pages given back after their last read (hlir.store.STREAMING)
    held: int = 0            # streaming: the weights one process holds at once (WeightSizes.held)

    def describe(self) -> str:
        pool = f"{self.workers} workers" if self.workers > 1 else "no worker pool"
        weights = (f"weights {_gb(self.weights)} streamed ({_gb(self.held)} held at once)" if self.streaming
                   else f"weights {_gb(self.weights)}")
        return (f"memory {_gb(self.budget)}: {weights}, {pool}, caches {_gb(self.weight_cache)} "
                f"(derived) + {_gb(self.converted_cache)} (stored formats)"
                + (f", {_gb(self.worker_cache)} x 2 per worker" if self.workers > 1 else ""))

    def check(self, stage: str, need: int) -> None:
        """Stop (MemoryBudgetError, one line) when the process tree's memory now plus `need`, what stage
        `stage` will add, exceeds the budget."""
        held = tree_pss()
        over, cached = held + need - self.budget, WEIGHTS.bytes + CONVERTED.bytes
        if over > 0 and cached > 0:  # the caches are what the compile can give back: evict before refusing
            keep = max(0.0, 1.0 - over / cached)
            for cache in (WEIGHTS, CONVERTED):  # entries evicted; the budgets stay (the plan sized them)
                budget = cache.budget_bytes
                cache.resize(int(cache.bytes * keep))
                cache.resize(budget)
            trim_heap()  # what they freed back to the system, not kept in the heap
            held = tree_pss()
        if held + need > self.budget:
            # "needs 0.0 GB more" read as nonsense where the compile is already over before the stage adds anything
            what = f"needs {_gb(need)} more memory" if need >= 50 << 20 else "cannot start"
            raise MemoryBudgetError(f"stage {stage} {what}; the compile holds {_gb(held)} "
                                    f"and its memory budget is {_gb(self.budget)}: raise --max-memory, or compile "
                                    f"fewer layers or calibration prompts")

    def fit(self, stage: str, growing: int = 0) -> None:
        """Before the search stages: size the process's caches to what the budget leaves now (measured:
        the process may hold more than PROCESS_BASE guessed), keeping a reserve for what a cache entry's
        making and a chunk run allocate beside the caches, and for `growing`: bytes that stores created
        before this call will still add (the judging deviations fill their in-memory share during the
        search, after the caches were sized); stop (one line) when not even one weight in two forms fits."""
        held = tree_pss() - WEIGHTS.bytes - CONVERTED.bytes  # the caches' own bytes are re-planned here
        # a worker shares the parent's pages of resident weights (PSS counts them once); streamed, it holds its own
        per_worker = WORKER_BASE + 2 * self.worker_cache + (self.held if self.streaming else 0)
        workers = self.workers * per_worker if self.workers > 1 else 0
        workers -= sum(_pss(p) for p in _descendants(os.getpid()))  # already counted in what is held
        reading = self.held if self.streaming else 0  # streamed, this process's own runs map a layer at a time
        workers, growing, copies = max(0, workers), max(0, growing), TRANSIENT * self.largest
        room = self.budget - held - workers - copies - growing - reading
        need = MIN_CACHE * self.largest
        if room < need:
            raise MemoryBudgetError(f"stage {stage} needs {_gb(self.budget - room + need - held)} beside the "
                                    f"{_gb(held)} the compile holds (caches' minimum {_gb(need)}, working copies "
                                    f"{_gb(copies)}, weights read at once {_gb(reading)}, deviations still to keep "
                                    f"{_gb(growing)}, workers {_gb(workers)}) and its memory budget "
                                    f"is {_gb(self.budget)}: raise --max-memory, or compile fewer layers or "
                                    f"calibration prompts")
        want = self.weight_cache + self.converted_cache
        if room < want:
            share = room / want
            WEIGHTS.resize(int(self.weight_cache * share))
            CONVERTED.resize(int(self.converted_cache * share))
            print(f"[luminal-num] memory: the compile holds {_gb(held)} at stage {stage}: caches "
                  f"{_gb(WEIGHTS.budget_bytes)} (derived) + {_gb(CONVERTED.budget_bytes)} (stored formats)",
                  file=sys.stderr, flush=True)

    @contextmanager
    def applied(self) -> Iterator[None]:
        """This process's caches sized to the plan while the block runs (workers size theirs when they
        start), then back to what they were: a compile of a small model must not shrink the caches of
        whatever the process does next. The streaming policy likewise (forked workers inherit it)."""
        old = WEIGHTS.budget_bytes, CONVERTED.budget_bytes, SPILL.budget_bytes
        WEIGHTS.resize(self.weight_cache)
        CONVERTED.resize(self.converted_cache)
        SPILL.budget_bytes = self.boundary
        try:
            with STREAMING.set_to(self.streaming):
                yield
        finally:
            WEIGHTS.resize(old[0])
            CONVERTED.resize(old[1])
            SPILL.budget_bytes = old[2]


def _pss(pid: int) -> int:
    """A process's proportional set size in bytes (0 when it is gone or /proc lacks smaps_rollup)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        for task in (os.listdir(f"/proc/{p}/task") if os.path.isdir(f"/proc/{p}/task") else ()):
            try:
                with open(f"/proc/{p}/task/{task}/children") as f:
                    kids = [int(c) for c in f.read().split()]
            except OSError:
                kids = []
            out += kids
            todo += kids
    return out


def tree_pss() -> int:
    """PSS of this process and its descendants (the pool's workers): what the compile occupies."""
    me = os.getpid()
    return _pss(me) + sum(_pss(p) for p in _descendants(me))


def weight_bytes(weights: Mapping[str, np.ndarray]) -> tuple[int, int]:
    """(all, largest) of the weights' sizes as FP32, without reading them."""
    sizes = [int(np.prod(np.shape(w), dtype=np.int64)) * 4 for w in weights.values()]
    return sum(sizes), max(sizes, default=0)


_LAYER_INDEX = re.compile(r"(?:^|[._])(\d+)(?=[._]|$)")  # "model.layers.12.mlp..." / "blk.12.attn_q..."


def layer_of(name: str) -> str:
    """The layer a weight belongs to by its name: the name up to its first integer component
    ("model.layers.12.mlp.up_proj.weight" -> "model.layers.12", GGUF "blk.12.ffn_up.weight" -> "blk.12"); a
    name without one (the embedding, the final norm, the LM head) is a layer of its own."""
    m = _LAYER_INDEX.search(name)
    return name if m is None else name[:m.end(1)]


@dataclass(frozen=True)
class WeightSizes:
    """The weights' sizes as FP32 (read from shapes only): what a plan needs to hold them or stream them."""

    total: int      # every weight
    largest: int    # the largest weight
    mapped: int     # the file-backed ones (their pages can be given back and read again)
    held: int       # streamed: what one process holds at once: the weights in memory (not file-backed), and of
    #                 the file-backed ones a layer's (a chunk's) plus the largest weight outside it (the LM head's,
    #                 or a tied embedding read at the start and again at the end), the largest such pair

    @staticmethod
    def of(weights: Mapping[str, np.ndarray]) -> "WeightSizes":
        total, largest = weight_bytes(weights)
        layers: dict[str, int] = {}  # layer -> its file-backed weights' bytes
        biggest: dict[str, int] = {}  # layer -> its largest file-backed weight
        for name, w in weights.items():
            if is_file_backed(w):
                size, layer = int(np.prod(np.shape(w), dtype=np.int64)) * 4, layer_of(name)
                layers[layer] = layers.get(layer, 0) + size
                biggest[layer] = max(biggest.get(layer, 0), size)
        ranked = sorted(biggest.items(), key=lambda kv: -kv[1])[:2]
        held = max((size + next((b for other, b in ranked if other != layer), 0) for layer, size in layers.items()),
                   default=0)
        mapped = sum(layers.values())
        return WeightSizes(total, largest, mapped, total - mapped + held)


def plan_memory(weights: Mapping[str, np.ndarray], budget: int | None = None, workers: int = 2,
                rotation: bool = False, streaming: bool | None = None) -> MemoryPlan:
    """The plan for a compile of a model with these weights within `budget` bytes (default: what this
    process holds now plus 80% of the machine's available memory). Each cache gets what the model can use (the derived cache: FP64 copies
    of every weight plus one FP32 form of each, and with `rotation` (rotated or smoothed weights) each weight's FP32 rotation and its widened
    stored form too; the stored-format cache: two formats of each), at most its share of what the budget
    leaves after the processes and the weights. `streaming` (None: decided here): on when the weights are
    file-backed and holding them all does not fit the budget beside the caches' minimum; then the floor
    counts the weights one process holds at once (WeightSizes.held), and each worker holds its own."""
    budget = tree_pss() + int(0.8 * available_bytes()) if budget is None else budget
    sizes = WeightSizes.of(weights)
    total, largest = sizes.total, sizes.largest
    work = (MIN_CACHE + TRANSIENT) * largest  # the caches' minimum and the transient reserve
    kept = 2 * KEPT_MIN  # the two spilling stores' least shares (MemoryPlan.fit counts them too)
    if streaming is None:
        streaming = sizes.mapped > 0 and budget < PROCESS_BASE + total + work + kept
    elif streaming and sizes.mapped == 0:
        raise MemoryBudgetError("streaming needs file-backed weights (a memory-mapped checkpoint); these are all in memory")
    held = sizes.held if streaming else total
    floor = PROCESS_BASE + held + work + kept  # one process: its baseline, the weights it holds (streaming: a layer's)
    if budget < floor:
        what = f"weights streamed {_gb(held)} of {_gb(total)}" if streaming else f"weights {_gb(total)}"
        raise MemoryBudgetError(f"the compile needs at least {_gb(floor)} (process {_gb(PROCESS_BASE)}, {what}, "
                                f"working copies of the largest weight {_gb(work)}, kept FP64 values and "
                                f"deviations {_gb(kept)}); the "
                                f"memory budget is {_gb(budget)}: raise --max-memory or compile fewer layers")
    worker_cache = min(WORKER_CACHE_MAX, max(2 * largest, 64 << 20))  # the largest weight in two forms
    per_worker = WORKER_BASE + 2 * worker_cache + (held if streaming else 0)  # streamed, each holds its own layer
    fit = workers
    while fit > 1 and budget - PROCESS_BASE - held - fit * per_worker < work:
        fit -= 1
    left = budget - PROCESS_BASE - held - (fit * per_worker if fit > 1 else 0) - TRANSIENT * largest
    derived = min((5 if rotation else 3) * total, int(0.6 * left))
    converted = min(2 * total, left - derived)
    share = max(KEPT_MIN, min(budget // 16, (left - MIN_CACHE * largest) // 4))
    return MemoryPlan(budget, total, largest, fit, derived, converted, worker_cache if fit > 1 else 0,
                      share, share, streaming, held)
