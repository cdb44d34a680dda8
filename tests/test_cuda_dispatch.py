"""The cost model prices every Gemm by the implementation the CUDA runtime launches: for each kernel of
MiniLM's and SmolLM2's plans (real layer shapes, few layers, random weights), the recording CUDA
stand-in (tests/fake_cuda.py) shows what the runtime enqueued (a cuBLAS / cuBLASLt call, or kernel
launches), and runtime/latency.py's KernelWork must say the same: tensor cores in the variant's math for
a library call (cuBLAS FP32: CUDA cores) and the tensor-core kernel (its `_tc` entry launched), FP32 on CUDA
cores for the tiled and weight-only kernels."""
from __future__ import annotations

import numpy as np
import pytest

import luminal_num.runtime.cuda as cuda_module
from fake_cuda import EPILOGUE_BIAS, Recorder, install
from luminal_num.codegen import nvrtc
from luminal_num.codegen.cuda_dispatch import GemmImpl, gemm_implementation
from luminal_num.dtypes.variants import GEMM_VARIANTS
from luminal_num.models.llama import LlamaConfig, build_prefill, random_weights
from luminal_num.runtime import cuda_device
from luminal_num.runtime.cpu import bind_program
from luminal_num.runtime.cuda import CudaRuntime
from luminal_num.runtime.latency import kernel_works
from luminal_num.runtime.targets import gemm_math
from luminal_num.search.space import SearchSpace
from test_cuda_codegen import needs_nvrtc
from test_gpu_check import load_check_module

pytestmark = needs_nvrtc

# SmolLM2-135M's layer shapes (config.json: hidden 576, intermediate 1536, 9 heads, 3 KV heads), two
# layers and a cut vocabulary: the Gemm forms per layer are what the 30-layer model has
SMOLLM2_LAYERS = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=2, num_attention_heads=9,
                             num_key_value_heads=3, vocab_size=2048, rms_norm_eps=1e-5, max_position_embeddings=64,
                             rope_theta=100000.0, tie_word_embeddings=True)


def workloads():
    check = load_check_module()
    graph, weights, batch = check.random_minilm(batch=2, seq=16, layers=2)
    yield "minilm", graph, weights, batch
    model = build_prefill(SMOLLM2_LAYERS, random_weights(SMOLLM2_LAYERS), seq=8, max_cache=16)
    yield "smollm2", model.graph, model.graph.weights, model.make_inputs(np.arange(8) + 7, np.arange(8))


@pytest.fixture
def fake(monkeypatch, tmp_path):
    rec = Recorder()
    monkeypatch.setenv(nvrtc.CACHE_ENV, str(tmp_path))
    install(monkeypatch, rec, cuda_module, cuda_device)
    enqueue = CudaRuntime._enqueue_kernel

    def marking(self, state, k):  # where each kernel's device work starts in the log
        rec.record("kernel", 0, id=k.id)
        return enqueue(self, state, k)
    monkeypatch.setattr(CudaRuntime, "_enqueue_kernel", marking)
    yield rec
    cuda_device.probe.cache_clear()


def library_class(event: dict) -> str:
    """The GemmImpl value of a recorded library call: its API, cuBLASLt with the bias epilogue apart."""
    return GemmImpl.CUBLASLT_BIAS.value if event.get("epilogue") == EPILOGUE_BIAS else event["api"]


def launched_by_runtime(rec: Recorder) -> dict[int, str]:
    """Kernel id -> the cuBLAS API the runtime called for it, "tensor_core" when it launched a tensor-core entry
    (codegen/cuda_gemm_tc.py, named <source>_tc), or "kernels" when it only launched other kernels."""
    out, current = {}, None
    for event in rec.log:
        if event["op"] == "kernel":
            current = event["id"]
            out[current] = "kernels"
        elif event["op"] == "gemm" and current is not None:
            out[current] = library_class(event)
        elif event["op"] == "launch" and current is not None and event["entry"].endswith("_tc"):
            out[current] = GemmImpl.TENSOR_CORE.value
    return out


def test_the_cost_models_kernel_classes_are_what_the_runtime_launches(fake):
    check = load_check_module()
    seen = set()
    for name, graph, weights, inputs in workloads():
        space = SearchSpace.build(graph)
        for plan in check.PLANS:
            program = space.program(check.plan_genome(space, plan))
            feed = {**weights, **inputs}
            fake.log.clear()
            CudaRuntime(program, weights).run(inputs)
            ran = launched_by_runtime(fake)
            works = {w.name.split(":")[0]: w for w in kernel_works(program, bind_program(program, feed))}
            for k in program.launched():
                if not k.kind.is_gemm:
                    continue
                work, api = works[f"k{k.id}"], ran[k.id]
                expected = gemm_math(GEMM_VARIANTS[k.precision or "f32"]) if api != "kernels" else ("fp32", False)
                assert (work.math, work.tensor_core) == expected, (name, plan, k.id, k.kind.value, api)
                impl = gemm_implementation(k, program, bind_program(program, feed))
                assert impl.tensor_cores == (api != "kernels")
                assert impl.tensor_core_kernel if api == "tensor_core" else api == "kernels" or impl.value == api
                assert work.implementation == impl.value
                seen.add((k.kind.value, impl, work.tensor_core))
    # every class occurs: library calls and the tensor-core kernel on tensor cores (BF16 / FP8 fused epilogues),
    # FP32 fused epilogues on the tiled SIMT kernel
    assert any(impl.library and tc for _, impl, tc in seen) and ("gemm_epilogue", GemmImpl.TILED, False) in seen
    assert ("gemm_epilogue", GemmImpl.TENSOR_CORE, True) in seen
    # `acc + bias` epilogues with an FP32 output: cuBLASLt's bias epilogue, FP32 on CUDA cores and in operand math
    assert {("gemm_epilogue", GemmImpl.CUBLASLT_BIAS, False), ("gemm_epilogue", GemmImpl.CUBLASLT_BIAS, True)} <= seen


def test_an_invariant_program_launches_no_library_gemm_and_is_priced_so(fake):
    """Batch invariance (issue 37) on CUDA: the runtime calls no cuBLAS(Lt) for a batch-invariant program (its
    algorithm follows the shape), the cost model prices each Gemm as the tiled SIMT kernel it launches, and the
    measured-class target charges the difference where the plain program had library calls (the roofline
    may price a memory-bound cuBLAS FP32 Gemm and the tiled one alike: same bytes, same FP32 CUDA-core peak)."""
    from luminal_num.runtime.latency import modelled_latency
    name, graph, weights, inputs = next(w for w in workloads() if w[0] == "smollm2")
    space = SearchSpace.build(graph)
    plain, invariant = (space.with_batch_invariance(flag).program(frozenset()) for flag in (False, True))
    bindings = bind_program(plain, {**weights, **inputs})
    assert any(gemm_implementation(k, plain, bindings).library for k in plain.launched() if k.kind.is_gemm)
    fake.log.clear()
    CudaRuntime(invariant, weights).run(inputs)
    assert set(launched_by_runtime(fake).values()) == {"kernels"}
    works = kernel_works(invariant, bindings)
    gemms = [w for w in works if w.implementation in {i.value for i in GemmImpl}]
    assert gemms and all(w.implementation == GemmImpl.TILED.value and not w.tensor_core for w in gemms)
    price = {t: modelled_latency(invariant, t, bindings).total_s / modelled_latency(plain, t, bindings).total_s
             for t in ("h200", "h200-measured")}
    assert price["h200"] >= 1.0 and price["h200-measured"] > 1.05, price


# -- the decode path (M <= SKINNY_M) as its own class, ordinary vs batch-invariant ---------------------------

def shape_workloads(models: tuple[str, ...]):
    """(name, shape, graph, weights, inputs): MiniLM and SmolLM2 (1 layer each, real layer shapes) at a decode
    shape (every dense Gemm M <= 4: MiniLM 1 sentence of 4 tokens, SmolLM2 4 sequences' next token) and a
    prefill shape (M = 32 and 8)."""
    check = load_check_module()
    for shape, (batch, seq) in (("decode", (1, 4)), ("prefill", (2, 16))) if "minilm" in models else ():
        graph, weights, inputs = check.random_minilm(batch=batch, seq=seq, layers=1)
        yield "minilm", shape, graph, weights, inputs
    if "smollm2" not in models:
        return
    config = SMOLLM2_LAYERS.with_layers(1)
    weights = random_weights(config)
    decode = build_prefill(config, weights, seq=1, max_cache=16, batch=4)
    yield "smollm2", "decode", decode.graph, weights, decode.make_batch_inputs(np.arange(4)[:, None] + 7,
                                                                               np.full((4, 1), 5))
    prefill = build_prefill(config, weights, seq=8, max_cache=16)
    yield "smollm2", "prefill", prefill.graph, weights, prefill.make_inputs(np.arange(8) + 7, np.arange(8))


def ran_as(rec: Recorder, k, bindings) -> str:
    """The class of what the fake runtime ran for Gemm `k`, read from its log alone: the cuBLAS API it called;
    else the dequantize-on-load kernel if it launched one; else the tiled kernel, on the decode path when the
    source it compiled has that branch and M is within it."""
    events, inside = [], False
    for event in rec.log:
        if event["op"] == "kernel":
            inside = event["id"] == k.id
        elif inside:
            events.append(event)
    apis = [library_class(e) for e in events if e["op"] == "gemm"]
    if apis:
        return apis[0]
    entries = [e["entry"] for e in events if e["op"] == "launch"]
    if any(e.startswith("ln_wgemm_") for e in entries):
        return GemmImpl.WEIGHT_ONLY.value
    source = next(rec.sources[e] for e in entries if e.startswith("ln_gemm_") and e in rec.sources)
    if any(e.endswith("_tc") for e in entries):
        return (GemmImpl.TENSOR_CORE_STORED if reads_parts(source) else GemmImpl.TENSOR_CORE).value
    return path_of(source, k, bindings)


def reads_parts(source: str) -> bool:
    """Whether a Gemm's compiled source takes B's stored parts (the `w_<part>` pointers)."""
    import re
    return re.search(r"\*\s*__restrict__\s+w_[a-z_]+\s*[,)]", source) is not None


def path_of(source: str, k, bindings) -> str:
    """The tiled kernel's class from its compiled source: on B's stored parts when its parameters take them
    (the `w_<part>` pointers), on the decode path when it has that branch and M is within it."""
    from luminal_num.codegen.cuda_gemv import SKINNY_M
    from luminal_num.hlir.symbolic import evaluate
    decodes = f"if (M <= {SKINNY_M})" in source and evaluate(k.layout.m, bindings) <= SKINNY_M
    stored = reads_parts(source)
    return {(False, False): GemmImpl.TILED, (False, True): GemmImpl.TILED_DECODE,
            (True, False): GemmImpl.TILED_STORED, (True, True): GemmImpl.TILED_STORED_DECODE}[stored, decodes].value


@pytest.mark.parametrize("models, plans", [
    (("smollm2",), ("fp32", "w8a16")),
    pytest.param(("minilm", "smollm2"), ("fp32", "bf16", "w8a16"), marks=pytest.mark.slow)])
def test_the_cost_models_gemm_class_is_the_path_the_runtime_runs_at_decode_and_prefill(fake, models, plans):
    """For every Gemm of MiniLM's and SmolLM2's plans (FP32, BF16 Gemms, SmolLM2 also INT8 weights), ordinary
    and batch-invariant, at decode and prefill shapes: the class the cost model prices (kernel by kernel and in
    the megakernel, which inlines the tiled body) is what the fake runtime's log shows it ran. Ordinary decode
    programs take the decode path somewhere; invariant programs and prefill shapes never do. Default: SmolLM2,
    FP32 and W8A16 (~25 s); slow: both models, every plan."""
    from luminal_num.codegen.cuda_kernels import render_kernel
    from luminal_num.runtime.cost import LaunchForm
    seen = set()
    for name, shape, graph, weights, inputs in shape_workloads(models):
        space = SearchSpace.build(graph)
        tags = {"fp32": set(), "bf16": {"gemm:bf16"}, "w8a16": {"gemm:bf16", "store:int8_channel"}}
        tags = {plan: tags[plan] for plan in plans if plan != "w8a16" or name == "smollm2"}
        for invariant in (False, True):
            sp = space.with_batch_invariance(invariant)
            for plan, plan_tags in tags.items():
                program = sp.program(frozenset(c for c in sp.all_changes() if c[2] in plan_tags))
                bindings = bind_program(program, {**weights, **inputs})
                fake.log.clear()
                CudaRuntime(program, weights).run(inputs)
                gemms = [k for k in program.launched() if k.kind.is_gemm]
                works = dict(zip([k.id for k in program.launched()], kernel_works(program, bindings)))
                mega = dict(zip([k.id for k in program.launched()],
                                kernel_works(program, bindings, LaunchForm.MEGAKERNEL)))
                for k in gemms:
                    ran = ran_as(fake, k, bindings)
                    where = (name, shape, invariant, plan, k.id, k.label)
                    assert works[k.id].implementation == ran == gemm_implementation(k, program, bindings).value, where
                    inlined = ran if ran == GemmImpl.WEIGHT_ONLY.value else \
                        path_of(render_kernel(k, program).source, k, bindings)
                    assert mega[k.id].implementation == inlined, where
                    seen.add((name, shape, invariant, ran))
    decode_path = {key for key in seen if GemmImpl(key[3]).decode_path}
    assert {(n, "decode", False) for n in models} == {key[:3] for key in decode_path}
    # an invariant program: no library call, no decode path (the tiled kernel's sequential order, on stored parts or not)
    assert {key[3] for key in seen if key[2]} <= {GemmImpl.TILED.value, GemmImpl.TILED_STORED.value,
                                                  GemmImpl.WEIGHT_ONLY.value}
    assert any(key[3] == GemmImpl.WEIGHT_ONLY.value for key in seen)
