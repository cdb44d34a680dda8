"""The data a CUDA renderer produces, shared by every renderer and by the CUDA runtime.

Why a module of its own: the elementwise/reduction renderers (cuda_kernels.py) and the Gemm /
QUANTIZE renderers (cuda_gemm.py) both build `KernelSource`s from `Launch`es, `Arg`s and `Scratch`
buffers, and a Gemm's source carries the `GemmCall` the runtime hands to cuBLAS(Lt). Keeping these
types here lets cuda_kernels import cuda_gemm (to put its renderers in the one table keyed by
KernelKind) without cuda_gemm importing cuda_kernels back.

The cuBLAS enum values below are checked against cublas_api.h / library_types.h by
tests/test_cuda_headers.py; the FP8 legality rule of GemmCall.legal() is cuBLASLt's (module docstring
of runtime/cublas.py).
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, replace
from typing import Mapping

from ..hlir.symbolic import Dim, evaluate
from . import ctypes_map
from .cuda_body import ROUND_HELPER, SymbolTable
from .llir import Kernel

MAX_GRID = 65535          # every kernel loops grid-stride, so the cap is a tuning choice only
ELEMENTWISE_THREADS = 256
ENTRY = "LN_ENTRY"        # stands for the kernel name until the source is hashed
SCALES_SCRATCH = 0        # a QUANTIZE kernel keeps its scales in this scratch buffer of its source


@dataclass(frozen=True)
class Arg:
    """A pointer argument: the kernel's output ("out"), input slot `index` ("in"), scratch buffer
    `index` of the source ("scratch"), the scales beside input slot `index`, which a QUANTIZE
    kernel produced ("scales": its scratch SCALES_SCRATCH), or stored part `index` (StorageFormat.parts
    order) of the weight a Gemm reads as B in its storage format ("part"). `buffer` is the LLIR buffer id
    once bound to a kernel (for "in" and "scales", the producing kernel's; for "part", the weight's)."""

    role: str
    index: int = 0
    buffer: int | None = None

    def bind(self, kernel: Kernel) -> "Arg":
        if self.role == "out":
            return replace(self, buffer=kernel.id)
        if self.role in ("in", "scales"):
            return replace(self, buffer=kernel.inputs[self.index].buffer)
        if self.role == "part":
            return replace(self, buffer=kernel.inputs[1].buffer)
        return self


Extent = tuple[tuple[Dim, int], ...]  # prod(ceil(dim / per)) over the factors


def ceil_count(extent: Extent, bindings: Mapping[str, int]) -> int:
    return math.prod(-(-evaluate(d, bindings) // per) for d, per in extent)


def per(d: Dim, n: int) -> Extent:
    """ceil(d / n) blocks (or scratch elements)."""
    return ((d, n),)


@dataclass(frozen=True)
class Scratch:
    """A temporary buffer (Gemm scales, quantized operands): numel = prod(ceil(dim / block))."""

    label: str
    dtype: object  # a dtypes.formats.Format
    extents: Extent

    def numel(self, bindings: Mapping[str, int]) -> int:
        return ceil_count(self.extents, bindings)


@dataclass(frozen=True)
class Launch:
    """One kernel launch: grid axis i has ceil_count(grid[i]) blocks, capped at MAX_GRID."""

    entry: str
    grid: tuple[Extent, ...]
    block: tuple[int, ...]
    args: tuple[Arg, ...]

    def config(self, bindings: Mapping[str, int]) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
        """(grid, block) as 3-tuples; a zero grid extent means there is nothing to do."""
        grid = [min(ceil_count(axis, bindings), MAX_GRID) for axis in self.grid]
        return tuple((grid + [1, 1, 1])[:3]), tuple((list(self.block) + [1, 1, 1])[:3])


# -- the cuBLAS(Lt) call a Gemm maps to ------------------------------------------------------------------

# cudaDataType_t / cublasComputeType_t / cublasOperation_t values (library_types.h, cublas_api.h).
CUBLAS_ENUMS = {"CUDA_R_32F": 0, "CUDA_R_16F": 2, "CUDA_R_8I": 3, "CUDA_R_32I": 10, "CUDA_R_16BF": 14,
                "CUDA_R_8F_E4M3": 28, "CUDA_R_8F_E5M2": 29,
                "CUBLAS_COMPUTE_16F": 64, "CUBLAS_COMPUTE_32F": 68, "CUBLAS_COMPUTE_32I": 72,
                "CUBLAS_COMPUTE_32F_FAST_16F": 74, "CUBLAS_COMPUTE_32F_FAST_16BF": 75,
                "CUBLAS_COMPUTE_32F_FAST_TF32": 77, "CUBLAS_OP_N": 0, "CUBLAS_OP_T": 1}
COMPUTE_TYPES = frozenset(k for k in CUBLAS_ENUMS if k.startswith("CUBLAS_COMPUTE"))
DATA_TYPE_BYTES = {"CUDA_R_32F": 4, "CUDA_R_16F": 2, "CUDA_R_8I": 1, "CUDA_R_32I": 4, "CUDA_R_16BF": 2,
                   "CUDA_R_8F_E4M3": 1, "CUDA_R_8F_E5M2": 1}
LT_ALIGN_BYTES = 16       # cuBLASLt FP8: every leading dimension and batch stride a multiple of 16 bytes
FP8_LT_MULTIPLE = 16      # cuBLASLt FP8: K and the call's M (the row-major product's N) multiples of 16


@dataclass(frozen=True)
class GemmCall:
    """cublasGemmStridedBatchedEx (api "cublas") or cublasLtMatmul (api "cublasLt") arguments.

    a/b/c are cuBLAS's operands (A and B may be the LLIR's B and A); offsets are in elements.
    For cuBLASLt, `prologue` (launches of the kernel's KernelSource) first fills the scales and the
    FP8 operands (scratch buffers, or for a pre-quantized A its QUANTIZE kernel's buffer and scales);
    a_scale/b_scale point at the dequantization scales. `epilogue` (a cublasLtEpilogue_t name):
    CUBLASLT_EPILOGUE_BIAS adds `bias` (a packed vector of `bias_type`, D's rows long) to every column
    (codegen/cuda_gemm_bias.py says when).
    """

    api: str
    transa: bool
    transb: bool
    m: Dim
    n: Dim
    k: Dim
    a: Arg
    b: Arg
    c: Arg
    a_offset: Dim
    b_offset: Dim
    lda: Dim
    ldb: Dim
    ldc: Dim
    stride_a: Dim
    stride_b: Dim
    stride_c: Dim
    batch: Dim
    a_type: str
    b_type: str
    c_type: str
    compute_type: str
    min_ld: tuple[Dim, Dim, Dim] = (1, 1, 1)
    prologue: tuple[Launch, ...] = ()
    a_scale: Arg | None = None
    b_scale: Arg | None = None
    epilogue: str = "CUBLASLT_EPILOGUE_DEFAULT"
    bias: Arg | None = None
    bias_type: str | None = None

    def bind(self, bindings: Mapping[str, int]) -> "GemmCall":
        """Every dimension evaluated to an int."""
        fields = ("m", "n", "k", "a_offset", "b_offset", "lda", "ldb", "ldc", "stride_a", "stride_b", "stride_c",
                  "batch")
        values = {f: evaluate(getattr(self, f), bindings) for f in fields}
        return replace(self, **values, min_ld=tuple(max(1, evaluate(d, bindings)) for d in self.min_ld))

    def bind_args(self, kernel: Kernel) -> "GemmCall":
        """Buffer ids of this kernel in the pointer arguments (the cached call has roles only)."""
        prologue = tuple(replace(launch, args=tuple(a.bind(kernel) for a in launch.args)) for launch in self.prologue)
        scales = {f: getattr(self, f).bind(kernel) for f in ("a_scale", "b_scale", "bias") if getattr(self, f) is not None}
        return replace(self, a=self.a.bind(kernel), b=self.b.bind(kernel), c=self.c.bind(kernel), prologue=prologue,
                       **scales)

    def lt_violations(self) -> tuple[str, ...]:
        """What a bound cuBLASLt FP8 call breaks of cuBLASLt's rules (empty: legal). K and the output's
        contiguous extent (PyTorch _scaled_mm's K % 16 and N % 16), and every leading dimension and
        batch stride (of a batched call) a multiple of 16 bytes, as the FP8 kernels load 16-byte vectors."""
        out = []
        if self.k % FP8_LT_MULTIPLE:
            out.append(f"K={self.k} is not a multiple of {FP8_LT_MULTIPLE}")
        if self.m % FP8_LT_MULTIPLE:
            out.append(f"M={self.m} (the output's contiguous extent) is not a multiple of {FP8_LT_MULTIPLE}")
        batched = self.batch > 1
        for name, value, dtype in (("lda", self.lda, self.a_type), ("ldb", self.ldb, self.b_type),
                                   ("ldc", self.ldc, self.c_type), ("stride_a", self.stride_a, self.a_type),
                                   ("stride_b", self.stride_b, self.b_type), ("stride_c", self.stride_c, self.c_type)):
            if (batched or not name.startswith("stride")) and (value * DATA_TYPE_BYTES[dtype]) % LT_ALIGN_BYTES:
                out.append(f"{name}={value} elements of {dtype} is not a multiple of {LT_ALIGN_BYTES} bytes")
        return tuple(out)

    def legal(self) -> bool:
        """A bound call cuBLAS accepts: leading dimensions cover their matrices, FP8 alignment (lt_violations, for
        the scaled FP8 calls only: an unscaled bias-epilogue call has the plain call's rules)."""
        dims = (self.m, self.n, self.k, self.lda, self.ldb, self.ldc)
        if not all(isinstance(d, int) for d in dims):
            raise ValueError("bind() the call before asking whether it is legal")
        lds_ok = all(ld >= need for ld, need in zip((self.lda, self.ldb, self.ldc), self.min_ld))
        fp8_ok = self.api != "cublasLt" or self.a_scale is None or not self.lt_violations()
        return lds_ok and fp8_ok and max(dims) < 2 ** 31


# -- one compilation unit ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class KernelSource:
    """One compilation unit and how to run it: `launches` in order (for a Gemm, the fallback; `gemm`
    says whether cuBLAS replaces them). Buffers in `launches[i].args` are bound to LLIR ids."""

    kernel_id: int
    name: str
    source: str
    launches: tuple[Launch, ...]
    symbols: SymbolTable          # the trailing `dyn_dims` argument, present when symbols is non-empty
    scratch: tuple[Scratch, ...] = ()
    gemm: GemmCall | None = None  # GEMM only: the call that replaces `launches`, or None
    # a Gemm the tensor-core kernel can run (codegen/cuda_gemm_tc.py): the launches that replace `launches`
    # where codegen/cuda_dispatch picks GemmImpl.TENSOR_CORE; () where it refuses
    tensor_core: tuple[Launch, ...] = ()
    # launches over weights alone (a Gemm's static B scales: ScaleSpec.static), run once when the weights are
    # uploaded, before any step: their scratch then holds the values every step's launches read
    at_load: tuple[Launch, ...] = ()
    # a Gemm whose body can compute A's step scales in its own pass over A (gemm_scales.staged_a_bytes): its one
    # `_staged` launch, which replaces the body where A's scale launch is not run (the megakernel's GEMV tiles)
    staged: tuple[Launch, ...] = ()

    @property
    def entries(self) -> tuple[str, ...]:
        """Every entry a runtime may launch: the fallback's, the tensor-core kernel's, the cuBLASLt prologue's, the
        at-load launches' and the staged body's."""
        prologue = self.gemm.prologue if self.gemm is not None else ()
        return tuple(dict.fromkeys(launch.entry for launch in (*self.launches, *self.tensor_core, *prologue,
                                                               *self.at_load, *self.staged)))

    def dyn_values(self, bindings: Mapping[str, int]) -> tuple[int, ...]:
        return tuple(int(bindings[s]) for s in self.symbols.symbols)


# -- C building blocks every renderer shares ------------------------------------------------------------

REDUCE_HELPERS = r"""
struct LnSum {
    template <class T> static __device__ __forceinline__ T apply(T a, T b) { return a + b; }
};
struct LnMax {  // NaN-propagating, as numpy's max
    template <class T> static __device__ __forceinline__ T apply(T a, T b) {
        return (a != a) ? a : ((b != b || b > a) ? b : a);
    }
};
// Reduce over the block; every thread gets the result. blockDim.x: a multiple of 32, at most 1024.
template <class Op, class T>
static __device__ T ln_block_reduce(T v, T identity) {
    __shared__ T partial[32];
    for (int o = 16; o > 0; o >>= 1) v = Op::apply(v, __shfl_xor_sync(0xffffffffu, v, o));
    if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = v;
    __syncthreads();
    v = (threadIdx.x & 31) < (blockDim.x >> 5) ? partial[threadIdx.x & 31] : identity;
    for (int o = 16; o > 0; o >>= 1) v = Op::apply(v, __shfl_xor_sync(0xffffffffu, v, o));
    __syncthreads();  // `partial` is reused by the next call
    return v;
}
"""


def indent(lines, depth: int) -> str:
    return "".join(" " * (4 * depth) + line + "\n" for line in lines)


def source_header(formats, body: str) -> str:
    """Includes for the formats a kernel touches, and the rounding helper when the body calls it."""
    return '#include "common.cuh"\n' + ctypes_map.include_directives(
        f for f in formats if f in ctypes_map.CUDA_FORMATS) + (ROUND_HELPER if "ln_round_format(" in body else "")


def entry_name(kind: str, source: str) -> str:
    """Entries are named after a hash of the source, so equal code has equal names."""
    return f"ln_{kind}_{hashlib.sha256(source.encode()).hexdigest()[:16]}"


def name_launches(launches: tuple[Launch, ...], name: str) -> tuple[Launch, ...]:
    return tuple(replace(launch, entry=launch.entry.replace(ENTRY, name)) for launch in launches)


def finish_source(kind: str, source: str, launches: tuple[Launch, ...], table: SymbolTable) -> KernelSource:
    name = entry_name(kind, source)
    return KernelSource(0, name, source.replace(ENTRY, name), name_launches(launches, name), table)
