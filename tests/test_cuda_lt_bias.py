"""cuBLASLt's bias epilogue (codegen/cuda_gemm_bias.py) for FP32-output `acc + bias along N` Gemm epilogues, no GPU:
which kernels take it and why the others do not, the call's attributes against cublasLt.h, and the recording
stand-in (tests/fake_cuda.py, computing cublasLtMatmul with numpy: FP32 product, + FP32 bias, one rounding)
against the CPU backend, independently of the CUDA interpreter (no NVRTC entry runs for such a Gemm)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import luminal_num.runtime.cuda as cuda_module
from fake_cuda import ATTR, EPILOGUE_BIAS, FakeCublasLtLib, Recorder, install
from luminal_num.codegen import nvrtc
from luminal_num.codegen.cuda_dispatch import GemmImpl, gemm_implementation, library_refusal
from luminal_num.codegen.gemm_scales import variant_of
from luminal_num.codegen.cuda_gemm_bias import BIAS_SLOT, bias_refusal
from luminal_num.codegen.cuda_gemm_call import geometry
from luminal_num.codegen.cuda_kernels import input_formats, render_kernel
from luminal_num.codegen.cuda_source import Arg
from luminal_num.codegen.llir import KernelInput, KernelKind
from luminal_num.dtypes.formats import BF16, F32
from luminal_num.hlir import Graph
from luminal_num.hlir.shape import ShapeTracker
from luminal_num.models.testnets import mlp
from luminal_num.runtime import cublas, cuda_device
from luminal_num.runtime.cpu import CpuRuntime, bind_program
from luminal_num.runtime.cuda import CudaRuntime
from luminal_num.runtime.kernel_classes import DERIVED_CLASSES
from luminal_num.runtime.latency import kernel_works
from luminal_num.search.space import SearchSpace
from test_cuda_codegen import needs_nvrtc

pytestmark = needs_nvrtc
TAGS = {"fp32": None, "tf32": "gemm:tf32", "bf16": "gemm:bf16"}


def bias_graph(batch: int = 2, seq: int = 16, d: int = 384, n: int = 384, integers: bool = False, seed: int = 0):
    """MiniLM's q/k/v projection: x (batch, seq, d) @ W (d, n) + b. `integers`: small integer weights and inputs,
    so every product, sum and the bias add are exact in FP32 whatever the summation order."""
    rng = np.random.default_rng(seed)
    g = Graph()
    x = g.input("x", (batch, seq, d))
    if integers:
        w, b = rng.integers(-3, 4, (d, n)).astype(np.float64), rng.integers(-50, 51, n).astype(np.float64)
        feed = {"x": rng.integers(-3, 4, (batch, seq, d)).astype(np.float64)}
    else:
        w, b = rng.standard_normal((d, n)) / np.sqrt(d), 0.1 * rng.standard_normal(n)
        feed = {"x": rng.standard_normal((batch, seq, d))}
    g.output(x @ g.weight("w", w) + g.weight("b", b), "y")
    return g, feed


def program_of(graph, plan: str = "fp32", invariant: bool = False):
    space = SearchSpace.build(graph).with_batch_invariance(invariant)
    tag = TAGS[plan]
    return space.program(frozenset(c for c in space.all_changes() if c[2] == tag) if tag else frozenset())


def epilogues(program):
    return [k for k in program.launched() if k.kind is KernelKind.GEMM_EPILOGUE]


@pytest.fixture
def fake(monkeypatch, tmp_path):
    rec = Recorder()
    monkeypatch.setenv(nvrtc.CACHE_ENV, str(tmp_path))
    libs = install(monkeypatch, rec, cuda_module, cuda_device)
    enqueue, states = CudaRuntime._enqueue_kernel, []

    def marking(self, state, k):  # where each kernel's device work starts in the log; the state it runs in
        rec.record("kernel", 0, id=k.id)
        states[:] = [state]
        return enqueue(self, state, k)
    monkeypatch.setattr(CudaRuntime, "_enqueue_kernel", marking)
    yield rec, libs, states
    cuda_device.probe.cache_clear()


def events_of(rec: Recorder, kid: int) -> list[dict]:
    out, inside = [], False
    for event in rec.log:
        if event["op"] == "kernel":
            inside = event["id"] == kid
        elif inside:
            out.append(event)
    return out


# -- which kernels take it ---------------------------------------------------------------------------------

@pytest.mark.parametrize("plan", sorted(TAGS))
def test_a_plain_bias_epilogue_takes_cublaslt_and_the_others_name_their_refusal(plan):
    """The mlp test net (+ bias, then tanh-GELU + bias) and the bias Gemm: exactly the `acc + bias` epilogues with
    an FP32 output run GemmImpl.CUBLASLT_BIAS, at prefill and decode M, in FP32, TF32 and BF16 operand math."""
    for graph, feed in (bias_graph(), bias_graph(batch=1, seq=2), (mlp().graph, mlp().make_inputs(0))):
        program = program_of(graph, plan)
        bindings = bind_program(program, {**graph.weights, **feed})
        kinds = set()
        for k in epilogues(program):
            refused, impl = library_refusal(k, program), gemm_implementation(k, program, bindings)
            assert (impl is GemmImpl.CUBLASLT_BIAS) == (refused is None), (plan, k.id, refused, impl)
            kinds.add(refused.split(":")[0] if refused else impl.value)
        if graph.weights.keys() >= {"w1", "w2"}:  # mlp: the first Gemm's body is (acc + b1) then GELU
            assert kinds == {"cublasLt_bias", "a GELU epilogue"}, kinds
        else:
            assert kinds == {"cublasLt_bias"}


def test_a_batch_invariant_program_keeps_the_tiled_kernel():
    graph, feed = bias_graph()
    program = program_of(graph, invariant=True)
    bindings = bind_program(program, {**graph.weights, **feed})
    (k,) = epilogues(program)
    assert "batch-invariant" in library_refusal(k, program)
    assert render_kernel(k, program).gemm is None and gemm_implementation(k, program, bindings) is GemmImpl.TILED


def test_bf16_output_residual_and_a_bias_along_m_are_refused_in_one_line():
    """What cuBLASLt would compute differently: a BF16 D rounds the bias to BF16 first; a second operand (residual)
    has no epilogue; a vector along M (what D's columns are) would need a transpose."""
    graph, _ = bias_graph(seq=8, d=32, n=16)
    program = program_of(graph)
    (k,) = epilogues(program)
    formats = input_formats(k, program)
    variant, geo = variant_of(k), geometry(k)
    assert bias_refusal(k, variant, formats, geo) is None
    refusals = {
        "bf16": bias_refusal(dataclasses.replace(k, dtype=BF16), variant, formats, geo),
        "bias_bf16": bias_refusal(k, variant, (*formats[:2], BF16), geo),
        "residual": bias_refusal(dataclasses.replace(k, inputs=(*k.inputs, k.inputs[BIAS_SLOT])), variant,
                                 (*formats, F32), geo),
        "along_m": bias_refusal(dataclasses.replace(k, inputs=(*k.inputs[:2], KernelInput(
            k.inputs[BIAS_SLOT].buffer, ShapeTracker.contiguous((2, 8)).expand_dim(2, 16)))), variant, formats, geo),
        "plain": bias_refusal(dataclasses.replace(k, kind=KernelKind.GEMM), variant, formats[:2], geo)}
    assert "output bf16" in refusals["bf16"] and "bias bf16" in refusals["bias_bf16"]
    assert "residual" in refusals["residual"] and "along M" in refusals["along_m"]
    assert "no epilogue" in refusals["plain"]
    assert all("\n" not in r for r in refusals.values())


# -- the call and its attributes ----------------------------------------------------------------------------

def test_the_call_carries_the_header_values_and_the_descriptor_sets_them():
    """cublasLt.h: CUBLASLT_MATMUL_DESC_EPILOGUE = 7 (uint32), _BIAS_POINTER = 8, _BIAS_BATCH_STRIDE = 10 (int64),
    _BIAS_DATA_TYPE = 26 (int32, CUDA_R_32F = 0), CUBLASLT_EPILOGUE_BIAS = 4 (test_cuda_headers.py reads the header
    for every name in cublas.ENUMS); the call maps C = A B to C^T = B^T A^T: D's rows are N, the bias's length."""
    graph, _ = bias_graph()
    program = program_of(graph)
    (k,) = epilogues(program)
    call = render_kernel(k, program).gemm.bind({})
    assert (call.api, call.epilogue, call.bias_type) == ("cublasLt", "CUBLASLT_EPILOGUE_BIAS", "CUDA_R_32F")
    assert call.bias == Arg("in", BIAS_SLOT, k.inputs[BIAS_SLOT].buffer)
    # batched (2 x 16 rows): one bias vector for every batch (BIAS_BATCH_STRIDE 0), W shared (batch stride 0)
    assert (call.m, call.n, call.k, call.batch) == (384, 16, 384, 2) and call.a.buffer == k.inputs[1].buffer
    assert call.a_scale is None and call.prologue == () and call.legal()
    values = {n: cublas.ENUMS[n] for n in ("CUBLASLT_MATMUL_DESC_EPILOGUE", "CUBLASLT_MATMUL_DESC_BIAS_POINTER",
                                           "CUBLASLT_MATMUL_DESC_BIAS_BATCH_STRIDE", "CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE",
                                           "CUBLASLT_EPILOGUE_BIAS")}
    assert list(values.values()) == [7, 8, 10, 26, 4]
    lt = FakeCublasLtLib(Recorder())
    desc, _ = cublas.describe(lt, call)
    cublas.set_bias(lt, desc, 0x5000)
    assert {a: v for a, v in lt.attributes[desc.value].items() if a not in (ATTR["TRANSA"], ATTR["TRANSB"])} == \
        {7: 4, 26: 0, 10: 0, 8: 0x5000}


# -- the stand-in computes it ----------------------------------------------------------------------------------

@pytest.mark.parametrize("integers", [True, False], ids=["exact_data", "random_data"])
def test_the_stand_in_runs_the_bias_gemm_as_the_cpu_backend_without_nvrtc(fake, integers):
    """MiniLM's projection shape (32 x 384 @ 384 x 384 + b): one cublasLtMatmul with the bias epilogue, no kernel
    launched for it; equal to the CPU backend bit for bit on exact data, within the FP32 bound on random data."""
    rec, _, states = fake
    rec.execute = True
    graph, feed = bias_graph(integers=integers)
    program = program_of(graph)
    (k,) = epilogues(program)
    cpu = CpuRuntime(program, graph.weights).run(feed).outputs["y"]
    cuda = CudaRuntime(program, graph.weights)
    got = cuda.run(feed).outputs["y"]
    events = events_of(rec, k.id)
    gemms = [e for e in events if e["op"] == "gemm"]
    assert [(g["api"], g["epilogue"], g["bias_type"]) for g in gemms] == [("cublasLt", EPILOGUE_BIAS, 0)]
    state = states[0]
    assert gemms[0]["bias"] == state.slots[state.plan.slot_of[k.inputs[BIAS_SLOT].buffer]].data.ptr
    assert not [e for e in events if e["op"] == "launch"]  # a library call: nothing compiled or launched
    if integers:
        np.testing.assert_array_equal(got, cpu)
    else:  # K = 384 FP32 products in any order: within K * 2^-24 * sum |a||b| (+ the bias add's rounding)
        x, w = feed["x"].astype(np.float32), graph.weights["w"].astype(np.float32)
        bound = 384 * 2.0 ** -24 * (np.abs(x) @ np.abs(w)) + 2.0 ** -23 * np.abs(cpu)
        assert np.all(np.abs(got - cpu) <= 2 * bound)


def test_not_supported_runs_the_kernel_the_dispatch_would_otherwise_pick(fake):
    """A heuristic with no algorithm for the bias call: the runtime launches kernel_implementation's kernel (FP32:
    the tiled one) and gets the same values."""
    rec, libs, _ = fake
    libs["cublaslt"] = FakeCublasLtLib(rec, heuristic_results=0)
    rec.execute = True
    graph, feed = bias_graph(seq=4, d=32, n=16, integers=True)
    program = program_of(graph)
    (k,) = epilogues(program)
    got = CudaRuntime(program, graph.weights).run(feed).outputs["y"]
    events = events_of(rec, k.id)
    assert not [e for e in events if e["op"] == "gemm"]
    assert [e["entry"] for e in events if e["op"] == "launch"] == [e.entry for e in render_kernel(k, program).launches]
    np.testing.assert_array_equal(got, CpuRuntime(program, graph.weights).run(feed).outputs["y"])


# -- the cost model -----------------------------------------------------------------------------------------------

def test_the_cost_model_prices_it_as_the_library_call_with_the_bias_bytes():
    graph, feed = bias_graph()
    program = program_of(graph)
    (k,) = epilogues(program)
    bindings = bind_program(program, {**graph.weights, **feed})
    (work,) = [w for w, kk in zip(kernel_works(program, bindings), program.launched()) if kk.id == k.id]
    assert (work.implementation, work.math, work.tensor_core) == ("cublasLt_bias", "fp32", False)
    assert work.bytes_read == 4 * (32 * 384 + 384 * 384 + 384) and DERIVED_CLASSES["cublasLt_bias"] == "cublas"
    bf16 = program_of(graph, "bf16")
    (kb,) = epilogues(bf16)
    (work,) = [w for w, kk in zip(kernel_works(bf16, bindings), bf16.launched()) if kk.id == kb.id]
    assert work.implementation == "cublasLt_bias" and work.tensor_core


def test_the_real_cublaslt_accepts_the_bias_descriptor_without_a_device():
    """Host-side: the wheel's libcublasLt checks each attribute's id and size (INVALID_VALUE otherwise)."""
    try:
        lt = cublas.load_libraries().cublaslt
    except cuda_device.CudaUnavailableError as e:
        pytest.skip(str(e))
    graph, _ = bias_graph()
    program = program_of(graph)
    (k,) = epilogues(program)
    desc, layouts = cublas.describe(lt, render_kernel(k, program).gemm.bind({}))
    cublas.set_bias(lt, desc, 0x5000)
    for layout in layouts:
        assert lt.cublasLtMatrixLayoutDestroy(layout) == 0
    assert lt.cublasLtMatmulDescDestroy(desc) == 0
