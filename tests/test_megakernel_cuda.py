"""The megakernel's CUDA source: it compiles with NVRTC for sm_90, and each inlined op body, called with
the arguments the interpreter loop's switch passes it, computes what the CPU backend computes
(tests/cuda_interpreter.py runs the bodies single-threaded, or block by block where they synchronise)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from cuda_interpreter import Buffer, compile_entry, entry_body, launch
from luminal_num.codegen import nvrtc
from luminal_num.codegen.llir import KernelKind
from luminal_num.codegen.megakernel import build_queue
from luminal_num.codegen.cuda_weight_only import stored_operand, weight_only_gemm
from luminal_num.codegen.megakernel_cuda import ENTRY_NAME, render_megakernel
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
    for op, src in zip(mega.ops, mega.sources):
        if only is not None and op.kernel not in only:
            continue
        k = program.kernel(op.kernel)
        fn, params = compile_entry(mega.source, op.entry)
        out = results.get(k.id)
        if out is None:
            first = stored[k.inputs[0].buffer] if k.kind.in_place else np.zeros(k.numel(bindings))
            out = results[k.id] = Buffer(np.array(first, dtype=np.float64).reshape(-1), k.dtype.kind is Kind.INT)
        args = {}
        for name, slot in zip(params, op.arg_slots):
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
        if "__syncthreads" in entry_body(mega.source, op.entry)[1]:
            grid = tuple(min(-(-evaluate(d, bindings) // per), 65535) for axis in op.grid for d, per in axis)
            launch(fn, args, (grid + (1, 1, 1))[:3], (tuple(op.block) + (1, 1, 1))[:3])
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
        assert f"{op.entry}(" in line and all(f"bufs[{s}]" in line for s in op.arg_slots)
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
@pytest.mark.parametrize("genome", ["FP32", "BF16 + fused attention", "W4A16 INT4 group 128"])
def test_megakernel_compiles_with_nvrtc_for_sm90(genome):
    tags = {"FP32": frozenset(), "BF16 + fused attention": BF16_WEIGHTS | {"attn:flash_bf16"},
            "W4A16 INT4 group 128": STORAGE_RECIPES["W4A16 INT4 group 128"]}[genome]
    program = _smollm2_layer(tags)
    queue = build_queue(program)
    mega = render_megakernel(program, queue)
    compiled = nvrtc.compile_cuda(mega.source, mega.name, "sm_90")
    assert compiled.cubin and f".entry {ENTRY_NAME}" in compiled.ptx
    kinds = {program.kernel(op.kernel).kind for op in mega.ops}
    assert KernelKind.ROWS in kinds and any(k.is_gemm for k in kinds)
    if "attention" in genome:
        assert KernelKind.ATTENTION in kinds
    if genome != "FP32":  # the Gemms over stored weights inline the dequantize-on-load body
        assert any(src is None for src in mega.sources)
