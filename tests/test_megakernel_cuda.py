"""The megakernel's CUDA source: it compiles with NVRTC for sm_90, and each inlined op body, called with
the arguments the interpreter loop's switch passes it, computes what the CPU backend computes
(tests/cuda_interpreter.py runs the bodies single-threaded, or block by block where they synchronise)."""
from __future__ import annotations

import numpy as np
import pytest

from cuda_interpreter import Buffer, compile_entry, entry_body, launch
from luminal_num.codegen import nvrtc
from luminal_num.codegen.llir import KernelKind
from luminal_num.codegen.megakernel import build_queue
from luminal_num.codegen.megakernel_cuda import ENTRY_NAME, render_megakernel
from luminal_num.dtypes.formats import Kind
from luminal_num.hlir.symbolic import evaluate
from luminal_num.models.llama import build_decode, random_weights
from luminal_num.runtime.cpu import bind_program
from luminal_num.search.recipes import BF16_WEIGHTS, STORAGE_RECIPES, pick
from luminal_num.search.space import SearchSpace
from test_cuda_codegen import MODELS, needs_nvrtc, stored_values, tolerance
from test_megakernel import chain_program, feed

SMOLLM2_LAYER = None


def _transformer_program():
    model = next(m for name, m in MODELS.items() if name.startswith("transformer"))
    space = SearchSpace.build(model.graph)
    return space.program(()), {**model.graph.weights, **model.make_inputs(5)}


def _run_ops(mega, program, stored, bindings):
    """Every CudaOp's body from the megakernel source, with its switch's argument slots; returns
    kernel id -> its output as the body wrote it."""
    results, scratch_bufs = {}, {}
    for op, src in zip(mega.ops, mega.sources):
        k = program.kernel(op.kernel)
        fn, params = compile_entry(mega.source, op.entry)
        out = results.get(k.id)
        if out is None:
            first = stored[k.inputs[0].buffer] if k.kind.in_place else np.zeros(k.numel(bindings))
            out = results[k.id] = Buffer(np.array(first, dtype=np.float64).reshape(-1), k.dtype.kind is Kind.INT)
        args = {}
        scratch_slots = range(len(program.kernels), mega.slots)
        for name, slot in zip(params, op.arg_slots):
            if slot == k.id:
                args[name] = out
            elif slot in scratch_slots and name == "dyn_dims":
                args[name] = Buffer(np.asarray(src.dyn_values(bindings), dtype=np.float64), True)
            elif slot in scratch_slots:
                index = slot - min(s for s in op.arg_slots if s in scratch_slots)
                scratch_bufs.setdefault(slot, Buffer(np.zeros(src.scratch[index].numel(bindings)), False))
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
