"""CUDA source of the megakernel: one persistent kernel interpreting the work queue (issue 33).

Every launch of every kernel's own source (cuda_kernels.RENDERERS: for a Gemm its fallback, not the
cuBLAS call) becomes a device function with the same name and body; the bodies are inlined into one
interpreter loop: a block pops the next entry (one global head), thread 0 spins on the entry's barrier
counters (ld.acquire), the block runs the op's body as virtual block `tile` of its grid, then signals
its counter (fence, then atomicAdd). Before the wait, a tile whose op reads a weight band by band
(codegen/weight_stream.py: the Gemm bodies' own rows of an (N, K) weight, in each stored part) has all
its threads issue an L2 prefetch per 128-byte line of those rows, so the weight bytes stream while
thread 0 spins on the barrier (Hazy Research's no-bubbles megakernel overlaps the next instruction's
weight loads likewise: hazyresearch.stanford.edu/blog/2025-05-27-no-bubbles). A tile of an attention op
reading a KV cache (codegen/cache_stream.py: per key, the D (Dv) elements of its score row's K (V) row)
prefetches those lines the same way: the cache was written before the kernel started, but for the row this
step's scatter writes, which the prefetch also touches (a hint: L2 is the point of coherence, so the
scatter's store lands in the line). A tile of a GEMV that
recomputes a one-row norm (codegen/megakernel.py, QueueOp.recomputes) first runs that op's body as its
one tile, writing the block's own copy (`privates`), then its own body, whose reads of the norm's slot
`ln_mk_buf` redirects to that copy; the norm has no tiles and signals nothing. A GEMV whose A scales are
private (QueueOp.prologue) runs that scale launch's body next, as one virtual block, into the block's second
copy (`ln_mk.scale_copy`, redirecting the Gemm's scale scratch); the scale launch has no tiles. Where A's
copy fits (the launch is `staged`: gemm_scales.staged_a_bytes) the GEMV runs its Gemm's `_staged` entry instead,
which loads A once into shared memory taking each scale block's amax as it loads, and quantizes from that copy:
no second pass over A (the scale launch keeps its tileless entry, so launch indices stay the prologue's). The
bodies stay unchanged because the builtins they read are
macros over the current tile (`blockIdx`, `gridDim`, `blockDim`, `threadIdx` from `ln_mk`, and
`__syncthreads()` a named barrier over the body's threads); every body loops grid-stride, so any
virtual grid computes its whole output, and the grids are the launches' own.

A Gemm the kernel-by-kernel runtime runs as the dequantize-on-load kernel (codegen/cuda_weight_only.py:
a plain Gemm, B a weight held in a storage format) inlines that kernel's body, reading the weight's stored
parts (packed codes, scales) from slots of their own (`MegakernelSource.uses`); every other Gemm inlines
its tiled fallback, which for a stored B reads the same part slots (Arg role "part"), so the megakernel
moves the plan's stored bytes.

The table the loop reads (ops, waits, counters) is built per run from the symbolic queue
(`MegakernelSource.table`): a launch whose blocks are the queue op's tiles keeps its flat barrier
(one counter per tile); any other (a Gemm's scale prologue, a short-row reduction's 128-row blocks)
is opaque: it and its readers wait on whole ops.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Mapping

from ..hlir.symbolic import evaluate
from .blockops import Partition, TileCount
from .cuda_gemm_operands import TILE as GEMM_TILE
from .gemm_scales import scale_blocks, staged_a_bytes
from .cuda_kernels import render_kernel
from .cuda_source import KernelSource, ceil_count
from .cuda_weight_only import weight_only_gemm
from .llir import Program
from .megakernel import MegakernelError, WorkQueue
from .megakernel_loop import LOOP, PRELUDE
from .cache_stream import CacheStream, cache_stream
from .weight_stream import BAND, LINE, WeightStream, WholeRead, weight_stream, whole_reads

ENTRY_NAME = "ln_megakernel"
BLOCK_THREADS = 1024  # the persistent block: at least every body's block
# static shared memory the distinct staged GEMV bodies may take together: sm_90 gives a block 48 KB of static
# shared memory, and every other body's arrays took 10 KB of it in the 1-layer SmolLM2 FP8 W8A8 megakernel (PTX)
STAGED_SHARED_BYTES = 32 * 1024


@dataclass(frozen=True)
class CudaOp:
    """One launch of one queue op: its device function and the argument slots it is called with
    (bufs[] indices: LLIR buffer ids, then scratch, then each op's dyn_dims)."""

    queue_op: int
    launch: int
    kernel: int
    entry: str
    grid: tuple
    block: tuple[int, ...]
    arg_slots: tuple[int, ...]
    last: bool  # the launch that writes the kernel's output
    stream: WeightStream | None = None  # the weight rows its tiles prefetch before the wait (a Gemm's body)
    stream_slots: tuple[int, ...] = ()  # bufs[] slot of each of the stream's parts
    cache: CacheStream | None = None    # the KV-cache rows its tiles prefetch before the wait (an attention body)
    whole: tuple[WholeRead, ...] = ()   # inputs its tiles prefetch whole before the wait (and its recomputed row op's)


@dataclass(frozen=True)
class SlotUse:
    """What one bufs[] entry past the LLIR values points at: a kernel's scratch `index`, its dyn_dims
    (`index` None), or, for a stored weight a dequantize-on-load body reads, its stored `part`."""

    slot: int
    kernel: int
    index: int | None = None
    part: int | None = None


@dataclass(frozen=True)
class MegakernelSource:
    source: str
    name: str
    ops: tuple[CudaOp, ...]
    sources: tuple[KernelSource | None, ...]  # per CudaOp, the kernel's own source (None: a dequantize-on-load body)
    slots: int                         # bufs[] entries
    uses: tuple[SlotUse, ...] = ()     # every entry past the LLIR values, in slot order

    def table(self, queue: WorkQueue, bindings: Mapping[str, int]) -> tuple[list[tuple], list[tuple]]:
        """(ops rows, waits rows) as the loop reads them, for one run's shapes:
        op row = (body, first_entry, tiles, gx, gy, gz, bx, by, bz, counter_base, stride, wait_begin, wait_end,
        elements, prefetch_begin, prefetch_end, recompute, private_slot, span_begin, span_per_tile, scale_recompute,
        scale_slot), wait row = (producer CudaOp, read_elements or 0 for the whole producer); the op's prefetch
        rows are `prefetch_rows()[prefetch_begin:prefetch_end]`; `recompute`: the CudaOp of a one-tile row op each
        tile runs first into its block's own copy, which reads of bufs[private_slot] then see (-1: none). A row
        op so recomputed has no tiles; nor has a private scale launch (`scale_recompute`: the CudaOp each tile of a
        GEMV body runs next, as one virtual block, into its block's second copy, which bufs[scale_slot] then is).
        Tile t of an op with `span_per_tile` > 0 prefetches
        `cache_spans(...)[span_begin + t * span_per_tile:][:span_per_tile]` (its KV-cache rows)."""
        queue_table = queue.evaluate(bindings)
        last_of: dict[int, int] = {}
        rows, waits, counter, entry, prefetch, spans = [], [], 0, 0, 0, 0
        for i, op in enumerate(self.ops):
            grid = tuple(ceil_count(axis, bindings) for axis in op.grid) + (1, 1)
            q = queue.ops[op.queue_op]
            scale = op.launch < len(q.prologue)  # one of a Gemm's own scale launches (QueueOp.prologue)
            private = scale and q.prologue[op.launch].private  # run only by the body's tiles, privately
            tiles = 0 if q.recomputed_by is not None or private else math.prod(grid[:3])
            flat = (q.block.partition is Partition.FLAT and op.launch == 0 and op.last
                    and tiles == queue_table[op.queue_op].tiles)
            begin = len(waits)
            if q.prologue and op.last:  # a Gemm body: each of its scale launches with tiles, whole
                waits += [(j, 0) for j, p in zip(range(i - op.launch, i), q.prologue) if not p.private]
            if private or (scale and q.prologue[op.launch].ready):
                pass  # a private scale launch (no tiles), or one over an operand written before the kernel started
            elif op.launch > 0 and not q.prologue:
                waits.append((i - 1, 0))  # the previous launch of the same kernel, whole
            else:  # the op's producers: its first launch, a Gemm's scale launch over an activation, a Gemm's body
                for w in q.waits:
                    producer = last_of[w.producer]
                    aligned = flat and w.read_elements is not None and rows[producer][10] == 1
                    waits.append((producer, evaluate(w.read_elements, bindings) if aligned else 0))
            elements = evaluate(q.block.elements, bindings) if flat else 0
            stride = 1 if flat else 0
            block = tuple(op.block) + (1, 1)
            streams = _stream_rows(op)
            recompute, private_slot, scale_op, scale_slot = -1, -1, -1, -1
            if q.recomputes is not None and not (scale and (q.prologue[op.launch].ready or private)):
                # every launch of the reader that reads A recomputes the row op (its last launch)
                recompute, private_slot = last_of[q.recomputes], queue.ops[q.recomputes].kernel
            if op.last and any(p.second_pass for p in q.prologue):  # then A's scales, into a 2nd copy
                scale_op = i - op.launch + next(li for li, p in enumerate(q.prologue) if p.second_pass)
                scale_slot = self.ops[scale_op].arg_slots[0]  # the scale launch's output: the Gemm's scale scratch
            per_tile = _span_count(op, tiles, bindings)
            rows.append((i, entry, tiles, *grid[:3], *block[:3], counter, stride, begin, len(waits), elements,
                         prefetch, prefetch + len(streams), recompute, private_slot, spans, per_tile, scale_op,
                         scale_slot))
            prefetch += len(streams)
            spans += tiles * per_tile
            counter += tiles if stride else 1
            entry += tiles
            if op.last:
                last_of[op.queue_op] = i
        return rows, waits

    def private_bytes(self, program: Program, queue: WorkQueue, bindings: Mapping[str, int]) -> int:
        """Bytes of one block's own copy: the largest row op recomputed by its readers (0: none)."""
        sizes = [program.kernel(q.kernel).numel(bindings) * program.kernel(q.kernel).dtype.storage.itemsize
                 for q in queue.ops if q.recomputed_by is not None]
        return max(sizes, default=0)

    def private_scale_bytes(self, queue: WorkQueue, bindings: Mapping[str, int]) -> int:
        """Bytes of one block's second copy: the largest scale scratch a private scale launch writes (0: none)."""
        uses = {u.slot: u for u in self.uses}
        sizes = []
        for op, src in zip(self.ops, self.sources):
            q = queue.ops[op.queue_op]
            if op.launch < len(q.prologue) and q.prologue[op.launch].second_pass:
                scratch = src.scratch[uses[op.arg_slots[0]].index]
                sizes.append(int(scratch.numel(bindings) * scratch.dtype.itemsize))
        return max(sizes, default=0)

    def cache_spans(self, queue: WorkQueue, bindings: Mapping[str, int]) -> list[tuple]:
        """Every op's KV-cache spans in op order, tile by tile, as the loop reads them: (first byte, bytes
        between keys, keys, bytes per key, slot): the tile prefetches the lines of bufs[slot] holding
        [first + j * between, first + j * between + per key) for each key j (codegen/cache_stream.py)."""
        out = []
        for op in self.ops:
            if op.cache is None or queue.ops[op.queue_op].recomputed_by is not None:
                continue
            grid = tuple(ceil_count(axis, bindings) for axis in op.grid)
            _span_count(op, math.prod(grid), bindings)
            for t in range(math.prod(grid)):
                out += [(first, between, keys, per_key, o.buffer)
                        for o, first, between, keys, per_key in op.cache.tile_spans(t, bindings)]
        return out

    def prefetch_rows(self) -> list[tuple]:
        """Every op's prefetch rows in op order, as the loop reads them: (row_bytes, rows, rows_per_part_row,
        offset, n_out, slot): the tile at grid y `y` prefetches, for each of its bands b = y, y + grid y, ...
        (WeightStream.tile_bands), the part rows holding weight rows [b BAND + offset, min((b + 1) BAND, n_out) +
        offset) of bufs[slot]."""
        return [row for op in self.ops for row in _stream_rows(op)]


def _stream_rows(op: CudaOp) -> list[tuple]:
    """The op's prefetch rows: its weight stream's bands, then each whole read as (bytes, 1, 0, 0, 0, slot): a
    row whose rows_per_part_row is 0 is prefetched whole by every tile (the loop's `f.per == 0`)."""
    rows = [(r.nbytes, 1, 0, 0, 0, r.buffer) for r in op.whole]
    if op.stream is None:
        return rows
    return [(p.row_bytes, p.rows, p.rows_per_part_row, off, op.stream.n_out, slot)
            for off in op.stream.offsets for p, slot in zip(op.stream.parts, op.stream_slots)] + rows


def _whole(q, queue: WorkQueue, whole: Mapping[int, tuple[WholeRead, ...]]) -> tuple[WholeRead, ...]:
    """What the op's body launch prefetches whole: its kernel's whole reads, and those of the row op it recomputes
    (its tiles run that body too; runtime/megakernel_cost.streamed_before_wait prices the same bytes)."""
    reads = whole.get(q.kernel, ())
    if q.recomputes is not None:
        reads += whole.get(queue.ops[q.recomputes].kernel, ())
    return reads


def _span_count(op: CudaOp, tiles: int, bindings: Mapping[str, int]) -> int:
    """Cache spans per tile of the op (0: it prefetches none), checked: its tile t must be score row t."""
    if op.cache is None or not tiles:
        return 0
    if tiles != op.cache.tiles(bindings):
        raise MegakernelError(f"kernel {op.kernel}: {tiles} attention tiles are not its {op.cache.tiles(bindings)} "
                              "score rows: the cache prefetch would miss rows")
    return len(op.cache.operands)


_ENTRY = re.compile(r'extern "C" __global__ void (\w+)\(')


def _chunks(code: str) -> list[str]:
    """Top-level items of a source: preprocessor lines, and declarations up to their closing brace."""
    out, i, n = [], 0, len(code)
    while i < n:
        if code[i].isspace():
            i += 1
            continue
        if code[i] == "#" or code.startswith("//", i):
            end = code.find("\n", i)
            end = n if end < 0 else end
            out.append(code[i:end])
            i = end
            continue
        depth, j = 0, i
        while j < n:
            if code[j] == "{":
                depth += 1
            elif code[j] == "}":
                depth -= 1
                if depth == 0:
                    j += 1
                    if code[j:j + 1] == ";":
                        j += 1
                    break
            elif code[j] == ";" and depth == 0:
                j += 1
                break
            j += 1
        out.append(code[i:j])
        i = j
    return out


def _param_types(source: str, entry: str) -> list[str]:
    start = source.index(f"void {entry}(") + len(entry) + 6
    params = source[start:source.index(")", start)]
    return [p.rsplit(None, 1)[0].replace("__restrict__", "").strip() for p in params.split(",") if p.strip()]



def render_megakernel(program: Program, queue: WorkQueue) -> MegakernelSource:
    """One compilation unit: every op's launches as inlined device bodies plus the interpreter loop."""
    includes: list[str] = []
    items: list[str] = []
    ops: list[CudaOp] = []
    sources: list[KernelSource | None] = []
    uses: list[SlotUse] = []
    part_slots: dict[tuple[int, int], int] = {}
    staged_bytes: dict[str, int] = {}  # per staged Gemm body: its shared copies of A and its scales
    slot = len(program.kernels)

    def inline(source: str) -> None:
        for chunk in _chunks(source):
            bucket = includes if chunk.startswith("#include") else items
            text = _ENTRY.sub(r"static __device__ __forceinline__ void \1(", chunk)
            if text not in bucket:
                bucket.append(text)

    def part_slot(weight: int, index: int) -> int:  # a stored weight's part: a slot of its own (shared)
        nonlocal slot
        if (weight, index) not in part_slots:
            part_slots[(weight, index)] = slot
            uses.append(SlotUse(slot, weight, part=index))
            slot += 1
        return part_slots[(weight, index)]

    whole = whole_reads(program)
    for qi, q in enumerate(queue.ops):
        kernel = program.kernel(q.kernel)
        stored = weight_only_gemm(kernel, program)
        if stored is not None:  # B read in its storage format
            inline(stored.source)
            weight = kernel.inputs[1].buffer
            args = [kernel.id, kernel.inputs[0].buffer]
            args += [part_slot(weight, index) for index in range(len(stored.params) - 2)]
            grid = _body_grid(q, tuple(((g, 1),) for g in stored.grid))
            stream = _checked_stream(kernel, program, grid)
            ops.append(CudaOp(qi, 0, kernel.id, stored.name, grid, tuple(stored.block), tuple(args), True, stream,
                              _stream_slots(stream, part_slot), whole=_whole(q, queue, whole)))
            sources.append(None)
            continue
        src = render_kernel(kernel, program)
        inline(src.source)
        scratch = list(range(slot, slot + len(src.scratch)))
        uses += [SlotUse(s, kernel.id, index=i) for i, s in enumerate(scratch)]
        slot += len(src.scratch)
        dyn = slot if src.symbols.symbols else None
        if dyn is not None:
            uses.append(SlotUse(dyn, kernel.id))
        slot += dyn is not None
        for li, launch in enumerate(src.launches):
            last = li == len(src.launches) - 1  # a Gemm's own launch (after any scale launches)
            if last and any(p.staged for p in q.prologue):  # A's scales folded into the body's pass over A
                if not src.staged:
                    raise MegakernelError(f"kernel {kernel.id}: the queue folds A's scales into its body, which has "
                                          "no staged entry")
                launch = src.staged[0]
                staged_bytes[launch.entry] = _staged_shared_bytes(kernel, program)
            threads = math.prod(launch.block)
            if threads % 32 or threads > BLOCK_THREADS:
                raise MegakernelError(f"kernel {kernel.id} ({kernel.kind.value}): a block of {threads} threads is not "
                                      f"whole warps under {BLOCK_THREADS}: the megakernel cannot run its body")
            args = tuple(part_slot(a.buffer, a.index) if a.role == "part" else _arg_slot(a, scratch, kernel)
                         for a in launch.args) + ((dyn,) if dyn is not None else ())
            grid = launch.grid
            if kernel.kind.is_gemm:
                grid = _body_grid(q, launch.grid) if last else _scale_grid(q, li, launch.entry, len(src.launches))
            stream = _checked_stream(kernel, program, grid) if last else None
            cache = cache_stream(kernel, program) if last else None
            ops.append(CudaOp(qi, li, kernel.id, launch.entry, grid, tuple(launch.block), args, last,
                              stream, _stream_slots(stream, part_slot), cache,
                              _whole(q, queue, whole) if last else ()))
            sources.append(src)
    if sum(staged_bytes.values()) > STAGED_SHARED_BYTES:
        raise MegakernelError(f"the staged A copies of {len(staged_bytes)} GEMV bodies take "
                              f"{sum(staged_bytes.values())} bytes of shared memory, over the megakernel's "
                              f"{STAGED_SHARED_BYTES} for them")
    cases = []
    for i, op in enumerate(ops):
        types = _param_types("\n".join(items), op.entry)
        call = ", ".join(f"({t})ln_mk_buf(bufs, {s})" for t, s in zip(types, op.arg_slots))
        cases.append(f"        case {i}: {op.entry}({call}); break;")
    includes = sorted(i for i in includes if "common.cuh" not in i) + ['#include "common.cuh"']
    head = [i for i in includes if "common.cuh" not in i]
    loop = LOOP.replace("CASES", "\n".join(cases)).replace("ENTRY_NAME", ENTRY_NAME).replace(
        "BLOCK", str(BLOCK_THREADS)).replace("BAND_ROWS", str(BAND)).replace("LINE_BYTES", str(LINE))
    source = "\n".join(head) + PRELUDE + '#include "common.cuh"\n' + "\n".join(items) + "\n" + loop
    return MegakernelSource(source, ENTRY_NAME, tuple(ops), tuple(sources), slot, tuple(uses))


def _staged_shared_bytes(kernel, program: Program) -> int:
    """Static shared memory of a Gemm's staged body beyond the tiled one's (codegen/cuda_gemm_operands.stage_a): A's FP32
    copy, its scales and one partial amax per thread. Every inlined body's __shared__ arrays are the persistent
    block's, summed (a device function's arrays are static), so the distinct staged bodies add up."""
    scales = TileCount(scale_blocks(kernel, 0)).evaluate({})
    return staged_a_bytes(kernel, program.quantized_inputs(kernel)) + 4 * scales + 4 * GEMM_TILE * GEMM_TILE


def _body_grid(q, grid: tuple) -> tuple:
    """An inlined Gemm body's grid: the queue op's tiles (codegen/blockops.py), which for a GEMV over more than
    FILL_SMS bands is fewer along y than the launch's own; the body loops grid-stride, so it computes the same
    outputs, each by the same threads' sums (the same bits), tile y taking bands y, y + grid y, ..."""
    factors = q.block.tiles.factors
    if len(factors) != 3 or len(grid) != 3:
        raise MegakernelError(f"kernel {q.kernel}: a Gemm body's grid {grid} is not the queue op's (m, n, batch) tiles")
    return tuple((f,) for f in factors)


def _scale_grid(q, li: int, entry: str, launches: int) -> tuple:
    """A Gemm's scale launch `li` as the queue declares it (QueueOp.prologue: at most FILL_SMS tiles, the body
    grid-stride over its scale blocks), checked: the Gemm's launches are its prologue's, then its body."""
    if launches != len(q.prologue) + 1 or not entry.endswith(f"_scale{q.prologue[li].slot}"):
        raise MegakernelError(f"kernel {q.kernel}: launch {entry} is not scale launch {li} of the queue's prologue "
                              f"{[p.slot for p in q.prologue]}")
    return (q.prologue[li].tiles.factors,)


def _checked_stream(kernel, program: Program, grid) -> WeightStream | None:
    """The kernel's weight stream, checked against the launch it prefetches for: its grid y takes N_out's bands
    of BAND rows, one or several per tile (grid-stride), never fewer bands than tiles."""
    stream = weight_stream(kernel, program)
    if stream is not None and not 1 <= ceil_count(grid[1], {}) <= stream.bands:
        raise MegakernelError(f"kernel {kernel.id} ({kernel.kind.value}): its Gemm body's grid y is not "
                              f"over {stream.bands} bands of {BAND} weight rows: the weight prefetch would miss rows")
    return stream


def _stream_slots(stream: WeightStream | None, part_slot) -> tuple[int, ...]:
    """bufs[] slot of each streamed part: the stored part's own slot, or the weight's buffer."""
    if stream is None:
        return ()
    return tuple(p.weight if p.part is None else part_slot(p.weight, p.part) for p in stream.parts)


def _arg_slot(arg, scratch: list[int], kernel) -> int:
    if arg.role == "scratch":
        return scratch[arg.index]
    if arg.role == "scales":  # a QUANTIZE kernel's scales: its scratch, held beside its buffer by the runtime
        raise MegakernelError(f"kernel {kernel.id} ({kernel.kind.value}) reads a QUANTIZE kernel's scales, "
                              "which have no megakernel slot yet")
    return arg.buffer
