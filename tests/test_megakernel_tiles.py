"""The megakernel queue's tile counts (codegen/blockops.py) against the blocks the CUDA loop runs (issue 33).

Why: the cost model and the emulated scheduler schedule each op's tiles as blockops declares them; the
persistent loop runs the grids of each body's own CUDA launch (codegen/megakernel_cuda.py's table, built
from the renderers' Launch grids). Every op of the benchmarked queues (SmolLM2 decode and MiniLM, every
genome of bench/fusion.GENOMES) must agree; hand-derived counts pin the kinds a reviewer found wrong
(attention: one tile per score row, its splits inside the block; a KV scatter: one per 256 source elements).
"""
from __future__ import annotations

import math

import pytest

from bench.fusion import GENOMES, _cases
from luminal_num.codegen.blockops import block_op
from luminal_num.codegen.cuda_kernels import render_kernel
from luminal_num.codegen.llir import KernelKind
from luminal_num.codegen.megakernel import build_queue
from luminal_num.codegen.megakernel_cuda import render_megakernel
from luminal_num.hlir.symbolic import evaluate
from luminal_num.search.recipes import pick
from luminal_num.search.space import SearchSpace

_SPACES: dict[str, tuple] = {}


def _space(model: str):
    if not _SPACES:
        for name, graph, bindings in _cases(2, 64, True):
            _SPACES[name] = (SearchSpace.build(graph, fusion=True), bindings)
    return _SPACES[model]


MODELS = ("SmolLM2-135M decode", "MiniLM-L6 encoder")


def _launch_tiles(model: str, genome: str):
    """(program, queue, bindings, per queue op the CUDA table's tiles of each of its launches, entry names)."""
    space, bindings = _space(model)
    program = space.program(pick(space, GENOMES[genome].__contains__))
    queue = build_queue(program)
    mega = render_megakernel(program, queue)
    rows, _ = mega.table(queue, bindings)
    launches: dict[int, list[tuple[int, str]]] = {}
    for op, row in zip(mega.ops, rows):
        launches.setdefault(op.queue_op, []).append((row[2], op.entry))
    return program, queue, bindings, launches


@pytest.mark.parametrize("genome", list(GENOMES))
@pytest.mark.parametrize("model", MODELS)
def test_queue_tiles_are_the_blocks_the_device_loop_runs(model, genome):
    program, queue, bindings, launches = _launch_tiles(model, genome)
    table = queue.evaluate(bindings)
    for i, (op, row) in enumerate(zip(queue.ops, table)):
        k = program.kernel(op.kernel)
        *before, (tiles, _) = launches[i]
        assert tiles == row.tiles, f"op {i} ({k.kind.value}, {op.block.kind}): queue {row.tiles}, device {tiles}"
        # a Gemm's own operand-scale launches run before its body as CUDA ops of their own: the queue op's
        # prologue, launch for launch and tile for tile (the cost model schedules them); a private one has none
        assert [t for t, _ in before] == [0 if p.private else p.tiles.evaluate(bindings) for p in op.prologue], \
            f"op {i} ({k.kind.value}) runs launches the queue does not hold: {before}"
        assert all(entry.endswith(f"_scale{p.slot}") for (_, entry), p in zip(before, op.prologue))


def test_attention_and_kv_scatter_tiles_by_hand():
    """SmolLM2 decode, one new token: 9 heads x 1 query = 9 attention tiles whatever the key splits (the
    block walks them); a K or V row of 3 KV heads x 64 = 192 elements is one 256-thread scatter block."""
    program, queue, bindings, launches = _launch_tiles("SmolLM2-135M decode", "BF16 + fused attention")
    table = queue.evaluate(bindings)
    seen = set()
    for i, (op, row) in enumerate(zip(queue.ops, table)):
        k = program.kernel(op.kernel)
        if k.kind is KernelKind.ATTENTION:
            assert k.value.splits > 1 and row.tiles == 9 == launches[i][-1][0]
        elif k.kind in (KernelKind.SCATTER_NOCOPY, KernelKind.SCATTER_EW):
            assert row.tiles == 1 == launches[i][-1][0]
        else:
            continue
        seen.add(k.kind)
    assert seen == {KernelKind.ATTENTION, KernelKind.SCATTER_NOCOPY, KernelKind.SCATTER_EW}


def test_fp8_kv_scatter_runs_a_block_per_row_and_scale_group():
    program, queue, bindings, launches = _launch_tiles("SmolLM2-135M decode", "BF16 weights + FP8 KV cache")
    scaled = [(i, program.kernel(op.kernel)) for i, op in enumerate(queue.ops)
              if program.kernel(op.kernel).kind is KernelKind.SCATTER_NOCOPY and program.kernel(op.kernel).storage]
    assert scaled
    for i, k in scaled:
        rows = evaluate(k.inputs[2].view.shape[0], bindings)
        assert queue.evaluate(bindings)[i].tiles == rows * 1 == launches[i][-1][0]  # per-token scales: one group


def test_inlined_gemm_tiles_are_the_tiled_bodys_16x16_blocks():
    """The megakernel runs a Gemm's tiled body (16 x 16 outputs per block), kernel by kernel the library's
    tiles (the GEMV partition): SmolLM2's 960-column QKV projection is 60 blocks inlined, 120 GEMV tiles. Over
    132 bands a GEMV tile takes several (blockops.body_bands): the 49152-row LM head's 3072 bands are 128 tiles
    of ceil(3072 / 132) = 24 bands, 1536 kernel by kernel."""
    program, queue, bindings, launches = _launch_tiles("SmolLM2-135M decode", "W4A16 INT4 group 128")
    counts = []
    for i, op in enumerate(queue.ops):
        k = program.kernel(op.kernel)
        if k.kind.is_gemm and evaluate(k.layout.batch, bindings) == 1:  # the projections (M = 1 token)
            n = evaluate(k.shape[-1], bindings)
            inlined = block_op(k, inlined=True).tiles.evaluate(bindings)
            bands = math.ceil(n / 16)
            per_tile = 1 if bands <= 132 else math.ceil(bands / 132)
            assert inlined == math.ceil(bands / per_tile) == launches[i][-1][0]
            counts.append((n, inlined, block_op(k).tiles.evaluate(bindings)))
    assert (960, 60, 120) in counts and (49152, 128, 1536) in counts


def test_fp8_gemm_scale_launches_by_hand():
    """FP8 W8A8 (per-token A, static per-channel B): each projection of a one-token SmolLM2 decode is a GEMV, so
    A's scale launch is private and staged (each body tile computes it in its pass over A: no tiles of its own); B's per-channel scales depend
    on the weight alone and are no step work at all (the Gemm's at-load launch writes them once), so the loop
    runs one scale CudaOp of 0 tiles and the body."""
    program, queue, bindings, launches = _launch_tiles("SmolLM2-135M decode", "FP8 W8A8 dynamic per-token")
    seen = set()
    for i, op in enumerate(queue.ops):
        k = program.kernel(op.kernel)
        if not (k.kind.is_gemm and evaluate(k.layout.batch, bindings) == 1):
            continue
        n = evaluate(k.shape[-1], bindings)
        # one token's 576 or 1536 FP32 values fit the staged copy: the body's own pass over A computes the scale
        assert [(p.slot, p.ready, p.private, p.staged) for p in op.prologue] == [(0, False, True, True)]
        assert [(t, e[-7:]) for t, e in launches[i][:-1]] == [(0, "_scale0")] and launches[i][-1][1][-7:] == "_staged"
        assert [launch.entry[-7:] for launch in render_kernel(k, program).at_load] == ["_scale1"]
        seen.add(n)
    assert {960, 576, 49152} <= seen
