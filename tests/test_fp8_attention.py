"""FP8 activation x activation Gemms (issue 15 item 3): Q K^T and P V with both operands scaled at run
time, per tensor or per row of A / column of B (one scale per query and per key token for Q K^T).
Offered where B is not a weight; emulated exactly (against ml_dtypes quantization written from the
definition), bounded soundly (genome fuzzing on a Llama step), charged B's amax pass by the cost model,
and the generated CUDA computes the CPU backend's bits."""
import warnings

import ml_dtypes
import numpy as np
import pytest

from luminal_num.codegen.llir import KernelKind
from luminal_num.dtypes.variants import GEMM_VARIANTS
from luminal_num.error.interval import Interval
from luminal_num.error.static import static_bound
from luminal_num.hlir import evaluate
from luminal_num.hlir.graph import Graph
from luminal_num.models.llama import LLAMA_TINY, build_prefill, random_weights
from luminal_num.runtime.cpu import CpuRuntime
from luminal_num.search.recipes import pick
from luminal_num.search.space import SearchSpace

warnings.filterwarnings("ignore", category=RuntimeWarning)
DYNAMIC = ("f8e4m3_tensor_dynamic", "f8e4m3_channel_dynamic")
M, K, N = 6, 48, 10


def act_gemm(precision: str, seed: int = 0):
    """y = a @ b, both runtime inputs (b is no weight): the attention-shaped Gemm."""
    g = Graph()
    g.output(g.input("a", (M, K)) @ g.input("b", (K, N)), "y")
    space = SearchSpace.build(g)
    rng = np.random.default_rng(seed)
    inputs = {"a": rng.standard_normal((M, K)) * 10.0 ** rng.uniform(-2, 1, (M, 1)),
              "b": rng.standard_normal((K, N)) * 10.0 ** rng.uniform(-2, 1, (1, N))}
    inputs["a"][1] = 0.0  # an all-zero token: scale 1
    return g, space, space.program(pick(space, {f"gemm:{precision}"}.__contains__)), inputs


def reference(a, b, per_token: bool):
    """Quantize each operand from its definition (s = amax / 448 over the tensor, or each row of a and
    column of b; 1 where amax = 0; q = e4m3(clip(x / s))), then the exact product of q's, scaled."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    amax_a = np.abs(a).max(axis=1, keepdims=True) if per_token else np.abs(a).max(keepdims=True)
    amax_b = np.abs(b).max(axis=0, keepdims=True) if per_token else np.abs(b).max(keepdims=True)
    sa, sb = (np.where(m > 0, (m / np.float32(448)).astype(np.float32), np.float32(1)) for m in (amax_a, amax_b))
    qa = np.clip(a / sa, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
    qb = np.clip(b / sb, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
    return (qa @ qb) * sa.astype(np.float64) * sb.astype(np.float64), np.abs(qa) @ np.abs(qb) * np.abs(sa * sb)


@pytest.mark.parametrize("name", DYNAMIC)
def test_dynamic_fp8_gemm_is_the_quantized_product(name):
    """The CPU backend's result = the exact product of ml_dtypes-quantized operands up to the FP32
    accumulation (gamma_K(2^-24) of sum |qa qb| sa sb, plus the final scaling's roundings)."""
    g, space, program, inputs = act_gemm(name)
    assert [k.precision for k in program.kernels if k.kind is KernelKind.GEMM] == [name]
    assert sum(k.kind is KernelKind.QUANTIZE for k in program.kernels) == 1  # A's QUANTIZE; B in the Gemm
    y = CpuRuntime(program).run(inputs).outputs["y"]
    exact, magnitude = reference(inputs["a"], inputs["b"], per_token=name.startswith("f8e4m3_channel"))
    gamma = K * 2.0 ** -24 / (1 - K * 2.0 ** -24)
    assert np.all(np.abs(y - exact) <= (gamma + 3 * 2.0 ** -24) * magnitude + 1e-37)
    assert not np.array_equal(y, inputs["a"] @ inputs["b"])  # it did quantize
    ref = evaluate(g, inputs)["y"]
    bound = GEMM_VARIANTS[name].a_priori_bound(K, np.abs(inputs["a"]) @ np.abs(inputs["b"]),
                                               float(np.abs(inputs["a"]).max()), float(np.abs(inputs["b"]).max()))
    assert np.all(np.abs(y - ref) <= bound)


def test_dynamic_variants_are_offered_for_activation_operands_static_ones_only_for_weights():
    weights = random_weights(LLAMA_TINY, seed=2)
    model = build_prefill(LLAMA_TINY, weights, 3, 16)
    space = SearchSpace.build(model.graph, fusion=False)  # the unfused Gemms (a fused q/k/v Gemm holds one variant)
    attention = weight = 0
    for gk, ks in space.knobs.items():
        gs = space.groups[gk].space
        for k in ks:
            if not any(n.op == "KGemm" for n in gs.classes[k.cls]):
                continue
            assert all(f"gemm:{d}" in k.tags for d in DYNAMIC), k.origin
            is_weight = "gemm:f8e4m3_tensor" in k.tags  # static B scales: offered for weights only
            attention += not is_weight
            weight += is_weight
    assert attention == 2 and weight == 8  # Q K^T, P V; q, k, v, o, gate, up, down and the LM head


def test_static_bound_is_sound_with_fp8_attention_and_kv_choices():
    """Genome fuzzing on a Llama step whose attention Gemms take the dynamic FP8 variants (and every
    other knob a random tag, KV-cache formats included): measured <= bound."""
    weights = random_weights(LLAMA_TINY, seed=3)
    model = build_prefill(LLAMA_TINY, weights, 3, 16)
    space = SearchSpace.build(model.graph)
    inputs = model.make_inputs(np.array([3, 1, 4]), np.arange(3))
    ranges = {k: Interval.point(np.asarray(v, dtype=np.float64)) for k, v in inputs.items()}
    bind = model.graph.bind_symbols(inputs)
    ref = evaluate(model.graph, inputs)
    rng = np.random.default_rng(7)
    used = set()
    for trial in range(6):
        genome = set()
        for gk, ks in space.knobs.items():
            for k in ks:
                dyn = [t for t in k.tags if t[5:] in DYNAMIC]
                if dyn and "gemm:f8e4m3_tensor" not in k.tags:  # an attention Gemm
                    genome.add((gk, k.cls, dyn[trial % len(dyn)]))
                elif rng.random() < 0.5:
                    genome.add((gk, k.cls, k.tags[int(rng.integers(len(k.tags)))]))
        program = space.program(frozenset(genome))
        used |= {k.precision for k in program.kernels if k.kind is KernelKind.GEMM}
        rep = static_bound(program, ranges, bind, model.graph.weights)
        if rep.overflow is not None:
            continue
        out = CpuRuntime(program, model.graph.weights).run(inputs).outputs
        for o in ref:
            assert np.all(np.abs(out[o] - ref[o]) <= rep.error_bounds[o]), (trial, o)
    assert set(DYNAMIC) <= used


@pytest.mark.parametrize("name", DYNAMIC)
def test_the_cost_model_charges_bs_amax_pass(name):
    _, space, program, inputs = act_gemm(name)
    static = space.program(pick(space, {"gemm:f32"}.__contains__))
    b = {}
    g_dyn = next(k for k in program.kernels if k.kind is KernelKind.GEMM)
    g_f32 = next(k for k in static.kernels if k.kind is KernelKind.GEMM)
    assert g_dyn.bytes_loaded(b, program.dtypes()) - g_f32.bytes_loaded(b, static.dtypes()) == \
        K * N * 4 + (M * K * 1 - M * K * 4)  # B read once more for its amax; A read as FP8 codes


@pytest.fixture
def fake(monkeypatch, tmp_path):
    """The executing CUDA stand-in (tests/fake_cuda.py): launches run in the CUDA interpreter."""
    from fake_cuda import executing_stand_in
    yield from executing_stand_in(monkeypatch, tmp_path)


@pytest.mark.parametrize("name", DYNAMIC)
def test_generated_cuda_gemm_computes_the_cpu_backends_bits(fake, name):
    """The CUDA runtime's fallback kernels (A's QUANTIZE, B's scale kernel, the tiled Gemm), run in the
    CUDA interpreter, give the CPU backend's output bit for bit; NVRTC compiles them for sm_90."""
    from test_cuda_codegen import needs_nvrtc  # noqa: F401  (the stand-in compiles through NVRTC)
    from luminal_num.codegen import nvrtc
    from luminal_num.runtime.cuda import CudaRuntime
    if not (nvrtc.nvrtc_available() and nvrtc.toolchain().include_dirs):
        pytest.skip("libnvrtc or the CUDA headers are missing")
    _, _, program, inputs = act_gemm(name, seed=4)
    cpu = CpuRuntime(program).run(inputs).outputs["y"]
    got = CudaRuntime(program, gemm="kernel").run(inputs).outputs["y"]
    assert got.astype(np.float32).tobytes() == cpu.astype(np.float32).tobytes()
    assert fake.ops("launch")
