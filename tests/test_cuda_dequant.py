"""The CUDA dequantize-on-load Gemm (codegen/cuda_weight_only.py): every weight-only variant compiles
with NVRTC for sm_90, and the generated C, run by the CUDA interpreter (tests/cuda_interpreter.py) on the
weight's STORED containers (packed nibbles, FP16 / E4M3 / E8M0 scales as stored), computes exactly
runtime/weight_only.py's sequential emulation, bit for bit."""
import ml_dtypes
import numpy as np
import pytest
from cuda_interpreter import Buffer, compile_entry, launch

from luminal_num.codegen import nvrtc
from luminal_num.codegen.cuda_weight_only import param_name, render_weight_only
from luminal_num.dtypes.formats import BF16, F16, F32
from luminal_num.quant.layout import Scheme
from luminal_num.runtime.weight_only import WEIGHT_ONLY_GEMMS, SumOrder, emulate_weight_only_gemm

needs_nvrtc = pytest.mark.skipif(not (nvrtc.nvrtc_available() and nvrtc.toolchain().include_dirs),
                                 reason="libnvrtc or the CUDA headers are missing")
NAMES = sorted(WEIGHT_ONLY_GEMMS)
A_DTYPES = {F32: np.float32, BF16: ml_dtypes.bfloat16, F16: np.float16}


def shape_for(variant) -> tuple[int, int, int]:
    """(M, N, K): N spans two blocks, K three stages with a ragged tail (GGUF blocks need K % 32 == 0)."""
    gguf = variant.weight.scheme in (Scheme.GGUF_Q4_1, Scheme.GGUF_Q8_0)
    return 3, 18, 64 if gguf else 70


def operands(variant, seed: int):
    m, n, k = shape_for(variant)
    rng = np.random.default_rng(seed)
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
SAMPLED = [name for i, name in enumerate(sorted({v.weight.name for v in WEIGHT_ONLY_GEMMS.values()}))
           for name in [f"{name}_a{('f32', 'bf16', 'f16')[i % 3]}"]]


@pytest.mark.parametrize("name", SAMPLED)
def test_interpreted_kernel_is_the_sequential_emulation_bit_for_bit(name):
    variant = WEIGHT_ONLY_GEMMS[name]
    a, stored, a_format = operands(variant, seed=len(name))
    got = run_interpreted(variant, a, stored, a_format)
    want = emulate_weight_only_gemm(a, stored, variant, SumOrder.SEQUENTIAL)
    assert got.tobytes() == want.astype(np.float32).tobytes(), name


def test_every_storage_format_is_sampled_with_every_activation_somewhere():
    assert {WEIGHT_ONLY_GEMMS[n].weight.name for n in SAMPLED} == {v.weight.name for v in WEIGHT_ONLY_GEMMS.values()}
    assert {WEIGHT_ONLY_GEMMS[n].activation for n in SAMPLED} == {F32, BF16, F16}


@needs_nvrtc
def test_every_variant_compiles_for_sm_90(tmp_path, monkeypatch):
    monkeypatch.setenv(nvrtc.CACHE_ENV, str(tmp_path))
    for name in NAMES:
        variant = WEIGHT_ONLY_GEMMS[name]
        m, n, k = shape_for(variant)
        for a_format in {F32, variant.activation}:
            src = render_weight_only(variant.weight, variant.activation, m, n, k, a_format)
            compiled = nvrtc.compile_cuda(src.source, src.name, "sm_90")
            assert f".entry {src.name}(" in compiled.ptx, name


def test_bad_shapes_and_activations_are_refused():
    v = WEIGHT_ONLY_GEMMS["int4_g32_abf16"]
    with pytest.raises(ValueError, match="M, N, K >= 1"):
        render_weight_only(v.weight, v.activation, 0, 4, 32)
    with pytest.raises(ValueError, match="llama.cpp blocks are 32 wide"):
        render_weight_only(WEIGHT_ONLY_GEMMS["gguf_q4_1_af32"].weight, F32, 1, 4, 40)
    with pytest.raises(ValueError, match="activations are f32/bf16/f16"):
        render_weight_only(v.weight, WEIGHT_ONLY_GEMMS["f8e4m3_channel_af32"].weight.element, 1, 4, 32)
