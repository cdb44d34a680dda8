"""The megakernel cost model against schedules worked out by hand on the hand-built chain program
(tests/test_megakernel.py): x (4, 300) -> y = 2x -> z = y + 1 -> r = row sums of z, w = z transposed + 1;
and on a hand-built decode GEMV, y = 2x then out = y W^T, whose tiles stream W's rows before their wait."""
from __future__ import annotations

import pytest

from luminal_num.codegen.attention import AttentionSpec
from luminal_num.codegen.llir import FApply, FConstV, FLoad, Kernel, KernelInput, KernelKind, Program, verify
from luminal_num.codegen.megakernel import build_queue
from luminal_num.dtypes.formats import F32, INT32
from luminal_num.hlir.gemm import GemmLayout
from luminal_num.hlir.ops import Op
from luminal_num.hlir.shape import ShapeTracker, View
from luminal_num.models.registry import transformer_job
from luminal_num.runtime.cost import LaunchForm
from luminal_num.runtime.latency import kernel_works
from luminal_num.runtime.megakernel_cost import (ACQUIRE_S, FIRST_LOAD_S, POST_WAIT_S, PRE_WAIT_S, QUEUE_POP_S,
                                                  SIGNAL_S, TILE_OVERHEAD_S, TileTimes, megakernel_latency)
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
    tiles of its row) and w (after all of z), in parallel; a tile that waits popped its entry while it
    waited (the loop pops, then spins), so z and r / w each pay the overhead less the queue pop."""
    program = chain_program()
    y, z = tile(2 * ELEMENTS * 4, TILES), tile(2 * ELEMENTS * 4, TILES) - QUEUE_POP_S
    r, w = tile(ELEMENTS * 4 + ROWS * 4, ROWS) - QUEUE_POP_S, tile(2 * ELEMENTS * 4, TILES) - QUEUE_POP_S
    got = megakernel_latency(build_queue(program), program, "h200", {"s": ROWS})
    assert got.makespan_s == pytest.approx(y + z + max(r, w), rel=1e-12)
    assert got.critical_path_s == pytest.approx(y + z + max(r, w), rel=1e-12)
    assert got.total_s == pytest.approx(got.makespan_s + LAUNCH, rel=1e-12)
    assert got.tiles == 3 * TILES + ROWS
    # what the critical path is made of: y, z, then w (w's 1,920 bytes a tile outlast r's 1,204), all elementwise
    assert w > r
    [(kind, hops, seconds, overhead)] = got.critical_by_kind
    assert (kind, hops) == ("elementwise", 3)
    assert (seconds, overhead) == (pytest.approx(y + z + w, rel=1e-12),
                                   pytest.approx(3 * TILE_OVERHEAD_S - 2 * QUEUE_POP_S, rel=1e-12))


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
    # the composition per block kind adds up to the critical path, its tiles and its overheads
    parts = got.critical_by_kind
    assert len(parts) > 1 and sum(p[1] for p in parts) == got.critical_hops
    assert sum(p[2] for p in parts) == pytest.approx(got.critical_path_s, rel=1e-9)
    assert sum(p[3] for p in parts) == pytest.approx(got.critical_overhead_s, rel=1e-9)


# -- weights streamed before the wait ---------------------------------------------------------------------------

CLOCK = 1.755e9       # H100 boost clock; L2 latency 200 cycles, DRAM 400 (megakernel_cost's stated assumptions)
FP32_SIMT = 67e12 * 790.0 / 989.4  # Hopper fp32 SIMT peak x the H200 compute efficiency (790 / 989.4 TFLOP/s)


def test_overhead_parts_are_round_trips_of_the_assumed_latencies():
    l2, dram = 200 / CLOCK, 400 / CLOCK
    assert (QUEUE_POP_S, FIRST_LOAD_S, ACQUIRE_S, SIGNAL_S) == pytest.approx((l2, dram, l2, l2), rel=1e-12)
    assert PRE_WAIT_S + POST_WAIT_S == pytest.approx(TILE_OVERHEAD_S, rel=1e-12)


def test_tile_times_by_hand():
    """A tile popped at 1 us whose barrier is ready at 2 us: its 3 us of weights end at 1 + pre + 3; its 1 us
    rest follows the wait; with no weights its pop still precedes the wait (the loop's order) and the rest of
    the overhead (first load, acquire, signal) follows max(free + pop, ready)."""
    late = TileTimes(weight_s=3e-6, rest_s=1e-6)
    assert late.finish(1e-6, 2e-6) == pytest.approx(max(1e-6 + PRE_WAIT_S + 3e-6, 2e-6 + POST_WAIT_S + 1e-6))
    assert late.finish(1e-6, 2e-6) == pytest.approx(1e-6 + PRE_WAIT_S + 3e-6)  # the weights dominate here
    light = TileTimes(weight_s=1e-8, rest_s=1e-6)
    assert light.finish(1e-6, 5e-6) == pytest.approx(5e-6 + POST_WAIT_S + 1e-6)
    assert light.finish(1e-6, 0.0) == pytest.approx(1e-6 + QUEUE_POP_S + POST_WAIT_S + 1e-6)  # pops before it waits
    none = TileTimes(weight_s=0.0, rest_s=1e-6)
    assert none.finish(1e-6, 2e-6) == pytest.approx(2e-6 + FIRST_LOAD_S + ACQUIRE_S + SIGNAL_S + 1e-6)
    assert none.finish(1e-6, 1.05e-6) == pytest.approx(1e-6 + TILE_OVERHEAD_S + 1e-6)  # the pop outlasts the wait
    assert none.finish(3e-6, 2e-6) == pytest.approx(3e-6 + TILE_OVERHEAD_S + 1e-6)
    assert none.alone_s == pytest.approx(TILE_OVERHEAD_S + 1e-6)


def gemv_program(n: int, k: int) -> Program:
    """x (1, K) -> y = 2x (elementwise) -> out (1, N) = y W^T, W an (N, K) FP32 weight."""
    row = ShapeTracker.contiguous((1, k))
    b = ShapeTracker.contiguous((n, k)).permute((1, 0)).expand_dim(0, 1)  # (1, K, N): W^T
    ks = (Kernel(0, KernelKind.EXTERNAL, (), (1, k), F32, external="x"),
          Kernel(1, KernelKind.EXTERNAL, (), (n, k), F32, external="w"),
          Kernel(2, KernelKind.ELEMENTWISE, (KernelInput(0, row),), (1, k), F32, body_shape=(1, k),
                 body=FApply(Op.MUL, (FLoad(0), FConstV(2.0)))),
          Kernel(3, KernelKind.GEMM, (KernelInput(2, row.expand_dim(2, n)), KernelInput(1, b)), (1, n), F32,
                 precision="f32", layout=GemmLayout((1, k, n), 1, (), (0,), (2,), "batched")))
    return verify(Program(ks, (("x", 0), ("w", 1)), (("out", 3),)))


def _gemv_hand(n: int, k: int, streamed: bool = True) -> tuple[float, float, float, float]:
    """(y's tiles end, a GEMV tile's weight stream, its rest, its whole roofline share) on an idle H200:
    N = 2048 columns in 128 tiles of 16 (blockops.gemv_cols), y's K elements in 256-element tiles, each tile
    on its own SM (128 + K / 256 <= 132). `streamed`: y's tiles prefetch x (a whole read: weight_stream.whole_reads,
    K x 4 bytes) before their wait, their share of it then their write after: y ends at max(pre + read, pop + post
    + write); else a y tile pays the whole overhead, then its read and write."""
    sm_share = ACHIEVED / SMS
    y_tiles = -(-k // 256)
    share = k * 4 / y_tiles / sm_share  # a y tile's read of x, or its write
    y_end = max(PRE_WAIT_S + share, QUEUE_POP_S + POST_WAIT_S + share) if streamed else 2 * share + TILE_OVERHEAD_S
    weight = n * k * 4 / 128 / sm_share
    rest = max((k * 4 + n * 4) / 128 / sm_share, 2 * n * k / 128 / (FP32_SIMT / SMS))
    whole = max((n * k * 4 + k * 4 + n * 4) / 128 / sm_share, 2 * n * k / 128 / (FP32_SIMT / SMS))
    return y_end, weight, rest, whole


def test_fp32_simt_rate_is_what_the_hand_numbers_assume():
    target = get_target("h200")
    assert target.cuda_cores.rate("fp32") * target.efficiency.compute == pytest.approx(FP32_SIMT)
    assert target.hbm_bandwidth * target.efficiency.bandwidth == pytest.approx(ACHIEVED)


def test_without_weight_bytes_the_split_model_is_the_old_one():
    """Streaming nothing, every tile pays the whole overhead after max(free, ready): y's tiles, then each
    GEMV tile at y's end plus the overhead plus its whole roofline share (weights included)."""
    program = gemv_program(2048, 1024)
    y_end, _, _, whole = _gemv_hand(2048, 1024, streamed=False)
    got = megakernel_latency(build_queue(program), program, "h200", {}, weight_bytes={})
    assert got.makespan_s == pytest.approx(y_end + TILE_OVERHEAD_S - QUEUE_POP_S + whole, rel=1e-12)
    assert got.critical_path_s == pytest.approx(got.makespan_s, rel=1e-12)
    assert (got.critical_hops, got.weight_bytes_streamed) == (2, 0)
    assert got.overhead_share == pytest.approx((2 * TILE_OVERHEAD_S - QUEUE_POP_S) / got.critical_path_s)


def test_a_late_barrier_under_large_weights_ends_with_the_weight_stream():
    """K = 1024: each GEMV tile streams 64 KiB of W from its pop at 0, longer than y's tiles (its
    barrier) plus its post-wait part: it ends at max(free + pre + weights, ready + post + rest) = the
    weight side, and the critical chain starts afresh at that tile."""
    program = gemv_program(2048, 1024)
    y_end, weight, rest, _ = _gemv_hand(2048, 1024)
    assert PRE_WAIT_S + weight > y_end + POST_WAIT_S + rest  # the case this test is about
    got = megakernel_latency(build_queue(program), program, "h200", {})
    assert got.makespan_s == pytest.approx(max(PRE_WAIT_S + weight, y_end + POST_WAIT_S + rest), rel=1e-12)
    assert got.weight_bytes_streamed == 2048 * 1024 * 4 + 1024 * 4  # W's rows, and x (y's whole read)
    assert (got.critical_hops, got.critical_overhead_s) == (1, pytest.approx(PRE_WAIT_S))


def test_small_weights_end_after_the_wait():
    """K = 16: 1 KiB of weights per tile land long before y is ready: the tile ends at ready + post + rest. y's
    tile prefetched x before its (empty) wait: its overhead on the chain is the pre-wait part (pop and first
    load), equal to the pop and the post-wait part, then the GEMV tile's post-wait part."""
    program = gemv_program(2048, 16)
    y_end, weight, rest, _ = _gemv_hand(2048, 16)
    assert PRE_WAIT_S + weight < y_end + POST_WAIT_S + rest
    got = megakernel_latency(build_queue(program), program, "h200", {})
    assert got.makespan_s == pytest.approx(y_end + POST_WAIT_S + rest, rel=1e-12)
    assert (got.critical_hops, got.critical_overhead_s) == (2, pytest.approx(PRE_WAIT_S + POST_WAIT_S))


def test_recomputed_rows_leave_the_chain_and_add_their_body_to_each_reader_tile():
    """A one-token llama-tiny layer: its three one-row norms are recomputed by their GEMVs
    (codegen/megakernel.py): three tiles and three hops fewer. On the chain, norm then GEMV tile was
    (overhead + norm body) then (post-wait part + GEMV rest); now the GEMV tile runs the norm body itself
    (the same one-SM roofline): streaming nothing, the critical path is shorter by exactly three tile overheads
    less their queue pops (a norm tile popped while it waited); with the norms' weights prefetched before the wait
    (weight_stream.whole_reads: by the norm's own tile, or by each GEMV tile that recomputes it) a norm tile's first
    load was before its wait already, so three post-wait parts (acquire and signal) leave the chain."""
    from luminal_num.models.registry import llama_tiny_job
    job = llama_tiny_job(seq=1, layers=1)
    space = SearchSpace.build(job.graph, fusion=True)
    program = space.program(())
    bindings = job.graph.bind_symbols(job.calibration[0])
    for streams, saved in (({}, TILE_OVERHEAD_S - QUEUE_POP_S), (None, POST_WAIT_S)):
        plain = megakernel_latency(build_queue(program, recompute_rows=False), program, "h200", bindings,
                                   weight_bytes=streams)
        got = megakernel_latency(build_queue(program), program, "h200", bindings, weight_bytes=streams)
        assert (plain.tiles - got.tiles, plain.critical_hops - got.critical_hops) == (3, 3)
        assert plain.critical_path_s - got.critical_path_s == pytest.approx(3 * saved, rel=1e-9)


# -- KV-cache rows streamed before the wait (codegen/cache_stream.py) ----------------------------------------

HEADS, HEAD_DIM = 4, 32


def decode_attention_program(keys: int) -> Program:
    """A hand-built decode attention over a KV cache: k_new = 2 x (one row), scattered into k_cache at pos;
    v_new scattered into v_cache; attention of 4 query heads over the `keys` cache rows (one KV head: K and V
    read with stride 0 along the heads) with a bias row."""
    def view(shape, strides):
        return ShapeTracker((View.create(shape, strides),))
    t, d, h = keys, HEAD_DIM, HEADS
    row = ShapeTracker.contiguous((1, d))
    ks = (Kernel(0, KernelKind.EXTERNAL, (), (h, d), F32, external="q"),
          Kernel(1, KernelKind.EXTERNAL, (), (t, d), F32, external="k_cache"),
          Kernel(2, KernelKind.EXTERNAL, (), (t, d), F32, external="v_cache"),
          Kernel(3, KernelKind.EXTERNAL, (), (1,), INT32, external="pos"),
          Kernel(4, KernelKind.EXTERNAL, (), (1, d), F32, external="x"),
          Kernel(5, KernelKind.EXTERNAL, (), (1, d), F32, external="v_new"),
          Kernel(6, KernelKind.EXTERNAL, (), (1, t), F32, external="bias"),
          Kernel(7, KernelKind.ELEMENTWISE, (KernelInput(4, row),), (1, d), F32, body_shape=(1, d),
                 body=FApply(Op.MUL, (FLoad(0), FConstV(2.0)))),
          Kernel(8, KernelKind.SCATTER_NOCOPY, (KernelInput(1, ShapeTracker.contiguous((t, d))), KernelInput(7, row),
                                               KernelInput(3, ShapeTracker.contiguous((1,)))), (t, d), F32, aliases=0),
          Kernel(9, KernelKind.SCATTER_NOCOPY, (KernelInput(2, ShapeTracker.contiguous((t, d))), KernelInput(5, row),
                                               KernelInput(3, ShapeTracker.contiguous((1,)))), (t, d), F32, aliases=0),
          Kernel(10, KernelKind.ATTENTION, (KernelInput(0, view((h, t, d), (d, 0, 1))),
                                            KernelInput(8, view((h, t, d), (0, d, 1))),
                                            KernelInput(6, view((h, t), (0, 1))),
                                            KernelInput(9, view((h, d, t), (0, 1, d)))), (h, d), F32,
                 body_shape=(h, t), axis=1, precision="flash_f32", value=AttentionSpec(scale=0.125, splits=4)))
    return verify(Program(ks, tuple((k.external, k.id) for k in ks if k.external), (("out", 10),)))


@pytest.mark.parametrize("keys", [64, 512, 4096])
def test_an_attention_tile_streams_its_cache_rows_before_its_wait(keys):
    """By hand: the attention's pre-wait bytes are K's and V's keys x 32 elements less the one row each scatter
    writes, at 4 bytes. Every tile has an SM (y's 1, each scatter's 1 (blockops: one block per 256 source
    elements, as the CUDA scatter runs), the attention's 4: one per score row, its 4 splits walked inside the
    block); the attention waits on the K scatter (after y's tile):
    ready = y + s. Streaming nothing, a tile ends at ready + overhead + its whole share; streaming,
    at max(pre + its cache share, ready + post + the rest): the post-wait side at 64 keys, the stream at 512 and
    4096 (at 512 the post-wait side was longer while y and the scatter paid their first loads after their waits).
    Streaming, the whole reads (weight_stream.whole_reads) go before the waits too: y's x (32 x 4 bytes), each
    scatter's pos (4) and the V scatter's v_new (128), the attention's q (4 x 32 x 4) and bias (keys x 4)."""
    program = decode_attention_program(keys)
    works = kernel_works(program, {}, LaunchForm.MEGAKERNEL)
    assert [w.tiles for w in works] == [1, 1, 1, HEADS] and sum(w.tiles for w in works) <= SMS
    cache = 2 * 4 * (keys * HEAD_DIM - HEAD_DIM)
    y = tile(works[0].bytes_moved, 1)
    # the K scatter, after y (it popped while it waited); the V scatter waits on nothing
    s = tile(works[1].bytes_moved, 1) - QUEUE_POP_S
    attention = works[3]
    assert attention.bytes_read > cache
    share = ACHIEVED / SMS
    flops = attention.flops / HEADS / (FP32_SIMT / SMS)
    whole = max(attention.bytes_moved / HEADS / share, flops)
    streamed = cache / HEADS / share
    rest = max((attention.bytes_moved - cache) / HEADS / share, flops)
    queue = build_queue(program)
    before = megakernel_latency(queue, program, "h200", {}, cache_bytes={}, weight_bytes={})
    assert before.makespan_s == pytest.approx(y + s + TILE_OVERHEAD_S - QUEUE_POP_S + whole, rel=1e-12)
    x, pos, q, bias = HEAD_DIM * 4, 4, HEADS * HEAD_DIM * 4, keys * 4
    y = max(PRE_WAIT_S + x / share, QUEUE_POP_S + POST_WAIT_S + (works[0].bytes_moved - x) / share)
    s = POST_WAIT_S + (works[1].bytes_moved - pos) / share  # after y, its pos prefetched while it waited
    streamed = (cache + q + bias) / HEADS / share
    rest = max((attention.bytes_moved - cache - q - bias) / HEADS / share, flops)
    got = megakernel_latency(queue, program, "h200", {})
    assert got.cache_bytes_streamed == cache and got.weight_bytes_streamed == x + 2 * pos + HEAD_DIM * 4 + q + bias
    assert got.makespan_s == pytest.approx(max(PRE_WAIT_S + streamed, y + s + POST_WAIT_S + rest), rel=1e-12)
    if keys == 64:
        assert PRE_WAIT_S + streamed < y + s + POST_WAIT_S + rest and got.critical_hops == 3
    else:
        assert PRE_WAIT_S + streamed > y + s + POST_WAIT_S + rest and got.critical_hops == 1
