"""The megakernel lowering: a fused program as one persistent kernel over a work queue (issue 33).

Why: a decode step is ~300 small kernels whose launches, not their bytes, set the latency. Luminal's
answer, rebuilt here at the LLIR level after fusion: every kernel becomes a block op (its tiles,
codegen/blockops.py); a work queue, built once at compile time, holds one entry per op with its
symbolic tile count (evaluated at run time, so a new sequence length rebuilds nothing); barrier
counters whose strides derive from the producers' launch dimensions let a consumer tile wait only on
the producer tiles it reads; one persistent kernel pops entries, waits, runs the op's inlined body and
signals.

Barriers: a flat producer (tile t writes elements [t E, (t + 1) E)) has stride 1 over its tiles (one
counter per tile, each reaching 1); an opaque producer has stride 0 (all its tiles count into one
counter, which reaches its tile count). A consumer tile reading a flat producer through an identity
view (`Wait.read_elements` = R per consumer tile) reads elements [t R, (t + 1) R) and waits on producer
tiles t R // E .. ((t + 1) R - 1) // E; any other read waits on the producer's every counter.

Scale prologues: a Gemm that scales an operand itself (codegen/cuda_gemm.py: FP8 / INT8 variants, per token
or per channel) runs those scale launches before its body, as entries of their own in the persistent loop
(`QueueOp.prologue`): a launch over an operand written before the kernel starts waits on nothing, any
other on the op's producers, and the body on every launch before it, whole; the cost model schedules their
tiles, the emulated scheduler runs the op's CPU body. A static scale (a weight's per-channel scales,
ScaleSpec.static) is no step work: the runtime writes it once at load (gemm_scales.static_scales,
KernelSource.at_load), as the CPU backend prepares its weight operands once. Under a GEMV, A's per-token
scales are `private` (blockops.scale_launches): every body tile computes them into its block's own copy
after any norm it recomputes, so they add no tiles and no hop.

Recomputed producers: a one-tile flat row op (the RMSNorm of a decode row) whose only reader is one GEMV
is not a queue entry of its own: every tile of that GEMV runs the row op's body first, into its block's own
copy, and reads that (`QueueOp.recomputes`; the row op keeps its place with no tiles, `recomputed_by`). The
GEMV then waits on the row op's producers instead: one barrier hop fewer on the chain, the same body and
summation order, so the same bits.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Mapping

from ..hlir.shape import contiguous_strides
from ..hlir.symbolic import Dim, evaluate
from .blockops import BlockOp, Partition, ScaleLaunch, block_op, scale_launches
from .gemm_scales import static_scales
from .llir import FAt, FApply, FExpr, FRoundTo, FRowSum, Kernel, KernelKind, Program, load_slots


class MegakernelError(ValueError):
    """A program the megakernel lowering cannot take (one line: which kernel and why)."""


@dataclass(frozen=True)
class Wait:
    """A consumer op's wait on one producer op (queue positions). `read_elements`: elements of the
    producer each consumer tile reads, contiguous and in step with the consumer's tiles; None: the
    consumer reads the producer whole."""

    producer: int
    read_elements: Dim | None = None


@dataclass(frozen=True)
class QueueOp:
    """One queue entry: a kernel's block op, the stride its tiles signal with, what it waits on."""

    kernel: int
    block: BlockOp
    stride: int
    waits: tuple[Wait, ...]
    signal_stride: int | None = None  # None: signals with `stride` (a test sets a wrong one)
    recomputes: int | None = None     # a one-tile row op (queue position) each tile runs first, privately
    recomputed_by: int | None = None  # this op has no tiles: that op's tiles run its body
    prologue: tuple[ScaleLaunch, ...] = ()  # a Gemm's own scale launches, in launch order

    @property
    def signals_with(self) -> int:
        return self.stride if self.signal_stride is None else self.signal_stride


@dataclass(frozen=True)
class OpLaunch:
    """An op's run-time figures: tiles, its first counter and how many it has, its first queue slot."""

    tiles: int
    counter_base: int
    counters: int
    first_entry: int


@dataclass(frozen=True)
class WorkQueue:
    ops: tuple[QueueOp, ...]

    def position(self, kernel_id: int) -> int:
        for i, op in enumerate(self.ops):
            if op.kernel == kernel_id:
                return i
        raise KeyError(f"kernel {kernel_id} is not in the work queue")

    def evaluate(self, bindings: Mapping[str, int]) -> tuple[OpLaunch, ...]:
        """Tile counts, counter offsets and entry offsets for one run's shapes."""
        out, counter, entry = [], 0, 0
        for op in self.ops:
            tiles = 0 if op.recomputed_by is not None else op.block.tiles.evaluate(bindings)
            counters = tiles if op.stride else 1
            out.append(OpLaunch(tiles, counter, counters, entry))
            counter += counters
            entry += tiles
        return tuple(out)


def expected_count(stride: int, tiles: int) -> int:
    """What one counter of a producer reaches when all its tiles signalled: 1 per tile (stride 1) or
    all of them (stride 0)."""
    return 1 if stride else tiles


def wait_counters(queue: WorkQueue, table: tuple[OpLaunch, ...], consumer: int, tile: int, wait: Wait,
                  bindings: Mapping[str, int]) -> list[tuple[int, int]]:
    """(counter index, count to reach) for one consumer tile's wait: the producer tiles it reads."""
    producer, launch = queue.ops[wait.producer], table[wait.producer]
    if producer.recomputed_by is not None:
        raise ValueError(f"op {consumer} waits on op {wait.producer}, which has no tiles (op {producer.recomputed_by} "
                         "recomputes it)")
    if wait.read_elements is None or producer.block.partition is not Partition.FLAT:
        tiles = range(launch.tiles)
    else:
        r, e = evaluate(wait.read_elements, bindings), evaluate(producer.block.elements, bindings)
        tiles = range(min(tile * r // e, launch.tiles - 1), min(((tile + 1) * r - 1) // e, launch.tiles - 1) + 1)
    need = expected_count(producer.stride, launch.tiles)
    return sorted({(launch.counter_base + t * producer.stride, need) for t in tiles})


# -- building the queue --------------------------------------------------------------------------------

def _slots_under_at(e: FExpr | None) -> set[int]:
    """Slots a ROWS body reads inside FAt (through a view of their own space, not at the element)."""
    if isinstance(e, FAt):
        return load_slots(e.x)
    if isinstance(e, (FRoundTo,)):
        return _slots_under_at(e.x)
    if isinstance(e, FRowSum):
        return _slots_under_at(e.body)
    if isinstance(e, FApply):
        return set().union(*(_slots_under_at(a) for a in e.args))
    return set()


def _identity_read(view, producer: Kernel) -> bool:
    """The view reads the producer's buffer as it lies: one unmasked view of its shape, row-major."""
    if len(view.views) != 1:
        return False
    v = view.views[0]
    if v.mask is not None or v.offset != 0 or tuple(v.shape) != tuple(producer.shape):
        return False
    return all(s == c or d == 1 for d, s, c in zip(v.shape, v.strides, contiguous_strides(list(producer.shape))))


def _read_elements(k: Kernel, slot: int, producer: Kernel, consumer: BlockOp, made: BlockOp) -> Dim | None:
    """Elements of the producer one consumer tile reads, when that is a range in step with its tiles."""
    if consumer.partition is not Partition.FLAT or made.partition is not Partition.FLAT:
        return None
    view = k.inputs[slot].view
    if not _identity_read(view, producer):
        return None
    if k.kind is KernelKind.ELEMENTWISE and tuple(view.shape) == tuple(k.shape):
        return consumer.elements
    if k.kind in (KernelKind.ROWS, KernelKind.SOFTMAX) and tuple(view.shape) == tuple(k.shape) \
            and slot not in _slots_under_at(k.body):
        return k.shape[-1]
    if k.kind in (KernelKind.SUM, KernelKind.MAX) and tuple(view.shape) == tuple(k.body_shape):
        return k.body_shape[-1]
    return None


def build_queue(program: Program, recompute_rows: bool = True) -> WorkQueue:
    """One op per launching kernel, in program order (a topological order: producers come first);
    `recompute_rows`: one-tile row ops read only by one GEMV are recomputed by its tiles (module doc)."""
    ops: list[QueueOp] = []
    position: dict[int, int] = {}
    blocks: dict[int, BlockOp] = {}
    for k in program.launched():
        made = block_op(k, inlined=True)  # the bodies the device loop runs (a Gemm's tiled body)
        waits = []
        for slot, inp in enumerate(k.inputs):
            producer = program.kernel(inp.buffer)
            if producer.kind is KernelKind.EXTERNAL:
                continue  # written before the kernel starts
            elements = _read_elements(k, slot, producer, made, blocks[producer.id])
            waits.append(Wait(position[producer.id], elements))
        merged: dict[int, Wait] = {}
        for w in waits:  # two reads of one producer: the wider wait
            old = merged.get(w.producer)
            merged[w.producer] = w if old is None or old.read_elements == w.read_elements else Wait(w.producer)
        position[k.id] = len(ops)
        blocks[k.id] = made
        ready = tuple(program.kernel(inp.buffer).kind is KernelKind.EXTERNAL for inp in k.inputs)
        prologue = ()
        if k.kind.is_gemm:
            prologue = scale_launches(k, program.quantized_inputs(k), ready)
            for slot in static_scales(k, program.quantized_inputs(k)):
                if not ready[slot]:
                    raise MegakernelError(f"kernel {k.id}: static scales over operand {slot}, which is no weight")
        ops.append(QueueOp(k.id, made, 1 if made.partition is Partition.FLAT else 0, tuple(merged.values()),
                           prologue=prologue))
    queue = WorkQueue(tuple(ops))
    return _recompute_rows(queue, program) if recompute_rows else queue


def _recompute_rows(queue: WorkQueue, program: Program) -> WorkQueue:
    """Each one-tile flat row op whose one reader is a GEMV reading it as A (and only there), not a program
    output: its reader recomputes it and waits on its producers (whole) instead of on it."""
    ops = list(queue.ops)
    outputs = {kid for _, kid in program.outputs}
    readers: dict[int, list[tuple[int, int]]] = {}
    for i, op in enumerate(ops):
        for slot, inp in enumerate(program.kernel(op.kernel).inputs):
            readers.setdefault(inp.buffer, []).append((i, slot))
    for p, op in enumerate(ops):
        tiles = op.block.tiles
        if op.block.kind != "rows" or op.block.partition is not Partition.FLAT or op.kernel in outputs \
                or not all(isinstance(d, int) for d, _ in tiles.factors) or tiles.evaluate({}) != 1:
            continue
        reads = readers.get(op.kernel, [])
        if len(reads) != 1 or reads[0][1] != 0 or ops[reads[0][0]].block.kind != "gemv" \
                or ops[reads[0][0]].recomputes is not None:
            continue
        c = reads[0][0]
        waits: dict[int, Wait] = {w.producer: Wait(w.producer) for w in op.waits}
        for w in ops[c].waits:
            if w.producer != p:
                waits[w.producer] = w if w.producer not in waits else Wait(w.producer)
        ops[c] = replace(ops[c], waits=tuple(waits[k] for k in sorted(waits)), recomputes=p)
        ops[p] = replace(op, recomputed_by=c)
    return WorkQueue(tuple(ops))


def with_signal_stride(queue: WorkQueue, op: int, stride: int) -> WorkQueue:
    """The queue with one op signalling with another stride than its consumers derive (a wrong barrier)."""
    ops = list(queue.ops)
    ops[op] = replace(ops[op], signal_stride=stride)
    return WorkQueue(tuple(ops))


def without_recompute(queue: WorkQueue, op: int) -> WorkQueue:
    """The queue with op `op` no longer recomputing its row op, which still has no tiles: its tiles read a
    buffer no tile writes (a wrong lowering the emulator must catch)."""
    ops = list(queue.ops)
    ops[op] = replace(ops[op], recomputes=None)
    return WorkQueue(tuple(ops))


def with_read_elements(queue: WorkQueue, op: int, wait: int, elements: Dim | None) -> WorkQueue:
    """The queue with one wait's per-tile read range replaced (a wrong consumer-side barrier stride)."""
    ops = list(queue.ops)
    waits = list(ops[op].waits)
    waits[wait] = replace(waits[wait], read_elements=elements)
    ops[op] = replace(ops[op], waits=tuple(waits))
    return WorkQueue(tuple(ops))


def without_wait(queue: WorkQueue, op: int, producer: int) -> WorkQueue:
    """The queue with op `op` no longer waiting on op `producer` (a missing dependency the emulator must catch)."""
    ops = list(queue.ops)
    ops[op] = replace(ops[op], waits=tuple(w for w in ops[op].waits if w.producer != producer))
    return WorkQueue(tuple(ops))
