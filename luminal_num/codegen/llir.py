"""LLIR: the kernel graph a backend executes. One `Kernel` per launch; fused bodies are `FExpr` trees.

Every kernel knows its output shape (symbolic), dtype, input views, bytes moved, flops, and whether
its output aliases an input buffer (in-place scatter). Shapes bind at run time.

Dynamic activation scales are a kernel of their own (QUANTIZE): it reads a Gemm's A operand through
the Gemm's view and writes it contiguous as (batch, M, K) in the variant's A format. Its scales are a
side output, not a second buffer: the LLIR keeps one output per kernel (liveness, aliasing and the
op table stay one buffer per id), and the scales are tiny (one float per tensor / token / block), so
each runtime keeps them beside the buffer, keyed by the QUANTIZE kernel's id; `scales_shape` says
their shape. There is no DEQUANTIZE kind: the only reader of quantized data is the Gemm, which
applies the scales itself exactly where its variant says (after each chunk, or per product), so a
kernel widening q * s back to values would change the arithmetic, not just move it.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Mapping, Union

import numpy as np

from ..dtypes.formats import F32, Format
from ..dtypes.variants import GEMM_VARIANTS, ScaleSpec
from ..hlir.gemm import GemmLayout
from ..hlir.ops import Op
from ..hlir.shape import ShapeTracker, View, contiguous_strides
from ..hlir.symbolic import Dim, evaluate, prod
from ..quant.scales import scale_shape


class KernelKind(enum.Enum):
    EXTERNAL = "external"        # a graph input buffer (no launch)
    CONST = "const"
    IOTA = "iota"
    ELEMENTWISE = "elementwise"  # a fused chain of elementwise ops
    SUM = "sum"
    MAX = "max"
    SOFTMAX = "softmax"
    GEMM = "gemm"
    QUANTIZE = "quantize"        # a Gemm's A operand -> (batch, M, K) in its format, scales beside it
    GATHER = "gather"
    SCATTER = "scatter"
    SCATTER_NOCOPY = "scatter_nocopy"

    @property
    def launches(self) -> bool:
        return self is not KernelKind.EXTERNAL


# -- fused scalar bodies ------------------------------------------------------------------------
@dataclass(frozen=True)
class FLoad:
    slot: int  # index into Kernel.inputs


@dataclass(frozen=True)
class FConstV:
    value: object  # float or symbolic Dim


@dataclass(frozen=True)
class FRoundTo:
    x: "FExpr"
    fmt: Format
    origin: str = ""  # the HLIR op whose value is rounded (a fused low-precision producer), for messages


@dataclass(frozen=True)
class FApply:
    op: Op                      # a UNARY/BINARY primop, or Op.CUSTOM with `kind`
    args: tuple["FExpr", ...]
    kind: str | None = None


FExpr = Union[FLoad, FConstV, FRoundTo, FApply]


def count_ops(e: FExpr) -> int:
    if isinstance(e, FApply):
        return 1 + sum(count_ops(a) for a in e.args)
    if isinstance(e, FRoundTo):
        return count_ops(e.x)
    return 0


@dataclass(frozen=True)
class KernelInput:
    buffer: int          # id of the producing kernel
    view: ShapeTracker   # how this kernel reads it


@dataclass(frozen=True)
class Kernel:
    id: int
    kind: KernelKind
    inputs: tuple[KernelInput, ...]
    shape: tuple[Dim, ...]
    dtype: Format
    body: FExpr | None = None          # ELEMENTWISE / SUM / MAX / SOFTMAX
    body_shape: tuple[Dim, ...] = ()   # iteration space of the body (un-reduced)
    axis: int | None = None
    acc: Format | None = None          # reduction accumulator
    precision: str | None = None       # Gemm variant name / softmax compute precision
    layout: GemmLayout | None = None
    aliases: int | None = None         # input index whose buffer the output overwrites
    chunk: int = -1
    external: str | None = None        # graph input name (EXTERNAL)
    value: object = None               # CONST value / IOTA length
    label: str = ""                    # where it came from (graph node), for op tables

    def numel(self, bindings: Mapping[str, int]) -> int:
        return int(evaluate(prod(self.shape), bindings)) if self.shape else 1

    # -- QUANTIZE: the scales kept beside the buffer ---------------------------------------------
    @property
    def scale_spec(self) -> ScaleSpec:
        """How a QUANTIZE kernel scales its operand: its Gemm variant's A scale."""
        if self.kind is not KernelKind.QUANTIZE:
            raise ValueError(f"kernel {self.id} is {self.kind.value}: only QUANTIZE kernels have scales")
        return GEMM_VARIANTS[self.precision].a_scale

    def scales_shape(self, bindings: Mapping[str, int]) -> tuple[int, ...]:
        """Shape of the scales beside a QUANTIZE kernel's (batch, M, K) buffer (luminal_num.quant)."""
        return scale_shape(self.scale_spec, tuple(evaluate(d, bindings) for d in self.shape))

    def scales_bytes(self, bindings: Mapping[str, int]) -> int:
        """Bytes of those scales: FP32 each (E8M0 scales too: kernels hold them unpacked as float)."""
        if self.kind is not KernelKind.QUANTIZE:
            return 0
        return int(np.prod(self.scales_shape(bindings), dtype=np.int64) * F32.itemsize)

    # -- cost ----------------------------------------------------------------------------------
    def bytes_stored(self, bindings: Mapping[str, int]) -> int:
        if not self.kind.launches:
            return 0
        return int(self.numel(bindings) * self.dtype.itemsize) + self.scales_bytes(bindings)

    def bytes_loaded(self, bindings: Mapping[str, int], dtypes: Mapping[int, Format]) -> int:
        """Each input read once per distinct element it touches (broadcasts are cached); a QUANTIZE
        kernel reads its operand twice (an amax pass, then the convert pass) and its scales once."""
        total = 0
        for inp in self.inputs:
            v = inp.view.views[0]
            distinct = prod(d for d, s in zip(v.shape, v.strides) if s != 0) if len(inp.view.views) == 1 \
                else prod(inp.view.shape)
            total += int(evaluate(distinct, bindings) * dtypes[inp.buffer].itemsize)
        if self.kind is KernelKind.QUANTIZE:
            total = 2 * total + self.scales_bytes(bindings)
        return total

    def flops(self, bindings: Mapping[str, int]) -> int:
        if self.kind is KernelKind.GEMM:
            lay = self.layout
            return int(2 * evaluate(lay.batch * lay.m * lay.n * lay.k, bindings))
        if self.kind is KernelKind.QUANTIZE:  # a max per element, a division per element, one per scale
            return 2 * self.numel(bindings) + int(self.scales_bytes(bindings) // F32.itemsize)
        body_n = int(evaluate(prod(self.body_shape), bindings)) if self.body_shape else 1
        if self.kind is KernelKind.ELEMENTWISE:
            return self.numel(bindings) * max(count_ops(self.body), 1)
        if self.kind in (KernelKind.SUM, KernelKind.MAX):
            return body_n * (count_ops(self.body) + 1)
        if self.kind is KernelKind.SOFTMAX:
            return body_n * (count_ops(self.body) + 5)
        return 0


def quantized_a_view(layout: GemmLayout) -> ShapeTracker:
    """How a Gemm reads its QUANTIZE buffer: over the Mul's full shape, (batch axes, M axes, K axis)
    mapped row-major into the contiguous (batch, M, K) buffer, stride 0 along the N axes; so
    gemm_operand_a of what it reads is the buffer itself."""
    full = layout.full_shape
    order = (*layout.batch_axes, *layout.m_axes, layout.k_axis)
    stride_of = dict(zip(order, contiguous_strides([full[a] for a in order])))
    return ShapeTracker((View.create(full, [stride_of.get(a, 0) for a in range(len(full))]),))


@dataclass(frozen=True)
class Program:
    kernels: tuple[Kernel, ...]
    inputs: tuple[tuple[str, int], ...]    # graph input name -> EXTERNAL kernel id
    outputs: tuple[tuple[str, int], ...]   # graph output name -> kernel id
    exports: tuple[tuple[int, int], ...] = ()  # (graph node id, kernel id) of every chunk export (audits)

    def dtypes(self) -> dict[int, Format]:
        return {k.id: k.dtype for k in self.kernels}

    def launched(self) -> list[Kernel]:
        return [k for k in self.kernels if k.kind.launches]

    def kernel(self, kid: int) -> Kernel:
        """The kernel with id `kid` (ids are positions in lowered programs; searched otherwise)."""
        k = self.kernels[kid] if 0 <= kid < len(self.kernels) else None
        return k if k is not None and k.id == kid else next(p for p in self.kernels if p.id == kid)

    def quantized_inputs(self, kernel: Kernel) -> tuple[bool, ...]:
        """Per input of `kernel`: whether it is a QUANTIZE kernel's buffer (q, read with its scales)."""
        return tuple(self.kernel(inp.buffer).kind is KernelKind.QUANTIZE for inp in kernel.inputs)
