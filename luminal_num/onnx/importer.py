"""ONNX graph -> HLIR Graph through the GraphTensor frontend (views stay views, MatMul stays Mul+SumReduce).

Every ONNX value is either a `Tensor` (a GraphTensor plus its kind: float data, bool mask held as
0/1 floats, or integer indices) or a numpy array known at import time. A node whose inputs are all
known is folded by ONNX's own reference implementation when folding is exact (shape arithmetic,
integer/bool results, value-preserving movement); float arithmetic on known values stays in the graph
so the FP64 reference computes it exactly. Input shapes are concrete (symbolic dims bound first).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping

import numpy as np
import onnx
from onnx import helper
from onnx.reference import ReferenceEvaluator

from ..dtypes.formats import F32, F64, INT32
from ..hlir.graph import Graph
from .kinds import FLOAT64, FP32_EXACT_INTEGER, INTEGER_KINDS, VALUE_TYPES, data_kind_of_elem
from .loader import BOOL, FLOAT, INT, LoadedModel, OnnxImportError, bind_input_shapes, elem_kind, graph_inputs, \
    initializer_arrays
from .ops import OPS, OpSpec, VALUE_INPUTS
from .ranges import RangeStep, check_ranges
from .values import Tensor, NodeCtx, Value, kind_of_array

_I32 = np.iinfo(np.int32)


@dataclass(frozen=True)
class IOSpec:
    name: str
    shape: tuple[int, ...]
    kind: str


@dataclass(frozen=True)
class OnnxModel:
    """An imported model: the HLIR graph plus how to feed it and read it back in ONNX terms."""

    graph: Graph
    inputs: tuple[IOSpec, ...]
    outputs: tuple[IOSpec, ...]
    constant_outputs: Mapping[str, np.ndarray]  # outputs fully known at import (folded)
    sha256: str
    opset: int
    ranges: tuple[RangeStep, ...] = ()  # how integer data's ranges follow from the inputs' (checked per batch)
    fp64_only: str | None = None  # why only the FP64 reference may run it (double data), None for any plan

    def feed(self, arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """ONNX input arrays -> graph inputs (bool masks as 0/1 float32, indices as int64, integer data and
        narrow floats as their exact FP32 values); a batch whose integer data could leave its exact range
        is refused in one line (onnx/ranges.py)."""
        out = {}
        for spec in self.inputs:
            if spec.name not in arrays:
                raise OnnxImportError(f"missing input {spec.name!r}")
            a = np.asarray(arrays[spec.name])
            if tuple(a.shape) != spec.shape:
                raise OnnxImportError(f"input {spec.name!r}: shape {a.shape}, the model was imported for {spec.shape}")
            integer = spec.kind == INT or spec.kind in INTEGER_KINDS
            exact_type = spec.kind in VALUE_TYPES and a.dtype == VALUE_TYPES[spec.kind].dtype  # int4/int2: ml_dtypes
            if integer and a.dtype.kind not in "iu" and not exact_type:  # a cast would truncate 2.7 to 2, NaN to 0
                raise OnnxImportError(f"input {spec.name!r} takes integers; got {a.dtype} data")
            if spec.kind == INT and a.size and (a.min() < _I32.min or a.max() > _I32.max):
                raise OnnxImportError(f"input {spec.name!r} holds integers outside int32 (the graph's index type)")
            magnitude = float(np.max(np.abs(a.astype(np.float64)))) if a.size and spec.kind in INTEGER_KINDS else 0.0
            if magnitude > FP32_EXACT_INTEGER:
                raise OnnxImportError(f"input {spec.name!r} holds integers beyond 2^24 in magnitude; integer data is "
                                      "exact in the graph only within +-2^24")
            if spec.kind == FLOAT64 and a.dtype.kind != "f":
                raise OnnxImportError(f"input {spec.name!r} takes double data; got {a.dtype}")
            out[spec.name] = a.astype(np.int64) if spec.kind == INT else \
                a.astype(np.float64) if spec.kind == FLOAT64 else a.astype(np.float32)
        check_ranges(self.ranges, {n: np.asarray(a) for n, a in arrays.items()})
        return out

    def restore(self, values: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Graph outputs -> ONNX outputs (masks back to bool, typed values to their ONNX dtype), with the
        folded outputs added."""
        out = {}
        for spec in self.outputs:
            if spec.name in self.constant_outputs:
                out[spec.name] = self.constant_outputs[spec.name]
            else:
                out[spec.name] = _as_onnx(np.asarray(values[spec.name]), spec)
        return out


def _as_onnx(v: np.ndarray, spec: IOSpec) -> np.ndarray:
    """A graph output as its ONNX type: exact (every value of a typed output is a value of its type)."""
    if spec.kind == BOOL:
        return v > 0.5
    t = VALUE_TYPES.get("int64" if spec.kind == INT else spec.kind)
    if t is None or spec.kind == FLOAT:
        return v
    with np.errstate(invalid="ignore", over="ignore"):
        typed = v.astype(t.dtype)
    same = typed.astype(np.float64) == v.astype(np.float64)
    if not np.all(same | (np.isnan(v) & (not t.integer))):
        raise ValueError(f"output {spec.name!r}: a value is not a {spec.kind} value (a bug: typed outputs are exact)")
    return typed


@dataclass
class _Importer:
    graph: Graph
    opset: int
    proto: onnx.ModelProto
    elem_types: dict[str, int]
    inferred: dict[str, tuple]  # ONNX shape inference's output shapes (None for unknown dims)
    env: dict[str, Value] = field(default_factory=dict)
    materialized: dict[str, Tensor] = field(default_factory=dict)
    ranges: list[RangeStep] = field(default_factory=list)
    ranged: set[str] = field(default_factory=set)  # values with a range step
    fp64_only: str | None = None  # the first node that computes on double data

    def record(self, step: RangeStep) -> None:
        self.ranges.append(step)
        self.ranged.add(step.out)

    def materialize(self, name: str, value: np.ndarray) -> Tensor:
        """A known array entering the graph: one-element floats as constants, others as weights."""
        kind = kind_of_array(value, name)
        if kind in (FLOAT, FLOAT64) and value.size == 1:  # constants live in their chunk (no cross-chunk edges)
            return Tensor(self.graph.constant(float(value.reshape(()))).reshape(value.shape), kind)
        if name in self.materialized:
            return self.materialized[name]
        if kind == INT:
            if value.size and (value.min() < np.iinfo(np.int32).min or value.max() > np.iinfo(np.int32).max):
                raise OnnxImportError(f"integer constant {name!r} does not fit int32")
            t = self.graph.weight(name, value.astype(np.int64), INT32)
        else:
            if not np.all(np.isfinite(value)):  # refused here, in one line, not by the run
                raise OnnxImportError(f"known tensor {name!r} holds NaN or Inf and would enter the graph as a "
                                      "weight; the runtime refuses non-finite values")
            wide = kind == FLOAT64  # double data keeps its values (the FP64 reference reads them exactly)
            t = self.graph.weight(name, value.astype(np.float64 if wide else np.float32), F64 if wide else F32)
        self.materialized[name] = Tensor(t, kind)
        return self.materialized[name]

    def fold(self, node: onnx.NodeProto, values: list[np.ndarray | None]) -> list[np.ndarray]:
        """Run one node on known values with ONNX's reference implementation (exact numpy)."""
        feeds = {n: v for n, v in zip(node.input, values) if n}
        ins = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
               for n, v in feeds.items()]
        outs = [helper.make_empty_tensor_value_info(o) for o in node.output if o]
        g = helper.make_graph([node], "fold", ins, outs)
        m = helper.make_model(g, opset_imports=list(self.proto.opset_import), ir_version=self.proto.ir_version)
        try:
            res = ReferenceEvaluator(m).run(None, feeds)
        except Exception as exc:  # noqa: BLE001 - a failing fold is the model's error
            raise OnnxImportError(f"{node.op_type} node {node.name!r}: folding known inputs failed: "
                                  f"{' '.join(str(exc).split())[:200]}") from None
        return [np.asarray(r) for r in res]


def _opset(proto: onnx.ModelProto) -> int:
    for o in proto.opset_import:
        if o.domain in ("", "ai.onnx"):
            return int(o.version)
    raise OnnxImportError("model imports no default-domain opset")


def import_model(loaded: LoadedModel, shapes: Mapping[str, tuple[int, ...]] | None = None,
                 known_inputs: Mapping[str, np.ndarray] | None = None) -> OnnxModel:
    """Build the HLIR graph of a loaded model for concrete input shapes.

    `known_inputs` freezes graph inputs to values known at import (ONNX node tests pass axes and
    shapes as inputs); every other input becomes a graph input of its bound shape.
    """
    proto = loaded.proto
    known = dict(known_inputs or {})
    bound = bind_input_shapes(proto, dict(shapes or {}), frozenset(known))
    elem_types = {v.name: v.type.tensor_type.elem_type for v in
                  list(proto.graph.input) + list(proto.graph.value_info) + list(proto.graph.output)
                  if v.type.HasField("tensor_type")}
    shapes_known = {vi.name: tuple(d.dim_value if d.HasField("dim_value") else None for d in vi.type.tensor_type.shape.dim)
                    for vi in list(proto.graph.value_info) + list(proto.graph.output)
                    if vi.type.HasField("tensor_type") and vi.type.tensor_type.HasField("shape")}
    imp = _Importer(Graph(), _opset(proto), proto, elem_types, shapes_known)
    imp.env.update(initializer_arrays(proto))
    inputs = []
    for inp in graph_inputs(proto):
        if inp.name not in known and 0 in bound[inp.name]:  # a zero-sized tensor has one value: known
            known[inp.name] = np.zeros(bound[inp.name], helper.tensor_dtype_to_np_dtype(inp.type.tensor_type.elem_type))
        if inp.name in known:
            imp.env[inp.name] = np.asarray(known[inp.name])
            continue
        kind = _input_kind(proto, inp, elem_types)
        dtype = INT32 if kind == INT else F64 if kind == FLOAT64 else F32
        if kind == FLOAT64:
            imp.fp64_only = imp.fp64_only or f"input {inp.name!r} holds double data"
        t = imp.graph.input(inp.name, bound[inp.name], dtype, value_range=_value_range(kind))
        imp.env[inp.name] = Tensor(t, kind)
        inputs.append(IOSpec(inp.name, bound[inp.name], kind))
        if kind == INT or kind in INTEGER_KINDS:  # indices: no range limit (feed checks int32)
            imp.record(RangeStep(inp.name, "input", (inp.name,), kind if kind != INT else None, f"input {inp.name!r}",
                                 limit=FP32_EXACT_INTEGER if kind != INT else math.inf))
    for node in proto.graph.node:
        _import_node(imp, node, OPS)
    outputs, constants = [], {}
    for out in proto.graph.output:
        v = imp.env[out.name]
        if isinstance(v, np.ndarray):
            constants[out.name] = v
            outputs.append(IOSpec(out.name, tuple(v.shape), kind_of_array(v, out.name) if v.dtype != np.float64
                                  else "double"))
        else:
            want = data_kind_of_elem(elem_types.get(out.name, 0))
            if want not in (None, v.kind) and not (v.kind == INT and want in ("int32", "int64")) and \
                    not (v.kind == FLOAT64 and want == "double"):
                raise OnnxImportError(f"output {out.name!r} is {want} in the model, but the graph holds {v.kind} "
                                      "values")
            imp.graph.output(v.t, out.name)
            outputs.append(IOSpec(out.name, v.shape, v.kind))
    return OnnxModel(imp.graph, tuple(inputs), tuple(outputs), constants, loaded.sha256, imp.opset, tuple(imp.ranges),
                     imp.fp64_only)


def _value_range(kind: str) -> tuple[float, float] | None:
    """The static analysis' declared range of an input: masks 0/1, integer data within its type and +-2^24
    (feed refuses other batches)."""
    if kind == BOOL:
        return (0.0, 1.0)
    t = VALUE_TYPES.get(kind)
    if t is None or not t.integer:
        return None
    return (max(t.lo, -FP32_EXACT_INTEGER), min(t.hi, FP32_EXACT_INTEGER))


# DOUBLE inputs whose every consumer is Cast(to=FLOAT) or CastLike to a FLOAT are fed as FP32: exactly that
# cast (double -> fp32 rounds to nearest, as Cast does); other DOUBLE inputs are double data (FLOAT64,
# FP64-only). Inputs of the narrower types (kinds.py) are their own kinds: every value is an FP32 value.
_T = onnx.TensorProto
_CAST_ONLY_INPUTS = (_T.DOUBLE,)


def _input_kind(proto: onnx.ModelProto, inp: onnx.ValueInfoProto, elem_types: Mapping[str, int]) -> str:
    elem = inp.type.tensor_type.elem_type
    kind = data_kind_of_elem(elem)
    if kind is not None and kind not in (FLOAT, "double", "int32", "int64"):
        return kind
    if elem in _CAST_ONLY_INPUTS:
        users = [n for n in proto.graph.node if inp.name in n.input]

        def to_float(n: onnx.NodeProto) -> bool:
            if n.op_type == "Cast":
                return {a.name: helper.get_attribute_value(a) for a in n.attribute}.get("to") == _T.FLOAT
            if n.op_type == "CastLike" and n.input[0] == inp.name and len(n.input) > 1:
                return _like_type(proto, n.input[1], elem_types) == _T.FLOAT
            return False
        return FLOAT if users and all(to_float(n) for n in users) else FLOAT64
    return elem_kind(elem, f"input {inp.name!r}")


def _like_type(proto: onnx.ModelProto, name: str, elem_types: Mapping[str, int]) -> int | None:
    """A CastLike target's element type: a declared value's, or an initializer's."""
    if name in elem_types:
        return elem_types[name]
    return next((t.data_type for t in proto.graph.initializer if t.name == name), None)


# A chunk starts at every normalization: transformer layers (pre- or post-norm) then fall into
# structurally identical chunks that share one search, as the hand-written models' graph_breaks do.
CHUNK_STARTS = ("LayerNormalization", "RMSNormalization", "SimplifiedLayerNormalization")


def _import_node(imp: _Importer, node: onnx.NodeProto, table: Mapping[str, OpSpec]) -> None:
    where = f"{node.op_type} node {node.name or node.output[0]!r}"
    if node.op_type in CHUNK_STARTS and len(imp.graph) > len(imp.graph.inputs):
        imp.graph.graph_break()
    if node.domain not in ("", "ai.onnx"):
        raise OnnxImportError(f"unsupported ONNX op {node.domain}.{node.op_type} ({where})")
    spec = table.get(node.op_type)
    if spec is None:
        raise OnnxImportError(f"unsupported ONNX op {node.op_type} ({where})")
    unknown = [] if spec.attrs is None else sorted({a.name for a in node.attribute} - spec.attrs)
    if unknown:
        raise OnnxImportError(f"{where}: unsupported attribute(s) {unknown}")
    values = [imp.env.get(n) if n else None for n in node.input]
    missing = [n for n, v in zip(node.input, values) if n and v is None]
    if missing:
        raise OnnxImportError(f"{where}: inputs {missing} are not defined")
    all_known = all(v is None or isinstance(v, np.ndarray) for v in values)
    out_types = [imp.elem_types.get(o) for o in node.output if o]
    exact = spec.exact or all(t is not None and t != onnx.TensorProto.FLOAT for t in out_types)
    # an op over zero-sized known tensors computes nothing (its outputs are empty or reductions' identities)
    exact = exact or any(isinstance(v, np.ndarray) and v.size == 0 for v in values)
    if all_known and (exact or spec.fn is None):
        results = imp.fold(node, values)
    elif spec.fn is None:
        raise OnnxImportError(f"{where}: {node.op_type} is supported only on values known at import time")
    else:
        try:
            results = spec.fn(NodeCtx(node, values, list(node.input), imp))
        except OnnxImportError:
            raise
        except (ValueError, IndexError) as exc:  # the frontend's shape checks: the model does not fit
            raise OnnxImportError(f"{where}: {' '.join(str(exc).split())}") from None
    if node.op_type not in ("Cast", "CastLike") and any(isinstance(v, Tensor) and v.kind in (FLOAT64, "double") or
                                                         isinstance(v, np.ndarray) and v.dtype == np.float64
                                                         for v in values):
        results = _as_double(imp, results, where)
    live = [o for o in node.output]
    if len(results) < len([o for o in live if o]):
        raise OnnxImportError(f"{where}: produces only {len(results)} of its outputs")
    for name, val in zip(live, results):
        if name:
            _check_shape(imp, name, val, where)
            imp.env[name] = val
            if isinstance(val, Tensor) and (val.kind == INT or val.kind in INTEGER_KINDS) and name not in imp.ranged:
                _range_through(imp, node, name, val, values, where)


def _as_double(imp: _Importer, results: list, where: str) -> list:
    """An op on double values computes in double in ONNX: its FP32-data results are double data (FLOAT64),
    which only the FP64 reference computes so (the model becomes FP64-only)."""
    out = []
    for r in results:
        if isinstance(r, Tensor) and r.kind == FLOAT:
            imp.fp64_only = imp.fp64_only or f"{where} computes on double data"
            r = Tensor(r.t, FLOAT64)
        out.append(r)
    return out


def _range_through(imp: _Importer, node: onnx.NodeProto, name: str, val: Tensor, values: list, where: str) -> None:
    """The range step of an integer result of an op that only moves or selects its inputs' values: the hull
    of the inputs that carry them (ops.VALUE_INPUTS); any other op must record its own step."""
    if node.op_type not in VALUE_INPUTS:
        raise OnnxImportError(f"{where}: no range rule for its integer result {name!r}")
    slots = VALUE_INPUTS[node.op_type] or tuple(range(len(node.input)))
    args = []
    for i in slots:
        arg = node.input[i] if i < len(node.input) else ""
        if not arg:
            continue
        if arg not in imp.ranged:
            v = values[i]
            if not isinstance(v, np.ndarray) or v.dtype.kind not in "iub":
                raise OnnxImportError(f"{where}: no range for its integer operand {arg!r}")
            lo, hi = (float(v.min()), float(v.max())) if v.size else (0.0, 0.0)
            imp.record(RangeStep(arg, "const", (), None, f"constant {arg!r}", math.inf, (lo, hi, bool(np.all(v != 0)))))
        args.append(arg)
    index = val.kind == INT
    imp.record(RangeStep(name, "hull", tuple(args), None if index else val.kind, where,
                         math.inf if index else FP32_EXACT_INTEGER))


def _check_shape(imp: _Importer, name: str, val: Value, where: str) -> None:
    """The importer's shape must equal ONNX shape inference's where that is known (catches mapping bugs)."""
    got, want = tuple(val.shape), imp.inferred.get(name)
    if want is not None and (len(want) != len(got) or any(w not in (None, 0) and w != g for w, g in zip(want, got))):
        raise OnnxImportError(f"{where}: output {name!r} has shape {got}, ONNX infers {want}")
