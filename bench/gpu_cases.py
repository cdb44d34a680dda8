"""The programs the device stages time (scripts/gpu_stages.py kernels), rebuilt identically anywhere.

Why shared: the per-kernel table recorded on a GPU names kernels by id; `bench.gpu_calibration` rebuilds
the same programs here (same seeds, genomes and shapes) to read each kernel's work (bytes, flops, tiles,
serial extent) beside its measured time. MiniLM: all-MiniLM-L6-v2's shapes with seeded random weights
(scripts/gpu_check.py); SmolLM2: a 135M-shaped decode step, 30 layers, random weights, `CONTEXT` cached
rows, under every genome of bench/fusion.py.
"""
from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from luminal_num.codegen.cuda_dispatch import GemmImpl
from luminal_num.codegen.llir import KernelKind, Program
from luminal_num.hlir.symbolic import evaluate
from luminal_num.models.llama import build_decode, random_weights
from luminal_num.runtime.cost import KernelWork
from luminal_num.runtime.latency import kernel_works, serial_extent
from luminal_num.search.recipes import pick
from luminal_num.search.space import SearchSpace
from .fusion import GENOMES
from .storage_decode import SMOLLM2

CONTEXT = 256
MINILM_PLANS = ("fp32", "bf16", "fp8")


def gpu_check_module():
    """scripts/gpu_check.py (random MiniLM, the plans' genomes) imported by path: scripts/ is no package."""
    path = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def smollm2_step(layers: int = SMOLLM2.num_hidden_layers, context: int = CONTEXT):
    """(graph, weights, inputs, space) of one decode step at `context` cached rows, random weights and caches."""
    config = SMOLLM2.with_layers(layers)
    model = build_decode(config, random_weights(config), context + 1)
    rng = np.random.default_rng(1)
    inputs = model.make_inputs([3], [context])
    caches = [name for name in inputs if "cache" in name]
    if not caches:
        raise AssertionError("the decode step takes no KV cache input")
    for name in caches:  # a filled cache: context rows of O(1) keys and values
        inputs[name] = rng.standard_normal(inputs[name].shape).astype(np.float32)
    return model.graph, model.graph.weights, inputs, SearchSpace.build(model.graph, fusion=True)


def genome_program(space: SearchSpace, label: str):
    return space.program(pick(space, GENOMES[label].__contains__))


def device_cases():
    """(model, plan, program, weights, inputs) of every program the kernels stage times, in its order."""
    check = gpu_check_module()
    graph, weights, batch = check.random_minilm()
    space = SearchSpace.build(graph)
    for plan in MINILM_PLANS:
        yield "minilm", plan, space.program(check.plan_genome(space, plan)), weights, batch
    _, step_weights, step_inputs, step_space = smollm2_step()
    for label in GENOMES:
        yield "smollm2-decode", label, genome_program(step_space, label), step_weights, step_inputs


# what the current code runs where the 2026-12-04 recording ran the sequential SIMT tiled kernel
RAN_AS_TILED = frozenset(i.value for i in (GemmImpl.TILED_DECODE, GemmImpl.TILED_STORED, GemmImpl.TILED_STORED_DECODE,
                                           GemmImpl.TENSOR_CORE, GemmImpl.TENSOR_CORE_STORED, GemmImpl.CUBLASLT_BIAS))


def recorded_works(program: Program, bindings: Mapping[str, int], recorded: Mapping[int, str]) -> list[KernelWork]:
    """kernel_works of `program` as a recorded device run executed it (`recorded`: kernel id -> the
    implementation the recording names). The H200 recording of 2026-12-04 predates the tiled Gemm's decode
    path (codegen/cuda_gemv.py): a Gemm the current code runs there (tiled_decode) ran the sequential tiled
    kernel in it, so its work is that kernel's (class tiled, serial extent K). It predates stored reads too: a
    Gemm on a stored weight (tiled_stored, its decode path) ran the sequential tiled kernel on the FP32 widening,
    and every reader of a stored weight was charged its stored bytes, and the tensor-core kernel
    (codegen/cuda_gemm_tc.py) and cuBLASLt's bias epilogue (codegen/cuda_gemm_bias.py): a fused Gemm ran the tiled
    kernel on CUDA cores. The work is what the fit was
    made with. It also predates the chunked
    attention kernel (codegen/cuda_attention.py): the attention it timed walked the whole key axis per output,
    so its serial extent is the key length, as the fit was made. Any other disagreement is not the same
    program: refused."""
    works = []
    # the recording predates stored reads: every reader of a stored weight was charged its stored bytes (what the
    # fit was made with), and a Gemm now reading the stored parts (tiled_stored, its decode path) ran the
    # sequential tiled kernel on the FP32 widening
    stored_bytes, dtypes = program.element_bytes(bindings), program.dtypes()
    side = {k.id: k.scales_bytes(bindings) for k in program.kernels if k.kind is KernelKind.QUANTIZE}
    for k, work in zip(program.launched(), kernel_works(program, bindings)):
        was = recorded[k.id]
        work = dataclasses.replace(work, bytes_read=k.bytes_loaded(bindings, dtypes, stored_bytes)
                                   + sum(side.get(i.buffer, 0) for i in k.inputs))
        if work.implementation in RAN_AS_TILED and was == GemmImpl.TILED.value:
            work = dataclasses.replace(work, implementation=was, serial_extent=serial_extent(k, bindings, GemmImpl.TILED),
                                       math="fp32", tensor_core=False)
        elif k.kind is KernelKind.ATTENTION and was == work.implementation:
            work = dataclasses.replace(work, serial_extent=int(evaluate(k.body_shape[-1], bindings)))
        elif work.implementation != was:
            raise ValueError(f"kernel {k.id}: recorded {was}, rebuilt {work.implementation}: not the same program")
        works.append(work)
    return works
