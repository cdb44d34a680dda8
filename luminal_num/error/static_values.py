"""The values static analysis carries (error/static.py): an exact-value interval with a bound on
|executed - exact| and a floor of the executed value; rounding one to a storage format (half-ulp relative
plus half the smallest subnormal, with the range check that finds an overflow); the derivative bounds of
the ops; and the report the analysis returns.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..codegen.llir import Kernel
from ..dtypes.formats import F32, Format, Kind
from ..dtypes.formats import get as get_format
from ..hlir.ops import CUSTOM_KINDS, Op
from ..quant.stored import storage_error
from .interval import Interval, derivative_bound
from .static_ball import cut, cut_parts, rounded_ball, rounded_parts

SLACK = 1.0 + 2.0 ** -40  # covers FP64's own error in the reference and in these bound computations


@dataclass(frozen=True)
class Overflow:
    kernel: int
    label: str
    fmt: str
    magnitude: float
    detail: str = ""  # why, when the limit is not the format's max finite (a weight its storage cannot hold)

    def message(self) -> str:
        if self.detail:
            return f"overflow: kernel {self.kernel} ({self.label}) cannot be held in {self.fmt}: {self.detail}"
        return (f"overflow: kernel {self.kernel} ({self.label}) stores values of magnitude >= {self.magnitude:.6g} "
                f"in {self.fmt} (max finite {Format_max(self.fmt):.6g})")


def Format_max(name: str) -> float:
    return get_format(name).max_finite


@dataclass(frozen=True)
class StaticReport:
    """Per-output error bounds (arrays), exact-value intervals, and the first certain overflow."""

    error_bounds: dict[str, np.ndarray]
    intervals: dict[str, Interval]
    overflow: Overflow | None

    def max_bound(self, name: str) -> float:
        return float(np.max(self.error_bounds[name])) if self.error_bounds[name].size else 0.0

    def certifies(self, atol: float, rtol: float, outputs=None) -> bool:
        """bound <= atol + rtol * min|exact| everywhere (min over the exact value's interval)."""
        if self.overflow is not None:
            return False
        for name, err in self.error_bounds.items():
            if outputs is not None and name not in outputs:
                continue
            iv = self.intervals[name]
            min_abs = np.where((iv.lo <= 0) & (iv.hi >= 0), 0.0, np.minimum(np.abs(iv.lo), np.abs(iv.hi)))
            if not np.all(err <= atol + rtol * min_abs):
                return False
        return True


@dataclass
class BoundedValue:
    iv: Interval
    err: np.ndarray
    floor: float | None = None  # a lower bound >= 0 of the EXECUTED value (exp2, squares, 1 + exp2 ...)
    # where True the EXECUTED value is exactly -inf: a mask entry (-1e9) stored in a format it overflows
    # (FP16), read only by a softmax, which gives it weight 0 as the exact e^-1e9 nearly is (its error is inf)
    masked: np.ndarray | None = None
    # a bound on the 2-norm of each row's error (rows along the last axis; shape iv.lo.shape[:-1]), or None:
    # the norm of `err` over the row then (error/static_ball.py)
    ball: np.ndarray | None = None
    # tighter balls of parts of each row, ((start, stop, ball), ...) along the last axis: a Gemm over weights
    # concatenated along N (q|k|v, gate|up) bounds each part's rows by that part's own spectral norm
    parts: tuple | None = None

    @property
    def wide(self) -> Interval:
        """Where the executed value can be: the exact interval widened by the error bound, cut at the
        executed value's floor (rounding is monotone: exp2(t) >= 0 stays >= 0, so 1 + exp2(t) >= 1 and
        a sigmoid's reciprocal keeps a slope <= 1 however large exp2's error is)."""
        with np.errstate(invalid="ignore"):
            lo = np.where(np.isfinite(self.err), self.iv.lo - self.err, -np.inf)
            hi = np.where(np.isfinite(self.err), self.iv.hi + self.err, np.inf)
            if self.floor is not None:  # the hull of executed (>= floor) and exact (>= iv.lo) values
                lo = np.maximum(lo, np.minimum(self.floor, self.iv.lo))
            return Interval(lo, hi, self.iv.nan)


def mag_of(iv: Interval) -> np.ndarray:
    return iv.magnitude


class OverflowFound(Exception):
    def __init__(self, ov: Overflow):
        self.ov = ov


def store_rounded(v: BoundedValue, fmt: Format, k: Kernel, origin: str = "", masked_ok: bool = False) -> BoundedValue:
    """Round to the storage format: half-ulp relative + half the smallest subnormal; range check.
    `masked_ok` (a value only a softmax reads): an element that certainly rounds to -inf is a masked
    entry (BoundedValue.masked), not an overflow."""
    if fmt.kind is not Kind.FLOAT or fmt.name == "f64":
        return v
    wide = v.wide
    lo_abs = np.where((wide.lo <= 0) & (wide.hi >= 0), 0.0, np.minimum(np.abs(wide.lo), np.abs(wide.hi)))
    certain = lo_abs > fmt.max_finite
    masked = v.masked
    if masked_ok and fmt.has_inf and np.any(certain) and not fmt.compute_only:
        with np.errstate(over="ignore"):  # RN is monotone: if the largest executed value rounds to -inf, all do
            to_minus_inf = np.broadcast_to(wide.hi, certain.shape).astype(fmt.storage).astype(np.float64) == -np.inf
        masked = to_minus_inf if masked is None else (masked | to_minus_inf)
        certain = certain & ~masked
    if np.any(certain):
        where = f"{origin} fused into {k.label}" if origin else (k.label or k.kind.value)
        raise OverflowFound(Overflow(k.id, where, fmt.name, float(np.max(lo_abs))))
    maybe = mag_of(wide) > fmt.max_finite
    rounding = fmt.unit_roundoff * mag_of(wide) + fmt.min_subnormal / 2
    err = _known_rounding(v, fmt, np.where(maybe, np.inf, (v.err + rounding) * SLACK))
    shape = v.iv.lo.shape
    ball = rounded_ball(v.ball, np.where(maybe, np.inf, rounding), err, shape)
    parts = rounded_parts(v.parts, np.where(maybe, np.inf, rounding), err, shape) if ball is not None else None
    return BoundedValue(v.iv, cut_parts(cut(err, ball, shape), parts, shape), rounded_floor(v.floor, fmt), masked,
                        ball, parts)


def store_known(v: BoundedValue, fmt: Format, k: Kernel) -> BoundedValue:
    """store_rounded of a value handed in (an input or a weight): a representable -1e9 mask, an FP32 weight
    or a zero cache row carries no rounding term (the mask had a 60-unit one)."""
    return store_rounded(v, fmt, k)


def _known_rounding(v: BoundedValue, fmt: Format, err: np.ndarray) -> np.ndarray:
    """A point with no error that the format holds exactly is stored exactly (round to nearest leaves it):
    an input, an iota's integers, i + 1 of them (a causal mask built by comparing them then cannot flip)."""
    if fmt.compute_only or fmt.storage is None or not np.any(np.asarray(v.err) == 0):
        return err
    known = (v.iv.lo == v.iv.hi) & (np.asarray(v.err) == 0) & ~np.asarray(v.iv.nan)
    if not np.any(known):
        return err
    x = np.where(known, v.iv.lo, 0.0)
    with np.errstate(over="ignore", invalid="ignore"):
        stored = x.astype(fmt.storage).astype(np.float64)
    # only a value the format holds exactly drops its rounding term (a fused and an unfused form then see
    # the same entry errors, whichever roundings each performs later)
    return np.where(known & (stored == x) & (np.abs(x) <= fmt.max_finite), 0.0, err)


def rounded_floor(floor: float | None, fmt: Format) -> float | None:
    """RN is monotone: a value >= f rounds to >= RN(f) >= f (1 - u) - half a subnormal, and >= 0."""
    if floor is None:
        return None
    return max(0.0, floor * (1 - fmt.unit_roundoff) * (1 - 2.0 ** -52) - fmt.min_subnormal / 2)


def floor_of(op: Op, args: list[BoundedValue]) -> float | None:
    """The executed result's floor before its rounding (None: nothing known); floors are >= 0."""
    floors = [a.floor for a in args]
    if op in (Op.EXP2, Op.SQRT):
        return 0.0
    if op is Op.RECIP:
        return 0.0 if floors[0] is not None and floors[0] > 0 else None
    if op in (Op.ADD, Op.MUL) and None not in floors:
        total = floors[0] + floors[1] if op is Op.ADD else floors[0] * floors[1]
        return max(0.0, float(np.nextafter(total, -np.inf)))
    return None


def round_f32(v: BoundedValue, k: Kernel) -> BoundedValue:
    return store_rounded(v, F32, k)


def slope_bound(op: Op, kind: str | None, wide: Interval) -> np.ndarray:
    if op is Op.CUSTOM:
        lo, hi = wide.lo, wide.hi
        nearest = np.where((lo <= 0) & (hi >= 0), 0.0, np.minimum(np.abs(lo), np.abs(hi)))
        if kind == "erf":
            return 2.0 / math.sqrt(math.pi) * np.exp(-nearest * nearest) * SLACK
        if kind == "tanh":
            return (1.0 - np.tanh(nearest) ** 2) * SLACK
        raise KeyError(f"no derivative bound for custom {kind!r}")
    return np.asarray(derivative_bound(op, wide))


def custom_interval(kind: str, iv: Interval) -> Interval:
    fn = CUSTOM_KINDS[kind].fn  # erf and tanh are increasing: endpoints, widened by a few ulps
    lo, hi = fn(iv.lo), fn(iv.hi)
    return Interval(np.nextafter(np.nextafter(lo, -np.inf), -np.inf), np.nextafter(np.nextafter(hi, np.inf), np.inf))


def stored_weight_value(iv: Interval, storage: str, shape, fill: str | None = None, weight=None) -> BoundedValue:
    """A weight held in a storage format: the exact (graph) weight, computed with its known storage error
    (a filled weight's: |its stored values - w|, from `weight` itself, which must be the point `iv`)."""
    lo, hi = np.broadcast_to(iv.lo, shape), np.broadcast_to(iv.hi, shape)
    if not np.array_equal(lo, hi):
        raise ValueError(f"a weight stored as {storage} must be a compile-time point, not a range")
    if fill is None:
        return BoundedValue(Interval(lo, hi), storage_error(lo, storage))
    if not np.array_equal(np.asarray(weight, dtype=np.float64), lo):
        raise ValueError(f"the weight handed in is not the point the bound ranges over ({storage}+{fill})")
    return BoundedValue(Interval(lo, hi), storage_error(weight, storage, fill=fill))
