"""ONNX Cast / CastLike on run-time tensors and the exact comparisons and selections (the op table in
onnx/ops.py names them). Every form here gives ONNX's result exactly on the values the graph holds:
casts within FP32's meaning, comparisons as LessThan (NaN compares false, as in ONNX), selections as
x*gt + y*(1-gt) of one operand.
"""
from __future__ import annotations

import math

import numpy as np
import onnx

from ..dtypes.formats import F32
from ..hlir.tensor import GraphTensor
from .loader import BOOL, FLOAT, INT
from .values import NodeCtx, Tensor, Value

ANY = (FLOAT, BOOL, INT)


def _out(t: GraphTensor, kind: str = FLOAT) -> list[Value]:
    return [Tensor(t, kind)]


def cast(c: NodeCtx) -> list[Value]:
    return _cast_to(c, c.attr("to"))


def castlike(c: NodeCtx) -> list[Value]:
    """Cast to the element type of input 1 (only its type is read: a zero-sized 'like' is fine)."""
    like = c.values[1]
    to = (onnx.helper.np_dtype_to_tensor_dtype(like.dtype) if isinstance(like, np.ndarray)
          else c.importer.elem_types.get(c.names[1]))
    if to is None:
        raise c.refuse(f"the element type of {c.names[1]!r} is unknown")
    return _cast_to(c, to)


# A run-time cast to DOUBLE keeps the FP32 value exactly. Casts that round (to FLOAT16, BFLOAT16, FP8) are
# refused: the FP64 reference treats an HLIR Cast as a precision choice, not as the value change ONNX means.


def _cast_to(c: NodeCtx, to: int) -> list[Value]:
    src = c.tensor(0, ANY)
    if c.attr("saturate", 1) != 1 and to != onnx.TensorProto.FLOAT:
        raise c.refuse("saturate=0 is not supported")
    if to in (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE):
        return _out(src.t.cast(F32) if src.kind == INT else src.t)
    want = {onnx.TensorProto.BOOL: BOOL, onnx.TensorProto.INT64: INT, onnx.TensorProto.INT32: INT}.get(to)
    if want is not None and want == src.kind:
        return [src]
    if want == BOOL and src.kind == INT:  # x != 0; int -> FP32 rounding never turns a nonzero into 0
        xf = src.t.cast(F32)
        return _out((xf > 0.0) + (xf < 0.0), BOOL)  # the two tests are disjoint: the sum is 0 or 1
    raise c.refuse(f"cast of a run-time {src.kind} tensor to {onnx.TensorProto.DataType.Name(to)} is not supported "
                   "(the graph computes in FP32; low-precision storage is the compiler's choice)")


# -- comparisons and selections on run-time floats, each exact (NaN compares false, as in ONNX) -------
def abs_(c: NodeCtx) -> list[Value]:
    x = c.tensor(0).t
    return _out(x * (1.0 - 2.0 * (x < 0.0)))  # x times +-1: exact; -0 stays -0 (== 0), NaN stays NaN


def _either(p: GraphTensor, q: GraphTensor) -> GraphTensor:
    return p + q - p * q  # OR of 0/1 values: exact


def _not_nan(x: GraphTensor) -> GraphTensor:
    return _either(x < math.inf, -math.inf < x)  # false for NaN only (+-inf pass one test each)


def _equal(a: GraphTensor, b: GraphTensor) -> GraphTensor:
    """a == b on floats: neither is below the other and neither is NaN (NaN == NaN is false in ONNX)."""
    return (1.0 - (a < b)) * (1.0 - (b < a)) * _not_nan(a) * _not_nan(b)


# (a, b) -> the 0/1 result; each exact on every float, NaN included (ONNX compares NaN as unordered)
_COMPARISONS = {
    "Less": lambda a, b: a < b,
    "Greater": lambda a, b: b < a,
    "Equal": _equal,
    "LessOrEqual": lambda a, b: _either(a < b, _equal(a, b)),
    "GreaterOrEqual": lambda a, b: _either(b < a, _equal(a, b)),
}


def compare(op: str):
    """Comparisons of run-time floats (and bool masks, held as 0/1); integers are refused: the graph
    would compare them as FP32, which merges integers past 2^24."""
    def build(c: NodeCtx) -> list[Value]:
        a, b = c.tensor(0, (FLOAT, BOOL)).t, c.tensor(1, (FLOAT, BOOL)).t
        return _out(_COMPARISONS[op](a, b), BOOL)
    return build


def extreme(largest: bool):
    """Variadic Max / Min by pairs: x*gt + y*(1-gt) selects one operand exactly (finite values; the runtime
    refuses infinite inputs); NaN in the first operand propagates, as numpy's maximum does."""
    def build(c: NodeCtx) -> list[Value]:
        acc = c.tensor(0).t
        for i in range(1, len(c.values)):
            y = c.tensor(i).t
            acc = acc.maximum(y) if largest else -((-acc).maximum(-y))
        return _out(acc)
    return build
