"""The cost model prices every Gemm by the implementation the CUDA runtime launches: for each kernel of
MiniLM's and SmolLM2's plans (real layer shapes, few layers, random weights), the recording CUDA
stand-in (tests/fake_cuda.py) shows what the runtime enqueued (a cuBLAS / cuBLASLt call, or kernel
launches), and runtime/latency.py's KernelWork must say the same: tensor cores in the variant's math for
a library call (cuBLAS FP32: CUDA cores), FP32 on CUDA cores for the tiled and weight-only kernels."""
from __future__ import annotations

import numpy as np
import pytest

import luminal_num.runtime.cuda as cuda_module
from fake_cuda import Recorder, install
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


def launched_by_runtime(rec: Recorder) -> dict[int, str]:
    """Kernel id -> the cuBLAS API the runtime called for it, or "kernels" when it only launched kernels."""
    out, current = {}, None
    for event in rec.log:
        if event["op"] == "kernel":
            current = event["id"]
            out[current] = "kernels"
        elif event["op"] == "gemm" and current is not None:
            out[current] = event["api"]
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
                assert impl.library == (api != "kernels") and (not impl.library or impl.value == api)
                seen.add((k.kind.value, impl, work.tensor_core))
    # both classes occur: library calls on tensor cores and fused epilogues on the tiled SIMT kernel
    assert any(tc for _, _, tc in seen) and ("gemm_epilogue", GemmImpl.TILED, False) in seen


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
