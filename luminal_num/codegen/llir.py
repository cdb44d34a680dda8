"""LLIR: the kernel graph a backend executes. One `Kernel` per launch; fused bodies are `FExpr` trees.

Every kernel knows its output shape (symbolic), dtype, input views, bytes moved, flops, and whether
its output aliases an input buffer (in-place scatter). Shapes bind at run time.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Mapping, Union

from ..dtypes.formats import Format
from ..hlir.gemm import GemmLayout
from ..hlir.ops import Op
from ..hlir.shape import ShapeTracker
from ..hlir.symbolic import Dim, evaluate, prod


class KernelKind(enum.Enum):
    EXTERNAL = "external"        # a graph input buffer (no launch)
    CONST = "const"
    IOTA = "iota"
    ELEMENTWISE = "elementwise"  # a fused chain of elementwise ops
    SUM = "sum"
    MAX = "max"
    SOFTMAX = "softmax"
    GEMM = "gemm"
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

    def bytes_stored(self, bindings: Mapping[str, int]) -> int:
        return int(self.numel(bindings) * self.dtype.itemsize) if self.kind.launches else 0

    def bytes_loaded(self, bindings: Mapping[str, int], dtypes: Mapping[int, Format]) -> int:
        """Each input read once per distinct element it touches (broadcasts are cached)."""
        total = 0
        for inp in self.inputs:
            v = inp.view.views[0]
            distinct = prod(d for d, s in zip(v.shape, v.strides) if s != 0) if len(inp.view.views) == 1 \
                else prod(inp.view.shape)
            total += int(evaluate(distinct, bindings) * dtypes[inp.buffer].itemsize)
        return total

    def flops(self, bindings: Mapping[str, int]) -> int:
        if self.kind is KernelKind.GEMM:
            lay = self.layout
            return int(2 * evaluate(lay.batch * lay.m * lay.n * lay.k, bindings))
        body_n = int(evaluate(prod(self.body_shape), bindings)) if self.body_shape else 1
        if self.kind is KernelKind.ELEMENTWISE:
            return self.numel(bindings) * max(count_ops(self.body), 1)
        if self.kind in (KernelKind.SUM, KernelKind.MAX):
            return body_n * (count_ops(self.body) + 1)
        if self.kind is KernelKind.SOFTMAX:
            return body_n * (count_ops(self.body) + 5)
        return 0


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
