"""NVRTC compile layer, CUDA type map and CUDA device probe.

Everything here runs without a GPU: kernels are compiled to CUBIN/PTX and the PTX is checked for the
instructions the numerics depend on. The one test that executes kernels is marked `gpu`.
"""
from __future__ import annotations

import json
import re
import sys
import threading
import types
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from luminal_num.codegen import ctypes_map as cm
from cuda_interpreter import Buffer, compile_entry
from luminal_num.codegen import nvrtc
from luminal_num.codegen.cuda_body import ROUND_HELPER, round_expr
from luminal_num.dtypes import formats as F
from luminal_num.dtypes.rounding import round_to
from luminal_num.runtime import cuda_device

needs_nvrtc = pytest.mark.skipif(
    not (nvrtc.nvrtc_available() and nvrtc.toolchain().include_dirs),
    reason="libnvrtc or the CUDA headers not found: pip install nvidia-cuda-nvrtc-cu12 nvidia-cuda-runtime-cu12")

STORAGE = tuple(cm.CUDA_FORMATS)


@pytest.fixture(autouse=True)
def private_kernel_cache(tmp_path, monkeypatch):
    """Each test gets an empty disk cache and memory cache (never the user's ~/.cache)."""
    monkeypatch.setenv(nvrtc.CACHE_ENV, str(tmp_path / "kernels"))
    nvrtc.clear_memory_cache()
    yield tmp_path / "kernels"
    nvrtc.clear_memory_cache()


def kernel_name(fmt: F.Format, saturate: bool) -> str:
    return f"roundtrip_{fmt.name}_{'sat' if saturate else 'nosat'}"


def roundtrip_source() -> str:
    """One kernel per (storage format, saturation): y = to_float(from_float(x)), plus a TF32 kernel,
    plus compile-time checks that each CUDA type has the format's storage size."""
    parts = ['#include "common.cuh"\n', cm.include_directives(STORAGE)]
    for fmt in STORAGE:
        c_type = cm.cuda_type(fmt)
        parts.append(f'static_assert(sizeof({c_type}) * 8 == {fmt.bits}, "{fmt.name} size");\n')
        for saturate in (True, False):
            parts.append(
                f'extern "C" __global__ void {kernel_name(fmt, saturate)}('
                f'const float* x, float* y, long long n) {{\n'
                f'    LN_GRID_STRIDE_LOOP(i, n) {{\n'
                f'        const {c_type} stored = {cm.from_float_expr(fmt, "x[i]", saturate)};\n'
                f'        y[i] = {cm.to_float_expr(fmt, "stored")};\n'
                f'    }}\n}}\n')
    parts.append(ROUND_HELPER)
    parts.append('extern "C" __global__ void roundtrip_tf32(const float* x, float* y, long long n) {\n'
                 f'    LN_GRID_STRIDE_LOOP(i, n) {{ y[i] = {round_expr(F.TF32, "x[i]")}; }}\n}}\n')
    return "".join(parts)


def entry_body(ptx: str, name: str) -> str:
    """The PTX text of one kernel entry."""
    start = ptx.index(f".entry {name}(")
    end = ptx.find(".entry ", start + 1)
    return ptx[start:] if end < 0 else ptx[start:end]


# ---------------------------------------------------------------- type map (no NVRTC needed)


def test_every_format_has_a_cuda_type_or_a_stated_reason():
    expected = {F.F32: "float", F.F16: "__half", F.BF16: "__nv_bfloat16", F.F8E4M3: "__nv_fp8_e4m3",
                F.F8E5M2: "__nv_fp8_e5m2", F.INT8: "signed char", F.INT32: "int", F.F64: "double"}
    assert {fmt: cm.cuda_type(fmt) for fmt in STORAGE} == expected
    assert cm.cuda_type("bf16") == "__nv_bfloat16"
    for fmt in set(F.FORMATS.values()) - set(expected):
        with pytest.raises(KeyError, match=fmt.name):
            cm.cuda_type(fmt)
    with pytest.raises(KeyError, match="round_expr"):
        cm.cuda_type(F.TF32)


def test_headers_are_deduplicated_in_a_stable_order():
    assert cm.headers_for([F.F32, F.INT8, F.F64]) == ()
    assert cm.headers_for([F.F8E5M2, F.BF16, F.F8E4M3, F.BF16]) == ("cuda_bf16.h", "cuda_fp8.h")
    assert cm.headers_for([F.BF16, F.F16]) == cm.headers_for([F.F16, F.BF16]) == ("cuda_fp16.h", "cuda_bf16.h")
    assert cm.include_directives([F.F16]) == "#include <cuda_fp16.h>\n"


def test_saturating_conversions_clamp_to_the_formats_max_finite():
    assert "__NV_SATFINITE" in cm.from_float_expr(F.F8E4M3, "v", saturate=True)
    assert "__NV_NOSAT" in cm.from_float_expr(F.F8E5M2, "v", saturate=False)
    assert cm.from_float_expr(F.F16, "v", saturate=False) == "__float2half_rn(v)"
    saturating_half = cm.from_float_expr(F.F16, "v", saturate=True)
    assert float.fromhex(saturating_half.split(", ")[1].rstrip(")f")) == 65504.0
    assert "ln_clamp_int(__float2int_rn(v), -128, 127)" in cm.from_float_expr(F.INT8, "v", saturate=True)
    # cvt.rni.s32.f32 saturates by definition, so both settings give the same expression.
    assert cm.from_float_expr(F.INT32, "v", True) == cm.from_float_expr(F.INT32, "v", False)


@settings(deadline=None, max_examples=200)
@given(st.floats(width=32, allow_nan=False, allow_infinity=False))
def test_float_literals_are_exact(value):
    literal = cm.c_float_literal(value)
    assert literal.endswith("f") and float.fromhex(literal[:-1]) == value
    assert float.fromhex(cm.c_float_literal(value, "double")) == value


def test_float_literal_rejects_values_a_float_cannot_hold():
    with pytest.raises(ValueError, match="not exactly representable"):
        cm.c_float_literal(0.1)
    assert cm.c_float_literal(float("-inf")) == "(-__int_as_float(0x7f800000))"


# ---------------------------------------------------------------- compiling


@needs_nvrtc
def test_literals_compile_to_the_values_they_name():
    """The compiler, as an independent reader, agrees with each hex literal's decimal repr."""
    values = [fmt.max_finite for fmt in F.FLOAT_FORMATS if fmt.max_finite <= F.F32.max_finite]
    values += [fmt.min_subnormal for fmt in F.FLOAT_FORMATS if fmt.min_subnormal >= F.F32.min_subnormal]
    values += [float(np.float32(0.1)), -3.0]
    checks = "".join(f'static_assert({cm.c_float_literal(v)} == {v!r}f, "{v!r}");\n'
                     f'static_assert({cm.c_float_literal(v, "double")} == {v!r}, "{v!r}");\n' for v in values)
    nvrtc.compile_cuda(checks + 'extern "C" __global__ void noop() {}\n', "noop", "compute_80")


@needs_nvrtc
@pytest.mark.parametrize("arch", ["sm_90", "compute_80"])
def test_every_storage_format_converts_both_ways_in_both_saturation_modes(arch):
    kernel = nvrtc.compile_cuda(roundtrip_source(), "roundtrip_tf32", arch)
    assert kernel.arch == arch and kernel.name == "roundtrip_tf32"
    if arch.startswith("sm_"):
        assert kernel.cubin is not None and kernel.cubin[:4] == b"\x7fELF"
    else:
        assert kernel.cubin is None
        assert ".target sm_80" in kernel.ptx
    if kernel.ptx is not None:
        for fmt in STORAGE:
            for saturate in (True, False):
                assert f".entry {kernel_name(fmt, saturate)}(" in kernel.ptx


@needs_nvrtc
@pytest.mark.parametrize("arch", ["sm_90", "compute_90"])
def test_hopper_ptx_uses_the_hardware_conversions(arch):
    ptx = nvrtc.compile_cuda(roundtrip_source(), "roundtrip_tf32", arch).ptx
    if ptx is None:
        pytest.skip(f"this NVRTC keeps no PTX for {arch}")
    assert "cvt.rn.satfinite.e4m3x2.f32" in entry_body(ptx, kernel_name(F.F8E4M3, True))
    assert "cvt.rn.satfinite.e5m2x2.f32" in entry_body(ptx, kernel_name(F.F8E5M2, True))
    for fmt in (F.F8E4M3, F.F8E5M2):  # the NOSAT mode has no hardware instruction: software path
        assert "satfinite" not in entry_body(ptx, kernel_name(fmt, False))
    assert "cvt.rna.tf32" not in entry_body(ptx, "roundtrip_tf32")  # one TF32 rounding: RNE, as the CPU's
    assert "cvt.rn.bf16.f32" in entry_body(ptx, kernel_name(F.BF16, False))
    assert "cvt.rn.f16.f32" in entry_body(ptx, kernel_name(F.F16, False))
    int8_saturating = entry_body(ptx, kernel_name(F.INT8, True))
    assert "cvt.rni.s32.f32" in int8_saturating and "max.s32" in int8_saturating and "min.s32" in int8_saturating
    assert "min.s32" not in entry_body(ptx, kernel_name(F.INT8, False))


@needs_nvrtc
def test_ampere_ptx_has_no_fp8_conversion_instruction():
    """fp8 cvt needs sm_89+: for compute_80 the header falls back to its software rounding."""
    ptx = nvrtc.compile_cuda(roundtrip_source(), "roundtrip_tf32", "compute_80").ptx
    assert "e4m3x2" not in ptx and "e5m2x2" not in ptx


BROKEN = """extern "C" __global__ void broken(float* x) {
    float a = 1.0f;
    x[0] = undefined_value + a;
    x[1] = a;
}
"""


@needs_nvrtc
def test_compile_error_reports_log_and_offending_line():
    before = nvrtc.compile_stats().compiles
    with pytest.raises(nvrtc.NvrtcError) as caught:
        nvrtc.compile_cuda(BROKEN, "broken", "sm_90")
    error = caught.value
    assert 'identifier "undefined_value" is undefined' in error.log
    message = str(error)
    assert "broken.cu(3): error" in message
    assert ">    3 |     x[0] = undefined_value + a;" in message
    assert error.log.strip() in message
    assert "3 |     x[0] = undefined_value + a;" in error.numbered_source
    assert nvrtc.compile_stats().compiles == before  # a failure is neither counted nor cached
    with pytest.raises(nvrtc.NvrtcError):
        nvrtc.compile_cuda(BROKEN, "broken", "sm_90")


@needs_nvrtc
def test_a_mangled_kernel_name_is_an_error():
    with pytest.raises(nvrtc.NvrtcError, match='extern "C"'):
        nvrtc.compile_cuda("__global__ void scale(float* x) { x[0] *= 2.0f; }\n", "scale", "compute_80")


@needs_nvrtc
def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError, match="arch"):
        nvrtc.compile_cuda(BROKEN, "broken", "hopper")
    with pytest.raises(ValueError, match="identifier"):
        nvrtc.compile_cuda(BROKEN, "not a name", "sm_90")
    with pytest.raises(nvrtc.NvrtcError, match="no-such-flag"):
        nvrtc.compile_cuda('extern "C" __global__ void k() {}', "k", "sm_90", ("--no-such-flag",))


# ---------------------------------------------------------------- caching

SCALE = 'extern "C" __global__ void scale(float* x) { x[threadIdx.x] *= SCALE_BY; }\n'


@needs_nvrtc
def test_memory_cache_returns_the_same_object_without_recompiling():
    before = nvrtc.compile_stats()
    first = nvrtc.compile_cuda(SCALE, "scale", "sm_90", ("-DSCALE_BY=3.0f",))
    again = nvrtc.compile_cuda(SCALE, "scale", "sm_90", ("-DSCALE_BY=3.0f",))
    after = nvrtc.compile_stats()
    assert again is first
    assert (after.compiles - before.compiles, after.memory_hits - before.memory_hits) == (1, 1)
    other = nvrtc.compile_cuda(SCALE, "scale", "sm_90", ("-DSCALE_BY=5.0f",))
    assert other.key != first.key and nvrtc.compile_stats().compiles == after.compiles + 1
    assert re.search(r"mul\.f32\s.*0f40400000", first.ptx) and re.search(r"mul\.f32\s.*0f40A00000", other.ptx)


@needs_nvrtc
def test_disk_cache_round_trip(private_kernel_cache):
    compiled = nvrtc.compile_cuda(SCALE, "scale", "sm_90", ("-DSCALE_BY=2.0f",))
    entry = private_kernel_cache / f"{compiled.key}.json"
    assert entry.is_file() and not list(private_kernel_cache.glob("*.tmp"))
    nvrtc.clear_memory_cache()
    before = nvrtc.compile_stats()
    loaded = nvrtc.compile_cuda(SCALE, "scale", "sm_90", ("-DSCALE_BY=2.0f",))
    after = nvrtc.compile_stats()
    assert loaded == compiled and loaded is not compiled
    assert (after.compiles - before.compiles, after.disk_hits - before.disk_hits) == (0, 1)


@needs_nvrtc
def test_a_damaged_disk_entry_is_recompiled_and_rewritten(private_kernel_cache):
    compiled = nvrtc.compile_cuda(SCALE, "scale", "compute_80", ("-DSCALE_BY=2.0f",))
    entry = private_kernel_cache / f"{compiled.key}.json"
    entry.write_text('{"name": "scale", "truncated')
    nvrtc.clear_memory_cache()
    before = nvrtc.compile_stats().compiles
    recompiled = nvrtc.compile_cuda(SCALE, "scale", "compute_80", ("-DSCALE_BY=2.0f",))
    assert nvrtc.compile_stats().compiles == before + 1
    assert recompiled.ptx == compiled.ptx and json.loads(entry.read_text())["key"] == compiled.key


@needs_nvrtc
def test_cache_off_writes_nothing(private_kernel_cache, monkeypatch):
    monkeypatch.setenv(nvrtc.CACHE_ENV, "off")
    nvrtc.compile_cuda(SCALE, "scale", "compute_80", ("-DSCALE_BY=5.0f",))
    assert not private_kernel_cache.exists()


@needs_nvrtc
def test_cache_key_covers_the_template_headers(monkeypatch):
    key = nvrtc.kernel_cache_key(SCALE, "scale", "sm_90")
    edited = {**nvrtc.template_headers(), "common.cuh": nvrtc.template_headers()["common.cuh"] + "\n"}
    monkeypatch.setattr(nvrtc, "template_headers", lambda: edited)
    assert nvrtc.kernel_cache_key(SCALE, "scale", "sm_90") != key


@needs_nvrtc
def test_concurrent_callers_share_one_compile():
    source = SCALE.replace("scale", "scale_threads")
    barrier = threading.Barrier(4)

    def compile_after_barrier(_):
        barrier.wait()
        return nvrtc.compile_cuda(source, "scale_threads", "compute_90", ("-DSCALE_BY=4.0f",))

    before = nvrtc.compile_stats().compiles
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(compile_after_barrier, range(4)))
    assert all(result is results[0] for result in results)
    assert nvrtc.compile_stats().compiles == before + 1


def test_missing_library_is_reported_not_crashed(tmp_path, monkeypatch):
    missing = tmp_path / "libnvrtc-missing.so"
    monkeypatch.setenv(nvrtc.LIBRARY_ENV, str(missing))
    assert nvrtc.nvrtc_available() is False
    with pytest.raises(nvrtc.NvrtcUnavailableError, match="nvidia-cuda-nvrtc-cu12") as caught:
        nvrtc.compile_cuda(SCALE, "scale")
    assert str(missing) in str(caught.value)


# ---------------------------------------------------------------- CUDA device probe


@pytest.fixture
def fresh_probe():
    cuda_device.probe.cache_clear()
    yield
    cuda_device.probe.cache_clear()


def fake_cupy(is_available) -> types.ModuleType:
    module = types.ModuleType("cupy")
    module.is_available = is_available
    properties = {"name": b"Fake GPU", "major": 9, "minor": 0}
    module.cuda = types.SimpleNamespace(runtime=types.SimpleNamespace(getDeviceProperties=lambda i: properties))
    return module


def raise_runtime_error():
    raise RuntimeError("cudaErrorInsufficientDriver")


@pytest.mark.parametrize("cupy_module, reason", [
    (None, "import cupy"),
    (fake_cupy(lambda: False), "is_available() is False"),
    (fake_cupy(raise_runtime_error), "cudaErrorInsufficientDriver"),
])
def test_no_device_is_an_answer_not_an_exception(fresh_probe, monkeypatch, cupy_module, reason):
    monkeypatch.setitem(sys.modules, "cupy", cupy_module)
    assert cuda_device.cuda_available() is False
    assert cuda_device.device_name() is None
    with pytest.raises(cuda_device.CudaUnavailableError) as caught:
        cuda_device.require_cuda()
    assert reason in str(caught.value) and "pip install -e '.[gpu]'" in str(caught.value)


def test_a_visible_device_is_named(fresh_probe, monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy(lambda: True))
    assert cuda_device.cuda_available() is True
    assert cuda_device.require_cuda() == cuda_device.CudaProbe(True, "Fake GPU", "90", "")
    assert cuda_device.device_name() == "Fake GPU"


def test_this_machine_without_cupy_has_no_cuda(fresh_probe):
    try:
        import cupy  # noqa: F401
    except ImportError:
        assert cuda_device.cuda_available() is False
        return
    pytest.skip("cupy is installed here; the probe's answer depends on the machine")


# ---------------------------------------------------------------- on a GPU


def emulate_roundtrip(x: np.ndarray, fmt: F.Format, saturate: bool) -> np.ndarray:
    """CPU truth for the roundtrip kernels: numpy/ml_dtypes casts, saturation as a NaN-keeping clip."""
    if fmt.is_float:
        wide = x.astype(np.float64)
        if saturate:
            wide = np.where(np.isnan(wide), wide, np.clip(wide, -fmt.max_finite, fmt.max_finite))
        with np.errstate(over="ignore", invalid="ignore"):  # overflow to inf is the expected answer
            return wide.astype(fmt.storage).astype(np.float32)
    rounded = np.nan_to_num(np.rint(x.astype(np.float64)), nan=0.0)
    as_int32 = np.clip(rounded, -2.0 ** 31, 2.0 ** 31 - 1).astype(np.int64)  # cvt.rni.s32 saturates
    if fmt is F.INT8:
        as_int32 = np.clip(as_int32, -128, 127) if saturate else (as_int32 + 128) % 256 - 128
    return as_int32.astype(np.float32)


@pytest.mark.gpu
@needs_nvrtc
def test_kernels_on_the_device_match_the_cpu_casts(tmp_path):
    if not cuda_device.cuda_available():
        pytest.skip(cuda_device.probe().reason)
    import cupy

    special = [0.0, -0.0, 0.5, 1.5, 2.5, -2.5, 127.5, 128.0, -128.5, 200.0, 300.0, 448.0, 464.0, 465.0,
               480.0, 57344.0, 61440.0, 65504.0, 65520.0, 1e6, 3e9, 3.0e38, 1e-8, 2.0 ** -10,
               float(np.float32(1.0 + 2.0 ** -11)), float(np.float32(1.0 + 3 * 2.0 ** -12)),
               np.inf, -np.inf, np.nan]
    rng = np.random.default_rng(7)
    x = np.concatenate([np.array(special, np.float32), -np.array(special, np.float32),
                        (rng.standard_normal(4096) * 10.0 ** rng.integers(-6, 7, 4096)).astype(np.float32)])
    arch = f"sm_{cuda_device.probe().compute_capability}"
    kernel = nvrtc.compile_cuda(roundtrip_source(), "roundtrip_tf32", arch)
    binary = tmp_path / "roundtrip.cubin"
    binary.write_bytes(kernel.cubin)
    module = cupy.RawModule(path=str(binary))
    device_x = cupy.asarray(x)

    def run(name: str) -> np.ndarray:
        device_y = cupy.empty_like(device_x)
        module.get_function(name)((64,), (256,), (device_x, device_y, np.int64(x.size)))
        return cupy.asnumpy(device_y)

    for fmt in STORAGE:
        for saturate in (True, False):
            np.testing.assert_array_equal(run(kernel_name(fmt, saturate)), emulate_roundtrip(x, fmt, saturate),
                                          err_msg=kernel_name(fmt, saturate))
    np.testing.assert_array_equal(run("roundtrip_tf32"), round_to(x, F.TF32))


# ---------------------------------------------------------------- library layouts (CUDA 12, CUDA 13, toolkit)


def real_layout() -> tuple[Path, Path]:
    """(this machine's libnvrtc, the include folder holding cuda_fp16.h)."""
    tools = nvrtc.toolchain()
    return tools.library, tools.include_dirs[0]


def fake_cuda13_site(root: Path) -> Path:
    """A site folder laid out like CUDA 13's wheels (nvidia/cu13/lib, nvidia/cu13/include), linking to this
    machine's NVRTC and headers."""
    library, include = real_layout()
    cu13 = root / "nvidia" / "cu13"
    (cu13 / "lib").mkdir(parents=True)
    (cu13 / "lib" / "libnvrtc.so.13").symlink_to(library.resolve())
    (cu13 / "include").symlink_to(include, target_is_directory=True)
    return root


@needs_nvrtc
def test_the_cuda13_wheel_layout_is_found_and_compiles_a_bf16_kernel(tmp_path, monkeypatch):
    site = fake_cuda13_site(tmp_path / "site")
    monkeypatch.syspath_prepend(str(site))
    library = site / "nvidia" / "cu13" / "lib" / "libnvrtc.so.13"
    assert nvrtc._library_candidates(None)[0] == str(library)
    assert nvrtc._include_dirs(library) == (site / "nvidia" / "cu13" / "include",)
    monkeypatch.setenv(nvrtc.LIBRARY_ENV, str(library))
    assert nvrtc.toolchain().include_dirs == (site / "nvidia" / "cu13" / "include",)
    source = ('#include <cuda_bf16.h>\nextern "C" __global__ void bf16_copy(const __nv_bfloat16* x, float* y) '
              '{ y[threadIdx.x] = __bfloat162float(x[threadIdx.x]); }\n')
    assert nvrtc.compile_cuda(source, "bf16_copy").cubin


@needs_nvrtc
def test_a_cuda_toolkit_under_cuda_home_is_found(tmp_path, monkeypatch):
    library, include = real_layout()
    toolkit = tmp_path / "cuda"
    (toolkit / "lib64").mkdir(parents=True)
    (toolkit / "lib64" / "libnvrtc.so").symlink_to(library.resolve())
    (toolkit / "include").symlink_to(include, target_is_directory=True)
    monkeypatch.setenv("CUDA_HOME", str(toolkit))
    assert str(toolkit / "lib64" / "libnvrtc.so") in nvrtc._library_candidates(None)
    # the header folder beside a toolkit's library wins, also when the library is a link into a wheel
    assert nvrtc._include_dirs(toolkit / "lib64" / "libnvrtc.so") in ((toolkit / "include",), (include,))
    monkeypatch.setattr(nvrtc, "HEADER_PACKAGES", ())
    monkeypatch.setattr(nvrtc, "DEFAULT_TOOLKIT", tmp_path / "absent")
    assert nvrtc._include_dirs(tmp_path / "elsewhere" / "lib" / "libnvrtc.so") == (toolkit / "include",)


# ---------------------------------------------------------------- one TF32 operand rounding


def tf32_probe_values() -> np.ndarray:
    """1 + j 2^-13 for j = 0..15 (each eighth of a TF32 step, ties at j = 4 and 12), their negatives, and
    values whose 13 dropped bits are all ones (where truncation loses a whole step)."""
    ones = np.float32(1.0 + (2 ** 13 - 1) * 2.0 ** -23)
    return np.concatenate([1.0 + np.arange(16) * 2.0 ** -13, -(1.0 + np.arange(16) * 2.0 ** -13),
                           [ones, -ones, ones * 2.0 ** -120, 3.0e38]]).astype(np.float32)


def test_the_tf32_operand_rounding_of_cuda_kernels_is_the_emulators_in_the_interpreter():
    """The CUDA rounding of an FP32 operand to TF32 (cuda_body.round_expr, what the tiled Gemm kernel
    applies) run by the CUDA interpreter: bit for bit dtypes.rounding.round_to(x, TF32), ties to even."""
    x = tf32_probe_values()
    fn, _ = compile_entry(roundtrip_source(), "roundtrip_tf32")
    y = Buffer(np.zeros(x.size), integer=False)
    fn(x=Buffer(x.astype(np.float64), integer=False), y=y, n=x.size)  # one thread: the grid-stride loop does all
    expected = round_to(x, F.TF32)
    np.testing.assert_array_equal(y.values.astype(np.float32), expected)
    assert expected[4] == 1.0 and expected[12] == np.float32(1.0 + 2.0 ** -9)  # ties to even, both ways
