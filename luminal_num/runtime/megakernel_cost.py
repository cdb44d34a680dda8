"""Modelled latency of a program run as one megakernel (codegen/megakernel.py), on a named target.

Why a model of its own: the kernel-by-kernel model charges every kernel a launch, a minimum time and
its wave quantization; a megakernel pays one launch, and its cost is how its tiles pack onto the SMs
under the barriers. The model list-schedules the work queue's tiles in queue order (the persistent
kernel's pop order) onto the target's SMs. A tile's body is its share of its kernel's roofline on one SM
(bytes and flops / tiles, at 1 / SMs of the achievable bandwidth and peak). What it charges is what the
device loop (codegen/megakernel_cuda.py) does:
- a tile that streams weights (codegen/weight_stream.py: a Gemm's own rows of an (N, K) weight, which
  depend on no barrier) issues their L2 prefetch as soon as its SM pops it: the weight path ends at
  free + PRE_WAIT_S + weight bytes / the SM's bandwidth share, whenever the barrier is ready; the rest of
  the tile (the other bytes, the flops) and POST_WAIT_S follow max(pop, ready); it ends when both have;
- an attention tile reading a KV cache (codegen/cache_stream.py) streams the cache rows the same way: the
  bytes charged before the wait are the cache elements it reads less every element this step's scatter
  writes (those it reads after the wait, with the query and the bias);
- a tile whose kernel reads a small input written before the kernel starts (codegen/weight_stream.whole_reads: a
  norm's weight, a rope table, a mask, a scatter's index) prefetches it whole the same way, as does a GEMV tile
  for the row op it recomputes: those bytes are charged before the wait like a weight stream, so such a tile's
  first DRAM load is before its wait too (streamed_before_wait);
- any other tile issues nothing before its wait but its queue pop (the loop pops, then spins): the rest of
  its time (first load, acquire, signal, body) follows max(free + QUEUE_POP_S, ready);
- a Gemm that computes an operand's scales itself (QueueOp.prologue: FP8 / INT8 variants) runs each scale
  launch's tiles first (scale_work: one amax pass over the operand): over an input after nothing, over an
  activation after the op's producers (recomputing a row op as the body does), and the body after its
  producers and every scale launch, as the loop's table orders them; a private one (A's scales under a
  GEMV) adds its one-block body on one SM to each body tile's rest instead, as a recomputed row op does, and a
  staged one (folded into the body's one pass over A) only its max per element: A is read once, by the body (a
  weight's static scales are no step work: written at load);
- a GEMV whose tiles recompute a one-tile row op (codegen/megakernel.py, QueueOp.recomputes) adds that
  op's body on one SM to each tile's rest, waits on the row op's producers, and the row op has no tiles.
The makespan plus one launch is the latency; the critical path (the same chain of waits with unlimited
SMs) says how much of it is barrier waits rather than SM throughput.

The overhead constants are assumptions derived from round published latencies, not measurements of this
kernel: an L2 hit of 200 cycles and a DRAM load of 400 cycles at the H100's 1755 MHz boost clock, round
figures of the order GPU microbenchmarks publish (an L40's L2 hit spans 222-339 cycles across its SMs,
arXiv:2606.22588; we found no Hopper table to cite exactly, and a device has not measured them here), i.e.
an L2 round trip ~0.114 us and a DRAM load ~0.228 us; an H200 (same SM and L2 design) is assumed the same. Each
named part below is a count of those round trips (the old single TILE_OVERHEAD_S, 0.5 us, was the
unsplit guess of pop + acquire + first DRAM load; the split adds the signal's fence and sums to 0.57 us).
"""
from __future__ import annotations

import dataclasses
import heapq
import math
from dataclasses import dataclass
from typing import Mapping

from ..codegen.blockops import Partition, TileCount
from ..codegen.gemm_scales import scale_blocks
from ..codegen.cuda_weight_only import stored_operand
from ..codegen.llir import Kernel, Program
from ..codegen.megakernel import Wait, WorkQueue, wait_counters
from ..codegen.cache_stream import cache_stream
from ..codegen.weight_stream import weight_stream, whole_reads
from .cost import KernelWork, LaunchForm, roofline_s
from .latency import kernel_works, stored_weights
from .targets import LaunchConstants, Target, get_target

H100_CLOCK_HZ = 1.755e9
L2_ROUND_TRIP_S = 200 / H100_CLOCK_HZ    # L2 hit latency, 200 cycles (an assumption: see above)
DRAM_LOAD_S = 400 / H100_CLOCK_HZ        # global-memory latency, 400 cycles (an assumption: see above)
# before the wait (at the SM's pop):
QUEUE_POP_S = L2_ROUND_TRIP_S            # atomicAdd on the queue head: resolved at L2, one round trip
FIRST_LOAD_S = DRAM_LOAD_S               # the tile's first DRAM load (the weight stream's first line)
PRE_WAIT_S = QUEUE_POP_S + FIRST_LOAD_S
# after the wait:
ACQUIRE_S = L2_ROUND_TRIP_S              # the ld.acquire that sees the producer's count: an L2 round trip
SIGNAL_S = L2_ROUND_TRIP_S               # __threadfence (the block's writes reach L2), then the counter atomicAdd
POST_WAIT_S = ACQUIRE_S + SIGNAL_S
TILE_OVERHEAD_S = PRE_WAIT_S + POST_WAIT_S  # a tile that streams nothing pays all of it after its wait


@dataclass(frozen=True)
class MegakernelLatency:
    total_s: float          # makespan on the SMs + one launch
    critical_path_s: float  # the longest chain of barrier waits (unlimited SMs)
    makespan_s: float
    launch_s: float
    tiles: int
    busy_fraction: float    # SM time spent in tiles / (SMs * makespan)
    critical_hops: int = 0  # tiles on that longest chain
    bytes_moved: int = 0    # what the megakernel's bodies move (stored weights read widened: kernel_works)
    critical_overhead_s: float = 0.0  # the per-tile overheads (pre- and post-wait) on that chain
    weight_bytes_streamed: int = 0    # weight bytes (and whole reads) tiles load before their waits (weight_stream.py)
    cache_bytes_streamed: int = 0     # KV-cache bytes attention tiles load before their waits (codegen/cache_stream.py)
    busy_by_kind: tuple[tuple[str, float], ...] = ()  # SM seconds in tiles per block kind ("scale": Gemm prologues)
    # the critical path per block kind: (kind, tiles on it, seconds it grew by at them, of which per-tile overhead)
    critical_by_kind: tuple[tuple[str, int, float, float], ...] = ()

    @property
    def overhead_share(self) -> float:
        """The part of the critical path that is per-tile overhead rather than bytes and flops."""
        return self.critical_overhead_s / self.critical_path_s if self.critical_path_s else 0.0


@dataclass(frozen=True)
class TileTimes:
    """One tile of an op on one SM: `weight_s` its weight bytes streamed before the wait (0: it streams
    none), `rest_s` the rest of its body (other bytes, flops), which runs after the wait."""

    weight_s: float
    rest_s: float

    def finish(self, free: float, ready: float) -> float:
        """When the tile ends on an SM free at `free` whose barriers are ready at `ready`."""
        if not self.weight_s:  # it pops before it waits (the loop's order), then loads and runs after the wait
            return max(free + QUEUE_POP_S, ready) + FIRST_LOAD_S + POST_WAIT_S + self.rest_s
        return max(free + PRE_WAIT_S + self.weight_s, max(free + QUEUE_POP_S, ready) + POST_WAIT_S + self.rest_s)

    @property
    def alone_s(self) -> float:
        """The tile's time on an SM when its barriers are ready as it pops it (its busy time)."""
        return self.finish(0.0, 0.0)


def tile_times(work: KernelWork, tiles: int, target: Target, weight_bytes: int = 0) -> TileTimes:
    """One tile's share of its kernel on one SM: the roofline at 1 / SMs of the machine, or, where the
    target measured this implementation (h200-measured), one wave's share of the measured kernel time;
    its `weight_bytes` (the kernel's bytes streamed before the wait, weights or KV-cache rows, at most what it
    reads) split off at the SM's share of the bandwidth, the rest the roofline of what remains."""
    sms = target.sm_count
    weight_bytes = min(weight_bytes, work.bytes_read)
    rest = dataclasses.replace(work, bytes_read=work.bytes_read - weight_bytes)
    bandwidth = target.hbm_bandwidth * target.efficiency.bandwidth
    weight_s = weight_bytes / bandwidth * sms / tiles
    body = roofline_s(rest, target) * sms / tiles
    measured = target.measured_kernels.get(work.implementation) if target.measured_kernels else None
    if measured is not None:  # the measured kernel time covers its weight bytes too: only its excess is the rest
        waves = math.ceil(tiles / sms)
        whole = measured.seconds(work.bytes_moved, work.flops, work.tiles, work.serial_extent, sms) / waves
        body = max(body, whole - weight_s)
    return TileTimes(weight_s, body)


def megakernel_latency(queue: WorkQueue, program: Program, target: str | Target, bindings: Mapping[str, int],
                       launch: LaunchConstants | None = None, works: list[KernelWork] | None = None,
                       weight_bytes: Mapping[int, int] | None = None,
                       cache_bytes: Mapping[int, int] | None = None) -> MegakernelLatency:
    """`works`: per launched kernel, other work than what the megakernel runs (a bench's what-if);
    `weight_bytes`: kernel id -> bytes its tiles stream before their waits, in place of the kernels' weight
    streams and whole reads (streamed_before_wait; a recomputed row op's entry is streamed by its reader's tiles; a
    kernel left out streams none: {} prices the model before the split);
    `cache_bytes`: kernel id -> KV-cache bytes its tiles stream before their waits, in place of the attention
    kernels' cache streams (codegen/cache_stream.py; {}: none)."""
    resolved = get_target(target)
    constants = launch or resolved.launch
    sms = resolved.sm_count
    if works is None:
        works = kernel_works(program, bindings, LaunchForm.MEGAKERNEL)
    works = {k.id: w for k, w in zip(program.launched(), works)}
    if weight_bytes is None:
        weight_bytes = streamed_before_wait(program)
    if cache_bytes is None:
        caches = {k.id: cache_stream(k, program) for k in program.launched()}
        cache_bytes = {kid: s.bytes_streamed(bindings) for kid, s in caches.items() if s is not None}
    table = queue.evaluate(bindings)
    counter_done = [0.0] * sum(t.counters for t in table)  # latest finish of the tiles signalling each counter
    counter_chain = [_Chain()] * len(counter_done)         # the longest chain of waits ending at each counter
    free = [0.0] * sms
    heapq.heapify(free)
    busy = makespan = 0.0
    longest = _Chain()
    tiles_total = streamed = cached = extra_bytes = 0
    by_kind: dict[str, float] = {}
    for i, (op, launch_row) in enumerate(zip(queue.ops, table)):
        if not launch_row.tiles:  # a row op its reader recomputes: priced in the reader's tiles
            continue
        work = works[op.kernel]
        early = weight_bytes.get(op.kernel, 0) + cache_bytes.get(op.kernel, 0)  # loaded before the wait
        times = tile_times(work, launch_row.tiles, resolved, early)
        own = None
        if op.recomputes is not None:  # each tile first runs the row op's one-tile body on its SM, having
            row = queue.ops[op.recomputes].kernel  # prefetched the row op's whole reads with its own
            own = tile_times(works[row], 1, resolved)
            ahead = tile_times(works[row], 1, resolved, weight_bytes.get(row, 0))
            times = TileTimes(times.weight_s + ahead.weight_s, times.rest_s + ahead.rest_s)
            streamed += min(weight_bytes.get(row, 0), works[row].bytes_read)
        streamed += min(weight_bytes.get(op.kernel, 0), work.bytes_read)
        cached += min(cache_bytes.get(op.kernel, 0), work.bytes_read)
        # a wait on a whole producer is the same for every tile: its latest counter, found once
        whole = [_whole_wait(queue, table, w, counter_done, counter_chain) for w in op.waits if not _per_tile(queue, w)]
        base_ready = max((r for r, _ in whole), default=0.0)
        base_chain = max((c for _, c in whole), default=_Chain(), key=lambda c: c.path_s)
        per_tile = [w for w in op.waits if _per_tile(queue, w)]
        stages = []  # its scale launches: over an input after nothing, else after the producers; the body after all
        for launch in op.prologue:
            stage_work = scale_work(program.kernel(op.kernel), launch.slot, program, bindings, launch.staged)
            extra_bytes += stage_work.bytes_moved
            if launch.private:  # each body tile runs it on its SM as one block, after any row op it recomputes
                times = dataclasses.replace(times, rest_s=times.rest_s + tile_times(stage_work, 1, resolved).rest_s)
                continue
            n = launch.tiles.evaluate(bindings)
            stage = tile_times(stage_work, n, resolved)
            if own is not None and not launch.ready:  # it reads A: it recomputes the row op too
                stage = dataclasses.replace(stage, rest_s=stage.rest_s + own.rest_s)
            after, after_chain = (0.0, _Chain()) if launch.ready else (base_ready, base_chain)
            stage_ready, stage_chain = 0.0, _Chain()
            for _ in range(n):
                finish = stage.finish(heapq.heappop(free), after)
                heapq.heappush(free, finish)
                chain = after_chain.then(stage, "scale")
                busy += stage.alone_s
                by_kind["scale"] = by_kind.get("scale", 0.0) + stage.alone_s
                makespan, stage_ready = max(makespan, finish), max(stage_ready, finish)
                stage_chain = max(stage_chain, chain, key=lambda c: c.path_s)
                longest = max(longest, chain, key=lambda c: c.path_s)
                tiles_total += 1
            stages.append((stage_ready, stage_chain))
        if stages:  # the body waits on its producers (whole) and on each scale launch
            whole_per_tile = [_whole_wait(queue, table, w, counter_done, counter_chain) for w in per_tile]
            waited = [(base_ready, base_chain), *whole_per_tile, *stages]
            base_ready = max(r for r, _ in waited)
            base_chain = max((c for _, c in waited), key=lambda c: c.path_s)
            per_tile = []
        for t in range(launch_row.tiles):
            ready, chain = base_ready, base_chain
            for wait in per_tile:
                for index, _ in wait_counters(queue, table, i, t, wait, bindings):
                    ready = max(ready, counter_done[index])
                    if counter_chain[index].path_s > chain.path_s:
                        chain = counter_chain[index]
            finish = times.finish(heapq.heappop(free), ready)
            heapq.heappush(free, finish)
            signal = launch_row.counter_base + t * op.signals_with
            counter_done[signal] = max(counter_done[signal], finish)
            chain = chain.then(times, op.block.kind)
            if chain.path_s > counter_chain[signal].path_s:
                counter_chain[signal] = chain
            busy += times.alone_s
            by_kind[op.block.kind] = by_kind.get(op.block.kind, 0.0) + times.alone_s
            makespan = max(makespan, finish)
            if chain.path_s > longest.path_s:
                longest = chain
            tiles_total += 1
    launch_s = constants.graph_node_s + constants.min_kernel_s
    return MegakernelLatency(makespan + launch_s, longest.path_s, makespan, launch_s, tiles_total,
                             busy / (sms * makespan) if makespan else 0.0, longest.hops,
                             sum(w.bytes_moved for w in works.values()) + extra_bytes, longest.overhead_s, streamed,
                             cached,
                             tuple(sorted(by_kind.items())), longest.composition())


def streamed_before_wait(program: Program) -> dict[int, int]:
    """Kernel id -> the bytes its tiles prefetch before their waits, as the loop does: a Gemm's weight stream
    (codegen/weight_stream.weight_stream) and any other kernel's whole reads (weight_stream.whole_reads; a
    recomputed row op's are prefetched by its reader's tiles). KV-cache rows are `cache_bytes`."""
    out, whole = {}, whole_reads(program)
    for k in program.launched():
        stream = weight_stream(k, program)
        nbytes = stream.bytes_streamed() if stream is not None else sum(r.nbytes for r in whole.get(k.id, ()))
        if nbytes:
            out[k.id] = nbytes
    return out


def scale_work(kernel: Kernel, slot: int, program: Program, bindings: Mapping[str, int],
               staged: bool = False) -> KernelWork:
    """One of a Gemm's scale launches (codegen/cuda_gemm.py `_scale<slot>`): one amax pass over the operand (a
    weight read as its stored parts at its stored bytes, as the Gemm reads it), a max per element, one FP32
    scale written per scale block. `staged` (ScaleLaunch.staged): the body's own pass over A takes the amax as it
    loads A into shared memory and keeps the scales there, so only the max per element is added: A's bytes are the
    body's (read once), no scale reaches memory."""
    dtypes = program.dtypes()
    stored = slot == 1 and stored_operand(kernel, program) is not None
    weights = stored_weights(program)
    element_bytes = {b: v for b, v in program.element_bytes(bindings).items() if stored or b not in weights}
    elements = kernel.input_bytes(slot, bindings, dtypes, {kernel.inputs[slot].buffer: 1.0})
    scales = TileCount(scale_blocks(kernel, slot)).evaluate(bindings)
    if staged:
        return KernelWork(name=f"k{kernel.id}:staged{slot}", bytes_read=0, bytes_written=0, flops=int(elements),
                          implementation="gemm_scale")
    return KernelWork(name=f"k{kernel.id}:scale{slot}", bytes_read=int(round(kernel.input_bytes(slot, bindings, dtypes,
                                                                                              element_bytes))),
                      bytes_written=4 * scales, flops=int(elements), implementation="gemm_scale")


@dataclass(frozen=True, eq=False)
class _Chain:
    """A chain of barrier waits with unlimited SMs: when its last tile ends, its tiles, their overheads; `kind`
    the block kind of its last tile and `prev` the chain it extended (None: it starts there), so the critical
    path can say what it is made of (`composition`)."""

    path_s: float = 0.0
    hops: int = 0
    overhead_s: float = 0.0
    kind: str = ""
    prev: "_Chain | None" = None

    def then(self, times: TileTimes, kind: str) -> "_Chain":
        """The chain extended by a tile of block kind `kind` waiting on it (its own SM, free at 0): a tile whose
        weight stream ends after its waited-for part starts a chain of its own."""
        path = times.finish(0.0, self.path_s)
        if not times.weight_s:  # its pop hides under the wait when the chain is at least that long
            hidden = self.path_s >= QUEUE_POP_S
            overhead = TILE_OVERHEAD_S - QUEUE_POP_S if hidden else TILE_OVERHEAD_S
            return _Chain(path, self.hops + 1, self.overhead_s + overhead, kind, self)
        if PRE_WAIT_S + times.weight_s >= path:
            return _Chain(path, 1, PRE_WAIT_S, kind)
        if self.path_s >= QUEUE_POP_S:
            return _Chain(path, self.hops + 1, self.overhead_s + POST_WAIT_S, kind, self)
        return _Chain(path, 1, QUEUE_POP_S + POST_WAIT_S, kind)

    def composition(self) -> tuple[tuple[str, int, float, float], ...]:
        """Per block kind on the chain, in order of first appearance from its start: (kind, tiles, seconds the
        chain grew by at them, of which per-tile overhead)."""
        links = []
        link: _Chain | None = self
        while link is not None and link.hops:
            links.append(link)
            link = link.prev
        out: dict[str, list] = {}
        for link in reversed(links):
            before = link.prev if link.prev is not None else _Chain()
            row = out.setdefault(link.kind, [0, 0.0, 0.0])
            row[0] += 1
            row[1] += link.path_s - before.path_s
            row[2] += link.overhead_s - before.overhead_s
        return tuple((kind, hops, seconds, overhead) for kind, (hops, seconds, overhead) in out.items())


def _per_tile(queue: WorkQueue, wait: Wait) -> bool:
    """The wait depends on the consumer tile (a flat producer read in step): wait_counters per tile."""
    return wait.read_elements is not None and queue.ops[wait.producer].block.partition is Partition.FLAT


def _whole_wait(queue: WorkQueue, table, wait: Wait, done: list[float], chains: list[_Chain]) -> tuple[float, _Chain]:
    """(ready, longest chain) over every counter of a producer read whole."""
    producer, row = queue.ops[wait.producer], table[wait.producer]
    indices = range(row.counter_base, row.counter_base + row.counters) if producer.stride else (row.counter_base,)
    return max(done[j] for j in indices), max((chains[j] for j in indices), key=lambda c: c.path_s)
