"""The megakernel's work queue run on the CPU backend's op bodies by N simulated SMs (issue 33).

Why: no GPU is needed to check the barriers. Each simulated SM does what the persistent kernel does:
pop the next queue entry (one global head, so entries are taken in queue order), spin on its barrier
counters, run the tile, signal. A seeded random choice of which SM moves next gives one interleaving;
the tile's read happens when it starts, its write and signal when it finishes, so other SMs act in
between.

The check is independent of the barrier derivation: every buffer keeps which of its elements have been
written, and a starting tile's reads (its input views realized on index arrays: the producer elements it
touches, or the whole buffer) must all be written, else a violation is recorded. Unwritten elements
hold NaN, so a read of one also shows in the values. No SM able to move while tiles remain is a
deadlock. Values: a tile's value is its kernel's CPU body (runtime/cpu.py KERNELS) evaluated on the
buffers as they are, of which the tile keeps its own range (flat ops) or, for an opaque op, the whole
output when its last tile finishes; bodies are memoized by the bytes the tile reads, so a correct
interleaving reuses the first one's values and a wrong one recomputes from what it saw. A tile of an op
that recomputes a row op (QueueOp.recomputes) reads that row op's inputs, evaluates its body into a private
copy and runs its own body on that copy; the row op's buffer is never written, so a reader that did not
recompute it reads unwritten elements (a violation).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Mapping

import numpy as np

from ..codegen.blockops import Partition
from ..codegen.llir import KernelKind, Program
from ..codegen.megakernel import WorkQueue, _slots_under_at, wait_counters
from ..hlir.symbolic import evaluate
from .cpu import KERNELS, CpuRuntime, _external, _Run, bind_program


@dataclass(frozen=True)
class Violation:
    op: int
    tile: int
    producer_kernel: int
    what: str


@dataclass
class EmulatedRun:
    outputs: dict[str, np.ndarray]
    violations: list[Violation] = field(default_factory=list)
    deadlock: str | None = None
    tiles_run: int = 0


def _poison(shape: tuple[int, ...], dtype) -> np.ndarray:
    out = np.empty(shape, dtype=dtype)
    if np.issubdtype(dtype, np.integer):
        out.fill(np.iinfo(dtype).max)
    else:
        out.fill(np.nan)
    return out


class MegakernelEmulator:
    """One program's queue on the CPU backend; `run(seed, sms)` is one interleaving."""

    def __init__(self, program: Program, queue: WorkQueue, weights: Mapping[str, np.ndarray],
                 inputs: Mapping[str, np.ndarray]):
        self.program, self.queue = program, queue
        self.rt = CpuRuntime(program, weights)
        feed = {**self.rt.weights, **inputs}
        feed.update(self.rt._concatenated(feed, inputs))
        self.bindings = bind_program(program, feed)
        self.feed = feed
        self.weight_names = frozenset(n for n in self.rt.weights if n not in inputs) | frozenset(self.rt._concats)
        setup = self._state({})
        self.externals = {k.id: _external(self.rt, k, setup) for k in program.kernels if k.kind is KernelKind.EXTERNAL}
        self.table = queue.evaluate(self.bindings)
        self.kernels = [program.kernel(op.kernel) for op in queue.ops]
        self.shapes = [tuple(evaluate(d, self.bindings) for d in k.shape) for k in self.kernels]
        self._reads: dict[tuple[int, int], list[tuple[int, np.ndarray | None]]] = {}
        self._memo: dict[tuple, tuple[np.ndarray, np.ndarray | None]] = {}
        self._waits: dict[tuple[int, int], tuple[tuple[int, int], ...]] = {}

    def _state(self, stored: dict) -> _Run:
        return _Run(stored, {}, self.feed, self.bindings, self.weight_names, self.rt._compiled)

    # -- what a tile reads (independent of the barriers) ---------------------------------------------
    def reads(self, op: int, tile: int) -> list[tuple[int, np.ndarray | None]]:
        """(producer kernel id, flat element indices it reads or None for the whole buffer) per input."""
        key = (op, tile)
        if key not in self._reads:
            k, block = self.kernels[op], self.queue.ops[op].block
            recomputed = self.queue.ops[op].recomputes
            out = [] if recomputed is None else list(self.reads(recomputed, 0))
            for slot, inp in enumerate(k.inputs):
                producer = self.program.kernel(inp.buffer)
                if producer.kind is KernelKind.EXTERNAL:
                    continue
                if recomputed is not None and producer.id == self.kernels[recomputed].id:
                    continue  # its private copy, made by this tile
                out.append((producer.id, self._read_indices(k, block, slot, producer, tile)))
            self._reads[key] = out
        return self._reads[key]

    def _read_indices(self, k, block, slot, producer, tile) -> np.ndarray | None:
        if block.partition is not Partition.FLAT:
            return None
        shape = tuple(evaluate(d, self.bindings) for d in producer.shape)
        index = np.arange(int(np.prod(shape, dtype=np.int64)), dtype=np.int64).reshape(shape)
        realized = np.asarray(k.inputs[slot].view.realize(index, self.bindings))
        e = evaluate(block.elements, self.bindings)
        out_shape = tuple(evaluate(d, self.bindings) for d in k.shape)
        if k.kind is KernelKind.ELEMENTWISE and realized.shape == out_shape:
            return realized.reshape(-1)[tile * e:(tile + 1) * e]
        if k.kind in (KernelKind.ROWS, KernelKind.SOFTMAX) and realized.ndim == len(out_shape) \
                and realized.shape[:-1] == out_shape[:-1] and slot not in _slots_under_at(k.body):
            return realized.reshape(int(np.prod(out_shape[:-1], dtype=np.int64)), -1)[tile]
        body = tuple(evaluate(d, self.bindings) for d in k.body_shape)
        if k.kind in (KernelKind.SUM, KernelKind.MAX) and realized.shape == body:
            return realized.reshape(-1, body[-1])[tile]
        return None

    # -- one interleaving ----------------------------------------------------------------------------
    def run(self, seed: int, sms: int) -> EmulatedRun:
        rng = np.random.default_rng(seed)
        buffers = {k.id: _poison(shape, k.dtype.storage) for k, shape in zip(self.kernels, self.shapes)}
        written = {k.id: np.zeros(int(np.prod(shape, dtype=np.int64)), dtype=bool)
                   for k, shape in zip(self.kernels, self.shapes)}
        scales: dict[int, np.ndarray] = {}
        counters = [0] * sum(t.counters for t in self.table)
        versions = {k.id: 0 for k in self.kernels}  # writes per buffer: equal versions, equal bytes
        seen: dict[tuple, tuple[np.ndarray, np.ndarray | None]] = {}
        done = [0] * len(self.queue.ops)
        entries = [(op, t) for op, launch in enumerate(self.table) for t in range(launch.tiles)]
        result = EmulatedRun({})
        head = 0
        sm_entry: list[tuple[int, int] | None] = [None] * sms
        sm_value: list[tuple[np.ndarray, np.ndarray | None] | None] = [None] * sms
        sm_running = [False] * sms
        finished = 0
        released = [False] * sms  # a waiting SM's barriers passed (counters only grow: it stays passed)
        changed = True            # a counter moved since the waiting SMs were last checked
        while finished < len(entries):
            movable = []
            for s in range(sms):
                if sm_entry[s] is None:
                    if head < len(entries):
                        movable.append(s)
                elif sm_running[s] or released[s]:
                    movable.append(s)
                elif changed and self._released(counters, *sm_entry[s]):
                    released[s] = True
                    movable.append(s)
            changed = False
            if not movable:
                result.deadlock = f"no SM can move with {len(entries) - finished} tiles left: " + ", ".join(
                    f"SM{s} waits in op {e[0]} tile {e[1]}" for s, e in enumerate(sm_entry) if e is not None)
                break
            s = movable[int(rng.integers(len(movable)))]
            if sm_entry[s] is None:
                sm_entry[s], head = entries[head], head + 1
                released[s] = self._released(counters, *sm_entry[s])
            elif not sm_running[s]:
                op, tile = sm_entry[s]
                self._check(result, op, tile, written)
                flat = self.queue.ops[op].block.partition is Partition.FLAT
                key = (op, tile if flat else -1, tuple(versions[p] for p, _ in self.reads(op, tile)))
                if key not in seen:
                    seen[key] = self._value(op, tile, buffers, scales)
                sm_value[s] = seen[key]
                sm_running[s] = True
            else:
                op, tile = sm_entry[s]
                self._write(op, tile, sm_value[s], buffers, written, scales, done)
                versions[self.kernels[op].id] += 1
                q = self.queue.ops[op]
                counters[self.table[op].counter_base + tile * q.signals_with] += 1
                sm_entry[s], sm_value[s], sm_running[s], released[s] = None, None, False, False
                changed = True
                finished += 1
                result.tiles_run += 1
        result.outputs = {name: buffers[kid].astype(np.float64) if kid in buffers
                          else np.asarray(self.externals[kid]).astype(np.float64) for name, kid in self.program.outputs}
        return result

    def _released(self, counters: list[int], op: int, tile: int) -> bool:
        key = (op, tile)
        if key not in self._waits:  # the tile's counters and counts: the same in every interleaving
            pairs = [p for w in self.queue.ops[op].waits
                     for p in wait_counters(self.queue, self.table, op, tile, w, self.bindings)]
            self._waits[key] = tuple(pairs)
        n = len(counters)
        return all(i < n and counters[i] >= need for i, need in self._waits[key])

    def _check(self, result: EmulatedRun, op: int, tile: int, written) -> None:
        for producer, idx in self.reads(op, tile):
            ok = written[producer].all() if idx is None else bool(written[producer][idx].all())
            if not ok:
                result.violations.append(Violation(op, tile, producer, "reads elements no tile has written yet"))

    def _value(self, op: int, tile: int, buffers, scales) -> tuple[np.ndarray, np.ndarray | None]:
        """The kernel's output (and a QUANTIZE kernel's scales) from the bytes this tile reads."""
        k = self.kernels[op]
        digest = hashlib.blake2b(digest_size=16)
        for producer, idx in self.reads(op, tile):
            values = buffers[producer].reshape(-1)
            digest.update((values if idx is None else values[idx]).tobytes())
            if producer in scales:
                digest.update(scales[producer].tobytes())
        key = (op, tile if self.queue.ops[op].block.partition is Partition.FLAT else -1, digest.digest())
        if key not in self._memo:
            stored = {**self.externals, **buffers}
            recomputed = self.queue.ops[op].recomputes
            if recomputed is not None:  # the row op's body first, on what this tile reads: its private copy
                stored[self.kernels[recomputed].id] = self._value(recomputed, 0, buffers, scales)[0]
            state = self._state(stored)
            state.scales.update(scales)
            state.out = np.empty(self.shapes[op], dtype=k.dtype.storage)
            with np.errstate(all="ignore"):
                value = KERNELS[k.kind](self.rt, k, state)
            if value is not state.out:
                np.copyto(state.out, value, casting="unsafe")
            self._memo[key] = (state.out, state.scales.get(k.id))
        return self._memo[key]

    def _write(self, op: int, tile: int, value, buffers, written, scales, done) -> None:
        k, block = self.kernels[op], self.queue.ops[op].block
        out, k_scales = value
        done[op] += 1
        if block.partition is Partition.FLAT:
            e = evaluate(block.elements, self.bindings)
            span = slice(tile * e, (tile + 1) * e)
            buffers[k.id].reshape(-1)[span] = out.reshape(-1)[span]
            written[k.id][span] = True
        elif done[op] == self.table[op].tiles:  # an opaque op's output exists once all its tiles ran
            np.copyto(buffers[k.id], out)
            written[k.id][:] = True
            if k_scales is not None:
                scales[k.id] = k_scales


def bit_identical(a: Mapping[str, np.ndarray], b: Mapping[str, np.ndarray]) -> bool:
    """Every output equal bit for bit (NaN payloads too)."""
    return a.keys() == b.keys() and all(
        np.asarray(a[n]).shape == np.asarray(b[n]).shape and np.asarray(a[n]).tobytes() == np.asarray(b[n]).tobytes()
        for n in a)
