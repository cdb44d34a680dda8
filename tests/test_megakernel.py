"""The megakernel's work queue, its barriers and the emulated scheduler (issue 33).

The barrier waits of a hand-built program are derived here by hand (tile ranges from the element
counts); the emulator's own check (written masks over realized views) is independent of that
derivation, so a deliberately wrong stride must show up as a violation or a deadlock; and every
interleaving's outputs must equal the kernel-by-kernel CPU plan bit for bit.
"""
from __future__ import annotations

import numpy as np
import pytest

from luminal_num.codegen.blockops import Partition, block_op, gemv_cols, tile_count
from luminal_num.codegen.llir import FApply, FConstV, FLoad, Kernel, KernelInput, KernelKind, Program, verify
from luminal_num.codegen.megakernel import (Wait, build_queue, wait_counters, with_read_elements,
                                            with_signal_stride, without_recompute, without_wait)
from luminal_num.dtypes.formats import F32
from luminal_num.hlir.ops import Op
from luminal_num.hlir.shape import ShapeTracker
from luminal_num.hlir.symbolic import sym
from luminal_num.models.registry import transformer_job
from luminal_num.runtime.cpu import CpuRuntime
from luminal_num.runtime.megakernel_emulator import MegakernelEmulator, bit_identical
from luminal_num.search.recipes import BF16_WEIGHTS, pick
from luminal_num.search.space import SearchSpace

S = sym("s")
C = 300


def chain_program() -> Program:
    """x (s, 300) -> y = 2x -> z = y + 1 -> r = sum(z, axis 1); w = z transposed + 1 (a non-identity read)."""
    row = ShapeTracker.contiguous((S, C))
    ks = (Kernel(0, KernelKind.EXTERNAL, (), (S, C), F32, external="x"),
          Kernel(1, KernelKind.ELEMENTWISE, (KernelInput(0, row),), (S, C), F32, body_shape=(S, C),
                 body=FApply(Op.MUL, (FLoad(0), FConstV(2.0)))),
          Kernel(2, KernelKind.ELEMENTWISE, (KernelInput(1, row),), (S, C), F32, body_shape=(S, C),
                 body=FApply(Op.ADD, (FLoad(0), FConstV(1.0)))),
          Kernel(3, KernelKind.SUM, (KernelInput(2, row),), (S,), F32, body_shape=(S, C), axis=1, acc=F32,
                 body=FLoad(0)),
          Kernel(4, KernelKind.ELEMENTWISE, (KernelInput(2, row.permute((1, 0))),), (C, S), F32, body_shape=(C, S),
                 body=FApply(Op.ADD, (FLoad(0), FConstV(1.0)))))
    return verify(Program(ks, (("x", 0),), (("r", 3), ("w", 4))))


def feed(rows: int) -> dict:
    return {"x": np.random.default_rng(rows).standard_normal((rows, C)).astype(np.float32)}


def test_barrier_strides_follow_the_producers_tiles_by_hand():
    program = chain_program()
    queue = build_queue(program)
    assert [op.kernel for op in queue.ops] == [1, 2, 3, 4]
    assert [op.stride for op in queue.ops] == [1, 1, 1, 1]  # all flat: one counter per tile
    assert queue.ops[1].waits == (Wait(0, 256),)   # z's tile t reads y's elements [256 t, 256 t + 256)
    assert queue.ops[2].waits == (Wait(1, 300),)   # r's tile t (one output) reads z's row t: 300 elements
    assert queue.ops[3].waits == (Wait(1, None),)  # the transposed read needs all of z
    for rows in (4, 7):  # one queue for every s: counts evaluated at run time
        bindings = {"s": rows}
        table = queue.evaluate(bindings)
        tiles = -(-rows * C // 256)
        assert [t.tiles for t in table] == [tiles, tiles, rows, tiles]
        base = table[1].counter_base
        assert base == tiles and table[2].counter_base == 2 * tiles
        for t in range(tiles):
            assert wait_counters(queue, table, 1, t, queue.ops[1].waits[0], bindings) == [(t, 1)]
        for t in range(rows):  # producer tiles 300 t // 256 .. (300 t + 299) // 256
            want = [(base + j, 1) for j in range(300 * t // 256, (300 * t + 299) // 256 + 1)]
            assert wait_counters(queue, table, 2, t, queue.ops[2].waits[0], bindings) == want
        assert wait_counters(queue, table, 3, 0, queue.ops[3].waits[0], bindings) == \
            [(base + j, 1) for j in range(tiles)]


@pytest.mark.parametrize("rows", [4, 7])
def test_interleavings_are_bit_identical_to_the_kernel_by_kernel_plan(rows):
    program = chain_program()
    reference = CpuRuntime(program).run(feed(rows)).outputs
    emulator = MegakernelEmulator(program, build_queue(program), {}, feed(rows))
    for seed in range(60):
        run = emulator.run(seed, sms=1 + seed % 6)
        assert not run.violations and run.deadlock is None, (seed, run.violations[:2], run.deadlock)
        assert bit_identical(run.outputs, reference)


def test_a_wrong_consumer_stride_is_caught():
    """r's wait claims one element per tile instead of a row of 300: its tiles 1..3 start before the
    rows they sum are written in some interleaving, and those read NaN."""
    program = chain_program()
    wrong = with_read_elements(build_queue(program), 2, 0, 1)
    emulator = MegakernelEmulator(program, wrong, {}, feed(4))
    reference = CpuRuntime(program).run(feed(4)).outputs
    runs = [emulator.run(seed, sms=4) for seed in range(40)]
    caught = [r for r in runs if r.violations]
    assert caught, "a consumer waiting on too few producer tiles went unnoticed"
    assert {v.producer_kernel for r in caught for v in r.violations} == {2}
    assert any(not bit_identical(r.outputs, reference) for r in caught)  # what it read shows in the values


def test_a_wrong_producer_stride_deadlocks_or_is_caught():
    """y signalling with stride 0 puts all its tiles in counter 0: z's tiles 1.. wait forever, or z's
    tile 0 starts after another tile of y and reads unwritten elements."""
    program = chain_program()
    wrong = with_signal_stride(build_queue(program), 0, 0)
    emulator = MegakernelEmulator(program, wrong, {}, feed(4))
    runs = [emulator.run(seed, sms=3) for seed in range(10)]
    assert all(r.deadlock is not None or r.violations for r in runs)
    assert any(r.deadlock is not None for r in runs)
    assert "waits in op 1" in next(r.deadlock for r in runs if r.deadlock)


def test_partition_per_kernel_kind_on_the_test_transformer():
    job = transformer_job(1)
    space = SearchSpace.build(job.graph)
    program = space.program(())
    bindings = job.graph.bind_symbols(job.calibration[0])
    kinds = {}
    for k in program.launched():
        b = block_op(k)
        kinds[k.kind] = b
        if k.kind is KernelKind.ROWS:  # one block per row
            assert b.partition is Partition.FLAT and b.elements == k.shape[-1]
            assert tile_count(k, bindings) == int(np.prod([int(d) for d in k.shape[:-1]]))
        if k.kind.is_gemm and b.kind == "gemv":  # blocks over N only
            assert tile_count(k, bindings) == -(-int(k.layout.n) // gemv_cols(k.layout.n))
    assert [gemv_cols(n) for n in (96, 576, 960, 1536, 49152)] == [1, 5, 8, 12, 32]
    assert KernelKind.ROWS in kinds and any(k.is_gemm for k in kinds)


@pytest.mark.parametrize("genome", ["fp32", "bf16"])
def test_emulated_test_transformer_matches_its_plan(genome):
    job = transformer_job(1)
    space = SearchSpace.build(job.graph)
    program = space.program(() if genome == "fp32" else pick(space, BF16_WEIGHTS.__contains__))
    inputs = job.calibration[0]
    reference = CpuRuntime(program, job.graph.weights).run(inputs).outputs
    emulator = MegakernelEmulator(program, build_queue(program), job.graph.weights, inputs)
    for seed in range(40):
        run = emulator.run(seed, sms=2 + seed % 7)
        assert not run.violations and run.deadlock is None
        assert bit_identical(run.outputs, reference)


# -- one-tile row ops recomputed by their GEMV ---------------------------------------------------------------

def _decode_tiny():
    from luminal_num.models.registry import llama_tiny_job
    job = llama_tiny_job(seq=1, layers=1)  # one token: the norms are one-row (one-tile) ops
    space = SearchSpace.build(job.graph, fusion=True)
    return job, space.program(pick(space, BF16_WEIGHTS.__contains__))


def test_a_one_row_norm_read_only_by_a_gemv_is_recomputed_by_its_tiles():
    """Found from the program: each one-tile ROWS op whose one reader is a GEMV (as A) has no tiles of its
    own; that GEMV recomputes it and waits on the row op's producers (whole) instead."""
    _, program = _decode_tiny()
    plain, queue = build_queue(program, recompute_rows=False), build_queue(program)
    readers = {}
    for k in program.launched():
        for slot, inp in enumerate(k.inputs):
            readers.setdefault(inp.buffer, []).append((k.id, slot))
    expected = {}
    for p, op in enumerate(plain.ops):
        k = program.kernel(op.kernel)
        reads = readers.get(k.id, [])
        if k.kind is KernelKind.ROWS and op.block.tiles.evaluate({}) == 1 and len(reads) == 1 and reads[0][1] == 0 \
                and program.kernel(reads[0][0]).kind.is_gemm:
            expected[p] = plain.position(reads[0][0])
    assert len(expected) == 3  # the layer's two norms and the final norm
    assert {p: op.recomputed_by for p, op in enumerate(queue.ops) if op.recomputed_by is not None} == expected
    table = queue.evaluate({})
    for p, c in expected.items():
        assert queue.ops[c].recomputes == p and table[p].tiles == 0 and table[c].tiles == plain.evaluate({})[c].tiles
        assert {w.producer for w in queue.ops[c].waits} == \
            {w.producer for w in plain.ops[p].waits} | {w.producer for w in plain.ops[c].waits if w.producer != p}
        assert all(w.read_elements is None for w in queue.ops[c].waits if w.producer in {x.producer for x in plain.ops[p].waits})
    assert sum(t.tiles for t in table) == sum(t.tiles for t in plain.evaluate({})) - 3


def test_recomputed_rows_are_bit_identical_under_fuzzed_interleavings():
    job, program = _decode_tiny()
    inputs = job.calibration[0]
    reference = CpuRuntime(program, job.graph.weights).run(inputs).outputs
    emulator = MegakernelEmulator(program, build_queue(program), job.graph.weights, inputs)
    for seed in range(40):
        run = emulator.run(seed, sms=(1, 2, 5, 16, 132)[seed % 5])
        assert not run.violations and run.deadlock is None, (seed, run.violations[:2], run.deadlock)
        assert bit_identical(run.outputs, reference)


def test_a_gemv_reading_the_row_op_without_recomputing_it_is_caught():
    """The row op has no tiles, so its buffer is never written: a reader that does not recompute it reads
    unwritten elements, every tile of it, in every interleaving."""
    job, program = _decode_tiny()
    queue = build_queue(program)
    c = next(i for i, op in enumerate(queue.ops) if op.recomputes is not None)
    wrong = without_recompute(queue, c)
    emulator = MegakernelEmulator(program, wrong, job.graph.weights, job.calibration[0])
    reference = CpuRuntime(program, job.graph.weights).run(job.calibration[0]).outputs
    for seed in range(3):
        run = emulator.run(seed, sms=4)
        row_op = program.kernel(queue.ops[queue.ops[c].recomputes].kernel).id
        assert {(v.op, v.producer_kernel) for v in run.violations} == {(c, row_op)}
        assert len(run.violations) == queue.evaluate({})[c].tiles
        assert not bit_identical(run.outputs, reference)


@pytest.mark.parametrize("scatter", ["scatter_ew", "scatter_nocopy"])
def test_an_attention_reading_the_new_kv_row_without_waiting_on_its_scatter_is_caught(scatter):
    """SmolLM2-shaped 1-layer decode at position 3, fused attention: the attention reads this step's K (V) row from
    the cache its scatter writes. Without its wait on that scatter the emulated scheduler records a read of
    unwritten cache elements in the interleavings where the attention starts first, and every run it records
    nothing for gives the plan's bits (a missing dependency never passes with wrong values unnoticed)."""
    from bench.storage_decode import SMOLLM2
    from luminal_num.models.llama import build_decode, random_weights
    config = SMOLLM2.with_layers(1)
    model = build_decode(config, random_weights(config), 64)
    inputs = model.make_inputs([1], [3])
    space = SearchSpace.build(model.graph, fusion=True)
    program = space.program(pick(space, (BF16_WEIGHTS | {"attn:flash_bf16"}).__contains__))
    queue = build_queue(program)
    a = next(i for i, op in enumerate(queue.ops) if program.kernel(op.kernel).kind is KernelKind.ATTENTION)
    s = next(w.producer for w in queue.ops[a].waits if program.kernel(queue.ops[w.producer].kernel).kind.value == scatter)
    emulator = MegakernelEmulator(program, without_wait(queue, a, s), model.graph.weights, inputs)
    reference = CpuRuntime(program, model.graph.weights).run(inputs).outputs
    caught = 0
    for seed in range(80):  # the attention also waits on the rope and the other scatter: few runs outrun this one
        run = emulator.run(seed, sms=(4, 132)[seed % 2])
        assert run.deadlock is None
        if run.violations:
            assert {(v.op, v.producer_kernel) for v in run.violations} == {(a, queue.ops[s].kernel)}
            caught += 1
        else:
            assert bit_identical(run.outputs, reference)
    assert caught  # 4 (K) and 2 (V) of these 80 seeds
