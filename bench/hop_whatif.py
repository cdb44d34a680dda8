"""What-if (modelled, not a lowering): SmolLM2 decode megakernels whose attention waits only on the q|k|v GEMV (issue 33).

Why: per layer the fused-attention chain is q|k|v GEMV -> rope / the two KV scatters -> attention -> o-proj ->
gate|up -> down, and the attention waits on the scatters only to read this step's new K/V row from the cache.
An attention that computed that row itself (rope on its q and k rows from the GEMV's output, the scatter's
rounding to the cache's format) and read only the older rows from the cache would drop one hop per layer. That
body is not written (README, launch model); this bench prices the queue as if it were, to size the prize: each
attention op waits on what its rope and scatter producers wait on (whole), and its work adds theirs (each of its
tiles recomputes its head's q rope, a 1/heads share of the rope kernel, and its KV head's new K and V rows, a
1/KV-heads share of each scatter: in all the rope's work once and each scatter's heads / KV heads times). The
scatters and the rope still run (the cache for the next step). Everything else is bench.launch_model's step
(runtime/megakernel_cost.py, H200, the same launch constants). Writes reports/bench/launch_model_hop_whatif.csv.
"""
from __future__ import annotations

import dataclasses

import pandas as pd

from luminal_num.codegen.llir import KernelKind
from luminal_num.codegen.megakernel import Wait, WorkQueue, build_queue
from luminal_num.runtime.cost import LaunchForm
from luminal_num.runtime.latency import kernel_works
from luminal_num.runtime.megakernel_cost import megakernel_latency
from luminal_num.search.recipes import pick
from luminal_num.search.space import SearchSpace
from .fusion import GENOMES, _cases
from .launch_model import TARGET, bytes_floor_s, step_cli, write_and_show


def without_new_row_hop(program, queue: WorkQueue, works: list, bindings):
    """(queue, works) with every attention waiting on its producers' producers, its work adding theirs (module doc)."""
    launched = [k.id for k in program.launched()]
    works = list(works)
    ops = list(queue.ops)
    for i, op in enumerate(ops):
        k = program.kernel(op.kernel)
        if k.kind is not KernelKind.ATTENTION:
            continue
        waits: dict[int, Wait] = {}
        tiles = op.block.tiles.evaluate(bindings)
        work = works[launched.index(k.id)]
        for w in op.waits:
            producer = ops[w.producer]
            for pw in producer.waits:
                waits[pw.producer] = Wait(pw.producer)
            extra = works[launched.index(producer.kernel)]
            made = program.kernel(producer.kernel)  # a scatter: each tile its KV head's dv of the row's elements
            times = 1 if made.kind is KernelKind.ROWS else tiles * int(k.shape[-1]) / int(made.shape[-1])
            work = dataclasses.replace(work, bytes_read=int(work.bytes_read + times * extra.bytes_read),
                                       flops=int(work.flops + times * extra.flops))
        works[launched.index(k.id)] = work
        ops[i] = dataclasses.replace(op, waits=tuple(waits[p] for p in sorted(waits)))
    return WorkQueue(tuple(ops)), works


def run(layers: int, max_cache: int) -> pd.DataFrame:
    name, graph, bindings = next(_cases(layers, max_cache, with_minilm=False))
    space = SearchSpace.build(graph, fusion=True)
    rows = []
    for label, tags in GENOMES.items():
        if "fused attention" not in label:
            continue
        program = space.program(pick(space, tags.__contains__))
        queue = build_queue(program)
        works = kernel_works(program, bindings, LaunchForm.MEGAKERNEL)
        now = megakernel_latency(queue, program, TARGET, bindings, works=works)
        what_queue, what_works = without_new_row_hop(program, queue, works, bindings)
        what = megakernel_latency(what_queue, program, TARGET, bindings, works=what_works)
        floor = bytes_floor_s(kernel_works(program, bindings))
        rows.append(dict(model=name, genome=label, floor_us=1e6 * floor, megakernel_us=1e6 * now.total_s,
                         critical_path_us=1e6 * now.critical_path_s, critical_hops=now.critical_hops,
                         whatif_us=1e6 * what.total_s, whatif_critical_path_us=1e6 * what.critical_path_s,
                         whatif_critical_hops=what.critical_hops, over_floor=now.total_s / floor,
                         whatif_over_floor=what.total_s / floor))
    return write_and_show(rows, "launch_model_hop_whatif.csv")


def main(argv=None) -> pd.DataFrame:
    return step_cli(run, __doc__, argv)


if __name__ == "__main__":
    main()
