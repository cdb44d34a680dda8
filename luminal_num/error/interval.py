"""Value intervals for the static numerics analysis: a sound enclosure for every HLIR primop.

Soundness contract of every transfer function: for all real inputs inside the input intervals, the
exact real result lies inside the output interval, and `nan` is True wherever executing the op could
give NaN (0 * inf, inf - inf, sqrt of a negative, ...). A NaN is a verdict the analysis reports, never a
value it silently carries.

Outward rounding: the correctly rounded ops (add, mul, recip, sqrt) round each endpoint exactly in the
right direction using error-free transformations (exact results such as 0 * x or sqrt(4) stay exact, so
signs are not lost to a spurious -5e-324); libm's transcendental functions are widened by a few ulps (error/libm_bounds.py).

One class for scalars and tensors: `Interval` holds numpy arrays of endpoints (per element or per
tensor, broadcasting like numpy); a scalar interval is the 0-d case. `IntervalArray` is the same class.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from luminal_num.dtypes.formats import Format, Kind
from luminal_num.error.highprec import add_directed, mul_directed, recip_directed, sqrt_directed
from luminal_num.error.libm_bounds import (cos_abs_point, exp2_point, exp_point, log2_point, sin_point, ulps_down,
                                           ulps_up)
from luminal_num.error.rounding_bounds import gamma
from luminal_num.hlir.ops import Op

INF = math.inf
U64 = 2.0 ** -53


@dataclass(frozen=True, eq=False)
class Interval:
    """Closed interval(s) [lo, hi]; `nan` marks elements whose executed value may be NaN."""

    lo: np.ndarray
    hi: np.ndarray
    nan: np.ndarray = np.False_

    def __post_init__(self):
        lo, hi, nan = np.broadcast_arrays(np.asarray(self.lo, dtype=np.float64),
                                          np.asarray(self.hi, dtype=np.float64),
                                          np.asarray(self.nan, dtype=bool))
        if np.isnan(lo).any() or np.isnan(hi).any():
            raise ValueError("interval endpoints must not be NaN (mark possible NaN with nan=True)")
        if (lo > hi).any():
            raise ValueError(f"empty interval: lo > hi at {int((lo > hi).sum())} element(s)")
        for name, value in (("lo", lo), ("hi", hi), ("nan", nan)):
            object.__setattr__(self, name, value)

    @classmethod
    def point(cls, values) -> "Interval":
        """Degenerate intervals [x, x], one per element."""
        return cls(values, values)

    @classmethod
    def of_values(cls, values, axis=None, keepdims: bool = False) -> "Interval":
        """The hull of observed values (per tensor by default, or reduced over `axis`)."""
        values = np.asarray(values, dtype=np.float64)
        missing = np.isnan(values)
        lo = np.min(np.where(missing, INF, values), axis=axis, keepdims=keepdims)
        hi = np.max(np.where(missing, -INF, values), axis=axis, keepdims=keepdims)
        all_missing = lo > hi
        return cls(np.where(all_missing, -INF, lo), np.where(all_missing, INF, hi),
                   np.any(missing, axis=axis, keepdims=keepdims))

    @classmethod
    def entire(cls, shape=()) -> "Interval":
        return cls(np.full(shape, -INF), np.full(shape, INF))

    @property
    def shape(self) -> tuple[int, ...]:
        return self.lo.shape

    @property
    def magnitude(self) -> np.ndarray:
        """max |x| over the interval: the |value| that rounding-error bounds scale with."""
        return np.maximum(np.abs(self.lo), np.abs(self.hi))

    def contains(self, values) -> np.ndarray:
        """Elementwise: value in [lo, hi], or NaN where NaN is allowed."""
        values = np.asarray(values, dtype=np.float64)
        return np.where(np.isnan(values), self.nan, (self.lo <= values) & (values <= self.hi))

    def bounds(self) -> tuple[float, float]:
        """(lo, hi) of a scalar interval as Python floats."""
        if self.lo.ndim:
            raise ValueError(f"bounds() needs a scalar interval, this one has shape {self.shape}")
        return float(self.lo), float(self.hi)

    def same_as(self, other: "Interval") -> bool:
        """Exact equality of endpoints and NaN flags (dataclass == is identity: these hold arrays)."""
        return all(np.array_equal(x, y) for x, y in
                   ((self.lo, other.lo), (self.hi, other.hi), (self.nan, other.nan)))

    def __add__(self, other: "Interval") -> "Interval":
        return add(self, other)

    def __mul__(self, other: "Interval") -> "Interval":
        return mul(self, other)

    def __repr__(self) -> str:
        if self.lo.ndim == 0:
            flag = ", nan" if self.nan else ""
            return f"Interval({float(self.lo)!r}, {float(self.hi)!r}{flag})"
        return f"Interval(shape={self.shape}, lo={self.lo!r}, hi={self.hi!r}, nan={self.nan!r})"


IntervalArray = Interval


def _make(lo, hi, nan, codomain: tuple[float, float] = (-INF, INF)) -> Interval:
    """Build a result: NaN endpoints (undefined) become the codomain's ends, then clip to the codomain
    (sound: every true value lies in it; this undoes widening past e.g. 0 for exp2)."""
    lo_nan, hi_nan = np.isnan(lo), np.isnan(hi)
    lo = np.clip(np.where(lo_nan, codomain[0], lo), *codomain)
    hi = np.clip(np.where(hi_nan, codomain[1], hi), *codomain)
    return Interval(lo, hi, np.asarray(nan) | lo_nan | hi_nan)


def _may_be_inf(a: Interval) -> np.ndarray:
    return (a.lo == -INF) | (a.hi == INF)


def _may_be_zero(a: Interval) -> np.ndarray:
    return (a.lo <= 0) & (a.hi >= 0)


def _hits_grid(lo, hi, offset: float, period: float) -> np.ndarray:
    """Whether [lo, hi] may contain offset + k*period for an integer k (errs towards True).

    offset and period are FP64 roundings of pi multiples, and the quotients are rounded; a relative
    slack of 1e-12 dwarfs both errors (about 4e-16 relative), so a missed extremum is impossible.
    """
    with np.errstate(invalid="ignore", over="ignore"):
        t_lo = (lo - offset) / period
        t_hi = (hi - offset) / period
        slack = 1e-12 * (1.0 + np.maximum(np.abs(t_lo), np.abs(t_hi)))
        return np.floor(t_hi + slack) >= np.ceil(t_lo - slack)


# ---- transfer functions ----------------------------------------------------------------------------

def add(a: Interval, b: Interval) -> Interval:
    lo, _ = add_directed(a.lo, b.lo)
    _, hi = add_directed(a.hi, b.hi)
    inf_minus_inf = ((a.lo == -INF) & (b.hi == INF)) | ((a.hi == INF) & (b.lo == -INF))
    return _make(lo, hi, a.nan | b.nan | inf_minus_inf)


def mul(a: Interval, b: Interval) -> Interval:
    """All sign cases at once: the hull of the four endpoint products, each rounded outward."""
    pairs = [mul_directed(x, y) for x in (a.lo, a.hi) for y in (b.lo, b.hi)]
    lo = np.minimum.reduce([down for down, _ in pairs])
    hi = np.maximum.reduce([up for _, up in pairs])
    zero_times_inf = (_may_be_zero(a) & _may_be_inf(b)) | (_may_be_inf(a) & _may_be_zero(b))
    return _make(lo, hi, a.nan | b.nan | zero_times_inf)


def recip(a: Interval) -> Interval:
    """1/x; an interval touching 0 gives (-inf, inf): 1/+0 = inf but 1/-0 = -inf, and both zeros exist."""
    touches_zero = _may_be_zero(a)
    lo, _ = recip_directed(np.where(touches_zero, 1.0, a.hi))
    _, hi = recip_directed(np.where(touches_zero, 1.0, a.lo))
    return _make(np.where(touches_zero, -INF, lo), np.where(touches_zero, INF, hi), a.nan)


@dataclass(frozen=True)
class _Increasing:
    """A non-decreasing unary op: its hull is [f(lo), f(hi)] after clipping the input to the domain."""

    point: Callable  # x -> (down, up) bounds of f(x)
    domain_lo: float  # inputs below are NaN when executed
    codomain: tuple[float, float]

    def __call__(self, a: Interval) -> Interval:
        outside = a.lo < self.domain_lo
        lo, _ = self.point(np.maximum(a.lo, self.domain_lo))
        _, hi = self.point(np.maximum(a.hi, self.domain_lo))
        return _make(lo, hi, a.nan | outside, self.codomain)


exp2 = _Increasing(exp2_point, -INF, (0.0, INF))
log2 = _Increasing(log2_point, 0.0, (-INF, INF))
sqrt = _Increasing(sqrt_directed, 0.0, (0.0, INF))


def sin(a: Interval) -> Interval:
    """sin, with the extrema found exactly: hi = 1 iff [lo, hi] holds some pi/2 + 2k pi, lo = -1 iff
    it holds some -pi/2 + 2k pi; otherwise sin is monotone between the endpoints."""
    lo_down, lo_up = sin_point(a.lo)
    hi_down, hi_up = sin_point(a.hi)
    lo = np.where(_hits_grid(a.lo, a.hi, -math.pi / 2, 2 * math.pi), -1.0, np.minimum(lo_down, hi_down))
    hi = np.where(_hits_grid(a.lo, a.hi, math.pi / 2, 2 * math.pi), 1.0, np.maximum(lo_up, hi_up))
    return _make(lo, hi, a.nan | _may_be_inf(a), (-1.0, 1.0))


def mod(a: Interval, b: Interval) -> Interval:
    """fmod(a, b) (C/Rust `%`: the result takes the dividend's sign) for a positive divisor b.

    fmod is exact in floating point. Within one period on one side of 0 it is increasing, so the
    endpoints' images are the hull; otherwise |result| < b with the dividend's sign.
    """
    if (b.lo <= 0).any():
        raise ValueError("Mod transfer needs a positive divisor interval (b.lo > 0)")
    b_hi = b.hi
    lo = np.where(a.lo >= 0, 0.0, np.maximum(a.lo, -b_hi))
    hi = np.where(a.hi <= 0, 0.0, np.minimum(a.hi, b_hi))
    with np.errstate(invalid="ignore"):
        r_lo, r_hi = np.fmod(a.lo, b_hi), np.fmod(a.hi, b_hi)
        _, width = add_directed(a.hi, -a.lo)
        one_side = (a.lo >= 0) | (a.hi <= 0)
        # width < b and no drop in the remainder <=> no multiple of b strictly inside (rounding is monotone)
        one_period = one_side & (b.lo == b.hi) & (width < b_hi) & (r_lo <= r_hi) & np.isfinite(width)
    return _make(np.where(one_period, r_lo, lo), np.where(one_period, r_hi, hi),
                 a.nan | b.nan | _may_be_inf(a))


def less_than(a: Interval, b: Interval) -> Interval:
    """1.0 where a < b, else 0.0: exact when decided by the intervals, [0, 1] otherwise. Never NaN
    (a comparison with NaN is false), but a possibly-NaN input makes a 'true' undecided."""
    true = (a.hi < b.lo) & ~a.nan & ~b.nan
    false = a.lo >= b.hi
    return Interval(np.where(true, 1.0, 0.0), np.where(false, 0.0, 1.0))


def _along(a: Interval, axis: int, n: int | None):
    """Endpoints with `axis` moved last and broadcast to length n (n copies of a per-tensor summary)."""
    lo, hi, nan = (np.moveaxis(np.atleast_1d(x), axis, -1) for x in (a.lo, a.hi, a.nan))
    stored = lo.shape[-1]
    n = stored if n is None else n
    if stored not in (1, n) or n < 1:
        raise ValueError(f"axis {axis} holds {stored} element(s); cannot read it as length {n}")
    shape = lo.shape[:-1] + (n,)
    return np.broadcast_to(lo, shape), np.broadcast_to(hi, shape), np.broadcast_to(nan, shape)


def _sum_outward(x, up: bool) -> np.ndarray:
    """A bound on the exact sum along the last axis: the FP64 sum moved by gamma_{n-1} sum|x|."""
    n = x.shape[-1]
    with np.errstate(invalid="ignore", over="ignore"):
        total = np.sum(x, axis=-1)
        g = float(gamma(n - 1, U64))
        slack = 0.0 if g == 0 else ulps_up(g * (np.sum(np.abs(x), axis=-1) * (1 + 2 * g)), 3)
        return ulps_up(total + slack) if up else ulps_down(total - slack)


def sum_reduce(a: Interval, axis: int = -1, n: int | None = None) -> Interval:
    """Sum over `axis` of length n. Per-element ranges: the FP64 sum widened by its error bound; a
    per-tensor summary (length 1 along axis): [n lo, n hi], rounded exactly outward. inf - inf is NaN."""
    lo, hi, nan = _along(a, axis, n)
    nan_out = nan.any(axis=-1) | ((lo == -INF).any(axis=-1) & (hi == INF).any(axis=-1))
    if np.atleast_1d(a.lo).shape[axis] == 1:
        count = float(lo.shape[-1])
        return _make(mul_directed(count, lo[..., 0])[0], mul_directed(count, hi[..., 0])[1], nan_out)
    return _make(_sum_outward(lo, up=False), _sum_outward(hi, up=True), nan_out)


def max_reduce(a: Interval, axis: int = -1, n: int | None = None) -> Interval:
    lo, hi, nan = _along(a, axis, n)
    return _make(lo.max(axis=-1), hi.max(axis=-1), nan.any(axis=-1))


def _exclusive_sums(terms: np.ndarray) -> np.ndarray:
    """sum_{j != i} terms_j along the last axis without cancellation: exclusive prefix + suffix sums."""
    zeros = np.zeros(terms.shape[:-1] + (1,))
    prefix = np.concatenate([zeros, np.cumsum(terms, axis=-1)[..., :-1]], axis=-1)
    suffix = np.concatenate([np.cumsum(terms[..., ::-1], axis=-1)[..., -2::-1], zeros], axis=-1)
    return prefix + suffix


def _softmax_side(own: np.ndarray, others: np.ndarray, upper: bool) -> np.ndarray:
    """A bound of y_i = 1 / (1 + exp(m - x_i) * sum_{j != i} exp(x_j - m)), any finite m.

    y_i rises with x_i and falls with every other x_j: (own=lo, others=hi) bounds it from below and
    (own=hi, others=lo) from above. The denominator is rounded against y at every step.
    """
    side = 0 if upper else 1  # index into (down, up) pairs: the denominator's side
    relative = float(gamma(others.shape[-1] + 1, U64))  # the cumulative sums' rounding, non-negative terms
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        m = others.max(axis=-1, keepdims=True)
        m = np.where(np.isfinite(m), m, 0.0)
        terms = np.maximum(exp_point(add_directed(others, -m)[side])[side], 0.0)
        sums = mul_directed(_exclusive_sums(terms), 1 - relative if upper else 1 + relative)[side]
        scale = exp_point(add_directed(m, -own)[side])[side]
        product = np.where(sums <= 0, 0.0, mul_directed(scale, np.maximum(sums, 0.0))[side])
        return recip_directed(add_directed(1.0, product)[side])[1 - side]


def softmax(a: Interval, axis: int = -1, n: int | None = None) -> Interval:
    """Per-element bounds of softmax along `axis`, each within [0, 1].

    NaN when executed if some element may be +inf (inf - inf) or all may be -inf (0 / 0).
    A per-tensor summary (length 1 along axis) gives a per-tensor summary back.
    """
    lo, hi, nan = _along(a, axis, n)
    row_nan = nan.any(axis=-1) | (hi == INF).any(axis=-1) | (lo == -INF).all(axis=-1)
    out = _make(_softmax_side(lo, hi, upper=False), _softmax_side(hi, lo, upper=True),
                np.broadcast_to(row_nan[..., None], lo.shape), (0.0, 1.0))
    summary = np.atleast_1d(a.lo).shape[axis] == 1  # then every element has the same bounds: keep one
    parts = [np.moveaxis(x[..., :1] if summary else x, -1, axis) for x in (out.lo, out.hi, out.nan)]
    return Interval(*(x.reshape(()) if a.lo.ndim == 0 else x for x in parts))


def cast(a: Interval, fmt: Format | None = None) -> Interval:
    """The hull of a cast. Without a format (or to F64) it is the identity hull.

    Rounding is monotone, so the cast endpoints are the exact hull of the cast values; overflow shows up
    as inf endpoints, or as NaN for formats without inf (FP8 E4M3: ml_dtypes gives NaN, not saturation).
    TF32 (compute-only, no storage type) is widened by its unit roundoff instead.
    """
    if fmt is None or fmt.storage == np.float64:
        return a
    if fmt.kind is not Kind.FLOAT:
        raise ValueError(f"cast hull to {fmt} (not a float format) belongs to the quantization stage")
    if fmt.compute_only:
        u = fmt.unit_roundoff
        return _make(ulps_down(a.lo - u * np.abs(a.lo), 2), ulps_up(a.hi + u * np.abs(a.hi), 2), a.nan)
    with np.errstate(over="ignore", invalid="ignore"):
        lo, hi = (x.astype(fmt.storage).astype(np.float64) for x in (a.lo, a.hi))
    return _make(lo, hi, a.nan | np.isnan(lo) | np.isnan(hi))


def hull(*items: Interval) -> Interval:
    """The smallest interval(s) holding all the given ones (elementwise, broadcasting)."""
    return Interval(np.minimum.reduce([x.lo for x in items]), np.maximum.reduce([x.hi for x in items]),
                    np.logical_or.reduce([x.nan for x in items]))


union = hull  # the union of intervals is not an interval; its hull is the sound stand-in


def intersection(a: Interval, b: Interval) -> Interval:
    """Elementwise intersection; raises ValueError where it is empty (two facts contradict)."""
    lo, hi = np.maximum(a.lo, b.lo), np.minimum(a.hi, b.hi)
    if (lo > hi).any():
        raise ValueError(f"empty intersection at {int((lo > hi).sum())} element(s)")
    return Interval(lo, hi, a.nan & b.nan)


# ---- derivative bounds: max |f'| over an interval, rounded up; inf where unbounded ----------------

# >= ln 2 and >= 1/ln 2: libm's log and one division are each within an ulp; two steps up cover both
_LN2_UP = float(ulps_up(math.log(2.0), 2))
_INV_LN2_UP = float(ulps_up(1.0 / math.log(2.0), 2))


def _exp2_slope(a: Interval) -> np.ndarray:
    return ulps_up(_LN2_UP * exp2_point(a.hi)[1])


def _log2_slope(a: Interval) -> np.ndarray:
    """1 / (x ln 2) at the left end; 1/x first, so a subnormal x cannot round x ln 2 to 0."""
    positive = a.lo > 0
    return np.where(positive, ulps_up(recip_directed(np.where(positive, a.lo, 1.0))[1] * _INV_LN2_UP), INF)


def _sqrt_slope(a: Interval) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(a.lo > 0, ulps_up(0.5 / sqrt_directed(np.maximum(a.lo, 0.0))[0]), INF)


def _recip_slope(a: Interval) -> np.ndarray:
    """1/x^2 at the end nearest 0, as (1/x)^2 so that x^2 cannot underflow to 0."""
    near_zero = _may_be_zero(a)
    inverse = recip_directed(np.where(near_zero, 1.0, np.where(a.lo > 0, a.lo, -a.hi)))[1]
    return np.where(near_zero, INF, ulps_up(inverse * inverse))


def _sin_slope(a: Interval) -> np.ndarray:
    """|cos| peaks at 1 on every k pi; elsewhere |cos| is monotone between its endpoints."""
    edge = np.maximum(cos_abs_point(a.lo)[1], cos_abs_point(a.hi)[1])
    return np.where(_hits_grid(a.lo, a.hi, 0.0, math.pi), 1.0, np.minimum(edge, 1.0))


# ---- the op table ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Transfer:
    """One HLIR primop's interval semantics: `apply(*intervals, **params)`, and for unary elementwise
    ops the max |f'| over an interval (first-order error propagation). Arity comes from the op's own
    declaration."""

    op: Op
    apply: Callable[..., Interval]
    slope: Callable[[Interval], np.ndarray] | None = None

    @property
    def arity(self) -> int:
        return self.op.decl.arity


TRANSFERS: dict[Op, Transfer] = {t.op: t for t in (
    Transfer(Op.ADD, add),
    Transfer(Op.MUL, mul),
    Transfer(Op.RECIP, recip, _recip_slope),
    Transfer(Op.SQRT, sqrt, _sqrt_slope),
    Transfer(Op.EXP2, exp2, _exp2_slope),
    Transfer(Op.LOG2, log2, _log2_slope),
    Transfer(Op.SIN, sin, _sin_slope),
    Transfer(Op.MOD, mod),
    Transfer(Op.LESS_THAN, less_than),
    Transfer(Op.SUM_REDUCE, sum_reduce),
    Transfer(Op.MAX_REDUCE, max_reduce),
    Transfer(Op.SOFTMAX, softmax),
    Transfer(Op.CAST, cast),
)}

# The ops with no interval transfer here, and where their values come from instead (a coverage test
# checks that TRANSFERS and this table together name every Op exactly once).
NO_TRANSFER: dict[Op, str] = {
    Op.INPUT: "seeded from the declared or calibration range",
    Op.CONSTANT: "a point interval of its value",
    Op.IOTA: "a point interval of 0..n-1",
    Op.GATHER: "rows of the table: error.static's GATHER kernel",
    Op.SCATTER: "hull of destination and source rows: error.static's SCATTER kernels",
    Op.CUSTOM: "per kind (erf, tanh: increasing): error.static",
    Op.OUTPUT: "the value it names",
}


def _entry(op: Op) -> Transfer:
    if not isinstance(op, Op):
        raise TypeError(f"interval transfers are keyed by hlir.ops.Op, got {op!r}")
    try:
        return TRANSFERS[op]
    except KeyError:
        raise KeyError(f"no interval transfer for {op.decl.name} ({NO_TRANSFER[op]}); "
                       f"known: {', '.join(o.decl.name for o in TRANSFERS)}") from None


def transfer(op: Op, *inputs: Interval, **params) -> Interval:
    """Apply op's transfer function (params: axis/n for reductions and Softmax, fmt for Cast)."""
    entry = _entry(op)
    if len(inputs) != entry.arity:
        raise TypeError(f"{op.decl.name} takes {entry.arity} interval(s), got {len(inputs)}")
    return entry.apply(*inputs, **params)


def derivative_bound(op: Op, x: Interval) -> float | np.ndarray:
    """max |f'(t)| for t in x (per element), rounded up; inf where f' is unbounded or x leaves f's domain."""
    entry = _entry(op)
    if entry.slope is None:
        known = [o.decl.name for o, t in TRANSFERS.items() if t.slope is not None]
        raise KeyError(f"no derivative bound for {op.decl.name}; known: {', '.join(known)}")
    with np.errstate(over="ignore", invalid="ignore"):
        slope = np.asarray(entry.slope(x), dtype=np.float64)
    return float(slope) if slope.ndim == 0 else slope
