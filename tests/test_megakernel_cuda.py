"""The megakernel's CUDA source: it compiles with NVRTC for sm_90, and each inlined op body, called with
the arguments the interpreter loop's switch passes it, computes what the CPU backend computes
(tests/cuda_interpreter.py runs the bodies single-threaded, or block by block where they synchronise)."""
from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest

from cuda_interpreter import Buffer, compile_entry, entry_body, launch
from luminal_num.codegen import nvrtc
from luminal_num.codegen.llir import KernelKind
from luminal_num.codegen.cache_stream import cache_stream
from luminal_num.codegen.megakernel import build_queue
from luminal_num.codegen.cuda_weight_only import stored_operand, weight_only_gemm
from luminal_num.codegen.cuda_source import ceil_count
from luminal_num.codegen.megakernel_cuda import ENTRY_NAME, render_megakernel
from luminal_num.codegen.weight_stream import whole_reads
from luminal_num.dtypes.formats import Kind
from luminal_num.hlir.symbolic import evaluate
from luminal_num.models.llama import build_decode, random_weights
from luminal_num.models.registry import llama_tiny_job
from luminal_num.quant.storage import STORAGE_FORMATS
from luminal_num.runtime.cpu import CpuRuntime, bind_program
from luminal_num.runtime.weight_only import stored_weight
from luminal_num.search.recipes import BF16_WEIGHTS, STORAGE_RECIPES, pick
from luminal_num.search.space import SearchSpace
from test_cuda_codegen import MODELS, needs_nvrtc, stored_values, tolerance
from test_megakernel import chain_program, feed

SMOLLM2_LAYER = None


def _transformer_program(tags=()):
    model = next(m for name, m in MODELS.items() if name.startswith("transformer"))
    space = SearchSpace.build(model.graph)
    return space.program(pick(space, set(tags).__contains__)), {**model.graph.weights, **model.make_inputs(5)}


def _stored_part(program, weight: int, part: int, inputs) -> Buffer:
    """A stored weight's part as the runtime uploads it (CudaRuntime._stored_parts): packed codes, scales."""
    w = program.kernel(weight)
    fmt = STORAGE_FORMATS[w.storage]
    arr = np.asarray(fmt.pack(stored_weight(w, inputs)).arrays[fmt.parts[part]])
    return Buffer(arr.astype(np.float64).reshape(-1), arr.dtype.kind in "iu")


def _run_ops(mega, program, stored, bindings, inputs=None, only=None):
    """Every CudaOp's body (or those of the kernels in `only`) from the megakernel source, with its
    switch's argument slots, reading the CPU backend's values; returns kernel id -> its output."""
    results, scratch_bufs = {}, {}
    uses = {u.slot: u for u in mega.uses}
    steps = [(op.kernel, op.entry, op.arg_slots, op.grid, op.block, src) for op, src in zip(mega.ops, mega.sources)]
    # a Gemm's at-load launches (its weight's static scales: KernelSource.at_load) first, into the same scratch
    # slots the step's bodies read, as the runtime runs them once after the upload
    slot_of = {(u.kernel, u.index, u.part): u.slot for u in mega.uses}
    loaded = [(op.kernel, launch.entry, tuple(slot_of[(op.kernel, a.index, None)] if a.role == "scratch"
                                              else slot_of[(a.buffer, None, a.index)] if a.role == "part" else a.buffer
                                              for a in launch.args), launch.grid, tuple(launch.block), src)
              for op, src in zip(mega.ops, mega.sources) if op.last and src is not None for launch in src.at_load]
    for kid, entry, arg_slots, grid_axes, block, src in loaded + steps:
        if only is not None and kid not in only:
            continue
        k = program.kernel(kid)
        fn, params = compile_entry(mega.source, entry)
        out = results.get(k.id)
        if out is None:
            first = stored[k.inputs[0].buffer] if k.kind.in_place else np.zeros(k.numel(bindings))
            out = results[k.id] = Buffer(np.array(first, dtype=np.float64).reshape(-1), k.dtype.kind is Kind.INT)
        args = {}
        for name, slot in zip(params, arg_slots):
            use = uses.get(slot)
            if slot == k.id:
                args[name] = out
            elif use is not None and use.part is not None:  # a stored part (dequantize-on-load or tiled body)
                assert name.startswith("w_")
                args[name] = _stored_part(program, use.kernel, use.part, inputs)
            elif use is not None and use.index is None:
                assert name == "dyn_dims"
                args[name] = Buffer(np.asarray(src.dyn_values(bindings), dtype=np.float64), True)
            elif use is not None:
                scratch_bufs.setdefault(slot, Buffer(np.zeros(src.scratch[use.index].numel(bindings)), False))
                args[name] = scratch_bufs[slot]
            else:
                args[name] = Buffer(np.array(stored[slot], dtype=np.float64).reshape(-1),
                                    program.kernel(slot).dtype.kind is Kind.INT)
        if "__syncthreads" in entry_body(mega.source, entry)[1]:
            grid = tuple(min(-(-evaluate(d, bindings) // per), 65535) for axis in grid_axes for d, per in axis)
            launch(fn, args, (grid + (1, 1, 1))[:3], (tuple(block) + (1, 1, 1))[:3])
        else:
            fn(**args)
    return {kid: buf.values.reshape([evaluate(d, bindings) for d in program.kernel(kid).shape])
            for kid, buf in results.items()}


@pytest.mark.parametrize("case", ["transformer", "chain"])
def test_each_inlined_op_body_computes_what_the_cpu_backend_computes(case):
    program, inputs = _transformer_program() if case == "transformer" else (chain_program(), feed(5))
    mega = render_megakernel(program, build_queue(program))
    assert len({op.kernel for op in mega.ops}) == len(program.launched())
    bindings = bind_program(program, inputs)
    stored = stored_values(program, inputs)
    got = _run_ops(mega, program, stored, bindings)
    for k in program.launched():
        ref = stored[k.id].reshape(got[k.id].shape)
        np.testing.assert_allclose(got[k.id], ref, rtol=0, atol=_tolerance(k, ref, bindings),
                                   err_msg=f"kernel {k.id} {k.kind.value}")


def test_a_gemm_over_a_stored_weight_inlines_the_dequantize_on_load_body():
    """A W4A16 llama-tiny layer: its Gemms over int4 weights run the dequantize-on-load body (plain Gemms) or
    their tiled body reading the stored parts (residual and GLU epilogues) on the packed codes and scales
    (slots of their own, shared by the readers of one weight), as kernel by kernel."""
    job = llama_tiny_job(seq=4, layers=1)
    space = SearchSpace.build(job.graph)
    program = space.program(pick(space, {"store:int4_g128", "gemm:bf16"}.__contains__))
    mega = render_megakernel(program, build_queue(program))
    dequantizing = {op.kernel for op, src in zip(mega.ops, mega.sources) if src is None}
    assert dequantizing == {k.id for k in program.launched() if weight_only_gemm(k, program)} != set()
    assert {u.part for u in mega.uses if u.part is not None} == {0, 1}  # the int4 codes and their scales
    inputs = {**job.graph.weights, **job.calibration[0]}
    bindings = bind_program(program, inputs)
    computed = tuple((f"k{k.id}", k.id) for k in program.launched() if not k.kind.in_place)  # no stored weights
    run = CpuRuntime(dataclasses.replace(program, outputs=computed), job.graph.weights).run(job.calibration[0])
    stored = {int(name[1:]): value for name, value in run.outputs.items()}
    reading = {k.id for k in program.launched() if stored_operand(k, program) is not None}
    assert reading - dequantizing  # the epilogue Gemms read the parts through their tiled bodies
    assert {u.kernel for u in mega.uses if u.part is not None} == {program.kernel(kid).inputs[1].buffer for kid in reading}
    got = _run_ops(mega, program, stored, bindings, inputs, only=reading)
    for kid in reading:  # BF16 x BF16 products are exact in FP32: only the order of the K-sum differs
        k = program.kernel(kid)
        ref = stored[kid].reshape(got[kid].shape)
        envelope = evaluate(k.layout.k, bindings) * 2.0 ** -23 * (float(np.max(np.abs(ref))) + 1.0) * 2
        envelope = max(envelope, _tolerance(k, ref, bindings))
        np.testing.assert_allclose(got[kid], ref, rtol=0, atol=envelope, err_msg=f"kernel {kid}")


def _tolerance(k, ref, bindings) -> float:
    """test_cuda_codegen's envelope; an FP32 Gemm's fallback sums K FMA products in another order than
    BLAS does: K ulps of the largest magnitude (the SUM envelope), then the epilogue's own."""
    if k.kind.is_gemm and k.precision in (None, "f32"):
        scale = float(np.max(np.abs(ref), initial=0.0)) + 1.0
        return evaluate(k.layout.k, bindings) * 2.0 ** -23 * scale * 2
    return tolerance(k, ref, bindings)


def test_switch_wires_every_argument_to_its_buffer():
    program, _ = _transformer_program()
    mega = render_megakernel(program, build_queue(program))
    for i, op in enumerate(mega.ops):
        line = next(l for l in mega.source.splitlines() if l.strip().startswith(f"case {i}:"))
        assert f"{op.entry}(" in line and all(f"ln_mk_buf(bufs, {s})" in line for s in op.arg_slots)
        k = program.kernel(op.kernel)
        for inp in k.inputs:  # the inputs the body reads are the kernel's buffers
            assert inp.buffer in op.arg_slots or k.kind.in_place


def _smollm2_layer(genome):
    from bench.storage_decode import SMOLLM2
    config = SMOLLM2.with_layers(1)
    model = build_decode(config, random_weights(config), 64)
    space = SearchSpace.build(model.graph)
    return space.program(pick(space, genome.__contains__))


@needs_nvrtc
@pytest.mark.parametrize("genome", ["FP32", "BF16 + fused attention", "W4A16 INT4 group 128",
                                    "FP8 W8A8 dynamic per-token"])
def test_megakernel_compiles_with_nvrtc_for_sm90(genome):
    tags = {"FP32": frozenset(), "BF16 + fused attention": BF16_WEIGHTS | {"attn:flash_bf16"},
            "W4A16 INT4 group 128": STORAGE_RECIPES["W4A16 INT4 group 128"],
            "FP8 W8A8 dynamic per-token": STORAGE_RECIPES["FP8 W8A8 dynamic per-token"]}[genome]
    program = _smollm2_layer(tags)
    queue = build_queue(program)
    mega = render_megakernel(program, queue)
    compiled = nvrtc.compile_cuda(mega.source, mega.name, "sm_90")
    assert compiled.cubin and f".entry {ENTRY_NAME}" in compiled.ptx
    # every inlined body's __shared__ arrays are the persistent block's: within sm_90's 48 KB of static shared memory
    shared = sum(int(n) for n in re.findall(r"\.shared \.align \d+ \.b8 [\w$]+\[(\d+)\]", compiled.ptx))
    assert 0 < shared <= 48 * 1024
    kinds = {program.kernel(op.kernel).kind for op in mega.ops}
    assert KernelKind.ROWS in kinds and any(k.is_gemm for k in kinds)
    if "attention" in genome:  # its tiles prefetch their KV-cache rows (codegen/cache_stream.py)
        assert KernelKind.ATTENTION in kinds
        assert {program.kernel(op.kernel).kind for op in mega.ops if op.cache is not None} == {KernelKind.ATTENTION}
    if genome.startswith("FP8"):  # every Gemm scales A in its staged body's pass over A; B's scales are at-load
        gemms = [op for op in mega.ops if program.kernel(op.kernel).kind.is_gemm]
        assert {op.entry[-7:] for op in gemms if not op.last} == {"_scale0"}
        assert {op.entry[-7:] for op in gemms if op.last and queue.ops[op.queue_op].prologue} == {"_staged"}
        assert 8 * 1024 < shared  # 10 KB before the staged copies (4 x 576 + 1536 FP32 values more)
    elif genome != "FP32":  # the Gemms over stored weights inline the dequantize-on-load body
        assert any(src is None for src in mega.sources)


# -- weights streamed before the wait (codegen/weight_stream.py) -------------------------------------------------

class _Reads(np.ndarray):
    """A buffer's values that record every element index a kernel reads."""

    def __getitem__(self, index):
        if isinstance(index, (int, np.integer)):
            self.seen.add(int(index))
        return super().__getitem__(index)


def _recording(values: np.ndarray, integer: bool) -> Buffer:
    arr = np.asarray(values, dtype=np.float64).reshape(-1).view(_Reads)
    arr.seen = set()
    return Buffer(arr, integer)


def _w4a16_tiny():
    job = llama_tiny_job(seq=4, layers=1)
    space = SearchSpace.build(job.graph, fusion=True)
    program = space.program(pick(space, {"store:int4_g128", "gemm:bf16"}.__contains__))
    return job, program, render_megakernel(program, build_queue(program))


def test_only_gemm_tiles_over_a_weight_prefetch_and_only_what_their_body_reads():
    """The Gemms over an (N, K) weight (found here from the program) are the ops with weight-band prefetch rows, on
    their own launch, prefetching bufs[] slots the body is called with; the other ops with prefetch rows prefetch
    whole reads only (weight_stream.whole_reads); the loop prefetches before it spins."""
    job, program, mega = _w4a16_tiny()
    weighted = {k.id for k in program.launched() if k.kind.is_gemm
                and program.kernel(k.inputs[1].buffer).kind is KernelKind.EXTERNAL
                and program.kernel(k.inputs[1].buffer).id not in program.cache_buffers()}
    assert weighted and {op.kernel for op in mega.ops if op.stream is not None} == weighted
    for op in mega.ops:
        if op.stream is not None:
            assert op.last and set(op.stream_slots) <= set(op.arg_slots)
    rows, _ = mega.table(build_queue(program), bind_program(program, {**job.graph.weights, **job.calibration[0]}))
    spans = [(r[14], r[15]) for r in rows]
    assert all((end > begin) == (op.stream is not None or bool(op.whole)) for op, (begin, end) in zip(mega.ops, spans))
    assert spans[-1][1] == len(mega.prefetch_rows())
    prefetch = mega.prefetch_rows()
    for op, (begin, end) in zip(mega.ops, spans):
        bands = [r for r in prefetch[begin:end] if r[2] != 0]
        assert bool(bands) == (op.stream is not None)
        assert [(r[0], r[5]) for r in prefetch[begin:end] if r[2] == 0] == [(w.nbytes, w.buffer) for w in op.whole]
    assert any(op.whole for op in mega.ops)
    loop = mega.source[mega.source.index(f"void __launch_bounds__({1024}) {ENTRY_NAME}("):]
    # the weight bands, the whole reads, the KV-cache spans (codegen/cache_stream.py)
    assert loop.count("prefetch.global.L2") == 3
    assert loop.rindex("prefetch.global.L2") < loop.index("ln_mk_acquire(c) < need")


def _one_block_reads(mega, program, op, band: int) -> dict[int, set[int]]:
    """Run block (0, band, 0) of a CudaOp's body in the interpreter on zero data; the element indices it
    read from each stored part slot."""
    fn, params = compile_entry(mega.source, op.entry)
    uses = {u.slot: u for u in mega.uses}
    args, parts = {}, {}
    for name, slot in zip(params, op.arg_slots):
        use = uses.get(slot)
        if use is not None and use.part is not None:
            w = program.kernel(use.kernel)
            fmt = STORAGE_FORMATS[w.storage]
            shape = tuple(int(d) for d in w.shape)
            size = int(np.prod(fmt.container_shape(fmt.parts[use.part], shape)))
            args[name] = parts[slot] = _recording(np.zeros(size), True)
        else:
            n = program.kernel(slot).numel({"s": 4}) if slot < len(program.kernels) else 1
            args[name] = Buffer(np.zeros(max(n, 1)), program.kernel(slot).dtype.kind is Kind.INT)
    grid = tuple(ceil_count(axis, {}) for axis in op.grid) + (1, 1)

    def only(**kw):
        if kw["blockIdx"].y == band and kw["blockIdx"].x == 0:
            yield from fn(**kw)
    launch(only, args, grid[:3], (tuple(op.block) + (1, 1, 1))[:3])
    return {slot: buf.values.seen for slot, buf in parts.items()}


def test_a_tile_prefetches_whole_the_inputs_it_reads_whole():
    """Differential: the bodies with whole reads (a norm, rope, a scatter, the attention), run in the interpreter,
    read every element of each such buffer and nothing past it (their tiles together: a tile may read only its row
    of a small table, and prefetches the rest too); a GEMV that recomputes a norm prefetches the norm's whole reads
    (its tiles run the norm's body)."""
    job, program, mega = _w4a16_tiny()
    checked = set()
    for op in mega.ops:
        if not op.whole or program.kernel(op.kernel).kind.is_gemm:
            continue
        fn, params = compile_entry(mega.source, op.entry)
        args, seen = {}, {}
        for name, slot in zip(params, op.arg_slots):
            n = program.kernel(slot).numel({"s": 4}) if slot < len(program.kernels) else 1
            integer = slot < len(program.kernels) and program.kernel(slot).dtype.kind is Kind.INT
            buf = _recording(np.zeros(max(n, 1)), integer)
            args[name] = buf
            seen[slot] = buf.values.seen
        grid = tuple(ceil_count(axis, {"s": 4}) for axis in op.grid) + (1, 1)

        def steps(**kw):  # a body that never synchronises runs at its thread's first step
            body = fn(**kw)
            if body is not None:
                yield from body
        launch(steps, args, grid[:3], (tuple(op.block) + (1, 1, 1))[:3])
        for read in op.whole:
            numel = int(read.nbytes // program.dtypes()[read.buffer].itemsize)
            assert read.buffer in op.arg_slots and seen[read.buffer] == set(range(numel)), (op.entry, read)
            checked.add(program.kernel(op.kernel).kind)
    assert KernelKind.ROWS in checked
    program = _smollm2_layer(STORAGE_RECIPES["W4A16 INT4 group 128"])
    queue = build_queue(program)
    mega = render_megakernel(program, queue)
    readers = [(i, q) for i, q in enumerate(queue.ops) if q.recomputes is not None]
    assert len(readers) == 3  # the layer's two norms and the final norm
    for i, q in readers:
        body = next(op for op in mega.ops if op.queue_op == i and op.last)
        row = whole_reads(program).get(queue.ops[q.recomputes].kernel, ())
        assert row and set(row) <= set(body.whole)


@pytest.mark.parametrize("which", ["dequantize-on-load", "glu"])
def test_a_tile_prefetches_exactly_the_weight_bytes_its_body_reads(which):
    """Differential: the bytes of each stored part that block (0, b, 0) of the inlined body reads (found by
    running it in the interpreter) are the byte ranges its prefetch rows name, line for line."""
    _, program, mega = _w4a16_tiny()
    from luminal_num.codegen.cuda_gemm_epilogue import glu_offsets
    ops = [op for op, src in zip(mega.ops, mega.sources) if op.stream is not None and (
        src is None if which == "dequantize-on-load" else
        program.kernel(op.kernel).kind is KernelKind.GEMM_EPILOGUE and glu_offsets(program.kernel(op.kernel)))]
    assert ops
    op = ops[0]
    band = op.stream.bands - 1 if op.stream.bands > 1 else 0  # the last band: a short one where N_out % 16
    reads = _one_block_reads(mega, program, op, band)
    assert op.stream.bands > 1 and len(reads) == len(op.stream.parts) == 2  # int4 codes and their group scales
    for slot, seen in reads.items():
        w = program.kernel(next(u.kernel for u in mega.uses if u.slot == slot))
        fmt = STORAGE_FORMATS[w.storage]
        part = fmt.parts[next(u.part for u in mega.uses if u.slot == slot)]
        size = fmt.container(part).itemsize
        read_bytes = {i * size + b for i in seen for b in range(size)}
        ranges = [(begin, end) for p, begin, end in op.stream.tile_ranges(band)
                  if op.stream_slots[op.stream.parts.index(p)] == slot]
        prefetched = {b for begin, end in ranges for b in range(begin, end)}
        assert read_bytes == prefetched, (which, part, sorted(read_bytes ^ prefetched)[:4])
        read_lines = {b // 128 for b in read_bytes}
        prefetched_lines = {line for begin, end in ranges for line in range(begin // 128, -(-end // 128))}
        assert seen and read_lines == prefetched_lines, (which, part, sorted(read_lines ^ prefetched_lines)[:4])


def test_the_loop_table_recomputes_a_one_row_norm_in_its_gemv_tiles():
    """A one-token SmolLM2-shaped layer: the row ops the queue has its GEMVs recompute have no tiles in the
    loop's table; every launch of the reader names the row op's CudaOp and its buffer slot (redirected to
    the block's own copy), waits on no row op, and the source runs the recompute before the reader's body."""
    program = _smollm2_layer(STORAGE_RECIPES["W4A16 INT4 group 128"])
    queue = build_queue(program)
    mega = render_megakernel(program, queue)
    bindings = {}
    rows, waits = mega.table(queue, bindings)
    recomputed = {i for i, q in enumerate(queue.ops) if q.recomputed_by is not None}
    assert len(recomputed) == 3  # the layer's two norms and the final norm
    row_ops = {i for i, op in enumerate(mega.ops) if op.queue_op in recomputed}
    for i, (op, row) in enumerate(zip(mega.ops, rows)):
        q = queue.ops[op.queue_op]
        if op.queue_op in recomputed:
            assert row[2] == 0
        if q.recomputes is not None:
            assert row[16] in row_ops and mega.ops[row[16]].queue_op == q.recomputes
            assert row[17] == queue.ops[q.recomputes].kernel and row[17] in op.arg_slots
        else:
            assert (row[16], row[17]) == (-1, -1)
        assert not {w[0] for w in waits[row[11]:row[12]]} & row_ops
    assert mega.private_bytes(program, queue, bindings) == 576 * 4  # one FP32 hidden row
    loop = mega.source[mega.source.index(f"void __launch_bounds__({1024}) {ENTRY_NAME}("):]
    assert loop.index("ln_mk_run(ops[ops[current].recompute].body") < loop.index("ln_mk_run(ops[current].body")


def test_the_loop_table_has_fp8_gemvs_scale_a_in_their_staged_body_after_their_norm():
    """FP8 W8A8 one-token layer: every Gemm's A-scale CudaOp has no tiles and no reader waits on it; the body is the
    Gemm's `_staged` entry, which computes A's scales in its own pass over A (gemm_scales.staged_a_bytes): it names
    no second pass (scale_recompute, scale_slot -1) and reads no A-scale scratch; a body that also recomputes its
    norm runs the norm first (its staged pass reads the norm's copy), then itself. Nothing computes B's scales in
    the loop: the at-load launch's scratch is the slot the body reads."""
    program = _smollm2_layer(STORAGE_RECIPES["FP8 W8A8 dynamic per-token"])
    queue = build_queue(program)
    mega = render_megakernel(program, queue)
    rows, waits = mega.table(queue, {})
    scale_ops = {i for i, op in enumerate(mega.ops) if program.kernel(op.kernel).kind.is_gemm and not op.last}
    uses = {u.slot: u for u in mega.uses}
    both = scaled = 0
    for i, (op, row) in enumerate(zip(mega.ops, rows)):
        assert not {w[0] for w in waits[row[11]:row[12]]} & scale_ops
        if i in scale_ops:
            assert row[2] == 0 and mega.ops[i].entry.endswith("_scale0")
        elif queue.ops[op.queue_op].prologue:  # an FP8 projection (attention's own Gemms are not scaled)
            assert [p.staged for p in queue.ops[op.queue_op].prologue] == [True] and op.entry.endswith("_staged")
            assert (row[20], row[21]) == (-1, -1)
            scale0 = next(mega.ops[j].arg_slots[0] for j in scale_ops if mega.ops[j].kernel == op.kernel)
            assert uses[scale0].kernel == op.kernel and scale0 not in op.arg_slots  # its scales stay in shared memory
            assert [a.entry[-7:] for a in mega.sources[i].at_load] == ["_scale1"]
            scale1 = next(u.slot for u in mega.uses if u.kernel == op.kernel and u.index == 1)
            assert scale1 in op.arg_slots  # B's scales: the scratch the at-load launch wrote, read as it is
            both += row[16] >= 0
            scaled += 1
        else:
            assert (row[20], row[21]) == (-1, -1)
    assert both == 3 and scaled == 5  # QKV, O, gate-up, down, the LM head; 3 of them behind a recomputed norm
    assert mega.private_scale_bytes(queue, {}) == 0  # no second copy: the scales live in the body's shared memory
    loop = mega.source[mega.source.index(f"void __launch_bounds__({1024}) {ENTRY_NAME}("):]
    assert loop.index("ln_mk_run(ops[ops[current].recompute].body") < loop.index("ln_mk_run(ops[current].body")


# -- KV-cache rows streamed before the wait (codegen/cache_stream.py) --------------------------------------------

def _attention_block_reads(mega, program, op, row: int) -> dict[int, set[int]]:
    """Run block `row` of the inlined attention body in the interpreter on zero data; the element indices it read
    from each cache slot (the buffers its K and V inputs name)."""
    k = program.kernel(op.kernel)
    fn, params = compile_entry(mega.source, op.entry)
    caches = {program.kernel(k.inputs[s].buffer).id for s in (1, 3)}
    args, seen = {}, {}
    for name, slot in zip(params, op.arg_slots):
        buf = program.kernel(slot)
        values = np.zeros(max(buf.numel({}), 1))
        args[name] = seen[slot] = _recording(values, False) if slot in caches else Buffer(values, False)
    grid = tuple(ceil_count(axis, {}) for axis in op.grid) + (1, 1)

    def only(**kw):
        if kw["blockIdx"].x == row:
            yield from fn(**kw)
    launch(only, args, grid[:3], (tuple(op.block) + (1, 1, 1))[:3])
    return {slot: seen[slot].values.seen for slot in caches}


def test_an_attention_tile_prefetches_exactly_the_cache_bytes_its_body_reads():
    """Differential: a SmolLM2-shaped decode layer (9 query heads over 3 KV heads, a 64-row FP32 cache): the
    bytes of the K and V caches that block `row` of the inlined attention body reads (found by running it in the
    interpreter) are the spans the loop's table gives tile `row`, byte for byte and line for line, for a tile
    of the first and of the last KV head; the table's span rows are the declaration's, tile by tile."""
    program = _smollm2_layer(BF16_WEIGHTS | {"attn:flash_bf16"})
    queue = build_queue(program)
    mega = render_megakernel(program, queue)
    ops = [(i, op) for i, op in enumerate(mega.ops) if op.cache is not None]
    assert [program.kernel(op.kernel).kind for _, op in ops] == [KernelKind.ATTENTION]
    index, op = ops[0]
    rows, _ = mega.table(queue, {})
    spans = mega.cache_spans(queue, {})
    begin, per_tile = rows[index][18:20]
    assert per_tile == 2 and rows[index][2] == 9 and len(spans) == begin + 9 * per_tile
    for row in (0, 8):
        mine = spans[begin + row * per_tile:begin + (row + 1) * per_tile]
        assert mine == [(a, b, c, d, o.buffer) for o, a, b, c, d in op.cache.tile_spans(row, {})]
        reads = _attention_block_reads(mega, program, op, row)
        assert set(reads) == {slot for *_, slot in mine}
        for first, between, keys, per_key, slot in mine:
            size = program.kernel(slot).dtype.storage.itemsize
            read_bytes = {i * size + b for i in reads[slot] for b in range(size)}
            prefetched = {first + j * between + b for j in range(keys) for b in range(per_key)}
            assert read_bytes == prefetched, (row, slot, sorted(read_bytes ^ prefetched)[:4])
            lines = {b // 128 for b in prefetched}
            loop_lines = set()  # what the loop's line walk touches (megakernel_loop.LOOP), per key
            for j in range(keys):
                lo = first + j * between
                loop_lines |= {lo // 128 + q for q in range(-(-per_key // 128) + 1) if (lo // 128 + q) * 128 < lo + per_key}
            assert loop_lines == lines


def test_only_an_attention_reading_a_cache_streams_it():
    """A cache operand is the buffer of an in-place scatter over an EXTERNAL cache: MiniLM's attention (K and V
    computed this step) streams nothing; llama-tiny's 4-token prefill over its 8-row cache (2 KV heads of 16)
    streams K and V less the 4 rows of 32 its scatters write; the SmolLM2-shaped decode layer's less the one row
    of 192 (3 KV heads x 64 rows x 64 FP32 elements each)."""
    from luminal_num.models.registry import minilm_job
    job = minilm_job()
    space = SearchSpace.build(job.graph, fusion=True)
    encoder = space.program(pick(space, {"attn:flash_f32"}.__contains__))
    attention = [k for k in encoder.launched() if k.kind is KernelKind.ATTENTION]
    assert attention and all(cache_stream(k, encoder) is None for k in attention)
    job = llama_tiny_job(seq=4, layers=1)
    space = SearchSpace.build(job.graph, fusion=True)
    prefill = space.program(pick(space, {"attn:flash_f32"}.__contains__))
    (k,) = [k for k in prefill.launched() if k.kind is KernelKind.ATTENTION]
    assert cache_stream(k, prefill).bytes_streamed(job.graph.bind_symbols(job.calibration[0])) == 2 * 4 * (2 * 8 * 16 - 4 * 32)
    program = _smollm2_layer(BF16_WEIGHTS | {"attn:flash_bf16"})
    (k,) = [k for k in program.launched() if k.kind is KernelKind.ATTENTION]
    stream = cache_stream(k, program)
    assert [o.slot for o in stream.operands] == [1, 3]
    assert stream.bytes_streamed({}) == 2 * 4 * (3 * 64 * 64 - 192)


def test_the_runtime_tables_have_the_loops_struct_layouts():
    """The numpy records the runtime uploads (runtime/cuda_megakernel.py) name the loop's C struct fields in
    order, with C sizes (8 bytes for long long, 4 for int) and C alignment (align=True pads as C does)."""
    from luminal_num.codegen.megakernel_loop import LOOP
    from luminal_num.runtime.cuda_megakernel import OP_DTYPE, PREFETCH_DTYPE, SPAN_DTYPE, WAIT_DTYPE
    for struct, dtype in (("LnMkOp", OP_DTYPE), ("LnMkWait", WAIT_DTYPE), ("LnMkPrefetch", PREFETCH_DTYPE),
                          ("LnMkSpan", SPAN_DTYPE)):
        body = re.search(r"struct %s \{(.*?)\};" % struct, LOOP, re.S).group(1)
        fields = []
        for decl in body.split(";"):
            decl = decl.strip()
            if decl:
                ctype, names = re.match(r"(long long|int)\s+(.*)", decl).groups()
                fields += [(n.strip(), 8 if ctype == "long long" else 4) for n in names.split(",")]
        assert [(n, dtype.fields[n][0].itemsize) for n in dtype.names] == fields, struct
