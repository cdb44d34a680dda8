"""Which of a Gemm's operand scales its own launches compute, and when: declared once for the CUDA renderer
(codegen/cuda_gemm.py), the megakernel's queue (codegen/blockops.py, codegen/megakernel.py) and its cost model
(runtime/megakernel_cost.py), so what the cost model schedules is what the device runs.

A Gemm variant (dtypes/variants.GemmPrecision) scales A and/or B per tensor, row, channel or block. An operand a
QUANTIZE kernel already quantized brings that kernel's scales; the others the Gemm computes itself, one launch
block per scale block (`scale_blocks`). A static scale (ScaleSpec.static: a weight's) depends on the weight
alone and is computed once when the weights are uploaded; a dynamic one (an activation's) every step.
"""
from __future__ import annotations

from ..dtypes.variants import GEMM_VARIANTS, WHOLE, GemmPrecision, Granularity
from ..hlir.symbolic import Dim
from .llir import Kernel


def variant_of(kernel: Kernel) -> GemmPrecision:
    return GEMM_VARIANTS[kernel.precision or "f32"]


def scale_blocks(kernel: Kernel, slot: int) -> tuple[tuple[Dim, int], ...]:
    """The scale blocks of operand `slot` (A: (batch, M, K), B: (batch, K, N)): one per (batch, row block, col
    block), WHOLE extents and TENSOR granularity collapsing to one; the `_scale<slot>` launch runs a block each."""
    lay, spec = kernel.layout, (variant_of(kernel).a_scale, variant_of(kernel).b_scale)[slot]
    nb, rows, cols = (lay.batch, lay.m, lay.k) if slot == 0 else (lay.batch, lay.k, lay.n)
    tensor = spec.granularity is Granularity.TENSOR
    return ((1, 1) if tensor else (nb, 1), (1, 1) if spec.block[0] == WHOLE else (rows, spec.block[0]),
            (1, 1) if spec.block[1] == WHOLE else (cols, spec.block[1]))


def own_scales(kernel: Kernel, prequantized: tuple[bool, ...]) -> list[int]:
    """The operands whose scales the Gemm's own launches compute, in launch order (a pre-quantized operand
    brings its QUANTIZE kernel's)."""
    specs = (variant_of(kernel).a_scale, variant_of(kernel).b_scale)
    return [s for s in (0, 1) if specs[s] is not None and not (prequantized + (False, False))[s]]


def static_scales(kernel: Kernel, prequantized: tuple[bool, ...]) -> list[int]:
    """The own-scaled operands whose scales are static (ScaleSpec.static: a weight's, which the precision rules
    guarantee): they depend on the weight alone, so they are computed once when the weights are uploaded
    (KernelSource.at_load), never per step; a runtime refuses one over an operand that is not a weight."""
    specs = (variant_of(kernel).a_scale, variant_of(kernel).b_scale)
    return [s for s in own_scales(kernel, prequantized) if specs[s].static]


def step_scales(kernel: Kernel, prequantized: tuple[bool, ...]) -> list[int]:
    """The own-scaled operands whose scales every step computes (dynamic ones: an activation's), in launch order."""
    static = static_scales(kernel, prequantized)
    return [s for s in own_scales(kernel, prequantized) if s not in static]


GEMV_MAX_ROWS = 16       # a Gemm with at most this many output rows (batch * M) runs as a GEMV (codegen/blockops):
                         # the rows of A a `_staged` body stages at most
STAGE_BYTES = 8192       # FP32 bytes of A one body stages in shared memory at most (2,048 values: K = 1,536 at one row)


def staged_a_bytes(kernel: Kernel, prequantized: tuple[bool, ...]) -> int | None:
    """Bytes of A's FP32 staged copy when the Gemm's `_staged` entry can compute A's step scales in its own pass over
    A (codegen/cuda_gemm.py: it loads A once into shared memory, taking each scale block's amax as it loads, then
    quantizes from that copy), else None: A's scales a step computes, concrete (batch, M, K), at most GEMV_MAX_ROWS
    rows and STAGE_BYTES. Why: a GEMV tile computing A's scales privately otherwise reads A twice (issue 33)."""
    if 0 not in step_scales(kernel, prequantized):
        return None
    lay = kernel.layout
    if not all(isinstance(d, int) for d in (lay.batch, lay.m, lay.k)) or lay.batch * lay.m > GEMV_MAX_ROWS:
        return None
    size = 4 * lay.batch * lay.m * lay.k
    return size if size <= STAGE_BYTES else None
