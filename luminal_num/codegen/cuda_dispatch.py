"""Which implementation the CUDA runtime launches for a Gemm kernel: ONE decision, read by the runtime
(runtime/cuda.py) to launch it and by the cost model (runtime/latency.py) to price it, so a plan is
never priced at tensor-core peak while it runs on CUDA cores.

Order (the runtime's): a plain Gemm whose B is a weight held in a storage format runs the dedicated
dequantize-on-load kernel (codegen/cuda_weight_only.py); every other Gemm on a stored B (epilogue:
bias, GELU, residual; GLU over gate|up; q|k|v concatenations; scaled or pre-quantized-A variants; BF16
or FP16 outputs) runs the tiled kernel reading B's stored parts (codegen/cuda_gemm.py, `stored`): both
read the stored bytes the cost model charges, never a widened copy. A plain Gemm with a cuBLAS(Lt) call
legal for the bound sizes runs that library call, and so does a GEMM_EPILOGUE that is exactly `+ bias along N`
with an FP32 output (cuBLASLt's bias epilogue, codegen/cuda_gemm_bias.py: the tuned library kernel, preferred
to the tensor-core kernel, at every M as the plain cuBLAS call is); everything else (every other
GEMM_EPILOGUE form; the scaled variants cuBLASLt does not take) runs its kernels: the tiled kernel, on stored parts or not, at M <=
SKINNY_M takes its decode path (codegen/cuda_gemv.py: K split over 16 lanes, a fixed tree) where the
variant has one and the program is not batch-invariant; otherwise the tensor-core kernel
(codegen/cuda_gemm_tc.py, on stored parts or not) where its `refusal` gives no reason (FP32-accumulated
BF16 / F16 / TF32 / FP8 with scales constant along K, INT8), else the 16x16 tiled SIMT kernel in its
sequential order. Not known
before a device answers: a cuBLASLt heuristic that calls a legal shape NOT_SUPPORTED (the runtime then
runs the kernel `kernel_implementation` names; runtime/cublas.py). Batch-invariant programs and Gemms on a
stored B never get a library call (codegen/cuda_gemm.render_gemm attaches none).
"""
from __future__ import annotations

import enum
from collections.abc import Mapping

from ..hlir.symbolic import evaluate
from .gemm_scales import variant_of
from .cuda_gemm_bias import bias_refusal
from .cuda_gemm_call import geometry
from .cuda_gemm_tc import refusal
from .cuda_gemv import SKINNY_M, has_decode_path
from .cuda_kernels import KernelSource, input_formats, render_kernel
from .cuda_weight_only import stored_operand, weight_only_gemm
from .llir import Kernel, Program


class GemmImpl(enum.Enum):
    """How a Gemm kernel runs on the GPU."""

    WEIGHT_ONLY = "weight_only"  # the dedicated dequantize-on-load kernel (plain Gemms): CUDA cores
    TILED_STORED = "tiled_stored"  # the tiled kernel reading B's stored parts (every other form): CUDA cores
    CUBLAS = "cublas"            # cublasGemmStridedBatchedEx: tensor cores in the variant's math (FP32: SIMT)
    CUBLASLT = "cublasLt"        # cublasLtMatmul, FP8 per-tensor: tensor cores
    # cublasLtMatmul with CUBLASLT_EPILOGUE_BIAS (FP32 output): a value of its own, so that "cublasLt" keeps
    # meaning FP8 per-tensor and the cost model prices this class apart (kernel_classes.DERIVED_CLASSES)
    CUBLASLT_BIAS = "cublasLt_bias"
    TILED = "tiled"              # the 16x16 tiled kernel (quantizes operands as it loads): CUDA cores
    TILED_DECODE = "tiled_decode"  # the same launch at M <= SKINNY_M on its decode path: K split over 16 lanes
    TILED_STORED_DECODE = "tiled_stored_decode"  # the tiled kernel on B's stored parts, on its decode path
    TENSOR_CORE = "tensor_core"  # the WMMA kernel (codegen/cuda_gemm_tc.py): tensor cores in the variant's math
    TENSOR_CORE_STORED = "tensor_core_stored"  # the WMMA kernel staging B from its stored parts

    @property
    def library(self) -> bool:
        """A cuBLAS(Lt) call (which uses tensor cores where the variant's math mode has them)."""
        return self in (GemmImpl.CUBLAS, GemmImpl.CUBLASLT, GemmImpl.CUBLASLT_BIAS)

    @property
    def tensor_cores(self) -> bool:
        """Priced in the variant's operand math (targets.gemm_math): a library call or the tensor-core kernel."""
        return self.library or self.tensor_core_kernel

    @property
    def tensor_core_kernel(self) -> bool:
        """The generated tensor-core kernel (KernelSource.tensor_core's launches), on stored parts or not."""
        return self in (GemmImpl.TENSOR_CORE, GemmImpl.TENSOR_CORE_STORED)

    @property
    def reads_stored(self) -> bool:
        """B is read as its stored parts (the weight's stored bytes), dequantized on load."""
        return self in (GemmImpl.WEIGHT_ONLY, GemmImpl.TILED_STORED, GemmImpl.TILED_STORED_DECODE,
                        GemmImpl.TENSOR_CORE_STORED)

    @property
    def decode_path(self) -> bool:
        """The tiled kernel's M <= SKINNY_M path: each row's K over 16 lanes and a fixed tree (cuda_gemv)."""
        return self in (GemmImpl.TILED_DECODE, GemmImpl.TILED_STORED_DECODE)


def tiled_implementation(kernel: Kernel, program: Program, bindings: Mapping[str, int]) -> GemmImpl:
    """Which path of the tiled kernel a launch of `kernel` takes at these bindings (the kernel branches on M
    at run time): the decode path where it was rendered with one and M <= SKINNY_M, else the sequential."""
    if has_decode_path(variant_of(kernel), program.batch_invariant) and \
            int(evaluate(kernel.layout.m, bindings)) <= SKINNY_M:
        return GemmImpl.TILED_DECODE
    return GemmImpl.TILED


def tensor_core_refusal(kernel: Kernel, program: Program) -> str | None:
    """Why `kernel` has no tensor-core kernel (one line, cuda_gemm_tc.refusal), None when it has one: the
    renderer asks the same function (KernelSource.tensor_core is empty exactly when this is not None)."""
    return refusal(variant_of(kernel), kernel, program.batch_invariant)


def kernel_implementation(kernel: Kernel, program: Program, bindings: Mapping[str, int],
                          tensor_core: bool = True) -> GemmImpl:
    """What the runtime launches for `kernel` when no library call runs it (none exists or is legal, a
    cuBLASLt NOT_SUPPORTED, CudaRuntime(gemm="kernel")): the decode path where the tiled kernel takes it at
    these bindings, else the tensor-core kernel where it exists, else the tiled kernel; each on B's stored
    parts where B is a weight held in a storage format. `tensor_core=False`: the tiled body's path alone
    (what the megakernel inlines)."""
    stored = stored_operand(kernel, program) is not None
    if tiled_implementation(kernel, program, bindings) is GemmImpl.TILED_DECODE:
        return GemmImpl.TILED_STORED_DECODE if stored else GemmImpl.TILED_DECODE
    if tensor_core and tensor_core_refusal(kernel, program) is None:
        return GemmImpl.TENSOR_CORE_STORED if stored else GemmImpl.TENSOR_CORE
    return GemmImpl.TILED_STORED if stored else GemmImpl.TILED


def gemm_implementation(kernel: Kernel, program: Program, bindings: Mapping[str, int],
                        source: KernelSource | None = None, weight_only: bool | None = None) -> GemmImpl:
    """The implementation the runtime launches for `kernel` at these bindings. `source` / `weight_only`:
    what the caller already rendered (render_kernel, weight_only_gemm is not None), else computed here."""
    if not kernel.kind.is_gemm:
        raise ValueError(f"kernel {kernel.id} is {kernel.kind.value}, not a Gemm")
    if weight_only is None:
        weight_only = weight_only_gemm(kernel, program) is not None
    if weight_only:
        return GemmImpl.WEIGHT_ONLY
    if stored_operand(kernel, program) is not None:  # no library call reads stored parts: the generated kernels
        return kernel_implementation(kernel, program, bindings)
    src = source if source is not None else render_kernel(kernel, program)
    if src.gemm is None:  # an epilogue other than cuBLASLt's bias, a variant or layout cuBLAS lacks
        return kernel_implementation(kernel, program, bindings)
    call = src.gemm.bind(bindings)
    if not call.legal() or call.batch == 0 or min(call.m, call.n) == 0:
        return kernel_implementation(kernel, program, bindings)
    return GemmImpl.CUBLASLT_BIAS if call.epilogue == "CUBLASLT_EPILOGUE_BIAS" else GemmImpl(call.api)


def library_refusal(kernel: Kernel, program: Program) -> str | None:
    """Why a GEMM_EPILOGUE kernel has no cuBLASLt bias-epilogue call (one line; None: it has one, legal or not at
    given sizes). Batch-invariant programs and stored weights are refused before the epilogue is looked at."""
    if program.batch_invariant:
        return "a batch-invariant program runs the tiled kernel's fixed order (no library call)"
    if stored_operand(kernel, program) is not None:
        return "B is read as a weight's stored parts (cuBLAS(Lt) reads a dense B)"
    return bias_refusal(kernel, variant_of(kernel), input_formats(kernel, program), geometry(kernel))
