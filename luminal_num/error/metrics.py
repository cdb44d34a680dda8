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
from functools import cached_property
from typing import Callable

import numpy as np

from luminal_num.dtypes.formats import FLOAT_FORMATS, Format
from luminal_num.hlir.store import WeightArray
from luminal_num.hlir.weightcache import WeightCache

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
    fn: Callable[["Compared"], float]  # of one output against its reference (Compared shares the work)
    direction: Direction
    description: str
    aliases: tuple[str, ...] = ()
    values: tuple[float, float] = (0.0, math.inf)  # the closed range the metric's value lies in
    perfect: float | None = None  # the value of y = ref (None: 0 for lower-is-better metrics, 1 otherwise)
    rows: bool = False  # computed from per-row statistics alone: poolable over batches (error/pooled.py)

    def __post_init__(self):
        if self.perfect is None:
            object.__setattr__(self, "perfect", 0.0 if self.direction is Direction.LOWER else 1.0)

    def passes(self, value: float, limit: float) -> bool:
        """value within limit in this metric's direction (NaN never passes)."""
        return bool(value <= limit) if self.direction is Direction.LOWER else bool(value >= limit)

    def better_than_perfect(self, value: float) -> bool:
        return value < self.perfect if self.direction is Direction.LOWER else value > self.perfect

    def share(self, value: float, limit: float) -> float:
        """The share of the allowance `limit` the value uses, both measured from perfect (<= 1 passes): KL over
        its limit, (1 - top1) over (1 - limit), (ppl_ratio - 1) over (limit - 1); inf for a non-finite value."""
        if not math.isfinite(value):
            return math.inf
        distance, allowance = abs(value - self.perfect), abs(limit - self.perfect)
        if self.better_than_perfect(value):  # a ppl ratio below 1: uses nothing
            distance = 0.0
        return distance / allowance if allowance > 0 else (0.0 if distance == 0 else math.inf)

    def tightened(self, limit: float, headroom: float) -> float:
        """The limit that keeps only `headroom` of the allowance (its distance from perfect)."""
        return self.perfect + (limit - self.perfect) * headroom

    def __call__(self, y, ref) -> float:
        return self.fn(Compared(y, ref))

    def of(self, compared: "Compared") -> float:
        return self.fn(compared)


class Compared:
    """y against its FP64 reference, with what several metrics share computed once: a budget checks
    allclose and every metric limit on one pair, and the judge checks hundreds of predicted outputs
    against the same few references (their facts and log-softmax rows are kept per reference, by its
    content key: error/reference.py keys them, hlir/store.py). Every value equals the one computed
    from scratch: the same operations on the same arrays."""

    def __init__(self, y, ref, targets=None):
        self._ref_source = ref if isinstance(ref, WeightArray) else None
        self.targets = None if targets is None else np.asarray(targets, dtype=np.int64).reshape(-1)
        self.y = np.asarray(y, dtype=np.float64)
        self.ref = np.asarray(ref, dtype=np.float64)
        if self.y.shape != self.ref.shape:
            raise ValueError(f"output shape {self.y.shape} != reference shape {self.ref.shape}")
        nan, finite = self._derived("facts", lambda: (bool(np.isnan(self.ref).any()), bool(np.isfinite(self.ref).all())))
        if nan:
            raise ValueError("the FP64 reference contains NaN: the judge is undefined there")
        self._ref_finite = finite

    def _derived(self, key: str, make):
        """A value that depends on the reference alone, kept per reference content (a keyed reference)."""
        if self._ref_source is None:
            return make()
        return _REFERENCE_DERIVED.get(self._ref_source, key, make)

    @cached_property
    def pair(self) -> "_Pair":
        """y and ref with non-finite elements set to 0 in both, and where they blew up."""
        if self._ref_finite and np.isfinite(self.y).all():  # the common case: nothing to mask, no copies
            return _Pair(self.y, self.ref, np.zeros(self.y.shape, bool))
        finite = np.isfinite(self.y) & np.isfinite(self.ref)
        blown = ~finite & ~(self.y == self.ref)
        return _Pair(np.where(finite, self.y, 0.0), np.where(finite, self.ref, 0.0), blown)

    @cached_property
    def blown_any(self) -> bool:
        return bool(self.pair.blown.any())

    @cached_property
    def logit_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """y's rows of logits with matching -inf kept (masked tokens: probability 0 in both), blown rows
        zeroed, and which rows blew up (the reference's rows are read per reference: _derived)."""
        bad = self._derived("logits_bad", lambda: bool((_rows(self.ref) == np.inf).any()
                                                       or (_rows(self.ref) == -np.inf).all(axis=-1).any()))
        if bad:
            raise ValueError("reference logits with +inf or an all -inf row have no softmax")
        y2, blown = _rows(self.y), _rows(self.pair.blown).any(axis=-1)
        return (np.where(~blown[:, None], y2, 0.0) if blown.any() else y2), blown

    @cached_property
    def kl_rows(self) -> np.ndarray:
        """KL(softmax(ref) || softmax(y)) per row; inf on a blown row. The reference's log-softmax is
        its own rows' (a blown row's value is replaced by inf, so masking it first changes nothing)."""
        y2, blown = self.logit_rows
        if not y2.size:
            return np.zeros(0)
        log_p, log_q = self._derived("log_softmax", lambda: _log_softmax(_rows(self.ref))), _log_softmax(y2)
        with np.errstate(invalid="ignore"):
            terms = np.where(log_p == -np.inf, 0.0, np.exp(log_p) * (log_p - log_q))
        return np.where(blown, np.inf, np.maximum(terms.sum(axis=-1), 0.0))  # KL >= 0; rounding can dip below

    @cached_property
    def top1_agrees(self) -> np.ndarray:
        """Per row: the argmax (first on ties) agrees and the row did not blow up."""
        y2, blown = self.logit_rows
        ref_top = self._derived("argmax", lambda: np.argmax(_rows(self.ref), -1))
        return (np.argmax(y2, -1) == ref_top) & ~blown


    @cached_property
    def target_nll(self) -> tuple[np.ndarray, np.ndarray]:
        """Per row: -log q(t) of the plan and -log p(t) of FP64 for the row's next token t: `targets` where
        given (the teacher-forced tokens), else FP64's own argmax (the greedy token teacher forcing feeds
        next); inf on a blown row."""
        y2, blown = self.logit_rows
        if not y2.size:
            return np.zeros(0), np.zeros(0)
        log_p = self._derived("log_softmax", lambda: _log_softmax(_rows(self.ref)))
        t = self._derived("argmax", lambda: np.argmax(_rows(self.ref), -1)) if self.targets is None else self.targets
        if t.shape != (y2.shape[0],) or t.min() < 0 or t.max() >= y2.shape[1]:
            raise ValueError(f"{t.size} target tokens for {y2.shape[0]} rows of {y2.shape[1]} logits")
        rows = np.arange(y2.shape[0])
        nll_ref = -log_p[rows, t]
        if not np.isfinite(nll_ref).all():
            raise ValueError("a target token has probability 0 under the FP64 reference: no perplexity")
        nll_y = -_log_softmax(y2)[rows, t]
        return np.where(blown, np.inf, nll_y), nll_ref


_REFERENCE_DERIVED = WeightCache(256 << 20)  # facts and log-softmax rows of the references being judged against


@dataclass(frozen=True)
class _Pair:
    y: np.ndarray
    ref: np.ndarray
    blown: np.ndarray


def _max(values: np.ndarray) -> float:
    return float(values.max()) if values.size else 0.0


def _max_abs(c: Compared) -> float:
    p = c.pair
    return np.inf if c.blown_any else _max(np.abs(p.y - p.ref))


def max_abs(y, ref) -> float:
    """max |y - ref|."""
    return _max_abs(Compared(y, ref))


def _max_rel(c: Compared, floor: float = TINY) -> float:
    p = c.pair
    if c.blown_any:
        return np.inf
    with np.errstate(over="ignore"):
        return _max(np.abs(p.y - p.ref) / np.maximum(np.abs(p.ref), floor))


def max_rel(y, ref, floor: float = TINY) -> float:
    """max |y - ref| / max(|ref|, floor). The floor only avoids 0/0: where ref is 0 any error is
    'infinitely' relative, so this metric is for outputs away from zero (use atol near zero)."""
    return _max_rel(Compared(y, ref), floor)


def _norm(x: np.ndarray, axis=None) -> np.ndarray:
    """Euclidean norm, scaled by the max so that squares neither overflow nor underflow."""
    scale = np.max(np.abs(x), axis=axis, keepdims=True) if x.size else np.ones((1,) * x.ndim)
    safe = np.where(scale == 0, 1.0, scale)
    return (np.sqrt(np.sum((x / safe) ** 2, axis=axis, keepdims=True)) * scale).squeeze(axis=axis)


def _rel_l2(c: Compared) -> float:
    p = c.pair
    if c.blown_any:
        return np.inf
    err, size = float(_norm(p.y - p.ref)), float(_norm(p.ref))
    if size == 0:
        return 0.0 if err == 0 else np.inf
    return err / size


def rel_l2(y, ref) -> float:
    """||y - ref||_2 / ||ref||_2 over all elements (0 if both are 0, inf if only ref is 0)."""
    return _rel_l2(Compared(y, ref))


def _rows(x: np.ndarray) -> np.ndarray:
    """View as (rows, last axis); a 0-d array is one row of one element."""
    return np.atleast_1d(x).reshape(-1, np.atleast_1d(x).shape[-1])


def _cosine(c: Compared) -> float:
    p = c.pair
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


def cosine(y, ref) -> float:
    """min over rows (last axis) of <y, ref> / (|y| |ref|); 1 when both rows are 0, 0 when one is."""
    return _cosine(Compared(y, ref))


def _log_softmax(x: np.ndarray) -> np.ndarray:
    shifted = x - x.max(axis=-1, keepdims=True)
    return shifted - np.log(np.sum(np.exp(shifted), axis=-1, keepdims=True))


def kl_rows(y, ref) -> np.ndarray:
    """KL(softmax(ref) || softmax(y)) = sum p (log p - log q) per row, stable log-softmax; inf on a blown row."""
    return Compared(y, ref).kl_rows


def _kl_logits(c: Compared) -> float:
    rows = c.kl_rows
    return float(rows.mean()) if rows.size else 0.0


def kl_logits(y, ref) -> float:
    """mean over rows of KL(softmax(ref) || softmax(y))."""
    return _kl_logits(Compared(y, ref))


def _kl_max(c: Compared) -> float:
    return _max(c.kl_rows)


def kl_max(y, ref) -> float:
    """max over rows of KL(softmax(ref) || softmax(y)): the worst next-token distribution."""
    return _kl_max(Compared(y, ref))


def _kl_p99(c: Compared) -> float:
    rows = c.kl_rows
    return float(np.quantile(rows, 0.99, method="inverted_cdf")) if rows.size else 0.0


def kl_p99(y, ref) -> float:
    """The 99th percentile of the rows' KL(softmax(ref) || softmax(y)): the smallest row value that at least
    99% of the rows do not exceed (llama-perplexity's "99.0%" KL line)."""
    return _kl_p99(Compared(y, ref))


def _ppl_ratio(c: Compared) -> float:
    nll_y, nll_ref = c.target_nll
    if not nll_y.size:
        return 1.0
    with np.errstate(over="ignore", invalid="ignore"):
        return float(np.exp(np.mean(nll_y) - np.mean(nll_ref)))


def ppl_ratio(y, ref, targets=None) -> float:
    """Perplexity of the plan over perplexity of FP64 on the rows' next tokens (`targets`, else FP64's
    argmax): exp(mean(-log q(t)) - mean(-log p(t))); 1 is FP64's, inf where a row blew up."""
    return _ppl_ratio(Compared(y, ref, targets))


def _greedy_agreement_length(c: Compared) -> int:
    agree = c.top1_agrees
    return int(agree.size if agree.all() else np.argmin(agree))


def greedy_agreement_length(y, ref) -> int:
    """Leading rows (positions, in order) whose argmax agrees before the first that does not; a blown row
    disagrees. On logits teacher-forced along the reference's own greedy continuation this is how many
    generated tokens the plan reproduces."""
    return _greedy_agreement_length(Compared(y, ref))


def _greedy_agreement(c: Compared) -> float:
    rows = _rows(c.y).shape[0] if c.y.size else 0
    return 1.0 if rows == 0 else _greedy_agreement_length(c) / rows


def greedy_agreement(y, ref) -> float:
    """greedy_agreement_length as a fraction of the rows (1 = every position agrees)."""
    return _greedy_agreement(Compared(y, ref))


def _top1_agreement(c: Compared) -> float:
    agree = c.top1_agrees
    return float(np.mean(agree)) if agree.size else 1.0


def top1_agreement(y, ref) -> float:
    """Fraction of rows whose argmax (first on ties) agrees; a blown row disagrees."""
    return _top1_agreement(Compared(y, ref))


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
    return _max_ulp(Compared(y, ref), fmt)


def _max_ulp(c: Compared, fmt: Format) -> float:
    p = c.pair
    if c.blown_any:
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
    return allclose_of(Compared(y, ref), atol, rtol)


def allclose_of(c: Compared, atol: float, rtol: float) -> float:
    """allclose_violation of a Compared pair; atol = inf (allclose off) needs no pass over the values."""
    if c.blown_any:
        return np.inf
    if atol == np.inf:  # every finite error is within an infinite tolerance: ratio 0
        return 0.0
    p = c.pair
    err = np.abs(p.y - p.ref)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        tolerance = atol + np.where(p.ref == 0, 0.0, rtol * np.abs(p.ref))  # rtol=inf at ref=0 is 0, not NaN
        ratio = np.where(err == 0, 0.0, err / tolerance)
    return _max(ratio)


def _ulp_metric(fmt: Format) -> Metric:
    return Metric(f"max_ulp_{fmt.name}", lambda c: _max_ulp(c, fmt), Direction.LOWER,
                  f"max distance in {fmt.name} ulps after rounding both to {fmt.name} (0 = correctly rounded)",
                  (f"ulp_{fmt.name}",))


METRICS: dict[str, Metric] = {m.name: m for m in (
    Metric("max_abs", _max_abs, Direction.LOWER, "max |y - ref|", ("abs",)),
    Metric("max_rel", _max_rel, Direction.LOWER, "max |y - ref| / max(|ref|, 2^-1022)", ("rel",)),
    Metric("rel_l2", _rel_l2, Direction.LOWER, "||y - ref||_2 / ||ref||_2", ("l2",)),
    Metric("cosine", _cosine, Direction.HIGHER, "min over rows of the cosine similarity (last axis)", ("cos",),
           (-1.0, 1.0)),
    Metric("kl_logits", _kl_logits, Direction.LOWER, "mean over rows of KL(softmax(ref) || softmax(y))", ("kl",),
           rows=True),
    Metric("top1_agreement", _top1_agreement, Direction.HIGHER, "fraction of rows with the same argmax",
           ("top1",), (0.0, 1.0), rows=True),
    Metric("kl_max", _kl_max, Direction.LOWER, "max over rows of KL(softmax(ref) || softmax(y))", (), rows=True),
    Metric("kl_p99", _kl_p99, Direction.LOWER, "99th percentile over rows of KL(softmax(ref) || softmax(y))", (),
           rows=True),
    # perfect (y = ref) is 1, and a plan may beat FP64 on the next tokens (below 1): a share counts only above 1
    Metric("ppl_ratio", _ppl_ratio, Direction.LOWER, "perplexity of y over perplexity of ref on the next tokens",
           ("ppl",), (0.0, math.inf), perfect=1.0, rows=True),
    Metric("greedy_agreement", _greedy_agreement, Direction.HIGHER,
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
