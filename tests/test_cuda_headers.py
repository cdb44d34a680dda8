"""The ctypes declarations and enum values of the CUDA bindings against NVIDIA's own headers (no GPU).

The headers come with the nvidia wheels of the test extra: cublas_api.h and cublasLt.h
(nvidia-cublas-cu12), library_types.h and driver_types.h (nvidia-cuda-runtime-cu12), nvrtc.h
(nvidia-cuda-nvrtc-cu12). This file parses them with its own small C-declaration reader and maps C
types to ctypes with its own table, then compares every function runtime/cublas.py and
codegen/nvrtc.py declare, every enumerator value they use, and the two structs passed by pointer.
The wheel's libraries are then loaded for real (no device needed) to check the symbols exist and to
ask them their version and a status name.
"""
from __future__ import annotations

import ctypes
import dataclasses
import importlib.util
import re
from functools import cache
from pathlib import Path

import pytest

from luminal_num.codegen import nvrtc
from luminal_num.codegen.cuda_gemm import CUDA_DATA_TYPES
from luminal_num.codegen.cuda_kernels import gemm_call
from luminal_num.codegen.cuda_source import COMPUTE_TYPES, CUBLAS_ENUMS, DATA_TYPE_BYTES
from luminal_num.runtime import cublas
from test_cuda_codegen import gemm_cases


def _include(package: str) -> Path | None:
    try:
        spec = importlib.util.find_spec(package)
    except ModuleNotFoundError:
        return None
    for folder in (spec.submodule_search_locations or []) if spec else []:
        if (Path(folder) / "include").is_dir():
            return Path(folder) / "include"
    return None


INCLUDES = {"cublas": _include("nvidia.cublas"), "runtime": _include("nvidia.cuda_runtime"),
            "nvrtc": _include("nvidia.cuda_nvrtc")}
HEADERS = {"cublas_api.h": "cublas", "cublasLt.h": "cublas", "library_types.h": "runtime",
           "driver_types.h": "runtime", "nvrtc.h": "nvrtc"}
missing = [h for h, where in HEADERS.items() if INCLUDES[where] is None or not (INCLUDES[where] / h).is_file()]
pytestmark = pytest.mark.skipif(bool(missing), reason=f"headers {missing} missing: install the test extra "
                                                      "(nvidia-cublas-cu12, nvidia-cuda-runtime-cu12, nvidia-cuda-nvrtc-cu12)")


# -- a small reader of C declarations -----------------------------------------------------------------------

@cache
def source(header: str) -> str:
    """The header without comments and preprocessor lines."""
    text = (INCLUDES[HEADERS[header]] / header).read_text(encoding="utf-8", errors="replace")
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    text = re.sub(r"//[^\n]*", " ", text)
    return "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))


@cache
def all_sources() -> str:
    return "\n".join(source(h) for h in HEADERS)


@cache
def enums() -> dict[str, dict[str, int]]:
    """typedef name -> {enumerator: value}, for `typedef enum [tag] {...} name;` and aliases of those."""
    out: dict[str, dict[str, int]] = {}
    known: dict[str, int] = {}
    text = all_sources()
    for match in re.finditer(r"typedef\s+enum\s*(\w*)\s*\{(.*?)\}\s*(\w+)\s*;", text, flags=re.S):
        tag, body, name = match.groups()
        values, nxt = {}, 0
        for entry in (e.strip() for e in body.split(",")):
            if not entry:
                continue
            ident, _, expr = (part.strip() for part in entry.partition("="))
            value = eval(expr, {"__builtins__": {}}, dict(known)) if expr else nxt  # noqa: S307  header constants
            values[ident], known[ident], nxt = value, value, value + 1
        out[name] = values
        if tag:
            out[tag] = values
    for alias, target in re.findall(r"typedef\s+(?:enum\s+)?(\w+)\s+(\w+)\s*;", text):
        if alias in out:
            out.setdefault(target, out[alias])
    return out


def enum_value(name: str) -> int:
    found = [values[name] for values in enums().values() if name in values]
    assert found, f"{name} is not an enumerator of any parsed header"
    assert len(set(found)) == 1
    return found[0]


@cache
def pointer_typedefs() -> frozenset[str]:
    """Opaque handles: `typedef [__device_builtin__] [struct] X* name;`."""
    return frozenset(re.findall(r"typedef\s+(?:__device_builtin__\s+)?(?:struct\s+)?\w+\s*\*\s*(\w+)\s*;",
                                all_sources()))


def struct_fields(name: str) -> list[tuple[str, str, int]]:
    """(type, field, array length or 0) of `typedef struct {...} name;`."""
    match = re.search(r"typedef\s+struct\s*\{([^{}]*)\}\s*" + name + r"\s*;", all_sources(), flags=re.S)
    assert match, f"no struct {name}"
    fields = []
    for decl in (d.strip() for d in match.group(1).split(";")):
        if decl:
            m = re.fullmatch(r"(.+?)\s+(\w+)\s*(?:\[(\d+)\])?", decl, flags=re.S)
            fields.append((m.group(1).strip(), m.group(2), int(m.group(3) or 0)))
    return fields


def prototype(name: str, header: str) -> tuple[str, list[str]]:
    """(return type, parameter declarations) of the exported declaration `ret name(params);`."""
    text = source(header)
    for match in re.finditer(r"\b" + name + r"\s*\(([^;{]*?)\)\s*;", text):
        before = text[:match.start()]
        start = max(before.rfind(c) for c in ";}{")
        ret = before[start + 1:]
        if "static" in ret or "inline" in ret:
            continue
        ret = re.sub(r'\b(CUBLASAPI|CUBLASWINAPI|extern\s+"C")\b', " ", ret).strip()
        params = [p.strip() for p in match.group(1).split(",")]
        return " ".join(ret.split()), [] if params in ([""], ["void"]) else params
    raise AssertionError(f"no exported declaration of {name} in {header}")


# -- C type -> ctypes (this test's own table) -------------------------------------------------------------

SCALARS = {"int": ctypes.c_int, "unsigned": ctypes.c_uint, "int32_t": ctypes.c_int32, "int64_t": ctypes.c_int64,
           "uint64_t": ctypes.c_uint64, "long long int": ctypes.c_longlong, "long long": ctypes.c_longlong,
           "size_t": ctypes.c_size_t, "float": ctypes.c_float, "double": ctypes.c_double, "char": ctypes.c_char,
           "void": None}
STRUCTS = {"cublasLtMatmulAlgo_t": cublas.MatmulAlgo, "cublasLtMatmulHeuristicResult_t": cublas.HeuristicResult}


def to_ctypes(decl: str, has_name: bool = True):
    """A parameter (or return) declaration as the ctypes type a correct binding declares."""
    decl = decl.strip()
    depth = 0
    if decl.endswith("]"):
        decl, depth = decl[:decl.rindex("[")].strip(), 1
    if has_name:
        decl = re.sub(r"\b\w+$", "", decl).strip()
    depth += decl.count("*")
    base = " ".join(w for w in decl.replace("*", " ").split() if w not in ("const", "enum", "struct"))
    if base in enums():
        t = ctypes.c_int
    elif base in pointer_typedefs():
        t = ctypes.c_void_p
    elif base in STRUCTS:
        t = STRUCTS[base]
    else:
        assert base in SCALARS, f"unmapped C type {base!r}"
        t = SCALARS[base]
    if base == "char" and depth:
        t, depth = ctypes.c_char_p, depth - 1
    elif t is None:
        assert depth >= 1, decl
        t, depth = ctypes.c_void_p, depth - 1
    for _ in range(depth):
        t = ctypes.POINTER(t)
    return t


DECLARED = [(name, sig, "cublas_api.h") for name, sig in cublas.CUBLAS_FUNCTIONS.items()] + \
           [(name, sig, "cublasLt.h") for name, sig in cublas.CUBLASLT_FUNCTIONS.items()] + \
           [(name, sig, "nvrtc.h") for name, sig in nvrtc.SIGNATURES.items()]


@pytest.mark.parametrize("name, signature, header", DECLARED, ids=[d[0] for d in DECLARED])
def test_ctypes_declarations_match_the_header_prototypes(name, signature, header):
    restype, argtypes = signature
    ret, params = prototype(name, header)
    assert to_ctypes(ret, has_name=False) == restype, (name, ret)
    assert len(params) == len(argtypes), (name, params)
    for position, (param, declared) in enumerate(zip(params, argtypes)):
        assert to_ctypes(param) == declared, f"{name} parameter {position} ({param!r}): declared {declared}"


ENUM_NAMES = sorted({**CUBLAS_ENUMS, **cublas.ENUMS})


@pytest.mark.parametrize("name", ENUM_NAMES)
def test_enum_values_match_the_headers(name):
    ours = {**CUBLAS_ENUMS, **cublas.ENUMS}[name]
    assert enum_value(name) == ours


def test_the_enum_reader_reads_known_values():
    """The reader itself, on values fixed by NVIDIA's documentation."""
    assert enums()["cublasOperation_t"]["CUBLAS_OP_C"] == 2
    assert enums()["cudaDataType"]["CUDA_R_64F"] == 1 and enums()["cudaDataType_t"]["CUDA_R_16BF"] == 14
    assert enums()["cublasStatus_t"]["CUBLAS_STATUS_INVALID_VALUE"] == 7
    assert "cublasHandle_t" in pointer_typedefs() and "cudaStream_t" in pointer_typedefs()


def test_codegen_data_and_compute_types_are_header_enumerators():
    data_types = enums()["cudaDataType"]
    assert set(CUDA_DATA_TYPES.values()) == set(DATA_TYPE_BYTES) and set(DATA_TYPE_BYTES) <= set(data_types)
    assert COMPUTE_TYPES <= set(enums()["cublasComputeType_t"])
    for name, nbytes in DATA_TYPE_BYTES.items():  # CUDA_R_<bits><kind>: the name says the width
        assert int(re.match(r"CUDA_R_(\d+)", name).group(1)) == 8 * nbytes


@pytest.mark.parametrize("struct", sorted(STRUCTS))
def test_structs_passed_by_pointer_match_the_headers(struct):
    ours = STRUCTS[struct]
    fields = struct_fields(struct)
    assert [f for f, _ in ours._fields_] == [name for _, name, _ in fields]
    for (ctype, name, length), (_, declared) in zip(fields, ours._fields_):
        expected = to_ctypes(ctype, has_name=False)
        assert declared == (expected * length if length else expected), (struct, name)
    assert ctypes.sizeof(ours) == (64 if struct == "cublasLtMatmulAlgo_t" else 96)


# -- the real libraries from the wheel, without a device ------------------------------------------------------

def header_define(name: str) -> int:
    text = (INCLUDES["cublas"] / "cublas_api.h").read_text()
    return int(re.search(r"#define\s+" + name + r"\s+(\d+)", text).group(1))


def test_the_wheel_libraries_load_with_every_declared_symbol():
    libs = cublas.load_libraries()
    assert all(Path(p).name.startswith(stem) for p, stem in zip(libs.paths, ("libcublas.so", "libcublasLt.so")))
    major = ctypes.c_int()
    assert libs.cublas.cublasGetProperty(cublas.ENUMS["MAJOR_VERSION"], ctypes.byref(major)) == 0
    assert major.value == header_define("CUBLAS_VER_MAJOR")
    version = (header_define("CUBLAS_VER_MAJOR") * 10000 + header_define("CUBLAS_VER_MINOR") * 100
               + header_define("CUBLAS_VER_PATCH"))
    assert libs.cublaslt.cublasLtGetVersion() == version
    assert libs.cublas.cublasGetStatusName(cublas.NOT_SUPPORTED) == b"CUBLAS_STATUS_NOT_SUPPORTED"


def test_an_explicit_library_path_is_used_alone(monkeypatch, tmp_path):
    missing_lib = tmp_path / "libcublas.so.99"
    monkeypatch.setenv(cublas.CUBLAS_LIB_ENV, str(missing_lib))
    assert cublas.library_candidates("libcublas", cublas.CUBLAS_LIB_ENV) == [str(missing_lib)]
    with pytest.raises(cublas.CudaUnavailableError, match="libcublas.so.99"):
        cublas.load_libraries()


def fp8_calls():
    """Bound cuBLASLt calls of the FP8 per-tensor variant on legal shapes, every layout."""
    out = []
    for name, (program, expressible) in gemm_cases(16, 16, 32, "f8e4m3_tensor").items():
        if expressible:
            out.append((name, gemm_call(program.kernels[-1], program).bind({})))
    return out


def test_the_real_cublaslt_accepts_our_descriptors_layouts_and_attribute_sizes():
    """Host-side cuBLASLt objects need no device: the library itself checks every attribute's id and
    size (INVALID_VALUE, status 7, for a wrong size: checked first, so the check can fail)."""
    lt = cublas.load_libraries().cublaslt
    desc, layouts = cublas.describe(lt, fp8_calls()[0][1])
    with pytest.raises(cublas.CublasError) as wrong:
        cublas.set_attribute(lt.cublasLtMatrixLayoutSetAttribute, layouts[0],
                             "CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET", ctypes.c_int32(0))
    assert wrong.value.status == 7
    for name, call in fp8_calls():
        assert call.legal(), name
        desc, layouts = cublas.describe(lt, call)
        cublas.set_scales(lt, desc, 0x1000, 0x2000)
        pref = cublas.workspace_preference(lt, 32 << 20)
        for layout in layouts:
            assert lt.cublasLtMatrixLayoutDestroy(layout) == 0
        assert lt.cublasLtMatmulDescDestroy(desc) == 0 and lt.cublasLtMatmulPreferenceDestroy(pref) == 0


def test_the_real_libraries_take_our_calls_arguments_without_a_device():
    """Every argument of the two matmul calls marshals through the declared argtypes; without a handle
    (no device) the libraries answer NOT_INITIALIZED (1) instead of crashing."""
    libs = cublas.load_libraries()
    call = fp8_calls()[0][1]
    with pytest.raises(cublas.CublasError) as caught:
        cublas.gemm_strided_batched(libs.cublas, None, dataclasses.replace(
            call, api="cublas", a_type="CUDA_R_32F", b_type="CUDA_R_32F"), 0, 0, 0)
    assert caught.value.status == 1
    desc, layouts = cublas.describe(libs.cublaslt, call)
    alpha, beta = ctypes.c_float(1.0), ctypes.c_float(0.0)
    status = libs.cublaslt.cublasLtMatmul(None, desc, ctypes.byref(alpha), None, layouts[0], None, layouts[1],
                                          ctypes.byref(beta), None, layouts[2], None, layouts[2],
                                          ctypes.byref(cublas.MatmulAlgo()), None, 0, None)
    assert status == 1
