"""Metric limits certified from a static error bound: for every y with |y - ref| <= err elementwise, each
metric of error/metrics.py is at most (or, for higher-is-better metrics, at least) the value given here.

Why: a budget of KL, top-1 or cosine limits (every LLM and embedding budget) could only be measured; the
per-element bound already proves some of them. Each derivation (ref: the FP64 reference, rows along the
last axis as error/metrics.py takes them):
- max_abs <= max err; max_rel <= max err / max(|ref|, floor); rel_l2 <= ||err|| / ||ref||.
- cosine: y = ref + d with ||d|| <= r < ||ref|| = c makes an angle whose sine is at most r / c, so
  cos >= sqrt(1 - (r/c)^2); r >= c allows any angle (-1).
- KL(p || q), p = softmax(ref), q = softmax(ref + d): KL = log E_p[e^d] - E_p[d], and d lies in
  [-m, m] (m = the row's max err), so Hoeffding's lemma gives KL <= (2m)^2 / 8 = m^2 / 2.
- top-1: the reference's argmax t stays the argmax when ref_t - err_t > ref_j + err_j for every other j
  (strictly: ties go to the first index); rows without that margin count as disagreeing.
Each bound is widened by FP64's own rounding in computing the metric (REL_SLACK, ABS_SLACK). A metric with
no derivation here (ULP distances) gives None: the static stage then leaves the candidate to measurement.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from .metrics import TINY

REL_SLACK = 1.0 + 2.0 ** -30  # FP64 rounding in these bounds and in the metric the measurement computes
ABS_SLACK = 2.0 ** -40        # absolute: a KL or cosine computed in FP64 over a long row


def _rows(x: np.ndarray) -> np.ndarray:
    return np.atleast_1d(x).reshape(-1, np.atleast_1d(x).shape[-1])


def _norm_rows(x: np.ndarray) -> np.ndarray:
    scale = np.max(np.abs(x), axis=-1, keepdims=True) if x.size else np.ones((x.shape[0], 1))
    safe = np.where(scale == 0, 1.0, scale)
    return np.sqrt(np.sum((x / safe) ** 2, axis=-1)) * scale[:, 0]


def _max_abs(err, ref) -> float:
    return float(np.max(err)) * REL_SLACK if err.size else 0.0


def _max_rel(err, ref) -> float:
    with np.errstate(over="ignore"):
        return float(np.max(err / np.maximum(np.abs(ref), TINY))) * REL_SLACK if err.size else 0.0


def _rel_l2(err, ref) -> float:
    size = float(_norm_rows(ref.reshape(1, -1))[0]) if ref.size else 0.0
    bound = float(_norm_rows(err.reshape(1, -1))[0]) if err.size else 0.0
    if bound == 0:
        return 0.0
    return bound / size * REL_SLACK if size > 0 else np.inf


def _cosine(err, ref) -> float:
    e2, r2 = _rows(err), _rows(ref)
    if not e2.size:
        return 1.0
    r, c = _norm_rows(e2) * REL_SLACK, _norm_rows(r2)
    with np.errstate(divide="ignore", invalid="ignore"):
        t = np.where(c > 0, r / c, np.inf)
        cos = np.where(t < 1, np.sqrt(np.maximum(1 - t * t, 0.0)) - ABS_SLACK, -1.0)
    return float(np.min(np.where(r == 0, 1.0, cos)))  # an exact row equals its reference: cosine 1


def _kl_rows(err, ref) -> np.ndarray:
    m = np.max(_rows(err), axis=-1) if err.size else np.zeros(0)
    return m * m / 2 * REL_SLACK + ABS_SLACK


def _kl_logits(err, ref) -> float:
    rows = _kl_rows(err, ref)
    return float(np.mean(rows)) if rows.size else 0.0


def _kl_max(err, ref) -> float:
    rows = _kl_rows(err, ref)
    return float(np.max(rows)) if rows.size else 0.0


def _ppl_ratio(err, ref) -> float:
    """Per row |(-log q(t)) - (-log p(t))| <= |y_t - r_t| + |lse(y) - lse(r)| <= 2 max|e| (log-sum-exp moves by at
    most the largest change), so the ratio of the perplexities is at most exp(2 max over rows of max|e|)."""
    e2 = _rows(err) * REL_SLACK
    return float(np.exp(2.0 * np.max(e2))) if e2.size else 1.0


def _top1_kept(err, ref) -> np.ndarray:
    """Per row: the reference's argmax is certainly the argmax of every y within the bound."""
    e2, r2 = _rows(err) * REL_SLACK, _rows(ref)
    if not r2.size:
        return np.zeros(0, bool)
    top = np.argmax(r2, axis=-1)
    at = np.arange(r2.shape[0])
    low = r2[at, top] - e2[at, top]
    high = r2 + e2
    high[at, top] = -np.inf
    return low > np.max(high, axis=-1)


def _top1(err, ref) -> float:
    kept = _top1_kept(err, ref)
    return float(np.mean(kept)) if kept.size else 1.0


def _greedy(err, ref) -> float:
    kept = _top1_kept(err, ref)
    if not kept.size:
        return 1.0
    return (kept.size if kept.all() else int(np.argmin(kept))) / kept.size


# metric name (error/metrics.py METRICS) -> its bound (an upper bound for lower-is-better metrics, a
# lower bound for higher-is-better ones) over every output within the error bound
METRIC_BOUNDS: dict[str, Callable[[np.ndarray, np.ndarray], float]] = {
    "max_abs": _max_abs, "max_rel": _max_rel, "rel_l2": _rel_l2, "cosine": _cosine,
    "kl_logits": _kl_logits, "kl_max": _kl_max, "top1_agreement": _top1, "greedy_agreement": _greedy,
    "kl_p99": _kl_max,  # a percentile of the rows' KL is at most their max
    "ppl_ratio": _ppl_ratio,
}


def metric_bound(name: str, err: np.ndarray, ref: np.ndarray) -> float | None:
    """The bound of metric `name` over every y with |y - ref| <= err; None where none is derived here, or
    where the reference is not finite (a masked or blown reference: the measurement judges it)."""
    fn = METRIC_BOUNDS.get(name)
    ref = np.asarray(ref, dtype=np.float64)
    err = np.broadcast_to(np.asarray(err, dtype=np.float64), ref.shape)
    if fn is None or not np.all(np.isfinite(ref)):
        return None
    if not np.all(np.isfinite(err)):
        return {"cosine": -1.0, "top1_agreement": 0.0, "greedy_agreement": 0.0}.get(name, np.inf)
    return fn(err, ref)
