"""ONNX Cast / CastLike on run-time tensors and the exact comparisons and selections (the op table in
onnx/ops.py names them). Every form here gives ONNX's result exactly on the values the graph holds:
casts that change no value (kinds.holds, or integers whose fed range fits the target: onnx/ranges.py),
comparisons as LessThan (NaN compares false, as in ONNX), selections as x*gt + y*(1-gt) of one operand.
"""
from __future__ import annotations

import math

import numpy as np
import onnx

from ..dtypes.formats import F32
from ..hlir.tensor import GraphTensor
from .kinds import ANY_KIND, EXACT_KINDS, FLOAT64, INTEGER_KINDS, VALUE_TYPES, data_kind_of_elem, holds
from .loader import BOOL, FLOAT, INT
from .ranges import RangeStep
from .round_cast import ROUNDING_TARGETS, round_to
from .values import NodeCtx, Tensor, Value

ANY = ANY_KIND
NUMBERS = INTEGER_KINDS + (INT,)


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


def _integer_operands(c: NodeCtx) -> bool:
    """Whether any input holds integers (then every input is taken as integer data: c.integer)."""
    return any(isinstance(v, np.ndarray) and v.dtype.kind in "iu" or isinstance(v, Tensor) and v.kind in NUMBERS
               for v in c.values if v is not None)


def _cast_to(c: NodeCtx, to: int) -> list[Value]:
    """A cast that changes no value: the source's values are all values of the target (kinds.holds), or
    integers whose fed range fits it (a range step: feed refuses a batch that would wrap or round). Any
    other cast rounds or wraps, which the graph does not express: refused."""
    src = c.tensor(0, ANY)
    dst = data_kind_of_elem(to)
    name = onnx.TensorProto.DataType.Name(to) if to in onnx.TensorProto.DataType.values() else str(to)
    if dst in ("int32", "int64") and src.kind == INT:
        return [src]  # indices stay indices
    if src.kind == FLOAT64 and dst == "double":
        return [src]
    if dst == BOOL:
        if src.kind == BOOL:
            return [src]
        if src.kind in NUMBERS:  # x != 0 at any magnitude: FP32 rounding never turns a nonzero into 0
            x = src.t.cast(F32) if src.kind == INT else src.t
            return _out((x > 0.0) + (x < 0.0), BOOL)  # the two tests are disjoint: the sum is 0 or 1
    elif dst is not None:
        as_kind = FLOAT if src.kind == "double" else src.kind  # "double" values are FP32 values (kinds.py)
        if src.kind in NUMBERS and not holds(as_kind, dst):
            x = c.integer(0)
            t = VALUE_TYPES[dst]
            if t.integer:  # values unchanged while they fit the target (ONNX wraps beyond)
                c.record("hull", (0,), dst)
            else:  # an integer is a value of a p-bit float up to 2^p
                c.record("hull", (0,), None, limit=min(2.0 ** t.p, t.hi))
            return _out(x.t, dst)
        if holds(as_kind, dst):
            if src.kind in NUMBERS:
                x = c.integer(0)
                if VALUE_TYPES[dst].integer:
                    c.record("hull", (0,), dst)
                return _out(x.t, dst)
            if src.kind == BOOL and VALUE_TYPES[dst].integer:
                c.importer.record(RangeStep(c.node.output[0], "const", (), dst, c.where, const=(0.0, 1.0, False)))
            return _out(src.t, dst)
    exact_float = src.kind in EXACT_KINDS + (FLOAT64,) and src.kind not in INTEGER_KINDS  # exact in the reference
    if exact_float and dst in ROUNDING_TARGETS:
        fp8 = dst.startswith("float8")  # ONNX's saturate applies to FP8 targets only
        return _out(round_to(src.t, VALUE_TYPES[dst], saturate=fp8 and c.attr("saturate", 1) == 1), dst)
    if c.attr("saturate", 1) != 1:
        raise c.refuse(f"saturate=0 is not supported (cast of a run-time {src.kind} tensor to {name})")
    raise c.refuse(f"cast of a run-time {src.kind} tensor to {name} is not supported: it rounds or wraps values, "
                   "which the graph (FP32 semantics; low-precision storage is the compiler's choice) does not express")


# -- comparisons and selections on run-time floats, each exact (NaN compares false, as in ONNX) -------
def abs_(c: NodeCtx) -> list[Value]:
    if _integer_operands(c):
        x = c.integer(0)
        c.record("abs", (0,), x.kind)
    else:
        x = c.tensor(0, EXACT_KINDS)
    return _out(x.t * (1.0 - 2.0 * (x.t < 0.0)), x.kind)  # x times +-1: exact; -0 stays -0 (== 0), NaN stays NaN


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
    """Comparisons of run-time values the graph holds exactly: floats, bool masks (0/1), integers (exact
    within the ranges feed checks: FP32 would merge integers past 2^24)."""
    def build(c: NodeCtx) -> list[Value]:
        if _integer_operands(c):
            a, b = c.integer(0).t, c.integer(1).t
        else:
            a, b = c.tensor(0, EXACT_KINDS + (BOOL,)).t, c.tensor(1, EXACT_KINDS + (BOOL,)).t
        return _out(_COMPARISONS[op](a, b), BOOL)
    return build


def extreme(largest: bool):
    """Variadic Max / Min by pairs: x*gt + y*(1-gt) selects one operand exactly (finite values; the runtime
    refuses infinite inputs); NaN in the first operand propagates, as numpy's maximum does."""
    def build(c: NodeCtx) -> list[Value]:
        integer = _integer_operands(c)
        parts = [c.integer(i) if integer else c.tensor(i, EXACT_KINDS) for i in range(len(c.values))]
        if len({p.kind for p in parts}) != 1:
            raise c.refuse(f"inputs mix {' and '.join(sorted({p.kind for p in parts}))} values")
        acc = parts[0].t
        for y in parts[1:]:
            acc = acc.maximum(y.t) if largest else -((-acc).maximum(-y.t))
        return _out(acc, (c.out_kind() or parts[0].kind) if integer else parts[0].kind)
    return build
