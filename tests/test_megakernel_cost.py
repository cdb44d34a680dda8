"""The megakernel cost model against schedules worked out by hand on the hand-built chain program
(tests/test_megakernel.py): x (4, 300) -> y = 2x -> z = y + 1 -> r = row sums of z, w = z transposed + 1."""
from __future__ import annotations

import pytest

from luminal_num.codegen.megakernel import build_queue
from luminal_num.models.registry import transformer_job
from luminal_num.runtime.latency import kernel_works
from luminal_num.runtime.megakernel_cost import TILE_OVERHEAD_S, megakernel_latency
from luminal_num.runtime.targets import Target, get_target
from luminal_num.search.space import SearchSpace
from test_megakernel import chain_program

ACHIEVED = 4.3e12  # the H200's measured copy bandwidth (targets.H200_EFFICIENCY)
SMS = 132
LAUNCH = 1.3e-6 + 1.0e-6  # one graph node and the minimum kernel time
ROWS = 4
ELEMENTS = ROWS * 300
TILES = -(-ELEMENTS // 256)  # 5 elementwise tiles of 256 elements


def tile(bytes_moved: int, tiles: int, sms: int = SMS) -> float:
    """One tile's share of a memory-bound kernel on one SM (1 / SMs of the bandwidth) plus the overhead."""
    return bytes_moved / tiles / (ACHIEVED / sms) + TILE_OVERHEAD_S


def test_schedule_on_an_idle_h200_is_the_chain_of_barriers():
    """Every tile has its own SM: y's tiles, then z's (each after its y tile), then r (after the two z
    tiles of its row) and w (after all of z), in parallel."""
    program = chain_program()
    y, z = tile(2 * ELEMENTS * 4, TILES), tile(2 * ELEMENTS * 4, TILES)
    r, w = tile(ELEMENTS * 4 + ROWS * 4, ROWS), tile(2 * ELEMENTS * 4, TILES)
    got = megakernel_latency(build_queue(program), program, "h200", {"s": ROWS})
    assert got.makespan_s == pytest.approx(y + z + max(r, w), rel=1e-12)
    assert got.critical_path_s == pytest.approx(y + z + max(r, w), rel=1e-12)
    assert got.total_s == pytest.approx(got.makespan_s + LAUNCH, rel=1e-12)
    assert got.tiles == 3 * TILES + ROWS


def test_one_sm_runs_every_tile_in_turn():
    """With one SM the makespan is the sum of the tile times (each at the whole bandwidth)."""
    program = chain_program()
    one_sm = Target(**{**get_target("h200").__dict__, "name": "h200_one_sm", "sm_count": 1})
    y = tile(2 * ELEMENTS * 4, TILES, 1)
    r = tile(ELEMENTS * 4 + ROWS * 4, ROWS, 1)
    got = megakernel_latency(build_queue(program), program, one_sm, {"s": ROWS})
    assert got.makespan_s == pytest.approx(3 * TILES * y + ROWS * r, rel=1e-12)
    assert got.busy_fraction == pytest.approx(1.0)


def test_megakernel_never_beats_the_bytes_floor():
    job = transformer_job(2)
    space = SearchSpace.build(job.graph)
    program = space.program(())
    bindings = job.graph.bind_symbols(job.calibration[0])
    moved = sum(w.bytes_moved for w in kernel_works(program, bindings))
    got = megakernel_latency(build_queue(program), program, "h200", bindings)
    assert got.total_s >= moved / ACHIEVED + LAUNCH
    assert got.critical_path_s <= got.makespan_s + 1e-15
