"""Error metrics of a candidate output y against the FP64 reference ref, all computed in FP64.

Every metric is declared once in `METRICS` (name, function, direction, description); budgets and
reports look metrics up there by name or alias.

Non-finite policy (one rule for every metric):
- NaN in ref raises ValueError: the judge itself is undefined there, nothing can be measured.
- An element where y equals ref exactly (including the same infinity) is exact: error 0.
- An element where y is NaN, or where y or ref is infinite and they differ, is a blow-up: elementwise
  metrics return their worst value (inf), row metrics count the row as failed (cosine -inf, KL inf,
  top-1 disagreement). Overflow is a verdict, never a number averaged away.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from luminal_num.dtypes.formats import FLOAT_FORMATS, Format

TINY = float(np.finfo(np.float64).tiny)  # max_rel's default floor: 2^-1022, the smallest normal double


class Direction(enum.Enum):
    LOWER = "lower is better"
    HIGHER = "higher is better"

    @property
    def operator(self) -> str:
        """The comparison a budget writes for this metric: `max_abs<=1e-3`, `cosine>=0.9999`."""
        return "<=" if self is Direction.LOWER else ">="

    @property
    def worst(self) -> float:
        return np.inf if self is Direction.LOWER else -np.inf


@dataclass(frozen=True)
class Metric:
    name: str
    fn: Callable[[np.ndarray, np.ndarray], float]
    direction: Direction
    description: str
    aliases: tuple[str, ...] = ()
    values: tuple[float, float] = (0.0, math.inf)  # the closed range the metric's value lies in

    def passes(self, value: float, limit: float) -> bool:
        """value within limit in this metric's direction (NaN never passes)."""
        return bool(value <= limit) if self.direction is Direction.LOWER else bool(value >= limit)

    def __call__(self, y, ref) -> float:
        return self.fn(y, ref)


@dataclass(frozen=True)
class _Pair:
    """y and ref as FP64 with non-finite elements set to 0 in both, and where they blew up."""

    y: np.ndarray
    ref: np.ndarray
    blown: np.ndarray


def _pair(y, ref) -> _Pair:
    y = np.asarray(y).astype(np.float64)
    ref = np.asarray(ref).astype(np.float64)
    if y.shape != ref.shape:
        raise ValueError(f"output shape {y.shape} != reference shape {ref.shape}")
    if np.isnan(ref).any():
        raise ValueError("the FP64 reference contains NaN: the judge is undefined there")
    finite = np.isfinite(y) & np.isfinite(ref)
    blown = ~finite & ~(y == ref)
    return _Pair(np.where(finite, y, 0.0), np.where(finite, ref, 0.0), blown)


def _max(values: np.ndarray) -> float:
    return float(values.max()) if values.size else 0.0


def max_abs(y, ref) -> float:
    """max |y - ref|."""
    p = _pair(y, ref)
    return np.inf if p.blown.any() else _max(np.abs(p.y - p.ref))


def max_rel(y, ref, floor: float = TINY) -> float:
    """max |y - ref| / max(|ref|, floor). The floor only avoids 0/0: where ref is 0 any error is
    'infinitely' relative, so this metric is for outputs away from zero (use atol near zero)."""
    p = _pair(y, ref)
    if p.blown.any():
        return np.inf
    with np.errstate(over="ignore"):
        return _max(np.abs(p.y - p.ref) / np.maximum(np.abs(p.ref), floor))


def _norm(x: np.ndarray, axis=None) -> np.ndarray:
    """Euclidean norm, scaled by the max so that squares neither overflow nor underflow."""
    scale = np.max(np.abs(x), axis=axis, keepdims=True) if x.size else np.ones((1,) * x.ndim)
    safe = np.where(scale == 0, 1.0, scale)
    return (np.sqrt(np.sum((x / safe) ** 2, axis=axis, keepdims=True)) * scale).squeeze(axis=axis)


def rel_l2(y, ref) -> float:
    """||y - ref||_2 / ||ref||_2 over all elements (0 if both are 0, inf if only ref is 0)."""
    p = _pair(y, ref)
    if p.blown.any():
        return np.inf
    err, size = float(_norm(p.y - p.ref)), float(_norm(p.ref))
    if size == 0:
        return 0.0 if err == 0 else np.inf
    return err / size


def _rows(x: np.ndarray) -> np.ndarray:
    """View as (rows, last axis); a 0-d array is one row of one element."""
    return np.atleast_1d(x).reshape(-1, np.atleast_1d(x).shape[-1])


def cosine(y, ref) -> float:
    """min over rows (last axis) of <y, ref> / (|y| |ref|); 1 when both rows are 0, 0 when one is."""
    p = _pair(y, ref)
    y2, r2, blown = _rows(p.y), _rows(p.ref), _rows(p.blown).any(axis=-1)
    if not y2.size:
        return 1.0
    # scale each row by its max first: cosine is scale-invariant and the dot products cannot overflow
    y_scale, r_scale = np.max(np.abs(y2), -1, keepdims=True), np.max(np.abs(r2), -1, keepdims=True)
    y2, r2 = y2 / np.where(y_scale == 0, 1, y_scale), r2 / np.where(r_scale == 0, 1, r_scale)
    yy, rr = np.sum(y2 * y2, -1), np.sum(r2 * r2, -1)  # each in [1, n] after scaling, or 0
    with np.errstate(invalid="ignore", divide="ignore"):
        cos = np.clip(np.sum(y2 * r2, -1) / np.sqrt(yy * rr), -1.0, 1.0)  # sqrt(yy*yy) == yy: y = ref gives 1
    cos = np.where((yy == 0) & (rr == 0), 1.0, np.where((yy == 0) | (rr == 0), 0.0, cos))
    return float(np.where(blown, -np.inf, cos).min())


def _logit_rows(y, ref) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows of logits with matching -inf kept (masked tokens: probability 0 in both) and blown rows."""
    p = _pair(y, ref)
    y2, r2 = _rows(np.asarray(y).astype(np.float64)), _rows(np.asarray(ref).astype(np.float64))
    if (r2 == np.inf).any() or (r2 == -np.inf).all(axis=-1).any():
        raise ValueError("reference logits with +inf or an all -inf row have no softmax")
    blown = _rows(p.blown).any(axis=-1)
    keep = ~blown[:, None]
    return np.where(keep, y2, 0.0), np.where(keep, r2, 0.0), blown


def _log_softmax(x: np.ndarray) -> np.ndarray:
    shifted = x - x.max(axis=-1, keepdims=True)
    return shifted - np.log(np.sum(np.exp(shifted), axis=-1, keepdims=True))


def kl_rows(y, ref) -> np.ndarray:
    """KL(softmax(ref) || softmax(y)) = sum p (log p - log q) per row, stable log-softmax; inf on a blown row."""
    y2, r2, blown = _logit_rows(y, ref)
    if not r2.size:
        return np.zeros(0)
    log_p, log_q = _log_softmax(r2), _log_softmax(y2)
    with np.errstate(invalid="ignore"):
        terms = np.where(log_p == -np.inf, 0.0, np.exp(log_p) * (log_p - log_q))
    return np.where(blown, np.inf, np.maximum(terms.sum(axis=-1), 0.0))  # KL >= 0; rounding can dip below


def kl_logits(y, ref) -> float:
    """mean over rows of KL(softmax(ref) || softmax(y))."""
    rows = kl_rows(y, ref)
    return float(rows.mean()) if rows.size else 0.0


def kl_max(y, ref) -> float:
    """max over rows of KL(softmax(ref) || softmax(y)): the worst next-token distribution."""
    return _max(kl_rows(y, ref))


def greedy_agreement_length(y, ref) -> int:
    """Leading rows (positions, in order) whose argmax agrees before the first that does not; a blown row
    disagrees. On logits teacher-forced along the reference's own greedy continuation this is how many
    generated tokens the plan reproduces."""
    y2, r2, blown = _logit_rows(y, ref)
    agree = (np.argmax(y2, -1) == np.argmax(r2, -1)) & ~blown
    return int(agree.size if agree.all() else np.argmin(agree))


def greedy_agreement(y, ref) -> float:
    """greedy_agreement_length as a fraction of the rows (1 = every position agrees)."""
    rows = _rows(np.asarray(y)).shape[0] if np.asarray(y).size else 0
    return 1.0 if rows == 0 else greedy_agreement_length(y, ref) / rows


def top1_agreement(y, ref) -> float:
    """Fraction of rows whose argmax (first on ties) agrees; a blown row disagrees."""
    y2, r2, blown = _logit_rows(y, ref)
    if not r2.size:
        return 1.0
    return float(np.mean((np.argmax(y2, -1) == np.argmax(r2, -1)) & ~blown))


# ---- ULP distance ----------------------------------------------------------------------------------

def ulp_formats() -> tuple[Format, ...]:
    """Formats with a ULP metric: stored floats (not compute-only TF32, not packed 4-bit)."""
    return tuple(f for f in FLOAT_FORMATS if not f.compute_only and f.storage.itemsize * 8 == f.bits)


def _ordinal(x: np.ndarray, fmt: Format) -> tuple[np.ndarray, np.ndarray]:
    """(sign, index) of x rounded to nearest-even in fmt; index counts representable magnitudes from 0.

    Computed arithmetically from frexp rather than from a cast's bit pattern: ml_dtypes casts FP64 to
    BF16 through FP32 (double rounding), which is one ulp off near ties; this rounding is exact.
    Index of a normal x = 2^e * m (1 <= m < 2): 2^(p-1) (e - emin) + rint(m 2^(p-1)); of a subnormal:
    rint(x / min_subnormal). Both agree at min_normal and are increasing, so they count values.
    """
    magnitude = np.abs(x)
    emin = int(np.log2(fmt.min_normal))
    half = 2 ** (fmt.p - 1)
    mantissa, exponent = np.frexp(magnitude)  # magnitude = mantissa 2^exponent, mantissa in [0.5, 1)
    with np.errstate(over="ignore", invalid="ignore"):
        normal = (exponent.astype(np.int64) - 1 - emin) * half + np.rint(np.ldexp(mantissa, fmt.p)).astype(np.int64)
        subnormal = np.rint(np.where(magnitude < fmt.min_normal, magnitude, 0) / fmt.min_subnormal)
    index = np.where(magnitude < fmt.min_normal, subnormal.astype(np.int64), normal)
    return np.signbit(x) & (index > 0), index


def max_ulp(y, ref, fmt: Format) -> float:
    """max distance between y and ref in units in the last place of fmt: the number of steps between
    them on fmt's grid, after rounding both to fmt (nearest-even). 0 means y is ref correctly rounded.

    A value beyond fmt's largest finite number counts as inf (one step past it) in formats that have
    inf, and as a blow-up (inf) in formats that do not (FP8 E4M3).
    """
    p = _pair(y, ref)
    if p.blown.any():
        return np.inf
    largest = int(_ordinal(np.array(fmt.max_finite), fmt)[1])
    (y_neg, y_idx), (r_neg, r_idx) = _ordinal(p.y, fmt), _ordinal(p.ref, fmt)
    if fmt.has_inf:  # everything past the largest finite value rounds to inf, one step further
        y_idx, r_idx = np.minimum(y_idx, largest + 1), np.minimum(r_idx, largest + 1)
    elif max(_max(y_idx), _max(r_idx)) > largest:
        return np.inf
    same_side = y_neg == r_neg
    distance = np.where(same_side, np.abs(y_idx - r_idx).astype(np.float64),
                        y_idx.astype(np.float64) + r_idx.astype(np.float64))
    return _max(distance)


def allclose_violation(y, ref, atol: float, rtol: float) -> float:
    """max over elements of |y - ref| / (atol + rtol |ref|): <= 1 means np.allclose-style pass.

    An exact element scores 0 even with atol = rtol = 0; an inexact one with a zero tolerance scores inf;
    a blow-up (NaN, overflow) scores inf.
    """
    p = _pair(y, ref)
    if p.blown.any():
        return np.inf
    err = np.abs(p.y - p.ref)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        tolerance = atol + np.where(p.ref == 0, 0.0, rtol * np.abs(p.ref))  # rtol=inf at ref=0 is 0, not NaN
        ratio = np.where(err == 0, 0.0, err / tolerance)
    return _max(ratio)


def _ulp_metric(fmt: Format) -> Metric:
    return Metric(f"max_ulp_{fmt.name}", lambda y, ref: max_ulp(y, ref, fmt), Direction.LOWER,
                  f"max distance in {fmt.name} ulps after rounding both to {fmt.name} (0 = correctly rounded)",
                  (f"ulp_{fmt.name}",))


METRICS: dict[str, Metric] = {m.name: m for m in (
    Metric("max_abs", max_abs, Direction.LOWER, "max |y - ref|", ("abs",)),
    Metric("max_rel", max_rel, Direction.LOWER, "max |y - ref| / max(|ref|, 2^-1022)", ("rel",)),
    Metric("rel_l2", rel_l2, Direction.LOWER, "||y - ref||_2 / ||ref||_2", ("l2",)),
    Metric("cosine", cosine, Direction.HIGHER, "min over rows of the cosine similarity (last axis)", ("cos",),
           (-1.0, 1.0)),
    Metric("kl_logits", kl_logits, Direction.LOWER, "mean over rows of KL(softmax(ref) || softmax(y))", ("kl",)),
    Metric("top1_agreement", top1_agreement, Direction.HIGHER, "fraction of rows with the same argmax",
           ("top1",), (0.0, 1.0)),
    Metric("kl_max", kl_max, Direction.LOWER, "max over rows of KL(softmax(ref) || softmax(y))", ()),
    Metric("greedy_agreement", greedy_agreement, Direction.HIGHER,
           "leading rows with the same argmax before the first that differs, as a fraction of the rows",
           ("greedy",), (0.0, 1.0)),
    *(_ulp_metric(f) for f in ulp_formats()),
)}

_BY_ALIAS: dict[str, str] = {alias: m.name for m in METRICS.values() for alias in (m.name, *m.aliases)}


def get_metric(name: str) -> Metric:
    """Look a metric up by name or alias; a KeyError lists what exists."""
    try:
        return METRICS[_BY_ALIAS[name]]
    except KeyError:
        raise KeyError(f"unknown metric {name!r}; known: {', '.join(sorted(_BY_ALIAS))}") from None
