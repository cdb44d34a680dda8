"""Integer data in an FP32 graph: the ranges that keep it exact, checked on every fed batch.

The graph holds integer data (ONNX int8 .. uint64, and int32/int64 indices used as numbers) as FP32
values and computes on them with FP32 arithmetic, whose every result is exact while it is an integer
of magnitude <= 2^24. The importer records, per integer value, how its range follows from its operands'
(`RangeStep`); `check_ranges` runs those steps on the fed arrays' min/max (sound interval arithmetic on
a few floats per value, no tensor work) and refuses the batch in one line if a value could leave
+-2^24, its ONNX type's range (ONNX wraps there, the graph does not), or the narrower range an op's
exact form needs (`limit`). A batch that passes computes ONNX's integers exactly, in the FP64 reference
and in FP32 plans.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np

from .kinds import FP32_EXACT_INTEGER, VALUE_TYPES
from .loader import OnnxImportError

# op -> how the result's interval follows from the operands' (each: lo, hi, nonzero)
STEP_OPS = ("input", "const", "hull", "add", "sub", "mul", "neg", "abs", "mod", "div", "sum")


@dataclass(frozen=True)
class RangeStep:
    """One integer value's interval from its operands' (ONNX value names), checked against its limits."""

    out: str
    op: str
    args: tuple[str, ...]
    kind: str | None        # its ONNX integer type (None: an index, not checked against a type range)
    where: str              # the node (or input) for the refusal
    limit: float = FP32_EXACT_INTEGER  # the largest magnitude the value (and its op's intermediates) may reach
    const: tuple[float, float, bool] | None = None  # op "const": (lo, hi, nonzero) known at import
    count: int = 1          # op "sum": how many values are added


@dataclass(frozen=True)
class _Range:
    lo: float
    hi: float
    nonzero: bool  # no value is 0 (a divisor)

    @property
    def mag(self) -> float:
        return max(abs(self.lo), abs(self.hi))


def _of_array(a: np.ndarray) -> _Range:
    if a.size == 0:
        return _Range(0.0, 0.0, True)
    a = a.astype(np.float64)  # exact for the integers feed accepts (|v| <= 2^24); int4/int2 are ml_dtypes
    return _Range(float(np.min(a)), float(np.max(a)), not bool(np.any(a == 0)))


def _span(values: list[float]) -> tuple[float, float]:
    return min(values), max(values)


def _step(s: RangeStep, a: list[_Range]) -> tuple[_Range, float]:
    """The result's range and the largest magnitude the op's exact form reaches on the way."""
    if s.op == "const":
        lo, hi, nz = s.const
        return _Range(lo, hi, nz), max(abs(lo), abs(hi))
    if s.op == "hull":
        r = _Range(min(x.lo for x in a), max(x.hi for x in a), all(x.nonzero for x in a))
        return r, r.mag
    if s.op in ("add", "sub"):
        x, y = a
        lo, hi = (x.lo + y.lo, x.hi + y.hi) if s.op == "add" else (x.lo - y.hi, x.hi - y.lo)
        return _Range(lo, hi, lo > 0 or hi < 0), max(abs(lo), abs(hi), x.mag, y.mag)
    if s.op == "mul":
        x, y = a
        lo, hi = _span([x.lo * y.lo, x.lo * y.hi, x.hi * y.lo, x.hi * y.hi])
        return _Range(lo, hi, x.nonzero and y.nonzero), max(abs(lo), abs(hi))
    if s.op == "neg":
        return _Range(-a[0].hi, -a[0].lo, a[0].nonzero), a[0].mag
    if s.op == "abs":
        x = a[0]
        lo = 0.0 if x.lo <= 0 <= x.hi else min(abs(x.lo), abs(x.hi))
        return _Range(lo, x.mag, x.nonzero), x.mag
    if s.op == "sum":
        lo, hi = a[0].lo * s.count, a[0].hi * s.count  # count values, each within [lo, hi]
        return _Range(lo, hi, False), max(abs(lo), abs(hi))
    x, y = a
    if not y.nonzero:
        raise OnnxImportError(f"{s.where}: the divisor may be 0 (its values span [{y.lo:g}, {y.hi:g}]); "
                              "integer division by 0 is undefined in ONNX")
    if s.op == "mod":  # |r| < |y|; the floor-mod's fix-up r + y reaches |r| + |y|
        m = y.mag - 1
        return _Range(-m if (x.lo < 0 or y.lo < 0) else 0.0, m, False), max(x.mag, 2 * y.mag)
    # div: |q| <= |x|, and q stays within the dividend's range
    return _Range(-x.mag if (x.lo < 0 or y.lo < 0) else 0.0, x.mag, False), x.mag


def check_ranges(steps: tuple[RangeStep, ...], arrays: Mapping[str, np.ndarray]) -> None:
    """Run the steps on the fed arrays (by input name); one-line OnnxImportError where a range is left."""
    ranges: dict[str, _Range] = {}
    for s in steps:
        if s.op == "input":
            r = _of_array(np.asarray(arrays[s.args[0]]))
            reach = r.mag
        else:
            r, reach = _step(s, [ranges[n] for n in s.args])
        if reach > s.limit:
            why = ("its exact truncating division takes dividends up to 2^21" if s.op == "div" else
                   "FP32 holds every integer up to 2^24" if s.limit == FP32_EXACT_INTEGER else
                   "the target type holds every integer up to there")
            raise OnnxImportError(f"{s.where}: integer values reach magnitude {reach:.17g}, beyond {s.limit:.17g} "
                                  f"({why}); refused")
        t = VALUE_TYPES.get(s.kind) if s.kind else None
        if t is not None and (r.lo < t.lo or r.hi > t.hi):
            raise OnnxImportError(f"{s.where}: the {s.kind} result may reach [{r.lo:.17g}, {r.hi:.17g}], outside "
                                  f"{s.kind}'s range (ONNX wraps, the graph does not); refused")
        ranges[s.out] = r
