"""The static bound of the fused attention kernel (runtime/cpu_attention.py says what it executes).

Softmax weights sum to one, so the output is a convex combination of V rows. Two stages, per row:
(a) exact arithmetic on the executed scores s^ and executed V v^ against the exact output:
    |sum_j w(s^)_j v^_j - sum_j w(s)_j v_j| <= T_row max_j |v^_j| + max_j err_v_j, where T_row >=
    sum_j |w(s^)_j - w(s)_j| is error/softmax_bound.py's row total for the score error (it also
    charges the unfused softmax's own roundings: an over-count, so still sound).
(b) the online algorithm's roundings against exact arithmetic on s^, v^. With M = max s^ (exact: max
    does not round), e_j = exp(s^_j - M) in (0, 1] and S = sum e_j >= 1. Term j is multiplied by
    e(fl(s^_j - m_t)) and then by the rescale factors e(fl(m_old - m_new)) of every later tile and of
    the split combine: the subtractions move its exponent by <= u (m_t - s^_j) + u sum |dm| <=
    2 u x_j, x_j = M - s^_j (the running max only grows towards M), and each e() and each l*alpha /
    o*alpha product is one relative rounding: c = 2 n_tiles + 3 of them. So the executed multiplier
    differs from e_j by A_j <= e^{-x}(e^{2ux}(1+u)^c - 1) <= ((1+u)^c - 1) e^{-a xl} + 2u x* e^{-a x*}
    (a = 1 - 2u, x in [xl, xh], x* = clip(1/a, xl, xh): e^y - 1 <= y e^y and x e^{-ax} peaks at 1/a);
    a key masked at -1e9 has xl ~ 1e9 and weighs 0 here, however large its exponent error.
    The running sums add at most g = gamma_{T + splits + 1} relative (positive terms, any order);
    P and V rounded to the variant's P V format add u_p and u_v. With everything divided by S >= 1:
      dL = sum A + g (1 + sum A),
      dO = Vm [(1 + u_v)(1 + g)(sum A + u_p (1 + sum A)) + u_v + g (1 + u_v)],
      |O/L - sum_j e_j v^_j / S| <= (dO + Vm dL) / (1 - dL)     (infinite when dL >= 1),
    Vm = max_j |v^_j| per output column. The divide's rounding is the caller's FP32 store.
"""
from __future__ import annotations

import numpy as np

from ..dtypes.formats import F32, Format
from .interval import Interval
from .rounding_bounds import gamma
from .softmax_bound import softmax_error

U = F32.unit_roundoff
U_EXP = U * (1 + 2.0 ** -50)  # exp in FP64 then one rounding to FP32


def term_errors(lo: np.ndarray, hi: np.ndarray, n_tiles: int) -> np.ndarray:
    """A_j per score (last axis = keys) from where the executed scores can be ([lo, hi])."""
    a = 1 - 2 * U
    c = 2 * n_tiles + 3
    with np.errstate(all="ignore"):
        m_lo, m_hi = np.max(lo, axis=-1, keepdims=True), np.max(hi, axis=-1, keepdims=True)
        xl = np.maximum(m_lo - hi, 0.0)
        xh = np.maximum(m_hi - lo, xl)
        x_star = np.clip(1 / a, xl, xh)
        out = np.expm1(c * np.log1p(U_EXP)) * np.exp(-a * xl) + 2 * U * x_star * np.exp(-a * x_star)
    return np.where(np.isfinite(out), out, np.inf) * (1 + 2.0 ** -40)


def online_error(a_sum: np.ndarray, v_mag: np.ndarray, keys: int, splits: int, pv: Format) -> np.ndarray:
    """Stage (b): a_sum (rows, 1) = sum_j A_j, v_mag (rows, Dv) = max_j |v^_j|; returns (rows, Dv)."""
    g = gamma(keys + splits + 1, U)
    u_p = u_v = 0.0 if pv is F32 else pv.unit_roundoff
    with np.errstate(all="ignore"):
        d_l = a_sum + g * (1 + a_sum)
        d_o = v_mag * ((1 + u_v) * (1 + g) * (a_sum + u_p * (1 + a_sum)) + u_v + g * (1 + u_v))
        err = (d_o + v_mag * d_l) / (1 - d_l)
    return np.where((d_l < 1) & np.isfinite(err), err, np.inf)


def score_row_total(exact: Interval, wide: Interval, err: np.ndarray, weights: Interval) -> np.ndarray:
    """Stage (a)'s T_row (rows, 1): sum_j |w(s^)_j - w(s)_j| <= row_total + n absolute (`weights`:
    the exact softmax's interval)."""
    bound = softmax_error(exact, wide, err, weights, exact.lo.ndim - 1, None)
    return bound.row_total + exact.lo.shape[-1] * bound.absolute
