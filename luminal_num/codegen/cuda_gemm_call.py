"""The cuBLAS / cuBLASLt call an LLIR Gemm maps to (or None where the library cannot compute it).

cuBLAS is column-major, so a row-major C is computed as C^T = B^T A^T. No call: scales other than
per-tensor FP8, integer or FP16-accumulator variants on FP32 buffers, a matrix with no unit stride,
batch axes that do not collapse into one batch stride. Per-tensor FP8 goes through cuBLASLt with both
operands K-contiguous (the "TN" layout FP8 needs), filled by the tiled source's quantize launches
(codegen/cuda_gemm.py). Split from cuda_gemm.py, which renders the kernels, so each stays readable.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..dtypes.formats import BF16, F8E4M3, F8E5M2, F16, F32, INT8, INT32, TF32, Format
from ..dtypes.variants import GemmPrecision, Granularity
from ..hlir.shape import contiguous_strides
from ..hlir.symbolic import Dim, prod
from .cuda_source import Arg, GemmCall, Launch
from .llir import Kernel

CUDA_DATA_TYPES = {F32: "CUDA_R_32F", F16: "CUDA_R_16F", BF16: "CUDA_R_16BF", F8E4M3: "CUDA_R_8F_E4M3",
                   F8E5M2: "CUDA_R_8F_E5M2", INT8: "CUDA_R_8I", INT32: "CUDA_R_32I"}


# -- geometry: the Mul's full shape seen as batch x (M x K) @ (K x N) ------------------------------------

@dataclass(frozen=True)
class _Role:
    """One logical axis group of one matrix: its extent and (when the axes nest) one stride."""

    extent: Dim
    stride: Dim | None  # None: the axes do not collapse into one strided axis

    def unit(self) -> bool:
        return self.stride == 1 or self.extent == 1


def collapse_axes(shape, strides, axes) -> _Role:
    axes = [a for a in axes if shape[a] != 1]
    extent = prod(shape[a] for a in axes)
    if not axes:
        return _Role(1, 0)
    if any(strides[a] != shape[b] * strides[b] for a, b in zip(axes, axes[1:])):
        return _Role(extent, None)
    return _Role(extent, strides[axes[-1]])


@dataclass(frozen=True)
class Geometry:
    batch: tuple[_Role, _Role, _Role]   # (A, B, C) batch strides
    a: tuple[_Role, _Role]              # (M, K)
    b: tuple[_Role, _Role]              # (K, N)
    c: tuple[_Role, _Role]              # (M, N)


def geometry(kernel: Kernel) -> Geometry:
    lay = kernel.layout
    full = lay.full_shape
    sa, sb = kernel.inputs[0].view.views[0].strides, kernel.inputs[1].view.views[0].strides
    out_strides = dict(zip(lay.out_axes, contiguous_strides([full[a] for a in lay.out_axes])))
    sc = [out_strides.get(a, 0) for a in range(len(full))]
    k = [lay.k_axis]
    return Geometry(
        tuple(collapse_axes(full, s, lay.batch_axes) for s in (sa, sb, sc)),
        (collapse_axes(full, sa, lay.m_axes), collapse_axes(full, sa, k)),
        (collapse_axes(full, sb, k), collapse_axes(full, sb, lay.n_axes)),
        (collapse_axes(full, sc, lay.m_axes), collapse_axes(full, sc, lay.n_axes)))


def _column_major(rows: _Role, cols: _Role) -> tuple[bool, Dim, Dim] | None:
    """op(X) = this rows x cols matrix for a column-major X: (transposed, ld, smallest legal ld)."""
    if rows.stride is None or cols.stride is None:
        return None
    if rows.unit():
        return False, cols.stride if cols.extent != 1 else rows.extent, rows.extent
    if cols.unit():
        return True, rows.stride if rows.extent != 1 else cols.extent, cols.extent
    return None


# -- the cuBLAS call ------------------------------------------------------------------------------------------

def _types(variant: GemmPrecision, a_fmt: Format, b_fmt: Format, out: Format) -> tuple[str, str] | None:
    """(operand data type, compute type) for an unscaled variant over these buffers, or None."""
    fmt = variant.a_format
    if variant.b_format is not fmt or a_fmt is not b_fmt:
        return None
    if variant.acc_format is F16:
        ok = a_fmt is F16 and out is F16
        return ("CUDA_R_16F", "CUBLAS_COMPUTE_16F") if ok else None
    if variant.acc_format is not F32:
        return None
    if a_fmt is F32 and out is F32:
        fast = {F32: "CUBLAS_COMPUTE_32F", TF32: "CUBLAS_COMPUTE_32F_FAST_TF32", BF16: "CUBLAS_COMPUTE_32F_FAST_16BF",
                F16: "CUBLAS_COMPUTE_32F_FAST_16F"}
        return ("CUDA_R_32F", fast[fmt]) if fmt in fast else None
    if a_fmt is fmt and fmt in (BF16, F16) and out in (F32, fmt):
        return CUDA_DATA_TYPES[fmt], "CUBLAS_COMPUTE_32F"
    return None


def lt_capable(variant: GemmPrecision, out: Format) -> bool:
    scales = (variant.a_scale, variant.b_scale)
    return (variant.a_format in (F8E4M3, F8E5M2) and variant.b_format in (F8E4M3, F8E5M2)
            and not (variant.a_format is F8E5M2 and variant.b_format is F8E5M2)
            and all(s is not None and s.granularity is Granularity.TENSOR for s in scales)
            and not variant.grouped and out in (F32, BF16, F16))


def cublas_call(kernel: Kernel, variant: GemmPrecision, formats: tuple[Format, ...], geo: Geometry) -> GemmCall | None:
    types = None if variant.a_scale or variant.b_scale else _types(variant, *formats, kernel.dtype)
    if types is None or any(r.stride is None for r in geo.batch):
        return None
    lay = kernel.layout
    c_rows, c_cols = geo.c
    offsets = (kernel.inputs[0].view.views[0].offset, kernel.inputs[1].view.views[0].offset)
    if c_cols.unit():  # row-major C: C^T (N x M) = B^T A^T
        first, second = _column_major(geo.b[1], geo.b[0]), _column_major(geo.a[1], geo.a[0])
        m, n, ldc = lay.n, lay.m, (c_rows.stride if c_rows.extent != 1 else lay.n)
        order = (1, 0)
    elif c_rows.unit():
        first, second = _column_major(*geo.a), _column_major(*geo.b)
        m, n, ldc = lay.m, lay.n, (c_cols.stride if c_cols.extent != 1 else lay.m)
        order = (0, 1)
    else:
        return None
    if first is None or second is None:
        return None
    data, compute = types
    return GemmCall("cublas", first[0], second[0], m, n, lay.k, Arg("in", order[0]), Arg("in", order[1]), Arg("out"),
                    offsets[order[0]], offsets[order[1]], first[1], second[1], ldc, geo.batch[order[0]].stride,
                    geo.batch[order[1]].stride, geo.batch[2].stride, lay.batch, data, data,
                    CUDA_DATA_TYPES[kernel.dtype], compute, (first[2], second[2], m))


def lt_call(kernel: Kernel, variant: GemmPrecision, geo: Geometry, prologue: tuple[Launch, ...],
             operands: tuple[Arg, Arg], scales: tuple[Arg, Arg]) -> GemmCall | None:
    """FP8 per-tensor scales: both operands K-contiguous, `operands` (A: batch x M x K, B: batch x N x K)
    with their `scales`."""
    lay = kernel.layout
    c_rows, c_cols = geo.c
    if geo.batch[2].stride is None:
        return None
    if c_cols.unit():
        m, n, ldc, order = lay.n, lay.m, (c_rows.stride if c_rows.extent != 1 else lay.n), (1, 0)
    elif c_rows.unit():
        m, n, ldc, order = lay.m, lay.n, (c_cols.stride if c_cols.extent != 1 else lay.m), (0, 1)
    else:
        return None
    fmts = (variant.a_format, variant.b_format)
    rows = (lay.m, lay.n)
    return GemmCall("cublasLt", True, False, m, n, lay.k, operands[order[0]], operands[order[1]],
                    Arg("out"), 0, 0, lay.k, lay.k, ldc, rows[order[0]] * lay.k, rows[order[1]] * lay.k,
                    geo.batch[2].stride, lay.batch, CUDA_DATA_TYPES[fmts[order[0]]], CUDA_DATA_TYPES[fmts[order[1]]],
                    CUDA_DATA_TYPES[kernel.dtype], "CUBLAS_COMPUTE_32F", (lay.k, lay.k, m), prologue,
                    scales[order[0]], scales[order[1]])
