"""The error bound of a SOFTMAX kernel, per element, from the row max it is computed with.

The kernel computes p^_i = fl(e^_i / s^), e^_j = exp(fl(x^_j - m)), s^ = fl(sum_j e^_j), m = max_j x^_j
(the CUDA kernel: FP32 subtract, expf, running sum, divide; the CPU backend: the same in FP64 with one
rounding, plus, for a low-precision variant, its inputs and result rounded to that format; the bound
below covers both). x is the exact score row, x^ the executed one with |x^_j - x_j| <= err_j.

Derivation (every step is exact, not first order):
1. Fold each rounding before the sum into the exponent: fl(x^_j - m) = (x^_j - m)(1 + d), |d| <= u, and
   x^_j - m lies in [lo^_j - max_k hi^_k, 0] (lo^, hi^: where the executed scores can be), so the subtract
   moves the exponent by at most c_j = u (max_k hi^_k - lo^_j); expf's <= 2 ulp error is a factor
   1 + d' = exp(log1p(d')), |log1p(d')| <= lambda = -log1p(-4u). Softmax is shift invariant, so the
   computed ratio e_i / sum_j e_j is softmax(x + t) exactly, with |t_j| <= D_j = err_j + c_j + lambda
   (+ the input rounding u_f |x^_j| + sub_f / 2 of a low-precision variant).
2. For any perturbation t: P_i = softmax(x + t)_i = p r / (p r + q) with p = p_i, q = 1 - p_i and
   r = e^{t_i} / W_i, W_i = sum_{j != i} w_j e^{t_j}, w_j = p_j / q (weights summing to 1). Then
   P_i - p_i = p q (r - 1) / (p r + q), and p r + q >= min(1, r), so
        |P_i - p_i| <= p_i (1 - p_i) expm1(|log r|) <= p_i (1 - p_i) expm1(D_i + L_i),
   L_i >= |log W_i|: log W_i <= log1p(A_i), A_i >= sum_{j != i} w_j expm1(D_j), and (Jensen)
   -log W_i <= sum_{j != i} w_j D_j; both also <= max_{j != i} D_j. The weights are bounded from the
   score intervals, w_j <= exp(hi_j) / sum_{k != i} exp(lo_k) (log space, so a masked key at -1e9
   weighs 0 however large its own D_j is). First order this is 2 p (1 - p) D for a uniform D: the
   sharp constant (softmax's Jacobian row p_i (delta_ij - p_j) has absolute row sum 2 p_i (1 - p_i));
   a row of length 1 has no propagated error at all. p (1 - p) is bounded over the output interval
   [p_lo, p_hi] (1/4 where it holds 1/2), and by p_hi q_hi with q_hi = sum_{j != i} exp(hi_j) /
   sum_k exp(lo_k) (a p within 1e-16 of 1 rounds to 1 in [p_lo, p_hi], not in log space).
   Second form, taken where smaller: P_i / p_i = e^{t_i} / sum_j p_j e^{t_j}, so |P_i - p_i| <=
   p_i expm1(D_i + L) with L from sum_j p_j expm1(D_j) and sum_j p_j D_j over all keys, each bounded
   by its maximum over p in the output box within the simplex (a fractional knapsack).
3. The sum and the divide: s^ = sum e^_j (1 + theta), |theta| <= gamma_{n-1} (positive terms, any
   order); the max term is exp(0) = 1, so sum e^_j >= 1 - 4u and expf's absolute error near underflow
   (<= 2 subnormal ulps per term) is relative to it. The result is P_i (1 + rho) + an absolute part.
The executed and the exact values are both in [0, 1], which caps the bound at max(p_hi, 1 - p_lo).
`row_total` bounds sum_i |p^_i - p_i| over a row (the attention Gemm's convex-combination bound):
sum_i p_i expm1(D_i + L) maximised over the same box, or the sum of the per-element bounds.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..dtypes.formats import F32, Format
from ..hlir.ops import Op
from .interval import Interval, transfer
from .rounding_bounds import gamma

EXP_ULPS = 2  # CUDA's expf (and numpy's exp, far more accurate) is within 2 ulps, results subnormal too
PAD = 2.0 ** -40  # relative slack of the FP64 log-space computations below (a few ulps of each term)


@dataclass(frozen=True)
class SoftmaxError:
    err: np.ndarray          # per element, the softmax's shape
    row_total: np.ndarray    # per row (axis kept, size 1): >= sum_i |p^_i - p_i| before the store
    absolute: float          # the part of each element's error not relative to p (underflow)


def _nan_to(x, nan: float) -> np.ndarray:
    """NaN replaced by `nan`, infinities kept (np.nan_to_num would turn inf into the largest double)."""
    return np.where(np.isnan(x), nan, x)


def _last(x: np.ndarray, axis: int) -> np.ndarray:
    return np.moveaxis(np.asarray(x, dtype=np.float64), axis, -1)


def _exclusive(x: np.ndarray, ufunc: np.ufunc, identity: float) -> np.ndarray:
    """ufunc over j != i along the last axis, for every i (prefix and suffix scans)."""
    pad = np.full(x.shape[:-1] + (1,), identity)
    prefix = np.concatenate([pad, ufunc.accumulate(x, axis=-1)[..., :-1]], axis=-1)
    suffix = np.concatenate([ufunc.accumulate(x[..., ::-1], axis=-1)[..., -2::-1], pad], axis=-1)
    return ufunc(prefix, suffix)


def _log_sums(logs: np.ndarray, exclusive: bool, up: bool) -> np.ndarray:
    """log sum_j exp(logs_j) along the last axis (over j != i for each i when exclusive), rounded outward
    by PAD times the magnitudes that matter (terms within 800 of the shift; the rest are below e^-800 of
    it); -inf for an empty sum. Shifted by the row max, and, for the sum that leaves the max out, by the
    second largest (else a row whose other terms are all masked would round to an empty sum)."""
    first = np.max(logs, axis=-1, keepdims=True)
    first = np.where(np.isfinite(first), first, 0.0)
    with np.errstate(divide="ignore"):
        if not exclusive:
            return _padded(np.log(np.sum(np.exp(logs - first), axis=-1, keepdims=True)), first, logs, up)
        total = _padded(np.log(_exclusive(np.exp(logs - first), np.add, 0.0)), first, logs, up)
        top = np.argmax(logs, axis=-1)[..., None]
        rest = logs.copy()
        np.put_along_axis(rest, top, -np.inf, axis=-1)
        second = np.max(rest, axis=-1, keepdims=True)
        second = np.where(np.isfinite(second), second, 0.0)
        without_top = _padded(np.log(np.sum(np.exp(rest - second), axis=-1, keepdims=True)), second, rest, up)
    np.put_along_axis(total, top, without_top, axis=-1)
    return total


def _padded(log_sum: np.ndarray, shift: np.ndarray, logs: np.ndarray, up: bool) -> np.ndarray:
    near = np.where(logs >= shift - 800, np.abs(logs), 0.0)
    pad = PAD * (logs.shape[-1] + 4 + np.abs(shift) + np.max(near, axis=-1, keepdims=True))
    return log_sum + shift + (pad if up else -pad)


def _log_expm1(d: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", over="ignore"):
        return np.where(d > 40, d + np.log1p(-np.exp(-np.minimum(d, 700))), np.log(np.expm1(np.minimum(d, 40))))


def _log_neg_expm1_neg(d: np.ndarray) -> np.ndarray:
    """log(1 - e^{-d}) for d >= 0."""
    with np.errstate(divide="ignore"):
        return np.log(-np.expm1(-d))


def _exp_product(log_a: np.ndarray, log_b: np.ndarray) -> np.ndarray:
    """exp(log_a + log_b) rounded up; 0 where a factor is 0 (a 0 weight times an infinite factor)."""
    total = log_a + log_b
    return np.where((log_a == -np.inf) | (log_b == -np.inf), 0.0, np.exp(total + PAD * (1 + np.abs(total))))


def _simplex_max(plo: np.ndarray, phi: np.ndarray, log_p: np.ndarray, log_g: np.ndarray) -> np.ndarray:
    """An upper bound of sum_j p_j g_j over p with plo <= p <= phi and sum p = 1 (the exact softmax is one
    such p): every p_j at plo_j, the rest of the mass to the largest g_j first (a fractional knapsack);
    each product in log space (log_p >= log p_j), so a masked key's e^-1e9 weight cancels any g_j."""
    order = np.argsort(-log_g, axis=-1)
    lo_s, hi_s, lp_s, lg_s = (np.take_along_axis(np.clip(a, 0.0, None) if i < 2 else a, order, axis=-1)
                              for i, a in enumerate((plo, phi, log_p, log_g)))
    room = np.maximum(hi_s - lo_s, 0.0)
    left = np.maximum(1.0 - np.sum(lo_s, axis=-1, keepdims=True), 0.0) + PAD  # more mass only raises the max
    before = np.cumsum(room, axis=-1) - room
    p_up = lo_s + np.clip(left - before, 0.0, room)
    with np.errstate(divide="ignore"):
        log_up = np.minimum(np.log(np.minimum(p_up * (1 + PAD), 1.0)), lp_s)
    return np.sum(_exp_product(log_up, lg_s), axis=-1, keepdims=True) * (1 + PAD)


def _p_one_minus_p(plo: np.ndarray, phi: np.ndarray) -> np.ndarray:
    """max of p (1 - p) over [plo, phi] within [0, 1], rounded up."""
    plo, phi = np.clip(plo, 0.0, 1.0), np.clip(phi, 0.0, 1.0)
    side = np.where(phi < 0.5, phi * (1 - phi), plo * (1 - plo))
    return np.where((plo <= 0.5) & (phi >= 0.5), 0.25, side) * (1 + PAD)


def softmax_error(exact: Interval, executed: Interval, err: np.ndarray, out: Interval, axis: int,
                  rounded_to: Format | None) -> SoftmaxError:
    """Bound of |p^ - p| (see the module docstring). exact/executed: the score intervals (exact value, and
    where the executed value can be); out: the exact softmax's interval; rounded_to: a low-precision
    variant's format (inputs and result rounded to it), None for FP32."""
    lo, hi, wlo, whi = (_last(a, axis) for a in (exact.lo, exact.hi, executed.lo, executed.hi))
    e = _last(np.broadcast_to(err, exact.lo.shape), axis)
    plo, phi = _last(out.lo, axis), _last(out.hi, axis)
    n = lo.shape[-1]
    u, sub = F32.unit_roundoff, F32.min_subnormal
    gone = np.isneginf(whi) & np.isneginf(hi)  # keys at -inf in both rows (masked_softmax_error): weight 0
    with np.errstate(all="ignore"):
        if rounded_to is not None:  # x^ rounded to the variant's format first: more exponent error, wider x^
            step = rounded_to.unit_roundoff * np.maximum(np.abs(wlo), np.abs(whi)) + rounded_to.min_subnormal / 2
            step = np.where(gone, 0.0, step)
            e, wlo, whi = e + step, wlo - step, whi + step
        top = np.max(whi, axis=-1, keepdims=True)
        d = e + u * (top - wlo) - np.log1p(-2 * EXP_ULPS * u)
        d = np.where(gone, 0.0, _nan_to(d * (1 + PAD), nan=np.inf))
        # weights of the others: w_j <= exp(hi_j) / sum_{k != i} exp(lo_k), in log space
        log_den = _log_sums(lo, exclusive=True, up=False)
        a_i = np.exp(_log_sums(hi + _log_expm1(d), exclusive=True, up=True) - log_den)
        b_i = np.exp(_log_sums(hi + _log_neg_expm1_neg(d), exclusive=True, up=True) - log_den)
        d_others = _exclusive(d, np.maximum, 0.0)
        a_i = _nan_to(np.minimum(a_i, np.expm1(d_others)), nan=np.inf)
        b_i = _nan_to(np.minimum(np.minimum(b_i, -np.expm1(-d_others)), 1.0), nan=1.0)
        with np.errstate(divide="ignore"):
            log_d = np.log(d)
        # Jensen: -log W <= sum_j w_j D_j <= max_j D_j, sharper than -log1p(-B) when B rounds to 1
        jensen = np.exp(_log_sums(hi + log_d, exclusive=True, up=True) - log_den)
        down = np.minimum(np.minimum(-np.log1p(-b_i), _nan_to(jensen, nan=np.inf)), d_others)
        spread = np.maximum(np.log1p(a_i), down) * (1 + PAD)
        g = _nan_to(np.expm1((d + spread) * (1 + PAD)), nan=np.inf)
        log_all = _log_sums(lo, exclusive=False, up=False)
        log_p_hi = hi - log_all + PAD * (1 + np.abs(hi - log_all))  # p_i <= exp(hi_i) / sum_k exp(lo_k)
        log_p_hi = np.where(gone, -np.inf, log_p_hi)
        # 1 - p_i = sum_{j != i} p_j <= sum_{j != i} exp(hi_j) / sum_k exp(lo_k): below 1e-16 too
        log_q_hi = _log_sums(hi, exclusive=True, up=True) - log_all
        log_q_hi = np.where(np.isfinite(log_q_hi), log_q_hi + PAD * (1 + np.abs(log_q_hi)), log_q_hi)
        log_pq = np.minimum(np.minimum(log_p_hi, 0.0) + np.minimum(log_q_hi, 0.0), np.log(_p_one_minus_p(plo, phi)))
        log_g = _log_expm1((d + spread) * (1 + PAD))
        prop = _exp_product(log_pq, log_g)
        # the same over all keys (no exclusion, no 1 - p): the weights are the output box within the simplex
        log_p = np.minimum(log_p_hi, np.log(np.clip(phi, 0.0, 1.0)))
        a_all = _simplex_max(plo, phi, log_p, _log_expm1(d))
        b_all = np.minimum(_simplex_max(plo, phi, log_p, _log_neg_expm1_neg(d)), 1.0)
        down_all = np.minimum(np.minimum(-np.log1p(-b_all), _simplex_max(plo, phi, log_p, log_d)),
                              np.max(d, axis=-1, keepdims=True))
        spread_all = np.maximum(np.log1p(a_all), down_all) * (1 + PAD)
        log_g_all = _log_expm1((d + spread_all) * (1 + PAD))
        prop = np.minimum(prop, _exp_product(log_p, log_g_all))
        if n == 1:
            prop = np.zeros_like(prop)  # softmax of one element is exactly 1
        cap = np.maximum(phi, 1 - plo)
        prop = _nan_to(np.minimum(prop, cap), nan=1.0)
        # the sum (gamma_{n-1}, its terms' absolute underflow relative to a sum >= 1 - 4u) and the divide
        a_exp = EXP_ULPS * sub
        rho = (1 + u) * (1 + 2 * n * a_exp) / (1 - float(gamma(max(n - 1, 1), u))) - 1
        absolute = 2 * a_exp * (1 + rho) + sub / 2
        big_p = np.minimum(1.0, np.minimum(phi, 1.0) + prop)
        elem = prop + big_p * rho + absolute
        # the row's total: sum_i p_i expm1(D_i + L) over the box within the simplex, or the elements' sum
        total = np.minimum(np.sum(prop, axis=-1, keepdims=True), _simplex_max(plo, phi, log_p, log_g_all))
        total = total + (1 + total) * rho
        if rounded_to is not None:  # the result rounded to the variant's format
            ur, sr = rounded_to.unit_roundoff, rounded_to.min_subnormal
            elem = elem + ur * (big_p + elem) + sr / 2
            total, absolute = total + ur * (1 + total), absolute * (1 + ur) + sr / 2
        # executed and exact values are in [0, 1] only while every executed score is finite
        finite = np.all(np.isfinite(d), axis=-1, keepdims=True)
        elem = np.where(finite, _nan_to(np.minimum(elem, cap), nan=np.inf), np.inf)
        total = np.where(finite, _nan_to(total, nan=np.inf), np.inf)
    return SoftmaxError(np.moveaxis(elem, -1, axis), np.moveaxis(total, -1, axis), float(absolute))


def masked_softmax_error(exact: Interval, executed: Interval, err: np.ndarray, masked: np.ndarray, axis: int,
                         rounded_to: Format | None) -> SoftmaxError:
    """The bound when some entries are executed as exactly -inf (a -1e9 mask stored in FP16): the kernel
    then computes p' = the softmax over the live keys (weight exactly 0 for the masked ones), bounded by
    softmax_error with the masked keys at -inf in both the exact and the executed row. The exact softmax
    p over all keys differs from p' by dropping the masked mass: p'_i = p_i (1 + S_m / S_l), so
    |p'_i - p_i| <= p'_i eta and a masked p_j <= eta, with eta >= S_m / S_l = sum_masked e^{x_j} /
    sum_live e^{x_k} <= exp(logsumexp(hi_masked) - logsumexp(lo_live)). A row with no live key executes
    0/0: unbounded."""
    lo, hi = (np.where(masked, -np.inf, x) for x in (exact.lo, exact.hi))
    wlo, whi = (np.where(masked, -np.inf, x) for x in (executed.lo, executed.hi))
    live = Interval(lo, hi)
    out_live = transfer(Op.SOFTMAX, live, axis=axis)
    bound = softmax_error(live, Interval(wlo, whi), np.where(masked, 0.0, err), out_live, axis, rounded_to)
    with np.errstate(all="ignore"):
        log_masked = _log_sums(_last(np.where(masked, exact.hi, -np.inf), axis), exclusive=False, up=True)
        log_live = _log_sums(_last(lo, axis), exclusive=False, up=False)
        eta = np.exp((log_masked - log_live) * (1 + PAD) + PAD)  # >= S_m / S_l; 0 when nothing is masked
        eta = np.where(np.isneginf(log_masked), 0.0, _nan_to(eta, nan=np.inf))
        eta = np.moveaxis(eta, -1, axis)
        no_live = np.all(masked, axis=axis, keepdims=True)
        drop = np.where(masked, np.minimum(eta, 1.0), np.minimum(out_live.hi * eta, 1.0))
        elem = np.where(no_live, np.inf, np.minimum(bound.err + drop, 1.0))
        total = np.where(no_live, np.inf, bound.row_total + 2 * eta)
    return SoftmaxError(elem, total, bound.absolute)
