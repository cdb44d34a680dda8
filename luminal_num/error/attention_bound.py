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
    (or, summed over the keys with x_j <= X and divided by S, <= (1+u)^c e^{2uX} - 1)
    (a = 1 - 2u, x in [xl, xh], x* = clip(1/a, xl, xh): e^y - 1 <= y e^y and x e^{-ax} peaks at 1/a);
    a key masked at -1e9 has xl ~ 1e9 and weighs 0 here, however large its exponent error.
    Every rounding of a running sum (an add, a rescale product) multiplies each term in it by one
    (1 + d): the sums add at most g = gamma_{T + splits + 1} relative (the P V product included).
    P and V rounded to the P V format f: |r(x) - x| <= u_f |x| + sub_f / 2 (inf past f's range).
    With EP = sum A + u_f (1 + sum A) + T sub_f / 2 (1 + u)^c >= sum_j |P^o_j - e_j| / S, V' =
    Vm (1 + u_f) + sub_f / 2 >= |r(v)|, ev = u_f Vm + sub_f / 2, everything divided by S >= 1:
      dL = sum A + g (1 + sum A),   dO = EP V' + ev + g (1 + EP) V',
      |O/L - sum_j e_j v^_j / S| <= (dO + Vm dL) / (1 - dL)     (infinite when dL >= 1),
    Vm = max_j |v^_j| per output column. The divide's rounding is the caller's FP32 store.
"""
from __future__ import annotations

import numpy as np

from ..codegen.attention import AttentionSpec, key_ranges
from ..dtypes.formats import F32, Format
from ..hlir.ops import Op
from .interval import Interval, transfer
from .rounding_bounds import gamma, nan_as_unbounded
from .softmax_bound import softmax_error

U = F32.unit_roundoff
U_EXP = U * (1 + 2.0 ** -50)  # exp in FP64 then one rounding to FP32


def _x_range(lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[xl, xh] of x_j = M - s^_j per score, from where the executed scores can be ([lo, hi])."""
    m_lo, m_hi = np.max(lo, axis=-1, keepdims=True), np.max(hi, axis=-1, keepdims=True)
    xl = np.maximum(m_lo - hi, 0.0)
    return xl, np.maximum(m_hi - lo, xl)


def term_errors(lo: np.ndarray, hi: np.ndarray, n_tiles: int) -> np.ndarray:
    """A_j per score (last axis = keys)."""
    a = 1 - 2 * U
    with np.errstate(all="ignore"):
        xl, xh = _x_range(lo, hi)
        x_star = np.clip(1 / a, xl, xh)
        out = np.expm1((2 * n_tiles + 3) * np.log1p(U_EXP)) * np.exp(-a * xl) + 2 * U * x_star * np.exp(-a * x_star)
    return np.where(np.isfinite(out), out, np.inf) * (1 + 2.0 ** -40)


def row_term_total(lo: np.ndarray, hi: np.ndarray, n_tiles: int) -> np.ndarray:
    """>= sum_j A_j / S per row (keys axis kept, size 1): the smaller of sum_j A_j (S >= 1) and, for a
    cut X, the near keys (x_j <= X) as a weighted mean (sum of e_j / S <= 1, each off by at most
    (1+u)^c e^{2uX} - 1) plus the far keys' own A_j."""
    per_term = term_errors(lo, hi, n_tiles)
    best = np.sum(per_term, axis=-1, keepdims=True)
    with np.errstate(all="ignore"):
        _, xh = _x_range(lo, hi)
        for cut in (4.0, 16.0, 64.0, 256.0, 1024.0, 16384.0):
            near = np.expm1((2 * n_tiles + 3) * np.log1p(U_EXP) + 2 * U * cut) * (1 + 2.0 ** -40)
            best = np.minimum(best, near + np.sum(np.where(xh > cut, per_term, 0.0), axis=-1, keepdims=True))
    return best


def online_error(a_sum: np.ndarray, v_mag: np.ndarray, keys: int, splits: int, n_tiles: int,
                 pv: Format) -> np.ndarray:
    """Stage (b): a_sum (rows, 1) = sum_j A_j, v_mag (rows, Dv) = max_j |v^_j|; returns (rows, Dv)."""
    g = gamma(keys + splits + 1, U)
    low = pv is not F32
    u, half_sub = (pv.unit_roundoff, pv.min_subnormal / 2) if low else (0.0, 0.0)
    chain = (1 + U_EXP) ** (2 * n_tiles + 3)  # a rounded p's absolute part, carried by the rescales (<= 1)
    with np.errstate(all="ignore"):
        v_round = v_mag * (1 + u) + half_sub         # >= |r(v)|
        v_err = u * v_mag + half_sub                 # >= |r(v) - v|
        e_p = a_sum + u * (1 + a_sum) + keys * half_sub * chain  # >= sum_j |P^o_j - e_j| / S
        d_l = a_sum + g * (1 + a_sum)
        d_o = e_p * v_round + v_err + g * (1 + e_p) * v_round
        err = (d_o + v_mag * d_l) / (1 - d_l)
        fits = v_mag * (1 + u) <= pv.max_finite  # r(v) overflows to inf past the format's range
    return np.where((d_l < 1) & np.isfinite(err) & fits, err, np.inf)


def score_row_total(exact: Interval, wide: Interval, err: np.ndarray, weights: Interval) -> np.ndarray:
    """Stage (a)'s T_row (rows, 1): sum_j |w(s^)_j - w(s)_j| <= row_total + n absolute (`weights`:
    the exact softmax's interval)."""
    bound = softmax_error(exact, wide, err, weights, exact.lo.ndim - 1, None)
    return bound.row_total + exact.lo.shape[-1] * bound.absolute


def attention_error(scores: Interval, wide: Interval, err: np.ndarray, v: Interval, v_err: np.ndarray,
                    spec: AttentionSpec, pv: Format) -> tuple[Interval, np.ndarray]:
    """(exact output interval, error bound before the divide's rounding) per output (rows..., Dv):
    scores over (rows..., T) (exact, where executed, error), V over (rows..., Dv, T)."""
    with np.errstate(all="ignore"):
        weights = transfer(Op.SOFTMAX, scores, axis=scores.lo.ndim - 1)
        t_row = score_row_total(scores, wide, err, weights)  # (rows..., 1)
        v_mag = np.max(np.maximum(np.abs(v.lo - v_err), np.abs(v.hi + v_err)), axis=-1)  # (rows..., Dv)
        keys = scores.lo.shape[-1]
        ranges = key_ranges(keys, spec)
        n_tiles = max(len(r) for r in ranges)
        a_sum = row_term_total(wide.lo, wide.hi, n_tiles)  # >= sum_j A_j / S
        total = t_row * v_mag + np.max(v_err, axis=-1) + online_error(a_sum, v_mag, keys, len(ranges), n_tiles, pv)
    # a convex combination of V rows
    return Interval(np.min(v.lo, axis=-1), np.max(v.hi, axis=-1)), nan_as_unbounded(total)
