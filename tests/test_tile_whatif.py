"""bench/tile_whatif.py's what-if queues (other GEMV tilings) against the queue they rewrite, on a 1-layer
SmolLM2-shaped decode with fused attention: only the GEMV ops' tile counts change, to the hand-counted bands per
tile (q|k|v 960 rows, o and down 576, gate|up 1536, the LM head 49152: 16-row bands), and the model prices the
tiles the rewritten queue declares."""
from __future__ import annotations

from bench.fusion import GENOMES, _cases
from bench.tile_whatif import _per_projection, _within, with_bands
from luminal_num.codegen.megakernel import build_queue
from luminal_num.runtime.megakernel_cost import megakernel_latency
from luminal_num.search.recipes import pick
from luminal_num.search.space import SearchSpace


def _tiles(queue) -> list[tuple[str, int]]:
    return [(op.block.kind, op.block.tiles.evaluate({})) for op in queue.ops if op.recomputed_by is None]


def test_gemv_tiles_take_the_bands_asked_and_nothing_else_changes():
    _, graph, bindings = next(_cases(1, 64, with_minilm=False))
    space = SearchSpace.build(graph, fusion=True)
    program = space.program(pick(space, GENOMES["W4A16 INT4 group 128 + fused attention"].__contains__))
    queue = build_queue(program)
    gemvs = [op.block.tiles.evaluate({}) for op in queue.ops if op.block.kind == "gemv"]
    assert gemvs == [60, 36, 96, 36, 128]  # 960 / 16, 576 / 16, 1536 / 16, 576 / 16, 3072 bands in 24s
    doubled = with_bands(queue, lambda op, b: 2 * b)
    assert [t for kind, t in _tiles(doubled) if kind == "gemv"] == [30, 18, 48, 18, 64]
    assert [t for kind, t in _tiles(doubled) if kind != "gemv"] == [t for kind, t in _tiles(queue) if kind != "gemv"]
    assert all(a == b for a, b in zip(doubled.ops, queue.ops) if a.block.kind != "gemv")
    assert [t for kind, t in _tiles(with_bands(queue, _within(48))) if kind == "gemv"] == [30, 36, 48, 36, 48]
    mixed = with_bands(queue, _per_projection(program, 2, 1, 3, 1))
    assert [t for kind, t in _tiles(mixed) if kind == "gemv"] == [30, 36, 32, 36, 128]
    now = megakernel_latency(queue, program, "h200", bindings)
    then = megakernel_latency(doubled, program, "h200", bindings)
    assert now.tiles - then.tiles == 30 + 18 + 48 + 18 + 64
    assert now.critical_path_s + now.launch_s <= now.total_s
