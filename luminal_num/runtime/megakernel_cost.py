"""Modelled latency of a program run as one megakernel (codegen/megakernel.py), on a named target.

Why a model of its own: the kernel-by-kernel model charges every kernel a launch, a minimum time and
its wave quantization; a megakernel pays one launch, and its cost is how its tiles pack onto the SMs
under the barriers. The model list-schedules the work queue's tiles in queue order (the persistent
kernel's pop order) onto the target's SMs: a tile starts when an SM is free and the producer tiles its
barriers wait on (codegen/megakernel.wait_counters) have finished; it runs its share of its kernel's
roofline on one SM (bytes and flops / tiles, at 1 / SMs of the achievable bandwidth and peak) plus a
fixed overhead. The makespan plus one launch is the latency; the critical path (the same chain of
waits with unlimited SMs) says how much of it is barrier waits rather than SM throughput.

TILE_OVERHEAD_S is an assumption, not a measurement: a queue pop (an atomic on the head) and a counter
acquire are two L2 round trips, and a tile's first load a DRAM round trip, together ~0.5 us on Hopper.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Mapping

from ..codegen.blockops import Partition
from ..codegen.llir import Program
from ..codegen.megakernel import Wait, WorkQueue, wait_counters
from .cost import KernelWork, LaunchForm, roofline_s
from .latency import kernel_works
from .targets import LaunchConstants, Target, get_target

TILE_OVERHEAD_S = 0.5e-6


@dataclass(frozen=True)
class MegakernelLatency:
    total_s: float          # makespan on the SMs + one launch
    critical_path_s: float  # the longest chain of barrier waits (unlimited SMs)
    makespan_s: float
    launch_s: float
    tiles: int
    busy_fraction: float    # SM time spent in tiles / (SMs * makespan)
    critical_hops: int = 0  # tiles on that longest chain: each pays TILE_OVERHEAD_S once
    bytes_moved: int = 0    # what the megakernel's bodies move (stored weights read widened: kernel_works)

    @property
    def overhead_share(self) -> float:
        """The part of the critical path that is per-tile overhead rather than bytes and flops."""
        return self.critical_hops * TILE_OVERHEAD_S / self.critical_path_s if self.critical_path_s else 0.0


def _tile_seconds(work: KernelWork, tiles: int, target: Target, tile_overhead_s: float) -> float:
    """One tile's share of its kernel on one SM: the roofline at 1 / SMs of the machine, or, where the
    target measured this implementation (h200-measured), one wave's share of the measured kernel time."""
    sms = target.sm_count
    body = roofline_s(work, target) * sms / tiles
    measured = target.measured_kernels.get(work.implementation) if target.measured_kernels else None
    if measured is not None:
        waves = math.ceil(tiles / sms)
        body = max(body, measured.seconds(work.bytes_moved, work.flops, work.tiles, work.serial_extent, sms) / waves)
    return body + tile_overhead_s


def megakernel_latency(queue: WorkQueue, program: Program, target: str | Target, bindings: Mapping[str, int],
                       launch: LaunchConstants | None = None, tile_overhead_s: float = TILE_OVERHEAD_S,
                       works: list[KernelWork] | None = None) -> MegakernelLatency:
    """`works`: per launched kernel, other work than what the megakernel runs (a bench's what-if)."""
    resolved = get_target(target)
    constants = launch or resolved.launch
    sms = resolved.sm_count
    if works is None:
        works = kernel_works(program, bindings, LaunchForm.MEGAKERNEL)
    works = {k.id: w for k, w in zip(program.launched(), works)}
    table = queue.evaluate(bindings)
    counter_done = [0.0] * sum(t.counters for t in table)  # latest finish of the tiles signalling each counter
    counter_path = [0.0] * len(counter_done)
    counter_hops = [0] * len(counter_done)
    free = [0.0] * sms
    heapq.heapify(free)
    busy = makespan = longest = 0.0
    longest_hops = tiles_total = 0
    for i, (op, launch_row) in enumerate(zip(queue.ops, table)):
        tile_s = _tile_seconds(works[op.kernel], launch_row.tiles, resolved, tile_overhead_s)
        # a wait on a whole producer is the same for every tile: its latest counter, found once
        whole = [_whole_wait(queue, table, w, counter_done, counter_path, counter_hops)
                 for w in op.waits if not _per_tile(queue, w)]
        base_ready = max((r for r, _, _ in whole), default=0.0)
        base_path, base_hops = max(((p, h) for _, p, h in whole), default=(0.0, 0))
        per_tile = [w for w in op.waits if _per_tile(queue, w)]
        for t in range(launch_row.tiles):
            ready, path, hops = base_ready, base_path, base_hops
            for wait in per_tile:
                for index, _ in wait_counters(queue, table, i, t, wait, bindings):
                    ready = max(ready, counter_done[index])
                    if counter_path[index] > path:
                        path, hops = counter_path[index], counter_hops[index]
            start = max(heapq.heappop(free), ready)
            finish = start + tile_s
            heapq.heappush(free, finish)
            signal = launch_row.counter_base + t * op.signals_with
            counter_done[signal] = max(counter_done[signal], finish)
            if path + tile_s > counter_path[signal]:
                counter_path[signal], counter_hops[signal] = path + tile_s, hops + 1
            busy += tile_s
            makespan = max(makespan, finish)
            if path + tile_s > longest:
                longest, longest_hops = path + tile_s, hops + 1
            tiles_total += 1
    launch_s = constants.graph_node_s + constants.min_kernel_s
    return MegakernelLatency(makespan + launch_s, longest, makespan, launch_s, tiles_total,
                             busy / (sms * makespan) if makespan else 0.0, longest_hops,
                             sum(w.bytes_moved for w in works.values()))


def _per_tile(queue: WorkQueue, wait: Wait) -> bool:
    """The wait depends on the consumer tile (a flat producer read in step): wait_counters per tile."""
    return wait.read_elements is not None and queue.ops[wait.producer].block.partition is Partition.FLAT


def _whole_wait(queue: WorkQueue, table, wait: Wait, done: list[float], path: list[float],
                hops: list[int]) -> tuple[float, float, int]:
    """(ready, longest path, its hops) over every counter of a producer read whole."""
    producer, row = queue.ops[wait.producer], table[wait.producer]
    indices = range(row.counter_base, row.counter_base + row.counters) if producer.stride else (row.counter_base,)
    ready = max(done[j] for j in indices)
    j = max(indices, key=lambda j: path[j])
    return ready, path[j], hops[j]
