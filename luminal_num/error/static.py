"""Static analysis of an LLIR program: value intervals + first-order, sound rounding-error bounds.

For every buffer we carry an interval of its *exact* value (the FP64-semantics value, per element)
and a bound on |executed - exact|. Each kernel propagates its inputs' errors through the op (a
derivative bound over the interval widened by the error) and adds its own roundings: FP32 per
fused op, the Gemm variant's a-priori bound, gamma_n of the accumulator for sums, the storage
format's half-ulp. A buffer whose exact value certainly exceeds its format's range is an overflow
verdict naming the kernel; one that only might overflow gets an infinite bound (measure instead).
A QUANTIZE kernel passes A's interval and error through unchanged (as the (batch, M, K) operand):
its Gemm's variant bound already charges A's quantization, so charging it here too would count it
twice, and the interval it carries is the exact value's, which quantizing does not change.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

import numpy as np

from ..codegen.llir import FApply, FConstV, FExpr, FLoad, FRoundTo, Kernel, KernelKind, Program
from ..dtypes.formats import F32, Format, Kind
from ..dtypes.variants import GEMM_VARIANTS
from ..quant.stored import storage_error
from ..hlir.gemm import gemm_operand_a, gemm_operand_b, gemm_result, read_operand
from ..hlir.ops import CUSTOM_KINDS, Op
from ..hlir.symbolic import evaluate as eval_dim
from .interval import Interval, derivative_bound, hull, transfer
from .rounding_bounds import gamma

SLACK = 1.0 + 2.0 ** -40  # covers FP64's own error in the reference and in these bound computations


@dataclass(frozen=True)
class Overflow:
    kernel: int
    label: str
    fmt: str
    magnitude: float

    def message(self) -> str:
        return (f"overflow: kernel {self.kernel} ({self.label}) stores values of magnitude >= {self.magnitude:.6g} "
                f"in {self.fmt} (max finite {Format_max(self.fmt):.6g})")


def Format_max(name: str) -> float:
    from ..dtypes.formats import get
    return get(name).max_finite


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
class _Val:
    iv: Interval
    err: np.ndarray

    @property
    def wide(self) -> Interval:
        """Where the executed value can be: the exact interval widened by the error bound."""
        with np.errstate(invalid="ignore"):
            return Interval(np.where(np.isfinite(self.err), self.iv.lo - self.err, -np.inf),
                            np.where(np.isfinite(self.err), self.iv.hi + self.err, np.inf), self.iv.nan)


def _mag(iv: Interval) -> np.ndarray:
    return iv.magnitude


class _Overflowed(Exception):
    def __init__(self, ov: Overflow):
        self.ov = ov


def _store(v: _Val, fmt: Format, k: Kernel, origin: str = "") -> _Val:
    """Round to the storage format: half-ulp relative + half the smallest subnormal; range check."""
    if fmt.kind is not Kind.FLOAT or fmt.name == "f64":
        return v
    wide = v.wide
    lo_abs = np.where((wide.lo <= 0) & (wide.hi >= 0), 0.0, np.minimum(np.abs(wide.lo), np.abs(wide.hi)))
    certain = lo_abs > fmt.max_finite
    if np.any(certain):
        where = f"{origin} fused into {k.label}" if origin else (k.label or k.kind.value)
        raise _Overflowed(Overflow(k.id, where, fmt.name, float(np.max(lo_abs))))
    maybe = _mag(wide) > fmt.max_finite
    rounding = fmt.unit_roundoff * _mag(wide) + fmt.min_subnormal / 2
    err = np.where(maybe, np.inf, (v.err + rounding) * SLACK)
    return _Val(v.iv, err)


def _round_f32(v: _Val, k: Kernel) -> _Val:
    return _store(v, F32, k)


def _slope(op: Op, kind: str | None, wide: Interval) -> np.ndarray:
    if op is Op.CUSTOM:
        lo, hi = wide.lo, wide.hi
        nearest = np.where((lo <= 0) & (hi >= 0), 0.0, np.minimum(np.abs(lo), np.abs(hi)))
        if kind == "erf":
            return 2.0 / math.sqrt(math.pi) * np.exp(-nearest * nearest) * SLACK
        if kind == "tanh":
            return (1.0 - np.tanh(nearest) ** 2) * SLACK
        raise KeyError(f"no derivative bound for custom {kind!r}")
    return np.asarray(derivative_bound(op.decl.name, wide))


def _custom_interval(kind: str, iv: Interval) -> Interval:
    fn = CUSTOM_KINDS[kind].fn  # erf and tanh are increasing: endpoints, widened by a few ulps
    lo, hi = fn(iv.lo), fn(iv.hi)
    return Interval(np.nextafter(np.nextafter(lo, -np.inf), -np.inf), np.nextafter(np.nextafter(hi, np.inf), np.inf))


class StaticAnalyzer:
    def __init__(self, program: Program, bindings: Mapping[str, int]):
        self.p, self.bindings = program, dict(bindings)
        self.vals: dict[int, _Val] = {}

    def read(self, k: Kernel, i: int) -> _Val:
        inp = k.inputs[i]
        src = self.vals[inp.buffer]
        lo = inp.view.realize(np.asarray(src.iv.lo), self.bindings)
        hi = inp.view.realize(np.asarray(src.iv.hi), self.bindings)
        nan = inp.view.realize(np.broadcast_to(src.iv.nan, src.iv.lo.shape).astype(np.float64), self.bindings)
        err = inp.view.realize(np.asarray(src.err), self.bindings)
        return _Val(Interval(lo, hi, nan > 0), err)

    def body(self, e: FExpr, k: Kernel) -> _Val:
        if isinstance(e, FLoad):
            return self.read(k, e.slot)
        if isinstance(e, FConstV):
            c = e.value if isinstance(e.value, float) else float(eval_dim(e.value, self.bindings))
            return _Val(Interval.point(c), np.asarray(abs(float(np.float32(c)) - c)))
        if isinstance(e, FRoundTo):
            return _store(self.body(e.x, k), e.fmt, k, e.origin)
        if e.op is Op.MUL and len(e.args) == 2 and e.args[0] == e.args[1]:
            return _round_f32(self._square(self.body(e.args[0], k)), k)
        args = [self.body(a, k) for a in e.args]
        return _round_f32(self._apply(e, args), k)

    @staticmethod
    def _square(a: _Val) -> _Val:
        """x*x of one value: never negative (a general product of [lo, hi] with itself would be), so a
        variance's interval stays off zero and its reciprocal square root stays bounded."""
        lo, hi = a.iv.lo, a.iv.hi
        with np.errstate(over="ignore"):
            sq_lo, sq_hi = lo * lo, hi * hi
            low = np.where((lo <= 0) & (hi >= 0), 0.0, np.nextafter(np.minimum(sq_lo, sq_hi), -np.inf))
            high = np.nextafter(np.maximum(sq_lo, sq_hi), np.inf)
            err = 2 * _mag(a.iv) * a.err + a.err * a.err
        return _Val(Interval(np.maximum(low, 0.0), high, a.iv.nan), np.nan_to_num(err, nan=np.inf) * SLACK)

    def _apply(self, e: FApply, args: list[_Val]) -> _Val:
        op = e.op
        with np.errstate(all="ignore"):
            if op is Op.ADD:
                a, b = args
                return _Val(transfer("Add", a.iv, b.iv), (a.err + b.err) * SLACK)
            if op is Op.MUL:
                a, b = args
                err = _mag(a.iv) * b.err + _mag(b.iv) * a.err + a.err * b.err
                return _Val(transfer("Mul", a.iv, b.iv), np.nan_to_num(err, nan=np.inf) * SLACK)
            if op is Op.LESS_THAN:
                a, b = args
                out = transfer("LessThan", a.iv, b.iv)
                aw, bw = a.wide, b.wide
                undecided = ~((aw.hi < bw.lo) | (aw.lo >= bw.hi))  # the executed comparison may flip
                flips = undecided & ((a.err > 0) | (b.err > 0))
                return _Val(out, np.where(flips, 1.0, 0.0))
            if op is Op.MOD:
                a, b = args
                out = transfer("Mod", a.iv, b.iv)
                return _Val(out, np.where((a.err > 0) | (b.err > 0), np.inf, 0.0))
            (a,) = args
            iv = _custom_interval(e.kind, a.iv) if op is Op.CUSTOM else transfer(op.decl.name, a.iv)
            slope = _slope(op, e.kind, a.wide)
            err = np.where(a.err > 0, slope * a.err, 0.0)
            return _Val(iv, np.nan_to_num(err, nan=np.inf) * SLACK)

    def run(self, inputs: Mapping[str, Interval]) -> StaticReport:
        try:
            for k in self.p.kernels:
                self.vals[k.id] = self.kernel(k, inputs)
        except _Overflowed as exc:
            return StaticReport({}, {}, exc.ov)
        outs = {name: self.vals[kid] for name, kid in self.p.outputs}
        return StaticReport({n: np.broadcast_to(v.err, v.iv.lo.shape).copy() for n, v in outs.items()},
                            {n: v.iv for n, v in outs.items()}, None)

    def kernel(self, k: Kernel, inputs: Mapping[str, Interval]) -> _Val:
        kind = k.kind
        if kind is KernelKind.EXTERNAL:
            iv = inputs[k.external]
            shape = tuple(eval_dim(d, self.bindings) for d in k.shape)
            if k.storage is not None:
                return stored_weight_value(iv, k.storage, shape)
            iv = Interval(np.broadcast_to(iv.lo, shape), np.broadcast_to(iv.hi, shape))
            if k.dtype.kind is not Kind.FLOAT:
                return _Val(iv, np.zeros(shape))
            return _store(_Val(iv, np.zeros(shape)), k.dtype, k)
        if kind is KernelKind.CONST:
            c = k.value if isinstance(k.value, float) else float(eval_dim(k.value, self.bindings))
            return _store(_Val(Interval.point(np.asarray(c)), np.asarray(0.0)), k.dtype, k)
        if kind is KernelKind.IOTA:
            n = eval_dim(k.value, self.bindings)
            return _store(_Val(Interval.point(np.arange(n, dtype=np.float64)), np.zeros(n)), k.dtype, k)
        if kind is KernelKind.ELEMENTWISE:
            v = self.body(k.body, k)
            shape = tuple(eval_dim(d, self.bindings) for d in k.shape)
            v = _Val(Interval(np.broadcast_to(v.iv.lo, shape), np.broadcast_to(v.iv.hi, shape),
                              np.broadcast_to(v.iv.nan, shape)), np.broadcast_to(v.err, shape))
            return _store(v, k.dtype, k)
        if kind is KernelKind.SUM:
            v = self.body(k.body, k)
            n = v.iv.lo.shape[k.axis]
            iv = transfer("SumReduce", v.iv, axis=k.axis)
            acc = k.acc or F32
            with np.errstate(all="ignore"):
                err = np.sum(v.err, axis=k.axis) + gamma(n, acc.unit_roundoff) * np.sum(_mag(v.wide), axis=k.axis) \
                    + n * acc.min_subnormal / 2
            return _store(_Val(iv, np.nan_to_num(err, nan=np.inf) * SLACK), k.dtype, k)
        if kind is KernelKind.MAX:
            v = self.body(k.body, k)
            return _store(_Val(transfer("MaxReduce", v.iv, axis=k.axis), np.max(v.err, axis=k.axis)), k.dtype, k)
        if kind is KernelKind.SOFTMAX:
            return _store(self.softmax(k), k.dtype, k)
        if kind is KernelKind.GEMM:
            return _store(self.gemm(k), k.dtype, k)
        if kind is KernelKind.QUANTIZE:
            lo, hi, err = self._gemm_operand(k, 0)
            return _Val(Interval(lo, hi), err)
        if kind is KernelKind.GATHER:
            table = self.read(k, 0)
            rows = Interval(table.iv.lo.min(axis=0), table.iv.hi.max(axis=0))
            shape = tuple(eval_dim(d, self.bindings) for d in k.shape)
            return _Val(Interval(np.broadcast_to(rows.lo, shape), np.broadcast_to(rows.hi, shape)),
                        np.broadcast_to(table.err.max(axis=0), shape))
        if kind in (KernelKind.SCATTER, KernelKind.SCATTER_NOCOPY):
            dest, src = self.read(k, 0), self.read(k, 1)
            srow = Interval(src.iv.lo.min(axis=0), src.iv.hi.max(axis=0))
            iv = hull(dest.iv, Interval(np.broadcast_to(srow.lo, dest.iv.lo.shape), np.broadcast_to(srow.hi, dest.iv.lo.shape)))
            return _Val(iv, np.maximum(dest.err, src.err.max(axis=0)))
        raise AssertionError(f"unhandled kernel kind {kind}")  # every KernelKind is handled above

    def softmax(self, k: Kernel) -> _Val:
        v = self.body(k.body, k)
        iv = transfer("Softmax", v.iv, axis=k.axis)
        e = np.max(v.err, axis=k.axis, keepdims=True)
        fmt = None if k.precision in (None, "f32") else k.precision
        if fmt is not None:  # inputs rounded to the compute format before the softmax
            from ..dtypes.formats import get
            f = get(fmt)
            e = e + f.unit_roundoff * np.max(_mag(v.wide), axis=k.axis, keepdims=True) + f.min_subnormal / 2
        with np.errstate(over="ignore", invalid="ignore"):
            prop = iv.hi * np.expm1(2 * e)  # p_i changes by at most a factor e^{+-2e}
        err = np.nan_to_num(prop, nan=np.inf)
        if fmt is not None:
            from ..dtypes.formats import get
            err = err + get(fmt).unit_roundoff * (iv.hi + err) + get(fmt).min_subnormal / 2
        return _Val(iv, err * SLACK)

    def _gemm_operand(self, k: Kernel, i: int):
        """(lo, hi, err) of a Gemm (or QUANTIZE) operand as (batch, M, K) / (batch, K, N) arrays: the
        broadcast axes are dropped before any elementwise work, so nothing of the Mul's full size is
        materialised."""
        inp = k.inputs[i]
        src = self.vals[inp.buffer]
        pick = gemm_operand_a if i == 0 else gemm_operand_b
        shape = src.iv.lo.shape
        arrays = (src.iv.lo, src.iv.hi, np.broadcast_to(src.err, shape))
        return tuple(pick(read_operand(inp.view, np.ascontiguousarray(x), self.bindings), k.layout) for x in arrays)

    def gemm(self, k: Kernel) -> _Val:
        lay = k.layout
        variant = GEMM_VARIANTS[k.precision or "f32"]
        (alo, ahi, aerr), (blo, bhi, berr) = self._gemm_operand(k, 0), self._gemm_operand(k, 1)
        full = [eval_dim(d, self.bindings) for d in lay.full_shape]
        with np.errstate(all="ignore"):
            a_iv, b_iv = Interval(alo, ahi), Interval(blo, bhi)
            mid_a, rad_a = _mid_rad(a_iv)
            mid_b, rad_b = _mid_rad(b_iv)
            mm = np.matmul
            center = mm(mid_a, mid_b)
            scale = 1.0 + 2.0 ** -30  # BLAS rounding in these non-negative bound products
            radius = (mm(np.abs(mid_a), rad_b) + mm(rad_a, np.abs(mid_b)) + mm(rad_a, rad_b)) * scale \
                + np.abs(center) * 2.0 ** -50
            lo, hi = center - radius, center + radius
            mag_a, mag_b = a_iv.magnitude, b_iv.magnitude
            prop = (mm(mag_a, berr) + mm(aerr, mag_b) + mm(aerr, berr)) * scale
            wa, wb = mag_a + aerr, mag_b + berr
            abs_dot = mm(wa, wb) * scale
            rounding = variant.a_priori_bound(alo.shape[-1], abs_dot, float(np.max(wa)) if wa.size else 0.0,
                                              float(np.max(wb)) if wb.size else 0.0)
            err = np.nan_to_num(prop + rounding, nan=np.inf) * SLACK
        lo = gemm_result(np.where(np.isnan(lo), -np.inf, lo), lay, full)
        hi = gemm_result(np.where(np.isnan(hi), np.inf, hi), lay, full)
        return _Val(Interval(lo, hi), gemm_result(err, lay, full))


def stored_weight_value(iv: Interval, storage: str, shape) -> _Val:
    """A weight held in a storage format: the exact (graph) weight, computed with its known storage error."""
    lo, hi = np.broadcast_to(iv.lo, shape), np.broadcast_to(iv.hi, shape)
    if not np.array_equal(lo, hi):
        raise ValueError(f"a weight stored as {storage} must be a compile-time point, not a range")
    return _Val(Interval(lo, hi), storage_error(lo, storage))


def _mid_rad(iv: Interval) -> tuple[np.ndarray, np.ndarray]:
    """Center/radius form; an unbounded interval is centred at 0 with infinite radius."""
    finite = np.isfinite(iv.lo) & np.isfinite(iv.hi)
    with np.errstate(all="ignore"):
        mid = np.where(finite, iv.lo / 2 + iv.hi / 2, 0.0)
        rad = np.where(finite, np.maximum(iv.hi - mid, mid - iv.lo), np.inf)
    return mid, rad


def static_bound(program: Program, input_ranges: Mapping[str, Interval], bindings: Mapping[str, int] | None = None,
                 weights: Mapping[str, np.ndarray] | None = None) -> StaticReport:
    """Bounds for every output given intervals of every activation input (weights are exact points)."""
    ranges = dict(input_ranges)
    for name, w in (weights or {}).items():
        ranges.setdefault(name, Interval.point(np.asarray(w, dtype=np.float64)))
    missing = [n for n, _ in program.inputs if n not in ranges]
    if missing:
        raise KeyError(f"no value range for inputs {missing}")
    return StaticAnalyzer(program, bindings or {}).run(ranges)
