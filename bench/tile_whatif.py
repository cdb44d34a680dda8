"""What-if (modelled, not lowerings): SmolLM2 decode megakernels with other GEMV tilings, without the SMs' limit, and
without the attention's scatter hop (issue 33: what would bring W4A16 within 3x of its bytes floor).

Why: the W4A16 step is far from its floor (reports/bench/launch_model.csv) and the model says why: per layer 248
tiles over 132 SMs, each paying its pop, first load, acquire and signal (runtime/megakernel_cost.py), along a chain
of six dependent tiles. Each row prices one change to the queue bench.launch_model prices (the same model, H200,
the same launch constants):
- `bands xF`: every GEMV tile takes F times its 16-row bands (blockops.body_bands; the bodies loop grid-stride, so
  the device loop runs any such count): fewer tiles, each longer;
- `gemv tiles <= T`: each GEMV takes as few bands per tile as keep it within T tiles;
- `qkv 2, gate|up 3 bands`: the best per-projection band counts found for W4A16 (a search over 1-2 bands for the
  q|k|v, o and down projections and 1-3 for gate|up);
- `unlimited SMs`: the critical path plus the launch, the floor of every queue order (the loop pops in queue order;
  no order of this chain's dependent tiles ends before its critical path);
- `no scatter hop` and `no scatter hop, unlimited SMs`: bench.hop_whatif's attention that waits on the q|k|v GEMV
  alone (a body not written).
Writes reports/bench/launch_model_tile_whatif.csv.
"""
from __future__ import annotations

import dataclasses

import pandas as pd

from luminal_num.codegen.blockops import TileCount
from luminal_num.codegen.llir import KernelKind
from luminal_num.codegen.megakernel import WorkQueue, build_queue
from luminal_num.codegen.weight_stream import BAND
from luminal_num.runtime.cost import LaunchForm
from luminal_num.runtime.latency import kernel_works
from luminal_num.runtime.megakernel_cost import megakernel_latency
from luminal_num.search.recipes import pick
from luminal_num.search.space import SearchSpace
from .fusion import GENOMES, _cases
from .hop_whatif import without_new_row_hop
from .launch_model import TARGET, bytes_floor_s, step_cli, write_and_show


def with_bands(queue: WorkQueue, bands) -> WorkQueue:
    """The queue with each GEMV op's bands per tile `bands(op, bands now)`."""
    ops = []
    for op in queue.ops:
        if op.block.kind == "gemv":
            (m, pm), (n, per), (b, pb) = op.block.tiles.factors
            tiles = TileCount(((m, pm), (n, BAND * bands(op, per // BAND)), (b, pb)))
            op = dataclasses.replace(op, block=dataclasses.replace(op.block, tiles=tiles))
        ops.append(op)
    return WorkQueue(tuple(ops))


def _within(most: int):
    return lambda op, now: max(now, -(-(-(-op.block.tiles.factors[1][0] // BAND)) // most))


def _per_projection(program, qkv: int, o: int, gate_up: int, down: int):
    """Bands per tile by projection of a SmolLM2 layer (q|k|v 960 rows, gate|up 1536, o and down 576: down is the
    epilogue Gemm); the LM head keeps its own."""
    def bands(op, now):
        n = op.block.tiles.factors[1][0]
        epilogue = program.kernel(op.kernel).kind is KernelKind.GEMM_EPILOGUE
        return {960: qkv, 1536: gate_up, 576: down if epilogue else o}.get(n, now)
    return bands


def run(layers: int, max_cache: int) -> pd.DataFrame:
    name, graph, bindings = next(_cases(layers, max_cache, with_minilm=False))
    space = SearchSpace.build(graph, fusion=True)
    rows = []
    for label, tags in GENOMES.items():
        if "fused attention" not in label:
            continue
        program = space.program(pick(space, tags.__contains__))
        works = kernel_works(program, bindings, LaunchForm.MEGAKERNEL)
        floor = bytes_floor_s(kernel_works(program, bindings))
        queue = build_queue(program)
        hop_queue, hop_works = without_new_row_hop(program, queue, works, bindings)
        variants = {"now": (queue, works), "bands x2": (with_bands(queue, lambda op, b: 2 * b), works),
                    "bands x3": (with_bands(queue, lambda op, b: 3 * b), works),
                    "gemv tiles <= 66": (with_bands(queue, _within(66)), works),
                    "gemv tiles <= 48": (with_bands(queue, _within(48)), works),
                    "qkv 2, gate|up 3 bands": (with_bands(queue, _per_projection(program, 2, 1, 3, 1)), works),
                    "no scatter hop": (hop_queue, hop_works)}
        for change, (q, w) in variants.items():
            got = megakernel_latency(q, program, TARGET, bindings, works=w)
            bound = got.critical_path_s + got.launch_s
            rows.append(dict(model=name, genome=label, change=change, floor_us=1e6 * floor, us=1e6 * got.total_s,
                             over_floor=got.total_s / floor, tiles=got.tiles,
                             critical_path_us=1e6 * got.critical_path_s,
                             busy_over_sms_us=1e6 * got.busy_fraction * got.makespan_s))
            if change in ("now", "no scatter hop"):
                rows.append(dict(rows[-1], change=("" if change == "now" else "no scatter hop, ") + "unlimited SMs",
                                 us=1e6 * bound, over_floor=bound / floor))
    return write_and_show(rows, "launch_model_tile_whatif.csv")


def main(argv=None) -> pd.DataFrame:
    return step_cli(run, __doc__, argv)


if __name__ == "__main__":
    main()
