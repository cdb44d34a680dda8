"""Two megakernel changes of issue 33, each against an independent truth:
- a Gemm's own scale launches (FP8 W8A8: A per token) are queue work the cost model schedules, but a weight's
  static per-channel scales are written once at load and a GEMV's A scales are computed by its own tiles:
  tiles, bytes and times worked out by hand on a hand-built decode GEMV and a 16-token Gemm;
- a GEMV over more than 132 bands runs fewer tiles of several bands each (blockops.body_bands): each tile
  prefetches exactly the weight bytes its body reads (the body run in the CUDA interpreter), and the body gives
  the same bits at the megakernel's grid as at the kernel's own launch grid."""
from __future__ import annotations

import dataclasses

import pytest

from luminal_num.codegen.llir import FApply, FConstV, FLoad, Kernel, KernelInput, KernelKind, Program, verify
from luminal_num.codegen.megakernel import build_queue
from luminal_num.dtypes.formats import F32
from luminal_num.hlir.gemm import GemmLayout
from luminal_num.hlir.ops import Op
from luminal_num.hlir.shape import ShapeTracker
from luminal_num.runtime.cost import LaunchForm
from luminal_num.runtime.latency import kernel_works
from luminal_num.runtime.megakernel_cost import (POST_WAIT_S, PRE_WAIT_S, QUEUE_POP_S, TILE_OVERHEAD_S,
                                                  megakernel_latency, tile_times)
from luminal_num.runtime.targets import Target, get_target

ACHIEVED = 4.3e12  # the H200's measured copy bandwidth (targets.H200_EFFICIENCY)
FP32_SIMT = 67e12 * 790.0 / 989.4
SMS = 1000  # every tile on an SM of its own (150 tiles below)


def fp8_gemv(n: int, k: int, m: int = 1) -> Program:
    """x (m, K) -> y = 2x -> out (m, N) = y W^T in FP8 W8A8 (A scaled per token at run time, B per channel,
    static: W is a weight). m <= 16 is a GEMV (A's scales private to its tiles), m = 32 the tiled Gemm."""
    row = ShapeTracker.contiguous((m, k))
    b = ShapeTracker.contiguous((n, k)).permute((1, 0)).expand_dim(0, m)
    ks = (Kernel(0, KernelKind.EXTERNAL, (), (m, k), F32, external="x"),
          Kernel(1, KernelKind.EXTERNAL, (), (n, k), F32, external="w"),
          Kernel(2, KernelKind.ELEMENTWISE, (KernelInput(0, row),), (m, k), F32, body_shape=(m, k),
                 body=FApply(Op.MUL, (FLoad(0), FConstV(2.0)))),
          Kernel(3, KernelKind.GEMM, (KernelInput(2, row.expand_dim(2, n)), KernelInput(1, b)), (m, n), F32,
                 precision="f8e4m3_channel_prologue", layout=GemmLayout((m, k, n), 1, (), (0,), (2,), "batched")))
    return verify(Program(ks, (("x", 0), ("w", 1)), (("out", 3),)))


def _roofline(nbytes: float, flops: float) -> float:
    """One tile's body on one of SMS SMs: its bytes at 1 / SMS of the bandwidth or its flops at 1 / SMS of
    the FP32 SIMT rate, whichever is longer."""
    return max(nbytes / (ACHIEVED / SMS), flops / (FP32_SIMT / SMS))


@pytest.mark.parametrize("k", [64, 4096])
def test_a_weights_static_scales_are_no_step_work_and_a_gemvs_a_scales_are_private(k):
    """N = 256, one token, on an idle H200 of 1000 SMs. B's per-channel scales are static (W is a weight): the Gemm's
    at-load launch writes them (KernelSource.at_load), the step runs no launch for them. A's per-token scale under a
    GEMV is private: no tiles, no hop. K = 64: A's 256 bytes fit the staged copy (gemm_scales.STAGE_BYTES), so each
    of the body's 16 tiles takes the amax in its own pass over A: a max per element on its SM and no byte more.
    K = 4096: 16 KB do not fit; each tile first runs the scale body on its SM (reading y's K FP32, a max each, one
    scale written), after y, then its own rest."""
    from luminal_num.codegen.cuda_kernels import render_kernel
    from luminal_num.codegen.gemm_scales import STAGE_BYTES
    n = 256
    staged = 4 * k <= STAGE_BYTES
    program = fp8_gemv(n, k)
    sm_many = dataclasses.replace(get_target("h200"), name="h200_1000_sms", sm_count=SMS)
    queue = build_queue(program)
    gemm = queue.ops[-1]
    assert [(p.slot, p.ready, p.private, p.staged) for p in gemm.prologue] == [(0, False, True, staged)]
    src = render_kernel(program.kernel(3), program)
    assert [launch.entry[-7:] for launch in src.launches] == ["_scale0", src.name[-7:]]
    assert [launch.entry[-7:] for launch in src.at_load] == ["_scale1"] and src.at_load[0].entry in src.entries
    assert [launch.entry[-7:] for launch in src.staged] == (["_staged"] if staged else [])
    got = megakernel_latency(queue, program, sm_many, {})
    y_tiles = -(-k // 256)  # the elementwise y: 256 elements per tile
    assert got.tiles == y_tiles + 16
    works = kernel_works(program, {}, LaunchForm.MEGAKERNEL)
    a_bytes = k * 4
    # A's amax pass, counted once, where it is a pass of its own; staged, A is the body's (read once)
    assert got.bytes_moved - sum(w.bytes_moved for w in works) == (0 if staged else a_bytes + 4)
    y_end = _roofline(2 * k * 4 / y_tiles, k / y_tiles) + TILE_OVERHEAD_S
    body = tile_times(works[-1], 16, sm_many, n * k * 4)  # its own W rows streamed before the wait
    scale = _roofline(0 if staged else a_bytes + 4, k)  # the scale's work on the tile's SM
    assert got.makespan_s == pytest.approx(max(PRE_WAIT_S + body.weight_s, max(QUEUE_POP_S, y_end) + POST_WAIT_S
                                               + body.rest_s + scale), rel=1e-12)
    assert "scale" not in dict(got.busy_by_kind)
    assert got.critical_hops <= 2  # at most y, then the body: no scale hop between


def test_a_tiled_gemms_a_scales_are_scheduled_tiles_on_one_sm():
    """32 tokens (the tiled Gemm, not a GEMV): A's per-token scales stay a launch of their own, 32 tiles after y
    (none for B: static); one SM runs every tile's whole time in queue order."""
    n, k, m = 256, 64, 32
    program = fp8_gemv(n, k, m)
    one = Target(**{**get_target("h200").__dict__, "name": "h200_one_sm", "sm_count": 1})
    queue = build_queue(program)
    prologue = queue.ops[-1].prologue
    assert [(p.slot, p.ready, p.private, p.tiles.evaluate({})) for p in prologue] == [(0, False, False, m)]
    got = megakernel_latency(queue, program, one, {})
    works = kernel_works(program, {}, LaunchForm.MEGAKERNEL)
    y_tiles, body_tiles = (queue.ops[i].block.tiles.evaluate({}) for i in (0, 1))
    assert body_tiles == (m // 16) * (n // 16)
    y = tile_times(works[0], y_tiles, one, m * k * 4).alone_s  # x prefetched whole (weight_stream.whole_reads)
    scale_a = max((m * k * 4 + m * 4) / m / ACHIEVED, k / FP32_SIMT) + TILE_OVERHEAD_S
    body = tile_times(works[-1], body_tiles, one, n * k * 4)
    assert got.tiles == y_tiles + m + body_tiles
    assert got.makespan_s == pytest.approx(y_tiles * y + m * scale_a + body_tiles * body.alone_s, rel=1e-12)


# -- a GEMV over more than 132 bands: tiles of several bands ------------------------------------------------------

VOCAB = 2320  # 145 bands of 16 rows: ceil(145 / 132) = 2 bands per tile, 73 tiles, the last of one band


def _wide_head(tags):
    """A one-layer, one-token llama-tiny decode whose LM head has VOCAB rows, in the genome `tags`."""
    import numpy as np
    from luminal_num.models.llama import LLAMA_TINY, build_decode, random_weights
    from luminal_num.search.recipes import pick
    from luminal_num.search.space import SearchSpace
    config = dataclasses.replace(LLAMA_TINY.with_layers(1), vocab_size=VOCAB)
    model = build_decode(config, random_weights(config, seed=0), 8)
    space = SearchSpace.build(model.graph, fusion=True)
    program = space.program(pick(space, set(tags).__contains__))
    inputs = model.make_inputs(np.array([3]), np.array([0]))
    head = next(k for k in program.launched() if k.kind.is_gemm and k.shape[-1] == VOCAB)
    return model, program, inputs, head


W4A16 = ("store:int4_g128", "gemm:bf16")


def test_a_wide_gemv_runs_tiles_of_several_bands():
    from luminal_num.codegen.megakernel_cuda import render_megakernel
    _, program, _, head = _wide_head(W4A16)
    queue = build_queue(program)
    op = queue.ops[queue.position(head.id)]
    assert op.block.kind == "gemv" and op.block.tiles.evaluate({}) == 73
    mega = render_megakernel(program, queue)
    cuda = next(o for o in mega.ops if o.kernel == head.id and o.last)
    assert cuda.stream is not None and cuda.stream.bands == 145
    assert [list(cuda.stream.tile_bands(y, 73)) for y in (0, 71, 72)] == [[0, 73], [71, 144], [72]]


@pytest.mark.parametrize("y", [0, 72])
def test_a_several_band_tile_prefetches_exactly_the_weight_bytes_its_body_reads(y):
    """Differential: the bytes of each stored part (int4 codes, group scales) that block (0, y, 0) of the
    inlined LM head reads at the megakernel's grid (found by running it in the CUDA interpreter) are the byte
    ranges of its bands y, y + 73, ... (WeightStream.tile_bands), which the loop's prefetch walks."""
    from luminal_num.codegen.megakernel_cuda import render_megakernel
    from luminal_num.quant.storage import STORAGE_FORMATS
    from test_megakernel_cuda import _one_block_reads
    _, program, _, head = _wide_head(W4A16)
    mega = render_megakernel(program, build_queue(program))
    op = next(o for o in mega.ops if o.kernel == head.id and o.last)
    reads = _one_block_reads(mega, program, op, y)
    assert len(reads) == len(op.stream.parts) == 2
    for slot, seen in reads.items():
        use = next(u for u in mega.uses if u.slot == slot)
        fmt = STORAGE_FORMATS[program.kernel(use.kernel).storage]
        size = fmt.container(fmt.parts[use.part]).itemsize
        read_bytes = {i * size + b for i in seen for b in range(size)}
        prefetched = {b for band in op.stream.tile_bands(y, 73) for p, begin, end in op.stream.tile_ranges(band)
                      if op.stream_slots[op.stream.parts.index(p)] == slot for b in range(begin, end)}
        assert seen and read_bytes == prefetched, (y, sorted(read_bytes ^ prefetched)[:4])
    loop = mega.source[mega.source.index("ln_megakernel("):]
    assert "band += ln_mk.grid.y" in loop and loop.index("band += ln_mk.grid.y") < loop.index("ln_mk_acquire(c)")


def test_the_wide_head_gives_the_same_bits_at_both_grids_and_in_the_emulator():
    """The LM head's body run at the megakernel's 73-tile grid and at its own launch's 145 blocks (CUDA
    interpreter) gives the same bits, within an FP32 sum's envelope of the CPU backend; the emulated scheduler
    over the queue gives the kernel-by-kernel plan's outputs bit for bit."""
    import numpy as np
    from luminal_num.codegen.megakernel_cuda import render_megakernel
    from luminal_num.runtime.cpu import CpuRuntime, bind_program
    from luminal_num.runtime.megakernel_emulator import MegakernelEmulator, bit_identical
    from test_cuda_codegen import stored_values
    from test_megakernel_cuda import _run_ops, _tolerance
    model, program, inputs, head = _wide_head(W4A16)
    queue = build_queue(program)
    mega = render_megakernel(program, queue)
    feed = {**model.graph.weights, **inputs}
    bindings = bind_program(program, feed)
    stored = stored_values(program, feed, model.graph.weights)
    at_tiles = _run_ops(mega, program, stored, bindings, feed, only={head.id})[head.id]
    own = next(o for o in mega.ops if o.kernel == head.id and o.last)
    assert own.grid[1] == ((VOCAB, 32),)
    own_launch = dataclasses.replace(own, grid=(own.grid[0], ((VOCAB, 16),), own.grid[2]))  # 145 blocks
    kernel_grid = dataclasses.replace(mega, ops=tuple(own_launch if o is own else o for o in mega.ops))
    at_launch = _run_ops(kernel_grid, program, stored, bindings, feed, only={head.id})[head.id]
    np.testing.assert_array_equal(at_tiles, at_launch)
    ref = stored[head.id].reshape(at_tiles.shape)
    # the CPU backend's plan sums this bf16 Gemm in another order than the body's sequential one (1 ulp on a few
    # percent of the rows, at either grid): the K-ulp envelope of an FP32 sum
    envelope = 64 * 2.0 ** -23 * (float(np.max(np.abs(ref))) + 1.0) * 2
    np.testing.assert_allclose(at_tiles, ref, rtol=0, atol=max(envelope, _tolerance(head, ref, bindings)))
    reference = CpuRuntime(program, model.graph.weights).run(inputs).outputs
    emulator = MegakernelEmulator(program, queue, model.graph.weights, inputs)
    for seed in range(6):
        run = emulator.run(seed, sms=(2, 16, 132)[seed % 3])
        assert not run.violations and run.deadlock is None
        assert bit_identical(run.outputs, reference)


def test_fp8_gemms_on_the_wide_head_compute_what_the_cpu_backend_computes():
    """FP8 W8A8 (per-token A, static per-channel B) on the wide head: the loop runs no tile of A's scale launch
    (its GEMV bodies are the staged entries, computing A's scales in their pass over A), B's scales come from the
    at-load launch (run first into the same scratch slot), then the body; each Gemm's output from the CUDA
    interpreter matches the CPU backend within an FP32 sum's envelope, and the emulated scheduler's the plan's."""
    import numpy as np
    from luminal_num.codegen.megakernel_cuda import render_megakernel
    from luminal_num.runtime.cpu import bind_program
    from test_cuda_codegen import stored_values
    from test_megakernel_cuda import _run_ops, _tolerance
    model, program, inputs, head = _wide_head(("store:f8e4m3_channel", "gemm:f8e4m3_channel_prologue"))
    queue = build_queue(program)
    mega = render_megakernel(program, queue)
    rows, _ = mega.table(queue, {})
    scale_ops = [(o.grid, row[2]) for o, row in zip(mega.ops, rows) if o.kernel == head.id and not o.last]
    assert scale_ops == [((((1, 1),),), 0)]
    feed = {**model.graph.weights, **inputs}
    bindings = bind_program(program, feed)
    stored = stored_values(program, feed, model.graph.weights)
    gemms = {k.id for k in program.launched() if k.kind.is_gemm}
    got = _run_ops(mega, program, stored, bindings, feed, only=gemms)
    for kid in gemms:
        k = program.kernel(kid)
        ref = stored[kid].reshape(got[kid].shape)
        # the decode path's fixed tree against the CPU plan's order: within the K-ulp envelope of an FP32 sum
        envelope = int(k.layout.k) * 2.0 ** -23 * (float(np.max(np.abs(ref))) + 1.0) * 2
        np.testing.assert_allclose(got[kid], ref, rtol=0, atol=max(envelope, _tolerance(k, ref, bindings)),
                                   err_msg=f"kernel {kid}")
    # the staged bodies run in the loop's table (no second pass), and the emulated scheduler over the queue gives
    # the kernel-by-kernel plan's outputs bit for bit
    scaled = [i for i, o in enumerate(mega.ops) if o.last and queue.ops[o.queue_op].prologue]
    assert scaled and all(mega.ops[i].entry.endswith("_staged") and rows[i][20] == -1 for i in scaled)
    from luminal_num.runtime.cpu import CpuRuntime
    from luminal_num.runtime.megakernel_emulator import MegakernelEmulator, bit_identical
    reference = CpuRuntime(program, model.graph.weights).run(inputs).outputs
    emulator = MegakernelEmulator(program, queue, model.graph.weights, inputs)
    for seed in range(4):
        run = emulator.run(seed, sms=(2, 132)[seed % 2])
        assert not run.violations and run.deadlock is None and bit_identical(run.outputs, reference)


def _unstaged(queue):
    """The queue with every staged scale launch a private second pass again (the form before folding)."""
    from luminal_num.codegen.megakernel import WorkQueue
    return WorkQueue(tuple(dataclasses.replace(op, prologue=tuple(dataclasses.replace(p, staged=False)
                                                                  for p in op.prologue)) for op in queue.ops))


@pytest.mark.parametrize("m", [4, 6])
def test_a_gemvs_staged_a_scales_give_the_separate_launchs_bits(m):
    """m tokens through the GEMV (4: the decode path; 6: the tiled loops), one row all zeros (scale 1), the others
    of magnitudes 1 to 30: the staged body (A loaded once into shared memory, each token's amax taken as it loads,
    its scale by the scale launch's expression) and the scale launch at its own grid of m blocks (a block per token)
    followed by the plain body give the same Gemm output bit for bit (an exact max, the same rounding). The staged
    body is run without the tileless scale launch: it reads no scale scratch. Both match the CPU backend within an
    FP32 sum's envelope. The loop's table gives the staged body no second pass (scale_recompute -1, no second
    copy); before folding (_unstaged) it ran the scale body into its second copy, sized for the m scales."""
    import numpy as np
    from luminal_num.codegen.megakernel_cuda import render_megakernel
    from luminal_num.runtime.cpu import bind_program
    from test_cuda_codegen import stored_values
    from test_megakernel_cuda import _run_ops
    n, k = 256, 64
    program = fp8_gemv(n, k, m)
    rng = np.random.default_rng(7)
    magnitudes = np.array([[1.0], [30.0], [0.0], [4.0], [1e-3], [0.25]])[:m]
    x = (rng.standard_normal((m, k)) * magnitudes).astype(np.float32)
    feed = {"x": x, "w": rng.standard_normal((n, k)).astype(np.float32)}
    bindings = bind_program(program, feed)
    stored = stored_values(program, feed, {"w": feed["w"]})
    queue = build_queue(program)
    assert [(p.private, p.staged) for p in queue.ops[-1].prologue] == [(True, True)]
    mega = render_megakernel(program, queue)
    scale = next(o for o in mega.ops if not o.last)
    body = next(i for i, o in enumerate(mega.ops) if o.kernel == 3 and o.last)
    assert mega.ops[body].entry.endswith("_staged") and scale.arg_slots[0] not in mega.ops[body].arg_slots
    rows, waits = mega.table(queue, {})
    assert rows[mega.ops.index(scale)][2] == 0 and rows[body][20:22] == (-1, -1)
    assert mega.private_scale_bytes(queue, {}) == 0
    keep = [i for i, o in enumerate(mega.ops) if o is not scale]
    alone = dataclasses.replace(mega, ops=tuple(mega.ops[i] for i in keep), sources=tuple(mega.sources[i] for i in keep))
    staged = _run_ops(alone, program, stored, bindings, feed, only={3})[3]

    before = _unstaged(queue)
    old = render_megakernel(program, before)
    old_scale = next(o for o in old.ops if not o.last)
    old_rows, _ = old.table(before, {})
    old_body = next(i for i, o in enumerate(old.ops) if o.kernel == 3 and o.last)
    assert old_rows[old_body][20:22] == (old.ops.index(old_scale), old_scale.arg_slots[0])
    assert old.private_scale_bytes(before, {}) == 4 * m
    own = dataclasses.replace(old_scale, grid=(((m, 1),),))  # the launch's own grid: a block per token
    separate = _run_ops(dataclasses.replace(old, ops=tuple(own if o is old_scale else o for o in old.ops)),
                        program, stored, bindings, feed, only={3})[3]
    np.testing.assert_array_equal(staged, separate)
    ref = stored[3].reshape(staged.shape)
    assert not ref[2].any()  # the zero token (scale 1) gives zeros
    envelope = k * 2.0 ** -23 * (float(np.max(np.abs(ref))) + 1.0) * 2
    np.testing.assert_allclose(staged, ref, rtol=0, atol=envelope)


def test_staged_copies_over_the_megakernels_shared_budget_are_refused(monkeypatch):
    """The staged bodies' shared copies are the persistent block's static shared memory, summed over the distinct
    bodies: over STAGED_SHARED_BYTES the lowering refuses with one line (the search then prices the program kernel
    by kernel), never a megakernel that would not launch. Here each llama-tiny FP8 GEMV body's copy is A's row plus
    a scale and 256 partial maxima."""
    from luminal_num.codegen import megakernel_cuda
    from luminal_num.codegen.megakernel import MegakernelError
    _, program, _, _ = _wide_head(("store:f8e4m3_channel", "gemm:f8e4m3_channel_prologue"))
    queue = build_queue(program)
    megakernel_cuda.render_megakernel(program, queue)  # within the budget
    monkeypatch.setattr(megakernel_cuda, "STAGED_SHARED_BYTES", 2048)
    with pytest.raises(MegakernelError, match="staged A copies of .* GEMV bodies take .* over the megakernel's 2048"):
        megakernel_cuda.render_megakernel(program, queue)
