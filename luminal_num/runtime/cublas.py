"""cuBLAS and cuBLASLt through ctypes, on the libraries CuPy already loaded: usable under stream capture.

Why ctypes and not CuPy's wrappers: every CuPy cuBLAS wrapper calls `setStream` before the call, which
raises NotImplementedError while a stream captures a CUDA graph, and CuPy has no `setWorkspace`
(cublasSetStream also resets the workspace). Why not nvmath-python: it pins its own cuda-bindings and
finds libraries its own way, so it could load a second libcublas beside CuPy's; ctypes on the loaded
library adds no dependency, and every declaration here is checked against cublas_api.h / cublasLt.h by
tests/test_cuda_headers.py (no GPU needed).

One `Cublas` per runtime: one handle, pointer mode host, default math without reduced-precision
reductions (MATH_MODE), the stream set once and then
the workspace set once (in that order, as cublasSetStream resets it), so eager runs and captured
graphs make the same calls and graph capture never allocates. `CublasLt` keeps one handle and, per
call shape, the matmul descriptor, the layouts and the heuristic's algorithm under a workspace
preference (NVIDIA's LtFp8Matmul sample); its calls are per-tensor FP8 (scale pointers) and FP32-output
bias epilogues (CUBLASLT_EPILOGUE_BIAS with the bias pointer, codegen/cuda_gemm_bias.py); a shape the heuristic or cublasLtMatmul calls
NOT_SUPPORTED (status 15) is remembered and answered False, so the runtime runs the tiled kernel
instead, the same way eagerly and when captured.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from ..codegen.cuda_source import CUBLAS_ENUMS, GemmCall
from .cuda_device import CudaUnavailableError

CUBLAS_LIB_ENV = "LUMINAL_CUBLAS_LIB"      # explicit libcublas.so (its folder's libcublasLt is used too)
CUBLASLT_LIB_ENV = "LUMINAL_CUBLASLT_LIB"  # explicit libcublasLt.so
WHEEL_PACKAGES = ("nvidia.cublas", "nvidia.cu13", "nvidia.cu12")

# Enumerators by their header names (cublas_api.h, cublasLt.h, library_types.h); values checked by a test.
ENUMS = {
    "CUBLAS_STATUS_SUCCESS": 0, "CUBLAS_STATUS_NOT_SUPPORTED": 15,
    "CUBLAS_POINTER_MODE_HOST": 0, "CUBLAS_DEFAULT_MATH": 0, "CUBLAS_GEMM_DEFAULT": -1,
    "CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION": 16,
    "MAJOR_VERSION": 0, "MINOR_VERSION": 1,
    "CUBLASLT_MATMUL_DESC_TRANSA": 3, "CUBLASLT_MATMUL_DESC_TRANSB": 4,
    "CUBLASLT_MATMUL_DESC_A_SCALE_POINTER": 17, "CUBLASLT_MATMUL_DESC_B_SCALE_POINTER": 18,
    "CUBLASLT_MATMUL_DESC_EPILOGUE": 7, "CUBLASLT_MATMUL_DESC_BIAS_POINTER": 8,
    "CUBLASLT_MATMUL_DESC_BIAS_BATCH_STRIDE": 10, "CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE": 26,
    "CUBLASLT_EPILOGUE_DEFAULT": 1, "CUBLASLT_EPILOGUE_BIAS": 4,
    "CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT": 5, "CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET": 6,
    "CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES": 1,
}
NOT_SUPPORTED = ENUMS["CUBLAS_STATUS_NOT_SUPPORTED"]
# The handle's math mode. CUBLAS_DEFAULT_MATH alone lets cuBLAS reduce split-K partial sums in the
# output type (BF16/FP16) instead of the compute type; the emulator (runtime/numerics.py) and the
# variants' bounds model FP32 accumulation to the end, so reduced-precision reductions are disallowed.
MATH_MODE = ENUMS["CUBLAS_DEFAULT_MATH"] | ENUMS["CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION"]


class MatmulAlgo(ctypes.Structure):
    """cublasLtMatmulAlgo_t."""

    _fields_ = [("data", ctypes.c_uint64 * 8)]


class HeuristicResult(ctypes.Structure):
    """cublasLtMatmulHeuristicResult_t."""

    _fields_ = [("algo", MatmulAlgo), ("workspaceSize", ctypes.c_size_t), ("state", ctypes.c_int),
                ("wavesCount", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


_P, _I, _VP = ctypes.POINTER, ctypes.c_int, ctypes.c_void_p
_HANDLE_OUT = _P(ctypes.c_void_p)
# name -> (restype, argtypes); the exported C symbols (cublas_v2.h maps cublasCreate to cublasCreate_v2).
CUBLAS_FUNCTIONS: dict[str, tuple[object, tuple]] = {
    "cublasCreate_v2": (_I, (_HANDLE_OUT,)),
    "cublasDestroy_v2": (_I, (_VP,)),
    "cublasGetProperty": (_I, (_I, _P(_I))),
    "cublasGetStatusName": (ctypes.c_char_p, (_I,)),
    "cublasSetStream_v2": (_I, (_VP, _VP)),
    "cublasSetWorkspace_v2": (_I, (_VP, _VP, ctypes.c_size_t)),
    "cublasSetPointerMode_v2": (_I, (_VP, _I)),
    "cublasSetMathMode": (_I, (_VP, _I)),
    "cublasGemmStridedBatchedEx": (_I, (_VP, _I, _I, _I, _I, _I, _VP, _VP, _I, _I, ctypes.c_longlong, _VP, _I, _I,
                                        ctypes.c_longlong, _VP, _VP, _I, _I, ctypes.c_longlong, _I, _I, _I)),
}
CUBLASLT_FUNCTIONS: dict[str, tuple[object, tuple]] = {
    "cublasLtCreate": (_I, (_HANDLE_OUT,)),
    "cublasLtDestroy": (_I, (_VP,)),
    "cublasLtGetVersion": (ctypes.c_size_t, ()),
    "cublasLtMatmulDescCreate": (_I, (_HANDLE_OUT, _I, _I)),
    "cublasLtMatmulDescDestroy": (_I, (_VP,)),
    "cublasLtMatmulDescSetAttribute": (_I, (_VP, _I, _VP, ctypes.c_size_t)),
    "cublasLtMatrixLayoutCreate": (_I, (_HANDLE_OUT, _I, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int64)),
    "cublasLtMatrixLayoutDestroy": (_I, (_VP,)),
    "cublasLtMatrixLayoutSetAttribute": (_I, (_VP, _I, _VP, ctypes.c_size_t)),
    "cublasLtMatmulPreferenceCreate": (_I, (_HANDLE_OUT,)),
    "cublasLtMatmulPreferenceDestroy": (_I, (_VP,)),
    "cublasLtMatmulPreferenceSetAttribute": (_I, (_VP, _I, _VP, ctypes.c_size_t)),
    "cublasLtMatmulAlgoGetHeuristic": (_I, (_VP, _VP, _VP, _VP, _VP, _VP, _VP, _I, _P(HeuristicResult), _P(_I))),
    "cublasLtMatmul": (_I, (_VP, _VP, _VP, _VP, _VP, _VP, _VP, _VP, _VP, _VP, _VP, _VP, _P(MatmulAlgo), _VP,
                            ctypes.c_size_t, _VP)),
}


class CublasError(RuntimeError):
    """A cuBLAS(Lt) call returned a status other than success (and other than a handled NOT_SUPPORTED)."""

    def __init__(self, what: str, status: int):
        self.status = status
        super().__init__(f"{what} failed with cublasStatus_t {status}")


def _check(status: int, what: str) -> None:
    if status != ENUMS["CUBLAS_STATUS_SUCCESS"]:
        raise CublasError(what, status)


# -- finding the libraries ---------------------------------------------------------------------------

def _loaded(stem: str) -> list[str]:
    """Paths of `stem`.so* this process has mapped already (CuPy's own copy, once it imported cuBLAS)."""
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return []
    found = [line.split()[-1] for line in lines if f"/{stem}.so" in line]
    return list(dict.fromkeys(found))


def _wheels(stem: str) -> list[str]:
    found = []
    for package in WHEEL_PACKAGES:
        try:
            spec = importlib.util.find_spec(package)
        except (ModuleNotFoundError, ValueError):
            continue
        for folder in (spec.submodule_search_locations or []) if spec else []:
            found += [str(p) for p in sorted(Path(folder, "lib").glob(f"{stem}.so*"))]
    return found


def library_candidates(stem: str, env: str, beside: str | None = None) -> list[str]:
    """An explicit $env alone; else the copy already loaded, the one beside `beside`, the wheels', the system's."""
    if os.environ.get(env):
        return [os.environ[env]]
    near = sorted(str(p) for p in Path(beside).parent.glob(f"{stem}.so*")) if beside else []
    system = ctypes.util.find_library(stem.removeprefix("lib"))
    return list(dict.fromkeys(_loaded(stem) + near + _wheels(stem) + ([system] if system else [])))


def declare(lib, functions: dict[str, tuple[object, tuple]]):
    """Set restype/argtypes of every declared function (a missing symbol raises AttributeError)."""
    for name, (restype, argtypes) in functions.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, list(argtypes)
    return lib


def _open(stem: str, env: str, functions, beside: str | None = None) -> tuple[ctypes.CDLL, str]:
    errors = []
    for candidate in library_candidates(stem, env, beside):
        try:
            return declare(ctypes.CDLL(candidate), functions), candidate
        except (OSError, AttributeError) as error:
            errors.append(f"{candidate}: {error}")
    raise CudaUnavailableError(f"{stem} could not be loaded (tried: {'; '.join(errors) or 'nothing found'}); "
                               f"install nvidia-cublas-cu12 or set {env}")


@dataclass(frozen=True)
class Libraries:
    """The two libraries (ctypes.CDLL, or a test's stand-in with the same functions)."""

    cublas: object
    cublaslt: object
    paths: tuple[str, str] = ("", "")


def load_libraries() -> Libraries:
    """libcublas and the libcublasLt beside it, declared; raises CudaUnavailableError saying what was tried."""
    cublas, path = _open("libcublas", CUBLAS_LIB_ENV, CUBLAS_FUNCTIONS)
    cublaslt, lt_path = _open("libcublasLt", CUBLASLT_LIB_ENV, CUBLASLT_FUNCTIONS, beside=path)
    return Libraries(cublas, cublaslt, (path, lt_path))


# -- cuBLAS --------------------------------------------------------------------------------------------

def gemm_strided_batched(lib, handle, call: GemmCall, a: int, b: int, c: int) -> None:
    """cublasGemmStridedBatchedEx(call) on device pointers a, b, c; alpha = 1, beta = 0 as host scalars."""
    e = CUBLAS_ENUMS
    half = call.compute_type == "CUBLAS_COMPUTE_16F"
    alpha, beta = (ctypes.c_uint16(0x3C00), ctypes.c_uint16(0)) if half else (ctypes.c_float(1.0), ctypes.c_float(0.0))
    op = lambda t: e["CUBLAS_OP_T"] if t else e["CUBLAS_OP_N"]  # noqa: E731  (0x3C00 above: FP16 1.0)
    vp = ctypes.c_void_p
    _check(lib.cublasGemmStridedBatchedEx(
        handle, op(call.transa), op(call.transb), call.m, call.n, call.k, ctypes.byref(alpha),
        vp(a), e[call.a_type], call.lda, call.stride_a, vp(b), e[call.b_type], call.ldb, call.stride_b,
        ctypes.byref(beta), vp(c), e[call.c_type], call.ldc, call.stride_c, call.batch, e[call.compute_type],
        ENUMS["CUBLAS_GEMM_DEFAULT"]), "cublasGemmStridedBatchedEx")


class Cublas:
    """One cuBLAS handle bound to one stream and one workspace for its whole life."""

    def __init__(self, lib, stream: int, workspace: int, workspace_bytes: int):
        self.lib, self.handle = lib, ctypes.c_void_p()
        _check(lib.cublasCreate_v2(ctypes.byref(self.handle)), "cublasCreate")
        _check(lib.cublasSetPointerMode_v2(self.handle, ENUMS["CUBLAS_POINTER_MODE_HOST"]), "cublasSetPointerMode")
        _check(lib.cublasSetMathMode(self.handle, MATH_MODE), "cublasSetMathMode")
        _check(lib.cublasSetStream_v2(self.handle, ctypes.c_void_p(stream)), "cublasSetStream")
        _check(lib.cublasSetWorkspace_v2(self.handle, ctypes.c_void_p(workspace), workspace_bytes),
               "cublasSetWorkspace")

    def gemm(self, call: GemmCall, a: int, b: int, c: int) -> None:
        """cublasGemmStridedBatchedEx on the bound stream."""
        gemm_strided_batched(self.lib, self.handle, call, a, b, c)

    def close(self) -> None:
        if self.handle:
            self.lib.cublasDestroy_v2(self.handle)
            self.handle = ctypes.c_void_p()


# -- cuBLASLt ------------------------------------------------------------------------------------------

def lt_layouts(call: GemmCall) -> tuple[tuple[str, int, int, int], ...]:
    """(data type, rows, cols, ld) of A, B and C/D as cuBLASLt sees them (column-major, before op())."""
    a_shape = (call.k, call.m) if call.transa else (call.m, call.k)
    b_shape = (call.n, call.k) if call.transb else (call.k, call.n)
    return ((call.a_type, *a_shape, call.lda), (call.b_type, *b_shape, call.ldb),
            (call.c_type, call.m, call.n, call.ldc))


def lt_key(call: GemmCall) -> tuple:
    """Everything a cached descriptor, layout and algorithm depend on (not the pointers)."""
    return (call.transa, call.transb, call.m, call.n, call.k, call.lda, call.ldb, call.ldc, call.stride_a,
            call.stride_b, call.stride_c, call.batch, call.a_type, call.b_type, call.c_type, call.compute_type,
            call.epilogue, call.bias_type)


def set_attribute(setter, obj, attr: str, value) -> None:
    """One cuBLASLt descriptor attribute; the library checks the value's size (INVALID_VALUE otherwise)."""
    _check(setter(obj, ENUMS[attr], ctypes.byref(value), ctypes.sizeof(value)), attr)


def describe(lib, call: GemmCall) -> tuple[ctypes.c_void_p, tuple[ctypes.c_void_p, ...]]:
    """The matmul descriptor (FP32 scale type, transposes, epilogue: for CUBLASLT_EPILOGUE_BIAS the bias type and
    batch stride 0, one vector for every batch) and the A, B, C/D layouts (batch count and strides) of a call:
    host-side objects, made without a device. The bias pointer is set per call (set_bias)."""
    e, setter = CUBLAS_ENUMS, lib.cublasLtMatmulDescSetAttribute
    desc = ctypes.c_void_p()
    _check(lib.cublasLtMatmulDescCreate(ctypes.byref(desc), e[call.compute_type], e["CUDA_R_32F"]),
           "cublasLtMatmulDescCreate")
    set_attribute(setter, desc, "CUBLASLT_MATMUL_DESC_TRANSA", ctypes.c_int32(int(call.transa)))
    set_attribute(setter, desc, "CUBLASLT_MATMUL_DESC_TRANSB", ctypes.c_int32(int(call.transb)))
    if call.epilogue != "CUBLASLT_EPILOGUE_DEFAULT":
        set_attribute(setter, desc, "CUBLASLT_MATMUL_DESC_EPILOGUE", ctypes.c_uint32(ENUMS[call.epilogue]))
        set_attribute(setter, desc, "CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE", ctypes.c_int32(e[call.bias_type]))
        set_attribute(setter, desc, "CUBLASLT_MATMUL_DESC_BIAS_BATCH_STRIDE", ctypes.c_int64(0))
    layouts = []
    for (dtype, rows, cols, ld), stride in zip(lt_layouts(call), (call.stride_a, call.stride_b, call.stride_c)):
        layout, set_layout = ctypes.c_void_p(), lib.cublasLtMatrixLayoutSetAttribute
        _check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(layout), e[dtype], rows, cols, ld),
               "cublasLtMatrixLayoutCreate")
        set_attribute(set_layout, layout, "CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT", ctypes.c_int32(call.batch))
        set_attribute(set_layout, layout, "CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET", ctypes.c_int64(stride))
        layouts.append(layout)
    return desc, tuple(layouts)


def set_scales(lib, desc, a_scale: int, b_scale: int) -> None:
    """The per-tensor dequantization scales (device pointers to one float each) of the next matmul."""
    setter = lib.cublasLtMatmulDescSetAttribute
    set_attribute(setter, desc, "CUBLASLT_MATMUL_DESC_A_SCALE_POINTER", ctypes.c_void_p(a_scale))
    set_attribute(setter, desc, "CUBLASLT_MATMUL_DESC_B_SCALE_POINTER", ctypes.c_void_p(b_scale))


def set_bias(lib, desc, bias: int) -> None:
    """The bias vector (a device pointer) of the next matmul with CUBLASLT_EPILOGUE_BIAS."""
    set_attribute(lib.cublasLtMatmulDescSetAttribute, desc, "CUBLASLT_MATMUL_DESC_BIAS_POINTER", ctypes.c_void_p(bias))


def workspace_preference(lib, workspace_bytes: int) -> ctypes.c_void_p:
    """A heuristic preference allowing `workspace_bytes` of workspace (the caller destroys it)."""
    pref = ctypes.c_void_p()
    _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "cublasLtMatmulPreferenceCreate")
    set_attribute(lib.cublasLtMatmulPreferenceSetAttribute, pref, "CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES",
                  ctypes.c_uint64(workspace_bytes))
    return pref


@dataclass
class _LtPlan:
    desc: ctypes.c_void_p
    layouts: tuple[ctypes.c_void_p, ...]
    algo: MatmulAlgo | None = None       # None: NOT_SUPPORTED, run the fallback


class CublasLt:
    """One cuBLASLt handle; per call shape one descriptor, three layouts and the heuristic's algorithm."""

    def __init__(self, lib, workspace: int, workspace_bytes: int):
        self.lib, self.workspace, self.workspace_bytes = lib, workspace, workspace_bytes
        self.handle = ctypes.c_void_p()
        _check(lib.cublasLtCreate(ctypes.byref(self.handle)), "cublasLtCreate")
        self.plans: dict[tuple, _LtPlan] = {}

    def plan(self, call: GemmCall, bias: int | None = None) -> _LtPlan:
        """The cached descriptor, layouts and algorithm of this call's shape (created on first use). `bias`: set
        before the heuristic, which reads the bias pointer's alignment (cublasLt.h); every bias is a slot's base
        (codegen/cuda_gemm_bias.py: offset 0), so later calls' pointers have the same alignment."""
        key = lt_key(call)
        if key not in self.plans:
            desc, layouts = describe(self.lib, call)
            if bias is not None:
                set_bias(self.lib, desc, bias)
            self.plans[key] = _LtPlan(desc, layouts, self._heuristic(desc, layouts))
        return self.plans[key]

    def _heuristic(self, desc, layouts) -> MatmulAlgo | None:
        """The heuristic's first algorithm within the workspace, or None when it has none (NOT_SUPPORTED)."""
        pref = workspace_preference(self.lib, self.workspace_bytes)
        try:
            result, count = HeuristicResult(), ctypes.c_int(0)
            status = self.lib.cublasLtMatmulAlgoGetHeuristic(self.handle, desc, layouts[0], layouts[1], layouts[2],
                                                             layouts[2], pref, 1, ctypes.byref(result),
                                                             ctypes.byref(count))
        finally:
            self.lib.cublasLtMatmulPreferenceDestroy(pref)
        if status == NOT_SUPPORTED or (status == 0 and (count.value == 0 or result.state != 0)):
            return None
        _check(status, "cublasLtMatmulAlgoGetHeuristic")
        return result.algo

    def matmul(self, call: GemmCall, a: int, b: int, c: int, stream: int, scales: tuple[int, int] | None = None,
               bias: int | None = None) -> bool:
        """D = scale_a * scale_b * op(A) op(B) with FP32 accumulation (`scales`: per-tensor FP8), + `bias` per row
        of D (CUBLASLT_EPILOGUE_BIAS), on `stream`; False: NOT_SUPPORTED."""
        plan = self.plan(call, bias)
        if plan.algo is None:
            return False
        if (scales is not None) != (call.a_scale is not None) or (bias is not None) != (call.bias is not None):
            raise ValueError("cublasLtMatmul: the scales and bias pointers must match the call's")
        if scales is not None:
            set_scales(self.lib, plan.desc, *scales)
        if bias is not None:
            set_bias(self.lib, plan.desc, bias)
        alpha, beta, vp = ctypes.c_float(1.0), ctypes.c_float(0.0), ctypes.c_void_p
        la, lb, lc = plan.layouts
        status = self.lib.cublasLtMatmul(self.handle, plan.desc, ctypes.byref(alpha), vp(a), la, vp(b), lb,
                                         ctypes.byref(beta), vp(c), lc, vp(c), lc, ctypes.byref(plan.algo),
                                         vp(self.workspace), self.workspace_bytes, vp(stream))
        if status == NOT_SUPPORTED:
            plan.algo = None  # remembered: this shape runs the fallback from now on, eagerly and captured
            return False
        _check(status, "cublasLtMatmul")
        return True

    def close(self) -> None:
        for plan in self.plans.values():
            for layout in plan.layouts:
                self.lib.cublasLtMatrixLayoutDestroy(layout)
            self.lib.cublasLtMatmulDescDestroy(plan.desc)
        self.plans.clear()
        if self.handle:
            self.lib.cublasLtDestroy(self.handle)
            self.handle = ctypes.c_void_p()
