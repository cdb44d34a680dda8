"""The values an ONNX op handler sees: run-time Tensors or numpy arrays known at import time."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import helper

from ..dtypes.formats import F32
from ..hlir.graph import Graph
from ..hlir.tensor import GraphTensor
from .kinds import FLOAT64, FP32_EXACT_INTEGER, INTEGER_KINDS, VALUE_TYPES, data_kind_of_elem
from .loader import BOOL, FLOAT, INT, OnnxImportError
from .ranges import RangeStep


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
        if t.kind in (FLOAT64, "double") and FLOAT in kinds:  # double data where FP32 data goes: FP64-only
            return t
        if t.kind not in kinds:
            raise OnnxImportError(f"{self.where}: input {self.names[i]!r} holds {t.kind} values; "
                                  f"this op takes {'/'.join(kinds)}")
        return t

    def refuse(self, why: str) -> OnnxImportError:
        return OnnxImportError(f"{self.where}: {why}")

    def out_kind(self, i: int = 0) -> str | None:
        """The data kind of output i by ONNX's type inference (None where it is not known)."""
        elem = self.importer.elem_types.get(self.node.output[i])
        return data_kind_of_elem(elem) if elem is not None else None

    def integer(self, i: int) -> Tensor:
        """Input i as integer data held in FP32 (indices cast, known integers as FP32 constants), with a
        range step for its ONNX value so that OnnxModel.feed checks it stays exact (onnx/ranges.py)."""
        v, name = self.values[i], self.names[i]
        imp = self.importer
        if isinstance(v, np.ndarray):
            if v.dtype.kind not in "iu":
                raise self.refuse(f"input {name!r} holds {v.dtype} values; this op takes integers here")
            kind = data_kind_of_elem(onnx.helper.np_dtype_to_tensor_dtype(v.dtype))
            if v.size and float(np.max(np.abs(v.astype(np.float64)))) > FP32_EXACT_INTEGER:
                raise self.refuse(f"integer constant {name!r} exceeds 2^24 in magnitude (not exact in FP32)")
            lo, hi = (float(v.min()), float(v.max())) if v.size else (0.0, 0.0)
            imp.record(RangeStep(name, "const", (), kind, f"constant {name!r}", const=(lo, hi, bool(np.all(v != 0)))))
            if v.size == 1:
                return Tensor(self.graph.constant(float(v.reshape(()))).reshape(v.shape), kind)
            return Tensor(imp.materialize(f"{name}:f32", v.astype(np.float32)).t, kind)
        if v.kind in INTEGER_KINDS:
            return v
        if v.kind != INT:
            raise self.refuse(f"input {name!r} holds {v.kind} values; this op takes integers here")
        kind = data_kind_of_elem(imp.elem_types.get(name, onnx.TensorProto.INT64))
        imp.record(RangeStep(name, "hull", (name,), kind, f"{self.where} (input {name!r} used as a number)"))
        return Tensor(v.t.cast(F32), kind)

    def record(self, op: str, args: tuple[int, ...], kind: str | None, limit: float = FP32_EXACT_INTEGER,
               count: int = 1) -> None:
        """The range step of output 0 from inputs `args` (their ranges are recorded by `integer`)."""
        self.importer.record(RangeStep(self.node.output[0], op, tuple(self.names[i] for i in args), kind, self.where,
                                       limit, count=count))


def kind_of_array(a: np.ndarray, name: str) -> str:
    """The kind of a known array: bool masks, integer indices, FP32 data or the narrow floats FP32 holds."""
    if a.dtype == np.bool_:
        return BOOL
    if a.dtype.kind in "iu":
        return INT
    if a.dtype == np.float64:
        return FLOAT64
    kind = data_kind_of_elem(onnx.helper.np_dtype_to_tensor_dtype(a.dtype)) if a.dtype != np.float64 else None
    if kind is not None and kind in VALUE_TYPES and not VALUE_TYPES[kind].integer:
        return kind
    raise OnnxImportError(f"value {name!r} has dtype {a.dtype}; supported: float32 and float64 data, narrow floats, "
                          "integers, bool masks")


