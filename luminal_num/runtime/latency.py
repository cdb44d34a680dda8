"""Latency of an LLIR program kernel by kernel: modelled (roofline, runtime/cost.py) for GPU targets, measured
for `cpu` (runtime/launch_form.py prices the megakernel form beside it and picks).

Each launched kernel becomes a `KernelWork`: bytes it loads and stores, flops, the math mode its
flops run in and its tiles (codegen/blockops.py), which the model quantizes into waves over the SMs.
A Gemm is priced by the implementation the CUDA runtime launches for it (codegen/cuda_dispatch.py, the
one decision both read): a cuBLAS(Lt) call (cuBLASLt's bias epilogue included: FP32 on CUDA cores for an FP32
variant, as plain cuBLAS FP32) and the tensor-core kernel (fused epilogues and scaled
variants it reproduces: codegen/cuda_gemm_tc.py) in the variant's operand math on tensor cores; the
dequantize-on-load and the tiled kernels (FP32, narrow-accumulator and K-scaled variants, the decode path,
every form on a stored weight, batch-invariant programs) in FP32 on CUDA cores. Everything else is FP32
on CUDA cores.
"""
from __future__ import annotations

from typing import Mapping

import numpy as np

from ..codegen.blockops import tile_count
from ..codegen.cuda_attention import serial_steps as attention_serial_steps
from ..codegen.cuda_dispatch import GemmImpl, gemm_implementation, kernel_implementation
from ..codegen.cuda_gemv import decode_serial_steps
from ..codegen.llir import Kernel, KernelKind, Program
from ..hlir.symbolic import evaluate
from ..dtypes.variants import GEMM_VARIANTS
from .cpu import CpuRuntime
from .cost import KernelWork, LaunchForm, Latency, model_latency
from .targets import LaunchConstants
from ..codegen.attention import ATTENTION_VARIANTS
from .targets import OPERAND_MATH, gemm_math


def serial_extent(k: Kernel, bindings: Mapping[str, int], implementation: GemmImpl | None = None) -> int:
    """The steps one block of `k` runs in order over the reduced axis: a Gemm's K (the tiled kernel's
    sequential path; the decode path's per-row K / 16 lanes plus its tree, over its M rows: cuda_gemv), an
    attention row's share of its score dots and its (V column, split) walks (cuda_attention.serial_steps), a
    reduction's axis; 0 when none."""
    if k.kind.is_gemm:
        if implementation is not None and implementation.decode_path:
            return decode_serial_steps(int(evaluate(k.layout.m, bindings)), int(evaluate(k.layout.k, bindings)))
        return int(evaluate(k.layout.k, bindings))
    if k.kind is KernelKind.ATTENTION:  # a block per score row: its chunked walk (codegen/cuda_attention.py)
        return attention_serial_steps(k.value, int(evaluate(k.body_shape[-1], bindings)),
                                      int(evaluate(k.inputs[0].view.shape[-1], bindings)),
                                      int(evaluate(k.shape[-1], bindings)))
    if k.axis is not None and k.body_shape:
        return int(evaluate(k.body_shape[k.axis], bindings))
    return 0


def kernel_works(program: Program, bindings: Mapping[str, int], form: LaunchForm = LaunchForm.KERNELS) -> list[KernelWork]:
    """A QUANTIZE kernel runs on CUDA cores in FP32 (amax, divide, convert); a Gemm reading its buffer
    also reads the scales kept beside it. A weight held in a storage format is priced as the runtime reads
    it, in either form: at its stored bytes by a Gemm reading its stored parts (GemmImpl.reads_stored:
    every Gemm form on a weight it reads whole, as W^T or W), at its widened dtype by any other reader
    (an embedding Gather, a Gemm reading the weight through another view), which the CUDA runtime hands
    the widened copy. `form`: in the megakernel (runtime/cuda_megakernel.py) a Gemm that is not dequantize-on-load runs
    its tiled body (a library call or the tensor-core kernel cannot be inlined; on a stored weight, the tiled body
    reading its parts), on the path that body takes at these bindings."""
    dtypes = program.dtypes()
    scales = {k.id: k.scales_bytes(bindings) for k in program.kernels if k.kind is KernelKind.QUANTIZE}
    element_bytes = program.element_bytes(bindings)  # weights held in a storage format: their stored bytes
    # what a kernel not reading stored parts is charged: KV caches (and the scatters writing them) at their
    # format's bytes as before; stored weights at their widened dtype (left out: the buffer's dtype is charged)
    weights = stored_weights(program)
    other_reader = {b: v for b, v in element_bytes.items() if b not in weights}
    works = []
    for k in program.launched():
        math, tc = "fp32", False
        implementation = None
        if k.kind.is_gemm:
            implementation = gemm_implementation(k, program, bindings)
            if form is LaunchForm.MEGAKERNEL and implementation.tensor_cores:  # the megakernel inlines the tiled body
                implementation = kernel_implementation(k, program, bindings, tensor_core=False)
        if implementation is not None and implementation.tensor_cores:
            math, tc = gemm_math(GEMM_VARIANTS[k.precision or "f32"])
        elif k.kind is KernelKind.ATTENTION:  # its two products run in the Q K^T operand format
            math, tc = OPERAND_MATH[ATTENTION_VARIANTS[k.precision].qk.name]
        side = sum(scales.get(inp.buffer, 0) for inp in k.inputs)
        read_as = element_bytes if implementation is not None and implementation.reads_stored else other_reader
        works.append(KernelWork(name=f"k{k.id}:{k.label}", bytes_read=k.bytes_loaded(bindings, dtypes, read_as) + side,
                                bytes_written=k.bytes_stored(bindings), flops=k.flops(bindings), math=math,
                                tensor_core=tc, tiles=tile_count(k, bindings, inlined=form is LaunchForm.MEGAKERNEL),
                                implementation=implementation.value if implementation is not None else k.kind.value,
                                serial_extent=serial_extent(k, bindings, implementation)))
    return works


def stored_weights(program: Program) -> frozenset[int]:
    """EXTERNAL weights held in a storage format (KV caches, runtime inputs converted on entry, are not)."""
    caches = program.cache_buffers()
    return frozenset(k.id for k in program.kernels
                     if k.kind is KernelKind.EXTERNAL and k.storage is not None and k.id not in caches)


def modelled_latency(program: Program, target: str, bindings: Mapping[str, int], cuda_graph: bool = True,
                     launch: LaunchConstants | None = None) -> Latency:
    """`launch`: other launch constants than the target's (bench/launch_model.py shows the old ones)."""
    return model_latency(kernel_works(program, bindings), target, cuda_graph=cuda_graph, launch=launch)


def measured_cpu_latency(program: Program, weights, inputs, repeats: int = 3) -> Latency:
    """Median wall time of the CPU backend's kernels over `repeats` runs (the `cpu` target)."""
    rt = CpuRuntime(program, weights)
    runs = [rt.run(inputs) for _ in range(repeats)]
    totals = [r.total_seconds for r in runs]
    best = runs[int(np.argsort(totals)[len(totals) // 2])]
    return Latency(total_s=float(np.median(totals)), per_kernel=tuple((f"k{i}", s) for i, s in best.kernel_seconds),
                   source="measured", target="cpu", cuda_graph=False)
