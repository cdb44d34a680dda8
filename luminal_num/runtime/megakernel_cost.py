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
from dataclasses import dataclass
from typing import Mapping

from ..codegen.llir import Program
from ..codegen.megakernel import WorkQueue, wait_counters
from .cost import roofline_s
from .latency import kernel_works
from .targets import LaunchConstants, get_target

TILE_OVERHEAD_S = 0.5e-6


@dataclass(frozen=True)
class MegakernelLatency:
    total_s: float          # makespan on the SMs + one launch
    critical_path_s: float  # the longest chain of barrier waits (unlimited SMs)
    makespan_s: float
    launch_s: float
    tiles: int
    busy_fraction: float    # SM time spent in tiles / (SMs * makespan)


def megakernel_latency(queue: WorkQueue, program: Program, target: str, bindings: Mapping[str, int],
                       launch: LaunchConstants | None = None, tile_overhead_s: float = TILE_OVERHEAD_S) -> MegakernelLatency:
    resolved = get_target(target)
    constants = launch or resolved.launch
    sms = resolved.sm_count
    works = {k.id: w for k, w in zip(program.launched(), kernel_works(program, bindings))}
    table = queue.evaluate(bindings)
    counter_done = [0.0] * sum(t.counters for t in table)  # latest finish of the tiles signalling each counter
    counter_path = [0.0] * len(counter_done)
    free = [0.0] * sms
    heapq.heapify(free)
    busy = makespan = longest = 0.0
    tiles_total = 0
    for i, (op, launch_row) in enumerate(zip(queue.ops, table)):
        tile_s = roofline_s(works[op.kernel], resolved) * sms / launch_row.tiles + tile_overhead_s
        for t in range(launch_row.tiles):
            ready = path = 0.0
            for wait in op.waits:
                for index, _ in wait_counters(queue, table, i, t, wait, bindings):
                    ready = max(ready, counter_done[index])
                    path = max(path, counter_path[index])
            start = max(heapq.heappop(free), ready)
            finish = start + tile_s
            heapq.heappush(free, finish)
            signal = launch_row.counter_base + t * op.signals_with
            counter_done[signal] = max(counter_done[signal], finish)
            counter_path[signal] = max(counter_path[signal], path + tile_s)
            busy += tile_s
            makespan = max(makespan, finish)
            longest = max(longest, path + tile_s)
            tiles_total += 1
    launch_s = constants.graph_node_s + constants.min_kernel_s
    return MegakernelLatency(makespan + launch_s, longest, makespan, launch_s, tiles_total,
                             busy / (sms * makespan) if makespan else 0.0)
