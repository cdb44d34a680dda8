"""Which kernels of a program couple the rows of a batch through their values (issue 37).

A batch-invariant program fixes every reduction order (the backends' job), but no order makes a value
computed over several rows invariant: an activation scale taken from the amax of a whole tensor (or of a
block spanning rows) changes when another input joins the batch. So a batch-invariant plan may scale an
activation dynamically only per row of A (one scale per token, or blocks one row high); weights' static
scales and a B operand's dynamic scales (B is an activation only in attention's batched Gemms, one
matrix per sequence and head, each with its own scales: quant/scales.py keeps leading axes) are fine.
"""
from __future__ import annotations

from ..dtypes.variants import GEMM_VARIANTS, ScaleSpec
from .llir import KernelKind, Program


def _spans_rows(spec: ScaleSpec | None) -> bool:
    """A dynamic A scale whose block is more than one row high (0 = the whole axis)."""
    return spec is not None and not spec.static and spec.block[0] != 1


def row_coupled_kernels(program: Program) -> tuple[str, ...]:
    """One line per kernel whose values in one row depend on other rows' values (empty: none)."""
    out = []
    for k in program.launched():
        if k.kind is KernelKind.QUANTIZE and _spans_rows(k.scale_spec):
            out.append(f"kernel {k.id} ({k.label}): {k.precision} scales A per {k.scale_spec.granularity.name.lower()}"
                       " over many rows at run time")
        elif k.kind.is_gemm and k.precision not in (None, "f32") and k.precision in GEMM_VARIANTS \
                and not program.quantized_inputs(k)[0] and _spans_rows(GEMM_VARIANTS[k.precision].a_scale):
            out.append(f"kernel {k.id} ({k.label}): {k.precision} scales A per "
                       f"{GEMM_VARIANTS[k.precision].a_scale.granularity.name.lower()} over many rows at run time")
    return tuple(out)
