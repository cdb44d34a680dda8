"""The values an ONNX op handler sees: run-time Tensors or numpy arrays known at import time."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import helper

from ..hlir.graph import Graph
from ..hlir.tensor import GraphTensor
from .loader import BOOL, FLOAT, INT, OnnxImportError


@dataclass(frozen=True)
class Tensor:
    """A run-time value: the GraphTensor and what its elements mean (float data, 0/1 mask, indices)."""

    t: GraphTensor
    kind: str

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(int(d) for d in self.t.shape)


Value = Tensor | np.ndarray


@dataclass
class NodeCtx:
    """What an op handler sees: the node, its attributes, its input values and the graph."""

    node: onnx.NodeProto
    values: list[Value | None]
    names: list[str]
    importer: Any  # the importer: .graph, .opset, .materialize(name, array)

    @property
    def graph(self) -> Graph:
        return self.importer.graph

    @property
    def opset(self) -> int:
        return self.importer.opset

    @property
    def where(self) -> str:
        return f"{self.node.op_type} node {self.node.name or self.node.output[0]!r}"

    def attr(self, name: str, default=None):
        for a in self.node.attribute:
            if a.name == name:
                return helper.get_attribute_value(a)
        return default

    def has(self, i: int) -> bool:
        return i < len(self.values) and self.values[i] is not None

    def const(self, i: int, what: str) -> np.ndarray:
        v = self.values[i]
        if not isinstance(v, np.ndarray):
            raise OnnxImportError(f"{self.where}: {what} (input {i}) must be known at import time, "
                                  f"but {self.names[i]!r} is computed at run time")
        return v

    def tensor(self, i: int, kinds: tuple[str, ...] = (FLOAT,)) -> Tensor:
        v = self.values[i]
        t = self.importer.materialize(self.names[i], v) if isinstance(v, np.ndarray) else v
        if t.kind not in kinds:
            raise OnnxImportError(f"{self.where}: input {self.names[i]!r} holds {t.kind} values; "
                                  f"this op takes {'/'.join(kinds)}")
        return t

    def refuse(self, why: str) -> OnnxImportError:
        return OnnxImportError(f"{self.where}: {why}")


def kind_of_array(a: np.ndarray, name: str) -> str:
    if a.dtype == np.bool_:
        return BOOL
    if a.dtype.kind in "iu":
        return INT
    if a.dtype == np.float32:
        return FLOAT
    raise OnnxImportError(f"value {name!r} has dtype {a.dtype}; supported: float32 data, int64/int32 indices, bool masks")


