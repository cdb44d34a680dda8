"""A GEMM_EPILOGUE kernel on CUDA: the tiled Gemm of codegen/cuda_gemm.py (and its tensor-core entry,
codegen/cuda_gemm_tc.py) with its one store replaced by the epilogue body, rendered by the elementwise body
writer from the same op table (cuda_body.py).

The accumulator `total` (the variant's FP32 result, scales applied, exactly what the plain Gemm stores
in FP32) is the body's FAcc; each epilogue operand is read at the output element through its view;
every op is one FP32 rounding, as in the unfused elementwise kernel; one store in the kernel's dtype.
cuBLAS cannot run a body before its store, so such a kernel has no GemmCall, except `acc + bias along N`
with an FP32 output, which cuBLASLt's bias epilogue computes with the same rounding (cuda_gemm_bias.py).
"""
from __future__ import annotations

from ..dtypes.formats import Format
from ..hlir.shape import contiguous_strides
from .cuda_body import BodyWriter, IndexExpr, SymbolTable, load_float, view_index, c_index
from .cuda_gemm import EpilogueCode, render_gemm
from .cuda_source import KernelSource
from .cuda_weight_only import StoredOperand
from .llir import Kernel, acc_reads, epilogue_as_elementwise, gemm_output_shape

_ACC = -1  # the accumulator's buffer id in the elementwise form of the body (no buffer: `total`)


def render_gemm_epilogue(kernel: Kernel, formats: tuple[Format, ...], prequantized: tuple[bool, ...],
                         invariant: bool = False, stored: StoredOperand | None = None) -> KernelSource:
    """The tiled Gemm with this kernel's epilogue; `stored`: B read as its stored parts (render_gemm)."""
    if any(prequantized[2:]):
        raise ValueError(f"kernel {kernel.id}: a Gemm epilogue cannot read a QUANTIZE kernel's buffer")
    body = epilogue_as_elementwise(kernel, _ACC).body
    acc_slot = len(kernel.inputs)
    offsets = glu_offsets(kernel)

    def render(coords: list[IndexExpr], table: SymbolTable) -> tuple[list[str], str]:
        def load(slot: int) -> str:
            if slot == acc_slot:
                return "total"
            if slot > acc_slot:  # a GLU epilogue's accumulator of the columns at offset i
                return f"total{slot - acc_slot - 1}"
            at = view_index(kernel.inputs[slot].view, coords, table)
            value = load_float(formats[slot], f"in{slot}[{c_index(at.pos)}]")
            return value if at.valid is None else f"({at.valid}) ? {value} : 0.0f"
        return BodyWriter(load, table, prefix="ep").render(body)

    return render_gemm(kernel, formats, prequantized[:2], EpilogueCode(tuple(range(2, len(kernel.inputs))), render,
                                                                       offsets, kernel.shape[-1] if offsets else None),
                       invariant=invariant, stored=stored)


def glu_offsets(kernel: Kernel) -> tuple[int, ...]:
    """The column offset of each accumulator view of a GLU epilogue (acc_reads order), () for a plain one;
    a view that is not the accumulator's columns [off, off + n) at every row is refused in one line."""
    views = acc_reads(kernel.body)[1:]
    acc_shape = gemm_output_shape(kernel)
    out = []
    for st in views:
        v = st.views[0]
        n, total = kernel.shape[-1], acc_shape[-1]
        if len(st.views) != 1 or v.mask is not None or tuple(v.shape) != tuple(kernel.shape) \
                or tuple(v.strides) != tuple(contiguous_strides(acc_shape)) or not isinstance(v.offset, int) \
                or not isinstance(n, int) or not isinstance(total, int) or not 0 <= v.offset <= total - n:
            raise ValueError(f"kernel {kernel.id}: accumulator view {st} is not a column slice of {acc_shape}")
        out.append(v.offset)
    return tuple(out)
