"""The CUDA dequantize-on-load Gemm (codegen/cuda_weight_only.py): every weight-only variant compiles
with NVRTC for sm_90, and the generated C, run by the CUDA interpreter (tests/cuda_interpreter.py) on the
weight's STORED containers (packed nibbles, FP16 / E4M3 / E8M0 scales as stored), computes exactly
runtime/weight_only.py's sequential emulation, bit for bit."""
import ml_dtypes
import numpy as np
import pytest
from cuda_interpreter import Buffer, compile_entry, launch
from kept_blocks import kept_sample

from luminal_num.codegen import nvrtc
from luminal_num.codegen.cuda_weight_only import param_name, render_weight_only
from luminal_num.dtypes.formats import BF16, F16, F32
from luminal_num.quant.layout import Scheme
from luminal_num.runtime.weight_only import WEIGHT_ONLY_GEMMS, SumOrder, emulate_weight_only_gemm

needs_nvrtc = pytest.mark.skipif(not (nvrtc.nvrtc_available() and nvrtc.toolchain().include_dirs),
                                 reason="libnvrtc or the CUDA headers are missing")
NAMES = sorted(WEIGHT_ONLY_GEMMS)  # kept GGUF blocks (Q4_0 / Q5_x / K-quants) too: the file's bytes, decoded on load
A_DTYPES = {F32: np.float32, BF16: ml_dtypes.bfloat16, F16: np.float16}


def shape_for(variant) -> tuple[int, int, int]:
    """(M, N, K): N spans two blocks, K three stages with a ragged tail (GGUF blocks need whole blocks:
    two of 32, or one 256-wide K-quant super-block, eight stages)."""
    gguf = variant.weight.scheme in (Scheme.GGUF_Q4_1, Scheme.GGUF_Q8_0, Scheme.GGUF_BLOCKS)
    return 3, 18, max(64, variant.weight.block) if gguf else 70


def operands(variant, seed: int):
    m, n, k = shape_for(variant)
    rng = np.random.default_rng(seed)
    if variant.weight.keeps_only:  # kept formats hold only a file's blocks: random valid ones
        a = rng.standard_normal((m, k)).astype(A_DTYPES[variant.activation]).astype(np.float32)
        return a, variant.weight.pack(kept_sample(variant.weight, n, k, seed)), variant.activation
    w = (rng.standard_normal((n, k)) * 10.0 ** rng.uniform(-2, 0, (n, 1))).astype(np.float32)
    w[0, :5] = 0.0
    a = rng.standard_normal((m, k)).astype(np.float32)
    a_format = variant.activation
    a = a.astype(A_DTYPES[a_format]).astype(np.float32)  # activations as their buffer holds them
    return a, variant.weight.pack(variant.weight.quantize(w)), a_format


def run_interpreted(variant, a, stored, a_format) -> np.ndarray:
    m, k = a.shape
    n = stored.shape[0]
    src = render_weight_only(variant.weight, variant.activation, m, n, k, a_format)
    fn, params = compile_entry(src.source, src.name)
    out = Buffer(np.zeros(m * n), False)
    args = {"out": out, "a": Buffer(a.astype(np.float64).reshape(-1), False)}
    for part, arr in stored.arrays.items():
        integer = arr.dtype.kind in "iu"
        args[param_name(part)] = Buffer(np.asarray(arr).astype(np.float64).reshape(-1), integer)
    assert list(params) == list(src.params)
    launch(fn, args, src.grid, src.block)
    return out.values.reshape(m, n).astype(np.float32)


# the interpreter is slow (every thread in Python): each storage format once, its activation rotating
SAMPLED = [name for i, name in enumerate(sorted({WEIGHT_ONLY_GEMMS[n].weight.name for n in NAMES}))
           for name in [f"{name}_a{('f32', 'bf16', 'f16')[i % 3]}"]]


@pytest.mark.parametrize("name", SAMPLED)
def test_interpreted_kernel_is_the_sequential_emulation_bit_for_bit(name):
    variant = WEIGHT_ONLY_GEMMS[name]
    a, stored, a_format = operands(variant, seed=len(name))
    got = run_interpreted(variant, a, stored, a_format)
    want = emulate_weight_only_gemm(a, stored, variant, SumOrder.SEQUENTIAL)
    assert got.tobytes() == want.astype(np.float32).tobytes(), name


def test_every_storage_format_is_sampled_with_every_activation_somewhere():
    assert {WEIGHT_ONLY_GEMMS[n].weight.name for n in SAMPLED} == {WEIGHT_ONLY_GEMMS[n].weight.name for n in NAMES}
    assert {WEIGHT_ONLY_GEMMS[n].activation for n in SAMPLED} == {F32, BF16, F16}


def _compiles_for_sm_90(names, tmp_path, monkeypatch):
    monkeypatch.setenv(nvrtc.CACHE_ENV, str(tmp_path))
    for name in names:
        variant = WEIGHT_ONLY_GEMMS[name]
        m, n, k = shape_for(variant)
        for a_format in {F32, variant.activation}:
            src = render_weight_only(variant.weight, variant.activation, m, n, k, a_format)
            compiled = nvrtc.compile_cuda(src.source, src.name, "sm_90")
            assert f".entry {src.name}(" in compiled.ptx, name


@needs_nvrtc
def test_each_storage_format_compiles_for_sm_90(tmp_path, monkeypatch):
    """Every storage format once (its activation rotating, as SAMPLED): the default suite's share."""
    _compiles_for_sm_90(SAMPLED, tmp_path, monkeypatch)


@pytest.mark.slow
@needs_nvrtc
def test_every_variant_compiles_for_sm_90(tmp_path, monkeypatch):
    """Every format x activation (81 sources, ~36 s of NVRTC on 2 cores)."""
    _compiles_for_sm_90(NAMES, tmp_path, monkeypatch)


def test_bad_shapes_and_activations_are_refused():
    v = WEIGHT_ONLY_GEMMS["int4_g32_abf16"]
    with pytest.raises(ValueError, match="M, N, K >= 1"):
        render_weight_only(v.weight, v.activation, 0, 4, 32)
    with pytest.raises(ValueError, match="llama.cpp blocks are 32 wide"):
        render_weight_only(WEIGHT_ONLY_GEMMS["gguf_q4_1_af32"].weight, F32, 1, 4, 40)
    with pytest.raises(ValueError, match="activations are f32/bf16/f16"):
        render_weight_only(v.weight, WEIGHT_ONLY_GEMMS["f8e4m3_channel_af32"].weight.element, 1, 4, 32)
    with pytest.raises(ValueError, match="gguf_q4_k: llama.cpp blocks are 256 wide; K = 128 is not a multiple"):
        render_weight_only(WEIGHT_ONLY_GEMMS["gguf_q4_k_af32"].weight, F32, 1, 4, 128)


# -- the CUDA runtime: Gemms on stored weights run this kernel on the stored bytes --------------------
RUNTIME_FORMATS = ["int8_channel", "int4_g128", "int4_g32_asym", "mxfp4", "nvfp4", "f8e4m3_channel", "bf16",
                   "gguf_q4_k", "gguf_q6_k", "gguf_q5_0"]


@pytest.fixture
def fake(monkeypatch, tmp_path):
    """The executing CUDA stand-in (tests/fake_cuda.py): launches run in the interpreter."""
    from fake_cuda import executing_stand_in
    yield from executing_stand_in(monkeypatch, tmp_path)


def linear(fmt: str, act: str, seed: int = 0):
    from luminal_num.hlir.graph import Graph
    from luminal_num.search.recipes import pick
    from luminal_num.search.space import SearchSpace
    m, n, k = 2, 20, 256
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n, k)) / 16).astype(np.float32)
    if fmt.startswith("gguf_") and fmt not in ("gguf_q4_1", "gguf_q8_0"):  # a kept format: a weight loaded from its blocks
        import gguf

        from luminal_num.models.gguf import TensorSource, keep_source
        from luminal_num.quant.gguf_blocks import block_type, random_blocks
        t = block_type(fmt)
        raw = random_blocks(t, n, k, rng)
        w = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[t.ggml]).astype(np.float32).reshape(n, k)
        keep_source(w, TensorSource(t.ggml, raw))
    g = Graph()
    x = g.input("x", (m, k))
    g.output(x @ g.weight("w", w).transpose(), "y")
    space = SearchSpace.build(g)
    program = space.program(pick(space, {f"store:{fmt}", f"gemm:{act}"}.__contains__))
    return g, w, program, {"x": rng.standard_normal((m, k)).astype(np.float32)}


@needs_nvrtc
@pytest.mark.parametrize("fmt", RUNTIME_FORMATS)
def test_the_cuda_runtime_runs_stored_weights_dequantized_on_load(fake, fmt):
    """The Gemm on a stored weight launches the dequantize-on-load kernel on the weight's stored bytes
    (no FP32 copy of the weight is uploaded) and computes the sequential emulation bit for bit."""
    from luminal_num.codegen.cuda_weight_only import weight_only_gemm
    from luminal_num.quant import STORAGE_FORMATS
    from luminal_num.quant.stored import convert
    from luminal_num.runtime.cuda import CudaRuntime
    act = "bf16" if fmt != "bf16" else "f16"
    g, w, program, inputs = linear(fmt, act)
    gemm = next(k for k in program.kernels if k.kind.value == "gemm")
    src = weight_only_gemm(gemm, program)
    assert src is not None
    cuda = CudaRuntime(program, g.weights)
    got = cuda.run(inputs).outputs["y"]
    assert [e["entry"] for e in fake.ops("launch")] == [src.name]
    uploads = sorted(e["nbytes"] for e in fake.ops("upload"))
    stored = STORAGE_FORMATS[fmt].pack(convert(w, fmt))  # a kept format: the blocks w came in
    assert w.nbytes not in uploads and sum(a.nbytes for a in stored.arrays.values()) <= sum(uploads)
    for part in stored.arrays.values():
        assert part.nbytes in uploads
    variant = WEIGHT_ONLY_GEMMS[f"{fmt}_a{act}"]
    want = emulate_weight_only_gemm(inputs["x"], stored, variant, SumOrder.SEQUENTIAL)
    assert got.astype(np.float32).tobytes() == want.tobytes()


def test_gemms_of_another_form_keep_their_own_kernels():
    """TF32 or FP8 variants on a stored weight, or no stored weight at all: not this kernel."""
    from luminal_num.codegen.cuda_weight_only import weight_only_gemm
    for fmt, act in (("int8_channel", "tf32"), ("none", "f32")):
        _, _, program, _ = linear(fmt, act)
        gemm = next(k for k in program.kernels if k.kind.value == "gemm")
        assert weight_only_gemm(gemm, program) is None, (fmt, act)
