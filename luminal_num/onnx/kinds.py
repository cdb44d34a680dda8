"""The value kinds an imported tensor carries, and the ONNX element types held exactly as FP32 values.

The graph computes in FP32 (choosing narrower storage is the compiler's job). Besides FP32 data (FLOAT),
bool masks (BOOL, held as 0/1) and indices (INT: int32/int64 inputs, the graph's INT32 index type), a
tensor may hold the values of a narrower ONNX type, each of which is an FP32 value:
- integer data (int2 .. int64, uint2 .. uint64), exact in FP32 while |v| <= 2^24: OnnxModel.feed
  propagates the fed values' ranges through every integer op (onnx/ranges.py) and refuses a batch that
  could leave that range or its ONNX type's range (ONNX wraps, the graph does not);
- narrow floats (float16, bfloat16, FP8, FP4): every value is an FP32 value, so ops that only select,
  compare, negate or move values give ONNX's result exactly; arithmetic (which ONNX rounds to the narrow
  type) is refused;
- "double": an FP32 value cast to DOUBLE (exact); exact ops keep it;
- FLOAT64: double data (DOUBLE inputs and constants, and what arithmetic on double values computes). The FP64
  reference computes it as ONNX does, in double; an FP32 plan would run it at FP32, so a model holding it is
  FP64-only (OnnxModel.fp64_only): its reference is honoured, its compile refused.
"""
from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np
from onnx import TensorProto as T

from .loader import BOOL, FLOAT, INT

FP32_EXACT_INTEGER = float(2 ** 24)  # every integer of magnitude <= 2^24 is an FP32 value
FLOAT64 = "float64"  # double data: the FP64 reference only (see the module docstring)


@dataclass(frozen=True)
class ValueType:
    """An ONNX element type as the importer holds it: its kind, numpy dtype and value set."""

    kind: str
    elem: int
    dtype: np.dtype      # what OnnxModel.restore returns for it
    integer: bool
    lo: float            # integers: the type's range; floats: -max_finite
    hi: float
    p: int = 0           # floats: significand bits (with the implicit one)
    min_subnormal: float = 0.0
    has_inf: bool = False
    has_nan: bool = False


def _int(kind: str, elem: int, dtype) -> ValueType:
    info = ml_dtypes.iinfo(dtype)
    return ValueType(kind, elem, np.dtype(dtype), True, float(info.min), float(info.max))


def _float(kind: str, elem: int, dtype, has_inf: bool = True) -> ValueType:
    info = ml_dtypes.finfo(dtype)
    return ValueType(kind, elem, np.dtype(dtype), False, -float(info.max), float(info.max), int(info.nmant) + 1,
                     float(info.smallest_subnormal), has_inf, kind != "float4e2m1")


VALUE_TYPES: dict[str, ValueType] = {t.kind: t for t in (
    _float(FLOAT, T.FLOAT, np.float32),
    _float("double", T.DOUBLE, np.float64),
    _float("float16", T.FLOAT16, np.float16),
    _float("bfloat16", T.BFLOAT16, ml_dtypes.bfloat16),
    _float("float8e4m3fn", T.FLOAT8E4M3FN, ml_dtypes.float8_e4m3fn, has_inf=False),
    _float("float8e4m3fnuz", T.FLOAT8E4M3FNUZ, ml_dtypes.float8_e4m3fnuz, has_inf=False),
    _float("float8e5m2", T.FLOAT8E5M2, ml_dtypes.float8_e5m2),
    _float("float8e5m2fnuz", T.FLOAT8E5M2FNUZ, ml_dtypes.float8_e5m2fnuz, has_inf=False),
    _float("float4e2m1", T.FLOAT4E2M1, ml_dtypes.float4_e2m1fn, has_inf=False),
    _int("int2", T.INT2, ml_dtypes.int2), _int("uint2", T.UINT2, ml_dtypes.uint2),
    _int("int4", T.INT4, ml_dtypes.int4), _int("uint4", T.UINT4, ml_dtypes.uint4),
    _int("int8", T.INT8, np.int8), _int("uint8", T.UINT8, np.uint8),
    _int("int16", T.INT16, np.int16), _int("uint16", T.UINT16, np.uint16),
    _int("int32", T.INT32, np.int32), _int("uint32", T.UINT32, np.uint32),
    _int("int64", T.INT64, np.int64), _int("uint64", T.UINT64, np.uint64),
)}
BY_ELEM: dict[int, ValueType] = {t.elem: t for t in VALUE_TYPES.values()}

INTEGER_KINDS = tuple(k for k, t in VALUE_TYPES.items() if t.integer)
NARROW_FLOAT_KINDS = tuple(k for k, t in VALUE_TYPES.items() if not t.integer and k not in (FLOAT, "double"))
# kinds whose every value is an FP32 value the graph holds exactly; ops that select, compare or move
# values take them (arithmetic takes FLOAT, and integers with their ranges checked)
EXACT_KINDS = (FLOAT, "double") + NARROW_FLOAT_KINDS + INTEGER_KINDS
ANY_KIND = EXACT_KINDS + (BOOL, INT, FLOAT64)


def value_type(kind: str) -> ValueType | None:
    return VALUE_TYPES.get(kind)


def np_dtype(kind: str) -> np.dtype:
    """The numpy dtype of a kind's ONNX values (masks bool, indices int64)."""
    if kind == FLOAT64:
        return np.dtype(np.float64)
    return np.dtype(np.bool_) if kind == BOOL else np.dtype(np.int64) if kind == INT else VALUE_TYPES[kind].dtype


def data_kind_of_elem(elem: int) -> str | None:
    """The data kind of an ONNX element type (int32/int64 give their integer-data kind), None if unknown."""
    t = BY_ELEM.get(elem)
    return t.kind if t is not None else (BOOL if elem == T.BOOL else None)


def holds(src: str, dst: str) -> bool:
    """Whether every value of kind `src` is a value of kind `dst` (a cast src -> dst changes no value).

    INT (indices) and integer kinds hold integers; BOOL holds 0 and 1."""
    if src == dst:
        return True
    s = VALUE_TYPES.get("int64" if src == INT else src) if src != BOOL else ValueType(BOOL, T.BOOL, np.dtype(bool),
                                                                                    True, 0.0, 1.0)
    d = VALUE_TYPES.get(dst)
    if s is None or d is None:
        return False
    if d.integer:
        return s.integer and d.lo <= s.lo and s.hi <= d.hi
    if s.integer:  # every integer up to 2^p is a value of a p-bit float (within its range)
        return max(-s.lo, s.hi) <= min(2.0 ** d.p, d.hi)
    return (s.p <= d.p and s.min_subnormal >= d.min_subnormal and s.hi <= d.hi
            and (d.has_inf or not s.has_inf) and (d.has_nan or not s.has_nan))
