"""The cuBLASLt call for a GEMM_EPILOGUE kernel that is exactly `accumulator + bias along N` with an FP32 output
(CUBLASLT_EPILOGUE_BIAS), or the one-line reason it has none.

Why only this form: the emulator (runtime/numerics.py, the CPU backend's epilogue, cuda_gemm_epilogue.py) computes
the FP32 accumulator, then one FP32 add of the bias, one FP32 rounding, stored in the kernel's dtype. cuBLASLt's
bias epilogue computes D = alpha * acc + bias in the FP32 scale type with alpha = 1, beta = 0 (C is not read),
which is that same FP32 add, when D and so the bias (CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE: D's type) are FP32.
Refused: a BF16/FP16 output (the bias would be read as D's type, rounded before the add: not the emulator's
sum); GELU (+ bias): cuBLASLt's header documents only "GELU point-wise transform", no formula, while the
emulator's GELU is erf-based, so CUBLASLT_EPILOGUE_GELU_BIAS is never used; ReLU, residual, GLU and every other
body (no cuBLASLt epilogue computes them with these rounding points); scaled variants (cuda_gemm_call.lt_call
covers per-tensor FP8 without epilogue); a bias that is not a packed (stride 1) vector along the model's output
columns N; operands at a non-zero offset (the heuristic assumes 256-byte-aligned pointers, which only a slot's
base is known to have).

Geometry: a row-major C = A B is called as the column-major C^T (N x M) = B^T A^T (cuda_gemm_call.cublas_call),
so cuBLASLt's D has N rows and its bias (length: D's rows, broadcast along D's columns and, with
CUBLASLT_MATMUL_DESC_BIAS_BATCH_STRIDE 0, every batch) runs along the model's N, as the epilogue's does. Where
the output is stored with M contiguous, D's rows would be M: refused, never transposed silently.
"""
from __future__ import annotations

from dataclasses import replace

from ..dtypes.formats import F32, Format
from ..dtypes.variants import GemmPrecision
from ..hlir.ops import Op
from .cuda_gemm_call import CUDA_DATA_TYPES, Geometry, collapse_axes, cublas_call
from .cuda_source import Arg, GemmCall
from .llir import FAcc, FApply, FLoad, FRoundTo, Kernel, KernelKind

BIAS_SLOT = 2  # a bias epilogue's inputs: A, B, the bias


def _is_bias_body(kernel: Kernel) -> bool:
    """The body is acc + in2 (either order), the accumulator read at the element, nothing else."""
    body = kernel.body
    return (isinstance(body, FApply) and body.op is Op.ADD and body.kind is None and len(body.args) == 2
            and {type(a) for a in body.args} == {FAcc, FLoad}
            and all(a.view is None for a in body.args if isinstance(a, FAcc))
            and all(a.slot == BIAS_SLOT for a in body.args if isinstance(a, FLoad)))


def _ops(e) -> list:
    """Every FApply and FAcc of a body (FExpr nodes with sub-expressions: FApply.args, FRoundTo.x)."""
    if isinstance(e, FApply):
        return [e] + [n for a in e.args for n in _ops(a)]
    if isinstance(e, FAcc):
        return [e]
    return _ops(e.x) if isinstance(e, FRoundTo) else []


def _body_refusal(kernel: Kernel) -> str:
    """Which non-bias epilogue this is, in one line."""
    nodes = _ops(kernel.body)
    if any(isinstance(n, FAcc) and n.view is not None for n in nodes):
        return "a GLU epilogue (accumulator column slices): no cuBLASLt epilogue computes it"
    if any(isinstance(n, FApply) and n.kind in ("erf", "tanh") for n in nodes):
        return ("a GELU epilogue: cuBLASLt's GELU formula is undocumented (CUBLASLT_EPILOGUE_GELU_BIAS unused), "
                "the emulator's is erf-based")
    if len(kernel.inputs) > BIAS_SLOT + 1:
        return (f"the epilogue reads {len(kernel.inputs) - BIAS_SLOT} operands (a residual or more): cuBLASLt's "
                "bias epilogue adds one vector")
    return "the epilogue is not exactly accumulator + bias"


def _bias_refusal_of_view(kernel: Kernel) -> str | None:
    """Why input BIAS_SLOT is not a packed vector along N read at offset 0 (broadcast over batch and M)."""
    views = kernel.inputs[BIAS_SLOT].view.views
    if len(views) != 1 or views[0].mask is not None or views[0].offset != 0:
        return "the bias is not read through one unmasked view at offset 0"
    lay, view = kernel.layout, views[0]
    full = lay.full_shape
    strides = [0] * len(full)
    for axis, stride in zip(lay.out_axes, view.strides):
        strides[axis] = stride
    if any(strides[a] != 0 and full[a] != 1 for a in (*lay.batch_axes, *lay.m_axes)):
        return "the bias varies along M or the batch, not only along N"
    n = collapse_axes(full, strides, lay.n_axes)
    if n.stride is None or not n.unit():
        return "the bias is not packed (stride 1) along N"
    return None


def bias_refusal(kernel: Kernel, variant: GemmPrecision, formats: tuple[Format, ...], geo: Geometry) -> str | None:
    """Why this Gemm kernel has no cuBLASLt bias-epilogue call (one line), None when it has one."""
    if kernel.kind is not KernelKind.GEMM_EPILOGUE:
        return f"a {kernel.kind.value} kernel has no epilogue"
    if len(kernel.inputs) != BIAS_SLOT + 1 or not _is_bias_body(kernel):
        return _body_refusal(kernel)
    if kernel.dtype is not F32 or formats[BIAS_SLOT] is not F32:
        return (f"output {kernel.dtype.name} / bias {formats[BIAS_SLOT].name}: cuBLASLt reads the bias in D's type, "
                "only an FP32 output and FP32 bias add as the emulator does")
    if variant.a_scale is not None or variant.b_scale is not None:
        return f"variant {variant.name} is scaled: no cuBLASLt bias epilogue with these scales"
    refused = _bias_refusal_of_view(kernel)
    if refused:
        return refused
    if any(len(inp.view.views) != 1 for inp in kernel.inputs[:2]):
        return "an operand is read through more than one view"
    base = cublas_call(kernel, variant, formats[:2], geo)
    if base is None:
        return f"no cuBLAS call for variant {variant.name} on these operand types and layouts"
    if base.a.index != 1:  # the call is C^T = B^T A^T only when C is row-major: D's rows are N
        return "the output is stored M-contiguous: cuBLASLt's bias would run along M, not N"
    if base.a_offset != 0 or base.b_offset != 0:
        return "an operand starts at a non-zero offset (cuBLASLt's heuristic assumes 256-byte-aligned pointers)"
    return None


def bias_call(kernel: Kernel, variant: GemmPrecision, formats: tuple[Format, ...], geo: Geometry) -> GemmCall | None:
    """The plain cuBLAS call as cublasLtMatmul with CUBLASLT_EPILOGUE_BIAS over input BIAS_SLOT, or None."""
    if bias_refusal(kernel, variant, formats, geo) is not None:
        return None
    base = cublas_call(kernel, variant, formats[:2], geo)
    return replace(base, api="cublasLt", epilogue="CUBLASLT_EPILOGUE_BIAS", bias=Arg("in", BIAS_SLOT),
                   bias_type=CUDA_DATA_TYPES[formats[BIAS_SLOT]])
