"""The CUDA backend against the CPU backend (and FP64), on a GPU; without one only the error path runs.

Bit for bit where the semantics are exact (cuda_body.EXACT_OPS bodies, casts, gather/scatter,
narrow-accumulator reductions, the fallback Gemm's narrow/integer accumulators); elsewhere within the
envelope test_cuda_codegen.tolerance states; cuBLAS(Lt) Gemms within their variant's a-priori bound
against FP64. Run on a GPU machine with `pytest -m gpu tests/test_cuda_runtime.py`.
"""
from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

import numpy as np
import pytest

from luminal_num.codegen.cuda_kernels import gemm_call
from luminal_num.codegen.llir import KernelKind
from luminal_num.dtypes.formats import INT32, TF32
from luminal_num.dtypes.rounding import round_to
from luminal_num.dtypes.variants import GEMM_VARIANTS
from luminal_num.hlir import evaluate as evaluate_fp64
from luminal_num.runtime.buffers import plan_buffers
from luminal_num.runtime.cpu import CpuRuntime, bind_program
from luminal_num.runtime.cuda import CudaRuntime
from luminal_num.runtime import cuda_device
from luminal_num.runtime.cuda_device import CudaUnavailableError, cuda_available
from test_cuda_codegen import GEMMS, HAND_BUILT, MODELS, feed_for, gemm_cases, programs, stored_values, tolerance
from test_fp8_hardware_data import hopper_fp8_envelope

needs_gpu = pytest.mark.skipif(not cuda_available(), reason="no CUDA device")

K_ULPS = 2.0 ** -22  # per unit of K and of max |output|: FP32 sums in another order


@pytest.mark.skipif(cuda_available(), reason="a CUDA device is present")
def test_without_a_device_construction_says_why():
    with pytest.raises(CudaUnavailableError, match="no CUDA device available"):
        CudaRuntime(HAND_BUILT["const_bf16"])


def with_precision(program, name):
    return dataclasses.replace(program, kernels=program.kernels[:-1] + (
        dataclasses.replace(program.kernels[-1], precision=name),))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("case", sorted(HAND_BUILT))
def test_each_kernel_kind_matches_the_cpu_backend(case):
    program = HAND_BUILT[case]
    feed = feed_for(program, np.random.default_rng(3))
    ref = CpuRuntime(program).run(feed).outputs["y"]
    got = CudaRuntime(program).run(feed).outputs["y"]
    np.testing.assert_allclose(got, ref, rtol=0, atol=tolerance(program.kernels[-1], ref))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("gemm", ["auto", "kernel"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_whole_models_match_the_cpu_backend(name, gemm):
    """Every kernel checked one by one (inputs from the CPU backend), then the outputs end to end."""
    model = MODELS[name]
    inputs = model.make_inputs(5)
    for program in programs(name, 3):
        feed = {**model.graph.weights, **inputs}
        stored = stored_values(program, feed)
        bindings = bind_program(program, feed)
        cuda = CudaRuntime(program, model.graph.weights, gemm=gemm)
        result = cuda.run(inputs)
        assert result.plan == plan_buffers(program, bindings)
        assert {kid for kid, _ in result.kernel_seconds} == {k.id for k in program.launched()}
        assert all(s >= 0.0 and math.isfinite(s) for _, s in result.kernel_seconds)
        for out_name, kid in program.outputs:
            ref = stored[kid]
            envelope = 64 * 2.0 ** -24 * float(np.max(np.abs(ref)))  # test_pipeline's FP32 envelope
            np.testing.assert_allclose(result.outputs[out_name], ref, rtol=0, atol=envelope, err_msg=out_name)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("case", sorted(GEMMS))
def test_gemm_layouts_through_cublas_and_the_fallback(case):
    program, expressible = GEMMS[case]
    kernel = program.kernels[-1]
    feed = feed_for(program, np.random.default_rng(4))
    ref = CpuRuntime(program).run(feed).outputs["y"]
    atol = kernel.layout.k * K_ULPS * float(np.abs(ref).max())
    assert (gemm_call(kernel, program) is not None) == expressible
    for mode in ("auto", "kernel"):
        np.testing.assert_allclose(CudaRuntime(program, gemm=mode).run(feed).outputs["y"], ref, rtol=0, atol=atol)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("name", sorted(GEMM_VARIANTS))
def test_every_gemm_variant(name):
    """Fallback kernel: bit for bit with the CPU emulator where the accumulation order is defined (narrow
    or integer accumulators), else within K ulps. cuBLAS(Lt): within the variant's a-priori bound of FP64."""
    base, _ = GEMMS["batched_shared_weight"]
    program = with_precision(base, name)
    variant = GEMM_VARIANTS[name]
    feed = feed_for(program, np.random.default_rng(8))
    ref = CpuRuntime(program).run(feed).outputs["y"]
    kernel = program.kernels[-1]
    exact = variant.grouped or variant.acc_format is INT32
    got = CudaRuntime(program, gemm="kernel").run(feed).outputs["y"]
    atol = 0.0 if exact else kernel.layout.k * K_ULPS * float(np.abs(ref).max())
    np.testing.assert_allclose(got, ref, rtol=0, atol=atol)
    if gemm_call(kernel, program) is not None:
        a = np.asarray(feed["a"], dtype=np.float32).astype(np.float64)   # (3, M, K)
        b = np.asarray(feed["b"], dtype=np.float32).astype(np.float64)   # (K, N)
        exact64 = a @ b
        bound = variant.a_priori_bound(kernel.layout.k, np.abs(a) @ np.abs(b), np.abs(a).max(), np.abs(b).max())
        got = CudaRuntime(program, gemm="auto").run(feed).outputs["y"]
        assert np.all(np.abs(got - exact64) <= bound), name


@pytest.mark.gpu
@needs_gpu
def test_cuda_graph_replays_what_run_computes():
    """Capture once, replay twice: the same bits as an eager run (inputs re-staged where slots are reused)."""
    model = MODELS["transformer4"]
    program = programs("transformer4", 1)[0]
    inputs = model.make_inputs(1)
    cuda = CudaRuntime(program, model.graph.weights)
    eager = cuda.run(inputs).outputs
    state = cuda.capture(inputs)
    for _ in range(2):
        replayed = cuda.replay(state)
        for name in eager:
            np.testing.assert_array_equal(replayed[name], eager[name])
    seconds = cuda.profile(inputs, n=5, warmup=2)
    assert 0.0 < seconds < 1.0


@pytest.mark.gpu
@needs_gpu
def test_scatter_in_place_writes_only_its_rows_of_the_aliased_buffer():
    program = HAND_BUILT["scatter_in_place"]
    assert program.kernels[-1].kind is KernelKind.SCATTER_NOCOPY
    feed = feed_for(program, np.random.default_rng(9))
    got = CudaRuntime(program).run(feed).outputs["y"]
    expected = np.asarray(feed["d"], dtype=np.float32).astype(np.float64)
    expected[feed["i"]] = np.asarray(feed["s"], dtype=np.float32)
    np.testing.assert_array_equal(got, expected)


@pytest.mark.gpu
@needs_gpu
def test_fp64_reference_agrees_on_a_symbolic_model():
    """A symbolic-length model at a length it was not traced with: the GPU result against FP64."""
    model = MODELS["transformer1"]
    program = programs("transformer1", 1)[0]
    x = np.random.default_rng(2).standard_normal((5, 32))
    ref = evaluate_fp64(model.graph, {"x": x})["y"]
    got = CudaRuntime(program, model.graph.weights).run({"x": x}).outputs["y"]
    # twice test_pipeline's FP32 envelope: CUDA's exp2f/tanhf are 2-ulp functions, not correctly rounded
    assert np.max(np.abs(got - ref)) <= 128 * 2.0 ** -24 * float(np.max(np.abs(ref)))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("genome_kind", ["fp32", "tf32", "bf16"])
def test_minilm_end_to_end_on_the_gpu(genome_kind):
    """MiniLM's shapes (random weights and token ids: no weight files on the device): the CUDA run of a plan
    equals the CPU emulation of the same plan."""
    from luminal_num.search.space import SearchSpace
    from test_gpu_check import load_check_module
    graph, weights, batch = load_check_module().random_minilm()
    space = SearchSpace.build(graph)
    tag = {"fp32": None, "tf32": "gemm:tf32", "bf16": "gemm:bf16"}[genome_kind]
    genome = frozenset(c for c in space.all_changes() if c[2] == tag) if tag else frozenset()
    program = space.program(genome)
    cpu = CpuRuntime(program, weights).run(batch).outputs["embedding"]
    gpu = CudaRuntime(program, weights).run(batch).outputs["embedding"]
    cos = np.sum(cpu * gpu, axis=1) / (np.linalg.norm(cpu, axis=1) * np.linalg.norm(gpu, axis=1))
    assert np.all(cos >= 0.99999), cos.min()
    ref = evaluate_fp64(graph, batch)["embedding"]
    assert np.max(np.abs(gpu - ref)) <= 4 * max(np.max(np.abs(cpu - ref)), 1e-6)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("case", sorted(c for c, (_, ok) in gemm_cases(16, 16, 32).items() if ok))
def test_cublaslt_fp8_on_legal_shapes_runs_cublaslt_and_matches_the_cpu_backend(case):
    """K = 32, M = N = 16: cuBLASLt accepts the call (the heuristic finds an algorithm and no fallback
    runs); the result is the CPU emulator's within the Hopper FP8 accumulator's envelope (the tensor cores
    do not accumulate E4M3 products in FP32: tests/test_fp8_hardware_data.py, measured on an H200)."""
    program, _ = gemm_cases(16, 16, 32, "f8e4m3_tensor")[case]
    kernel = program.kernels[-1]
    call = gemm_call(kernel, program).bind({})
    assert call.api == "cublasLt" and call.legal()
    feed = feed_for(program, np.random.default_rng(13))
    ref = CpuRuntime(program).run(feed).outputs["y"]
    cuda = CudaRuntime(program)
    got = cuda.run(feed).outputs["y"]
    assert [plan.algo is not None for plan in cuda.lt.plans.values()] == [True]
    largest = float(np.max(np.abs(feed["a"]))) * float(np.max(np.abs(feed["b"])))  # >= every |a_ij b_jk|
    np.testing.assert_allclose(got, ref, rtol=0, atol=float(hopper_fp8_envelope(32, np.float64(largest))))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("precision", ["f32", "tf32", "bf16", "f8e4m3_tensor"])
def test_graph_replay_of_cublas_and_cublaslt_gemms_is_the_eager_run(precision):
    """Capture goes through the same handle, stream and workspace as the eager run: the same bits."""
    program, _ = gemm_cases(16, 16, 32, precision)["batched_shared_weight"]
    feed = feed_for(program, np.random.default_rng(14))
    cuda = CudaRuntime(program)
    eager = cuda.run(feed).outputs["y"]
    state = cuda.capture(feed)
    for _ in range(2):
        np.testing.assert_array_equal(cuda.replay(state)["y"], eager)


TF32_ROUNDINGS = ("rne", "rna", "trunc", "none")


def tf32_candidates(a: np.ndarray) -> dict[str, np.ndarray]:
    """A rounded to TF32 each way a device may: nearest even (the project's), ties away, truncation; or
    not at all (an FP32 path)."""
    bits = a.astype(np.float32).view(np.uint32)
    low = np.uint32(0x1FFF)
    return {"rne": round_to(a, TF32), "rna": ((bits + np.uint32(0x1000)) & ~low).view(np.float32),
            "trunc": (bits & ~low).view(np.float32), "none": a.astype(np.float32)}


@pytest.mark.gpu
@needs_gpu
def test_probe_which_tf32_operand_rounding_cublas_applies():
    """C = A @ I under the TF32 variant (cuBLAS, CUBLAS_COMPUTE_32F_FAST_TF32) with A = +-(1 + j 2^-13):
    every output is one operand as the tensor cores read it, so C names the rounding (j = 4 is a tie,
    j = 5..7 lie above it). Reported (stdout, and $OUT/tf32_rounding.txt when OUT is set); the variant's
    bound must cover it whatever it is (tests/test_tf32_rounding.py checks all of them)."""
    program, _ = gemm_cases(16, 16, 64, "tf32")["batched_shared_weight"]
    kernel = program.kernels[-1]
    assert gemm_call(kernel, program) is not None  # the variant goes to cuBLAS
    j = np.arange(3 * 16 * 64).reshape(3, 16, 64) % 16
    a = ((1.0 + j * 2.0 ** -13) * np.where(j % 3 == 0, -1.0, 1.0)).astype(np.float32)
    feed = {"a": a, "b": np.eye(64, 16, dtype=np.float32)}
    got = CudaRuntime(program, gemm="auto").run(feed).outputs["y"].astype(np.float32)
    seen = a[:, :, :16]
    matches = [name for name, rounded in tf32_candidates(seen).items() if np.array_equal(got, rounded)]
    line = f"tf32 operand rounding of cuBLAS on {cuda_device.device_name()}: {matches or 'none of ' + str(TF32_ROUNDINGS)}"
    print(line)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "tf32_rounding.txt").write_text(line + "\n")
    assert len(matches) == 1, line
    variant = GEMM_VARIANTS["tf32"]
    bound = variant.a_priori_bound(64, np.abs(seen).astype(np.float64), float(np.abs(a).max()), 1.0)
    assert np.all(np.abs(got.astype(np.float64) - seen) <= bound)
