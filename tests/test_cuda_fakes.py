"""The CUDA runtime's call discipline on a recording stand-in for CuPy / libcublas / libcublasLt (no GPU).

Each test is one defect a first GPU run would have hit (issue 19): cuBLAS under stream capture, the
workspace never set, uploads on the legacy null stream, FP8 shapes cuBLASLt rejects, NOT_SUPPORTED
raising instead of falling back, the heuristic never consulted, cubins through temp files. The
stand-in (tests/fake_cuda.py) behaves as CuPy 14 does where it matters (its cuBLAS wrappers call
setStream, which raises while capturing); nothing computes, so values are checked elsewhere
(test_cuda_codegen.py for the generated code, test_cuda_runtime.py on a GPU).
"""
from __future__ import annotations

import tempfile

import numpy as np
import pytest

import luminal_num.runtime.cuda as cuda_module
import test_cuda_runtime as gpu_suite
from fake_cuda import FakeCublasLtLib, Recorder, install
from luminal_num.codegen import nvrtc
from luminal_num.hlir import evaluate as evaluate_fp64
from luminal_num.codegen.cuda_kernels import render_kernel
from luminal_num.dtypes.variants import GEMM_VARIANTS
from luminal_num.hlir.shape import ShapeTracker
from luminal_num.runtime import cublas, cuda_device
from luminal_num.runtime.cpu import CpuRuntime
from luminal_num.runtime.cuda import WORKSPACE_BYTES, CudaRuntime
from luminal_num.search.space import SearchSpace
from test_cuda_codegen import GEMMS, HAND_BUILT, MODELS, feed_for, gemm_cases, gemm_program, needs_nvrtc, programs

pytestmark = needs_nvrtc
NOT_SUPPORTED = 15


@pytest.fixture
def fake(monkeypatch, tmp_path):
    """A fake device: returns (recorder, set_lt) where set_lt(FakeCublasLtLib) swaps the cuBLASLt stand-in."""
    rec = Recorder()
    monkeypatch.setenv(nvrtc.CACHE_ENV, str(tmp_path))
    libs = install(monkeypatch, rec, cuda_module, cuda_device)
    yield rec, lambda lt: libs.update(cublaslt=lt)
    cuda_device.probe.cache_clear()


def fp8_program(m: int, n: int, k: int):
    """y = a @ b (row-major), per-tensor FP8 E4M3: the cuBLASLt variant."""
    a, b = ShapeTracker.contiguous((m, k)), ShapeTracker.contiguous((k, n))
    return gemm_program((m, n, k), (m, k), a.expand_dim(1, n), (k, n), b.permute((1, 0)).expand_dim(0, m), 2,
                        precision="f8e4m3_tensor")


def device_ops(rec: Recorder) -> list[dict]:
    return [e for e in rec.log if e["op"] in ("upload", "download", "memcpy", "launch", "gemm", "event")]


def test_capture_of_a_cublas_gemm_sets_no_stream_while_capturing(fake):
    """Defect 1: CuPy's wrappers call setStream inside every call, which raises during capture."""
    rec, _ = fake
    program = GEMMS["row_major"][0]
    cuda = CudaRuntime(program)
    state = cuda.capture(feed_for(program, np.random.default_rng(1)))
    cuda.replay(state)
    gemms = rec.ops("gemm")
    assert [(g["api"], g["capturing"]) for g in gemms] == [("cublas", False), ("cublas", True)]
    assert all(g["stream"] == cuda.stream.ptr for g in gemms)
    assert [e["stream"] for e in rec.ops("cublasSetStream")] == [cuda.stream.ptr]
    assert rec.ops("graph_launch")[0]["stream"] == cuda.stream.ptr


def test_the_workspace_is_set_once_after_the_stream(fake):
    """Defect 2: cublasSetStream resets the workspace, so it is set after the stream, once, to ours."""
    rec, _ = fake
    program = GEMMS["batched_shared_weight"][0]
    cuda = CudaRuntime(program)
    for seed in (1, 2):
        cuda.run(feed_for(program, np.random.default_rng(seed)))
    setup = [e for e in rec.log if e["op"].startswith("cublasSet")]
    assert [e["op"] for e in setup] == ["cublasSetPointerMode", "cublasSetMathMode", "cublasSetStream",
                                        "cublasSetWorkspace"]
    assert setup[0]["mode"] == 0  # host pointers
    # default math, split-K reductions in the compute type (FP32), never in a BF16/FP16 output type
    assert setup[1]["mode"] == cublas.ENUMS["CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION"] == 16
    assert setup[-1]["workspace"] == cuda.workspace.data.ptr and setup[-1]["nbytes"] == WORKSPACE_BYTES
    assert len(rec.ops("gemm")) == 2


@pytest.mark.parametrize("name", ["transformer1", "attention_kv"])
def test_uploads_downloads_and_launches_are_all_on_the_compute_stream(fake, name):
    """Defect 3: a non-blocking stream does not wait for the legacy null stream (ptr 0)."""
    rec, _ = fake
    model, program = MODELS[name], programs(name, 1)[0]
    inputs = model.make_inputs(1)
    cuda = CudaRuntime(program, model.graph.weights)
    cuda.run(inputs)
    ops = device_ops(rec)
    assert {e["op"] for e in ops} >= {"upload", "download", "launch", "gemm"}
    assert [e for e in ops if e["stream"] != cuda.stream.ptr] == []
    cuda.replay(cuda.capture(inputs))
    assert [e for e in device_ops(rec) if e["stream"] != cuda.stream.ptr] == []


def test_cubins_are_loaded_from_bytes_without_a_temp_file(fake, monkeypatch):
    """Defect 7: the CUBIN goes to cuModuleLoadData as bytes; no RawModule(path=...), no temp file."""
    rec, _ = fake
    monkeypatch.setenv(nvrtc.CACHE_ENV, "off")

    def no_temp_files(*args, **kwargs):
        raise AssertionError("a temp file was written")

    monkeypatch.setattr(tempfile, "NamedTemporaryFile", no_temp_files)
    model, program = MODELS["transformer1"], programs("transformer1", 1)[0]
    CudaRuntime(program, model.graph.weights)
    names = {render_kernel(k, program).name for k in program.launched()}
    assert len(rec.ops("module_load")) == len(names) > 0
    assert rec.ops("raw_module") == []


def test_fp8_gemm_asks_the_heuristic_once_per_shape_with_the_workspace(fake):
    """Defect 5: the heuristic's algorithm under a workspace preference, cached; eager == captured path."""
    rec, _ = fake
    program = fp8_program(5, 16, 32)
    cuda = CudaRuntime(program)
    feed = feed_for(program, np.random.default_rng(3))
    cuda.run(feed)
    cuda.replay(cuda.capture(feed))
    assert len(rec.ops("ltHeuristic")) == 1
    assert [(e["attr"], e["value"]) for e in rec.ops("ltPreferenceAttribute")] == [(1, WORKSPACE_BYTES)]
    gemms = rec.ops("gemm")
    assert [(g["api"], g["capturing"]) for g in gemms] == [("cublasLt", False)] * 2 + [("cublasLt", True)]
    assert all(g["algo"] == 0xA160 and g["workspace"] == cuda.workspace.data.ptr and g["nbytes"] == WORKSPACE_BYTES
               and g["stream"] == cuda.stream.ptr for g in gemms)
    # the same descriptor and layouts every time: created once
    assert len(rec.ops("ltDescCreate")) == 1 and len(rec.ops("ltLayoutCreate")) == 3


@pytest.mark.parametrize("results, status", [(0, 0), (1, NOT_SUPPORTED)], ids=["no_algorithm", "matmul_not_supported"])
def test_fp8_not_supported_falls_back_to_the_generated_kernel(fake, results, status):
    """Defect 4: NOT_SUPPORTED (15) from the heuristic or the matmul runs the fallback, and is remembered. The
    fallback is what codegen/cuda_dispatch.kernel_implementation picks: at M = 5 the tensor-core kernel."""
    from luminal_num.codegen.cuda_dispatch import GemmImpl, kernel_implementation
    rec, set_lt = fake
    set_lt(FakeCublasLtLib(rec, heuristic_results=results, matmul_status=status))
    program = fp8_program(5, 16, 32)
    kernel = program.kernels[-1]
    assert kernel_implementation(kernel, program, {}) is GemmImpl.TENSOR_CORE
    fallback = render_kernel(kernel, program).tensor_core[-1].entry
    cuda = CudaRuntime(program)
    feed = feed_for(program, np.random.default_rng(4))
    for _ in range(2):
        cuda.run(feed)
    tiled = [e for e in rec.ops("launch") if e["entry"] == fallback]
    assert len(tiled) == 2
    assert len(rec.ops("gemm")) == (1 if status else 0)  # tried once at most, then remembered
    assert len(rec.ops("ltHeuristic")) == 1


@pytest.mark.parametrize("m, n, k", [(5, 6, 32), (5, 16, 24), (5, 20, 32)])
def test_fp8_shapes_cublaslt_rejects_never_reach_it(fake, m, n, k):
    """Defect 4: N (the output's contiguous extent) and K multiples of 16, every ld 16-byte aligned; an illegal
    shape runs the generated kernel the dispatch picks (M = 5: the tensor-core one)."""
    rec, _ = fake
    program = fp8_program(m, n, k)
    kernel = program.kernels[-1]
    call = render_kernel(kernel, program).gemm.bind({})
    assert call.api == "cublasLt" and not call.legal() and call.lt_violations()
    cuda = CudaRuntime(program)
    cuda.run(feed_for(program, np.random.default_rng(5)))
    assert rec.ops("gemm") == [] and rec.ops("ltHeuristic") == []
    fallback = render_kernel(kernel, program).tensor_core[-1].entry
    assert [e["entry"] for e in rec.ops("launch")][-1] == fallback


# -- the stand-in executing: the runtime's pointer plumbing against the CPU backend ---------------------------

def execute(rec: Recorder) -> None:
    """From now on launches run in the CUDA interpreter and library calls compute."""
    rec.execute = True


PLAN_TAGS = {"fp32": None, "bf16": "gemm:bf16", "fp8": "gemm:f8e4m3_tensor", "tf32": "gemm:tf32"}


def plan_program(graph, plan: str):
    space = SearchSpace.build(graph, fusion=False)  # cuBLAS calls: a Gemm epilogue runs the tiled kernel instead
    tag = PLAN_TAGS[plan]
    return space.program(frozenset(c for c in space.all_changes() if c[2] == tag) if tag else frozenset())


@pytest.mark.parametrize("name, plan", [("transformer1", "fp32"), ("transformer4", "fp8"), ("attention_kv", "bf16"),
                                        ("mlp", "tf32")])
def test_a_run_on_the_executing_stand_in_is_the_cpu_backends_and_replays_bit_for_bit(fake, name, plan):
    """Slots, offsets, scratch, scales, dyn dims and staged copies wired right: the outputs are the CPU
    backend's (FP32 plan: within its FP32 envelope; others: no further from FP64 than 4x the CPU's
    error), and a captured graph replayed twice gives the eager run's bits."""
    rec, _ = fake
    model = MODELS[name]
    program = plan_program(model.graph, plan)
    inputs = model.make_inputs(3)
    execute(rec)
    cpu = CpuRuntime(program, model.graph.weights).run(inputs).outputs
    cuda = CudaRuntime(program, model.graph.weights)
    got = cuda.run(inputs).outputs
    assert any(e["api"] == ("cublasLt" if plan == "fp8" else "cublas") for e in rec.ops("gemm"))
    ref = evaluate_fp64(model.graph, inputs)
    for out in cpu:
        if plan == "fp32":
            envelope = 64 * 2.0 ** -24 * float(np.max(np.abs(cpu[out])))
            np.testing.assert_allclose(got[out], cpu[out], rtol=0, atol=envelope, err_msg=out)
        else:
            assert np.max(np.abs(got[out] - ref[out])) <= 4 * max(np.max(np.abs(cpu[out] - ref[out])), 1e-6), out
    state = cuda.capture(inputs)
    for _ in range(2):
        replayed = cuda.replay(state)
        for out in got:
            np.testing.assert_array_equal(replayed[out], got[out])


def sliced_a_program(precision: str = "f32"):
    """A reads rows 2.. of a larger matrix: the cuBLAS call carries a nonzero element offset."""
    m, n, k = 16, 16, 32
    a_view = ShapeTracker.contiguous((m + 2, k)).slice([(2, m + 2), (0, k)]).expand_dim(1, n)
    b_view = ShapeTracker.contiguous((k, n)).permute((1, 0)).expand_dim(0, m)
    return gemm_program((m, n, k), (m + 2, k), a_view, (k, n), b_view, 2, precision)


GEMM_PROGRAMS = {**{f"{case}_f32": program for case, (program, _) in GEMMS.items()},
                 **{f"{case}_fp8": program for case, (program, ok) in gemm_cases(16, 16, 32, "f8e4m3_tensor").items()
                    if ok},
                 "sliced_a_f32": sliced_a_program(), "sliced_a_tf32": sliced_a_program("tf32"),
                 "sliced_a_fp8": sliced_a_program("f8e4m3_tensor")}


@pytest.mark.parametrize("case", sorted(GEMM_PROGRAMS))
def test_gemm_pointers_offsets_and_scales_on_the_executing_stand_in(fake, case):
    """Every Gemm layout through cuBLAS / cuBLASLt (or the fallback where neither can): the CPU backend's
    product within K ulps; the sliced operand's offset reaches the call."""
    rec, _ = fake
    program = GEMM_PROGRAMS[case]
    kernel = program.kernels[-1]
    call = render_kernel(kernel, program).gemm
    if case.startswith("sliced_a") and call.api == "cublas":
        assert (call.a_offset, call.b_offset) != (0, 0)
    execute(rec)
    feed = feed_for(program, np.random.default_rng(15))
    ref = CpuRuntime(program).run(feed).outputs["y"]
    got = CudaRuntime(program).run(feed).outputs["y"]
    assert bool(rec.ops("gemm")) == (call is not None and call.bind({}).legal())
    np.testing.assert_allclose(got, ref, rtol=0, atol=kernel.layout.k * 2.0 ** -22 * float(np.abs(ref).max()))


# -- the GPU suite's own tests, run on the executing stand-in ---------------------------------------------------

def _gpu_suite_cases():
    """(id, test function of test_cuda_runtime.py, its arguments, model-scale?)."""
    t = gpu_suite
    cases = [(f"kernel_kind-{c}", t.test_each_kernel_kind_matches_the_cpu_backend, {"case": c}, False)
             for c in sorted(HAND_BUILT)]
    cases += [(f"gemm_layout-{c}", t.test_gemm_layouts_through_cublas_and_the_fallback, {"case": c}, False)
              for c in sorted(GEMMS)]
    cases += [(f"gemm_variant-{n}", t.test_every_gemm_variant, {"name": n}, False) for n in sorted(GEMM_VARIANTS)]
    cases += [(f"cublaslt_fp8-{c}", t.test_cublaslt_fp8_on_legal_shapes_runs_cublaslt_and_matches_the_cpu_backend,
               {"case": c}, False) for c, (_, ok) in sorted(gemm_cases(16, 16, 32).items()) if ok]
    cases += [(f"graph_gemm-{p}", t.test_graph_replay_of_cublas_and_cublaslt_gemms_is_the_eager_run, {"precision": p},
               False) for p in ("f32", "tf32", "bf16", "f8e4m3_tensor")]
    cases += [("scatter_in_place", t.test_scatter_in_place_writes_only_its_rows_of_the_aliased_buffer, {}, False),
              ("fp64_symbolic", t.test_fp64_reference_agrees_on_a_symbolic_model, {}, False),
              ("tf32_probe", t.test_probe_which_tf32_operand_rounding_cublas_applies, {}, False),
              ("graph_transformer4", t.test_cuda_graph_replays_what_run_computes, {}, True)]
    cases += [(f"whole_model-{m}-{g}", t.test_whole_models_match_the_cpu_backend, {"name": m, "gemm": g}, True)
              for m in sorted(MODELS) for g in ("auto", "kernel")]
    return [pytest.param(fn, kwargs, id=name, marks=[pytest.mark.slow] if slow else []) for name, fn, kwargs, slow in cases]


@pytest.mark.parametrize("test, kwargs", _gpu_suite_cases())
def test_the_gpu_suite_passes_on_the_executing_stand_in(fake, test, kwargs):
    """The GPU tests' own assertions (never run before a GPU) against the stand-in: a failure here is a
    bug in the runtime's plumbing or in the GPU test itself, found without a device."""
    rec, _ = fake
    execute(rec)
    test(**kwargs)


def test_a_weights_static_scales_are_launched_once_at_load_not_per_step(fake):
    """Per-channel FP8 (the tiled kernel): B's static scales are the Gemm's at-load launch, run once after the
    upload; the eager step and each replay of the captured graph launch A's scales and the Gemm only, read the
    scales the at-load launch wrote, and give the CPU backend's product within K ulps, the replays bit for bit."""
    rec, _ = fake
    m, n, k = 4, 24, 32
    a, b = ShapeTracker.contiguous((m, k)), ShapeTracker.contiguous((k, n))
    program = gemm_program((m, n, k), (m, k), a.expand_dim(1, n), (k, n), b.permute((1, 0)).expand_dim(0, m), 2,
                           precision="f8e4m3_channel")
    kernel = program.kernels[-1]
    src = render_kernel(kernel, program)
    assert src.gemm is None and [x.entry[-7:] for x in src.at_load] == ["_scale1"]
    assert [x.entry[-7:] for x in src.launches][:-1] == ["_scale0"]
    execute(rec)
    feed = feed_for(program, np.random.default_rng(3))
    ref = CpuRuntime(program).run(feed).outputs["y"]
    cuda = CudaRuntime(program)
    state = cuda.capture(feed)  # _start (the at-load launch), one eager step, then the captured step
    launched = [e["entry"] for e in rec.ops("launch")]
    assert launched.count(src.at_load[0].entry) == 1 and launched.count(src.launches[0].entry) == 2
    before = len(rec.ops("launch"))
    for _ in range(2):
        got = cuda.replay(state)["y"]
        np.testing.assert_allclose(got, ref, rtol=0, atol=k * 2.0 ** -22 * float(np.abs(ref).max()))
    assert src.at_load[0].entry not in [e["entry"] for e in rec.ops("launch")[before:]]
    assert cuda.replay(state)["y"].tobytes() == got.tobytes()
