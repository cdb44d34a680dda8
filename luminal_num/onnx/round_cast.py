"""ONNX's rounding Cast (FLOAT/float16 -> float16 or an FP8 type) as a value rounding, exact in any precision.

An HLIR Cast is a precision choice: the FP64 reference does not round there. ONNX's Cast does round, so
it is written here with ops whose every result is exact in FP32 and in FP64 alike (comparisons, products
by powers of two, fmod, sums of small integers), giving the round-to-nearest-even value of the target
format in both the FP64 reference and every FP32 plan:
- |x| is clamped to 2^(emax+1) (a max over a stacked axis: inf clamps too, NaN stays NaN), which still
  overflows, so every later value is finite or NaN;
- the quantum q of |x|'s binade is the least subnormal times 2 per binade boundary |x| reaches (a
  product of 1s and 2s: exact in any order);
- n = |x|/q rounded to nearest, ties to even, from fmod(n, 1) and fmod(trunc, 2); the result n*q;
- overflow past max_finite saturates (FP8 with saturate=1, as ONNX clamps before casting), becomes inf
  (float16, E5M2) or NaN (E4M3FN and the FNUZ types); then the sign is put back.
"""
from __future__ import annotations

import math

from ..hlir.tensor import GraphTensor, concat
from .kinds import ValueType

ROUNDING_TARGETS = ("float16", "float8e4m3fn", "float8e4m3fnuz", "float8e5m2", "float8e5m2fnuz")


def _max_with(a: GraphTensor, bound: float) -> GraphTensor:
    """max(a, bound) with no arithmetic on a (inf stays inf, NaN stays NaN): a max over a stacked axis."""
    shape = tuple(a.shape)
    col = a.graph.constant(bound).reshape((1,) * (len(shape) + 1)).broadcast_to(shape + (1,))
    return concat([a.unsqueeze(len(shape)), col], len(shape)).max(len(shape))


def clamp(x: GraphTensor, lo: float, hi: float) -> GraphTensor:
    """x clamped to [lo, hi], infinities included (NaN stays NaN): maxes over stacked axes, then negations."""
    return -_max_with(-_max_with(x, lo), -hi)


def round_to(x: GraphTensor, t: ValueType, saturate: bool) -> GraphTensor:
    """x rounded to the format `t` as ONNX's Cast does it (see the module docstring)."""
    emin = round(math.log2(t.min_subnormal)) + t.p - 1   # exponent of the least normal
    emax = math.floor(math.log2(t.hi))                   # binade of max_finite
    sign = 1.0 - 2.0 * (x < 0.0)                         # -1 or 1 (1 for NaN and -0)
    a = clamp(x * sign, 0.0, 2.0 ** (emax + 1))
    q = a.graph.constant(t.min_subnormal)
    for k in range(emin + 1, emax + 1):
        q = q * (2.0 - (a < 2.0 ** k))                   # x2 once a reaches binade k
    r = a * q.recip()                                    # a power of two: exact
    frac = r % 1.0
    whole = r - frac
    above = 0.5 < frac
    tie = (1.0 - (frac < 0.5)) * (1.0 - above)
    y = (whole + above + tie * (whole % 2.0)) * q        # nearest, ties to the even multiple
    over = t.hi < y
    if saturate:
        y = y * (1.0 - over) + over * t.hi
    elif t.has_inf:
        y = y * (1.0 - over).recip()                     # 1/0 = inf where it overflows
    else:
        z = (1.0 - over).recip()
        y = y + (z - z)                                  # inf - inf = NaN where it overflows
    return y * sign
