"""Two megakernel changes of issue 33, each against an independent truth:
- a Gemm's own scale launches (FP8 W8A8: A per token, B per channel) are queue work the cost model schedules:
  their tiles and bytes worked out by hand on a hand-built decode GEMV;
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
from luminal_num.runtime.megakernel_cost import (FIRST_LOAD_S, POST_WAIT_S, PRE_WAIT_S, QUEUE_POP_S, TILE_OVERHEAD_S,
                                                  megakernel_latency, tile_times)
from luminal_num.runtime.targets import Target, get_target

ACHIEVED = 4.3e12  # the H200's measured copy bandwidth (targets.H200_EFFICIENCY)
FP32_SIMT = 67e12 * 790.0 / 989.4
SMS = 1000  # every tile on an SM of its own (150 tiles below)


def fp8_gemv(n: int, k: int) -> Program:
    """x (1, K) -> y = 2x -> out (1, N) = y W^T in FP8 W8A8 (A scaled per token, B per channel, at run time)."""
    row = ShapeTracker.contiguous((1, k))
    b = ShapeTracker.contiguous((n, k)).permute((1, 0)).expand_dim(0, 1)
    ks = (Kernel(0, KernelKind.EXTERNAL, (), (1, k), F32, external="x"),
          Kernel(1, KernelKind.EXTERNAL, (), (n, k), F32, external="w"),
          Kernel(2, KernelKind.ELEMENTWISE, (KernelInput(0, row),), (1, k), F32, body_shape=(1, k),
                 body=FApply(Op.MUL, (FLoad(0), FConstV(2.0)))),
          Kernel(3, KernelKind.GEMM, (KernelInput(2, row.expand_dim(2, n)), KernelInput(1, b)), (1, n), F32,
                 precision="f8e4m3_channel_prologue", layout=GemmLayout((1, k, n), 1, (), (0,), (2,), "batched")))
    return verify(Program(ks, (("x", 0), ("w", 1)), (("out", 3),)))


def _roofline(nbytes: float, flops: float) -> float:
    """One tile's body on one of SMS SMs: its bytes at 1 / SMS of the bandwidth or its flops at 1 / SMS of
    the FP32 SIMT rate, whichever is longer."""
    return max(nbytes / (ACHIEVED / SMS), flops / (FP32_SIMT / SMS))


def test_fp8_scale_launches_are_scheduled_by_hand():
    """N = 256, K = 64 on an idle H200 of 1000 SMs. A's per-token scale: 1 tile after y, reading y's 64 FP32
    (a max each) and writing one scale; B's per-channel scales: 256 channels in 132 tiles (FILL_SMS, the body
    grid-stride), over the weight, so after nothing; the body's 16 tiles after y and both. Each scale tile pays
    the overheads of a tile that streams nothing (it popped before it waited)."""
    n, k = 256, 64
    program = fp8_gemv(n, k)
    sm_many = dataclasses.replace(get_target("h200"), name="h200_1000_sms", sm_count=SMS)
    queue = build_queue(program)
    gemm = queue.ops[-1]
    assert [(p.slot, p.ready, p.tiles.evaluate({})) for p in gemm.prologue] == [(0, False, 1), (1, True, 132)]
    got = megakernel_latency(queue, program, sm_many, {})
    assert got.tiles == 1 + 1 + 132 + 16
    works = kernel_works(program, {}, LaunchForm.MEGAKERNEL)
    a_bytes, b_bytes = k * 4, n * k * 4  # one pass over each operand (B an FP32 weight here)
    assert got.bytes_moved - sum(w.bytes_moved for w in works) == a_bytes + 4 + b_bytes + n * 4
    y_end = _roofline(2 * k * 4, k) + TILE_OVERHEAD_S
    scale_a = y_end + FIRST_LOAD_S + POST_WAIT_S + _roofline(a_bytes + 4, k)  # popped at 0, ready at y_end
    scale_b = TILE_OVERHEAD_S + _roofline((b_bytes + n * 4) / 132, n * k / 132)
    body = tile_times(works[-1], 16, sm_many, n * k * 4)  # its own W rows streamed before the wait
    ready = max(scale_a, scale_b)
    assert got.makespan_s == pytest.approx(max(PRE_WAIT_S + body.weight_s, max(QUEUE_POP_S, ready) + POST_WAIT_S
                                               + body.rest_s), rel=1e-12)
    unscaled = dataclasses.replace(queue, ops=(*queue.ops[:-1], dataclasses.replace(gemm, prologue=())))
    plain = megakernel_latency(unscaled, program, sm_many, {})
    assert plain.tiles == got.tiles - 133 and plain.makespan_s < got.makespan_s
    by_kind = dict(got.busy_by_kind)
    assert by_kind["scale"] == pytest.approx(scale_a - y_end + QUEUE_POP_S + 132 * scale_b, rel=1e-12)


def test_one_sm_pays_every_scale_tile_in_turn():
    """One SM: the makespan is every tile's whole time in queue order, the scale tiles included."""
    n, k = 256, 64
    program = fp8_gemv(n, k)
    one = Target(**{**get_target("h200").__dict__, "name": "h200_one_sm", "sm_count": 1})
    got = megakernel_latency(build_queue(program), program, one, {})
    share = ACHIEVED
    y = max(2 * k * 4 / share, k / FP32_SIMT) + TILE_OVERHEAD_S
    scale_a = max((k * 4 + 4) / share, k / FP32_SIMT) + TILE_OVERHEAD_S
    scale_b = 132 * (max((n * k * 4 + n * 4) / 132 / share, n * k / 132 / FP32_SIMT) + TILE_OVERHEAD_S)
    body = tile_times(kernel_works(program, {}, LaunchForm.MEGAKERNEL)[-1], 16, one, n * k * 4)
    assert got.makespan_s == pytest.approx(y + scale_a + scale_b + 16 * body.alone_s, rel=1e-12)


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


def test_fp8_scale_launches_at_132_tiles_compute_what_the_cpu_backend_computes():
    """FP8 W8A8 (per-token A, per-channel B) on the wide head: the inlined scale launches run 1 and 132 tiles
    (not 2320: their bodies loop grid-stride over the scale blocks), then the body: the head's output is the same
    bits as with B's scale launch at its own 2320 blocks, and each Gemm's output from the CUDA interpreter matches
    the CPU backend within an FP32 sum's envelope."""
    import numpy as np
    from luminal_num.codegen.megakernel_cuda import render_megakernel
    from luminal_num.runtime.cpu import bind_program
    from test_cuda_codegen import stored_values
    from test_megakernel_cuda import _run_ops, _tolerance
    model, program, inputs, head = _wide_head(("store:f8e4m3_channel", "gemm:f8e4m3_channel_prologue"))
    queue = build_queue(program)
    mega = render_megakernel(program, queue)
    scale_grids = [o.grid for o in mega.ops if o.kernel == head.id and not o.last]
    assert scale_grids == [(((1, 1),),), (((132, 1),),)]
    feed = {**model.graph.weights, **inputs}
    bindings = bind_program(program, feed)
    stored = stored_values(program, feed, model.graph.weights)
    gemms = {k.id for k in program.launched() if k.kind.is_gemm}
    got = _run_ops(mega, program, stored, bindings, feed, only=gemms)
    n_channels = program.kernel(head.id).layout.n
    own_grid = tuple(dataclasses.replace(o, grid=(((1, 1), (1, 1), (n_channels, 1)),)) if o.kernel == head.id
                     and o.launch == 1 and not o.last else o for o in mega.ops)
    at_launch = _run_ops(dataclasses.replace(mega, ops=own_grid), program, stored, bindings, feed, only={head.id})
    np.testing.assert_array_equal(got[head.id], at_launch[head.id])  # 132 tiles or a block per channel: same bits
    for kid in gemms:
        k = program.kernel(kid)
        ref = stored[kid].reshape(got[kid].shape)
        # the decode path's fixed tree against the CPU plan's order: within the K-ulp envelope of an FP32 sum
        envelope = int(k.layout.k) * 2.0 ** -23 * (float(np.max(np.abs(ref))) + 1.0) * 2
        np.testing.assert_allclose(got[kid], ref, rtol=0, atol=max(envelope, _tolerance(k, ref, bindings)),
                                   err_msg=f"kernel {kid}")
