"""HLIR nodes: what one primop application records (its sources' views, shape, dtype, chunk).

Separate from graph.py so the GraphTensor frontend (tensor.py) can build nodes without importing the
Graph that returns GraphTensors (graph -> tensor -> node, one way).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..dtypes.formats import Format
from .ops import Op
from .shape import ShapeTracker
from .symbolic import Dim, Poly, encode


@dataclass(frozen=True)
class Source:
    node: int
    view: ShapeTracker


@dataclass(frozen=True)
class Node:
    id: int
    op: Op
    srcs: tuple[Source, ...]
    shape: tuple[Dim, ...]
    dtype: Format
    attrs: tuple[tuple[str, Any], ...] = ()
    chunk: int = 0

    def attr(self, name: str) -> Any:
        for k, v in self.attrs:
            if k == name:
                return v
        raise KeyError(f"{self.op!r} node {self.id} has no attribute {name!r}")

    def structural_attrs(self) -> tuple:
        """Attributes that define the computed function; names of inputs/outputs are excluded."""
        out = []
        for k, v in self.attrs:
            if k == "name":
                continue
            if isinstance(v, float):
                v = ("float", v.hex())
            elif isinstance(v, (Poly, int)) and not isinstance(v, bool):
                v = encode(v)
            out.append((k, v))
        return tuple(out)


@dataclass(frozen=True)
class InputInfo:
    name: str
    node: int
    shape: tuple[Dim, ...]
    dtype: Format
    is_weight: bool
    value_range: tuple[float, float] | None = None  # declared range for static analysis
