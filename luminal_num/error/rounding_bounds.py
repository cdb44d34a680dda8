"""Rounding-error bounds of the static numerics gate (Higham, Accuracy and Stability, ch. 2-3).

Model: fl(x op y) = (x op y)(1 + d) with |d| <= u for round-to-nearest in a format with unit roundoff u,
as long as nothing underflows; callers add `underflow` terms where values can be subnormal.

Every bound here is evaluated in FP64 and then rounded up (`round_up`), so the bound computed is never
below the bound meant: a certificate that a candidate is within budget must not depend on luck.
All functions take floats or numpy arrays (elementwise, broadcasting) and return np.float64 / arrays.
"""
from __future__ import annotations

import numpy as np

# The bound formulas below take at most ~10 FP64 operations, each off by <= 2^-53 relative in the normal
# range and by <= half a subnormal step (2^-1075) below it: inflating by 2^-48 relative, adding four
# subnormal steps and moving one ulp up covers both with margin.
_INFLATE = 1.0 + 2.0 ** -48
_SUBNORMAL_SLACK = 4 * 2.0 ** -1074


def nan_as_unbounded(err) -> np.ndarray:
    """An error bound with NaN in it (0 * inf, inf - inf of its terms) read as unbounded, infinities kept:
    np.nan_to_num(err, nan=inf) would also turn +inf into the largest double, a finite bound."""
    err = np.asarray(err, dtype=np.float64)
    return np.where(np.isnan(err), np.inf, err)


def round_up(x) -> np.ndarray:
    """A value >= x for a non-negative bound x computed with a few FP64 roundings.

    A zero stays 0: bounds are sums of rounded-up non-negative terms, so a zero is exact (products that
    underflow to 0 are caught in `_times`).
    """
    x = np.asarray(x, dtype=np.float64)
    with np.errstate(over="ignore"):
        bumped = np.nextafter(x * _INFLATE + _SUBNORMAL_SLACK, np.inf)
    return np.where(x == 0, 0.0, bumped)[()]


def _times(bound_factor, magnitude) -> np.ndarray:
    """factor * magnitude, rounded up, with 0 * anything = 0 (an exact computation has no error)."""
    bound_factor = np.asarray(bound_factor, dtype=np.float64)
    magnitude = np.asarray(magnitude, dtype=np.float64)
    exact_zero = (bound_factor == 0) | (magnitude == 0)
    with np.errstate(invalid="ignore", under="ignore"):
        product = bound_factor * magnitude
    # a product of non-zeros that underflowed to 0 is not exact: give it the smallest subnormal
    return round_up(np.where(exact_zero, 0.0, np.where(product == 0, 2.0 ** -1074, product)))


def gamma(n, u) -> np.ndarray:
    """gamma_n = n u / (1 - n u): the relative error bound of n chained roundings; inf once n u >= 1."""
    nu = np.asarray(n, dtype=np.float64) * np.asarray(u, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        g = np.where(nu < 1.0, nu / (1.0 - nu), np.inf)
    return _times(g, 1.0)  # nu and 1 - nu are exact for integer n and power-of-two u; the division is not


def dot_bound(k, abs_dot, u_acc) -> np.ndarray:
    """|fl(x . y) - x . y| <= gamma_k(u_acc) * (|x| . |y|) for a length-k dot product in any order."""
    return _times(gamma(k, u_acc), abs_dot)


def sum_bound(n, abs_sum, u_acc) -> np.ndarray:
    """|fl(sum x_i) - sum x_i| <= gamma_{n-1}(u_acc) * sum |x_i| for n terms in any summation order."""
    return _times(gamma(np.maximum(np.asarray(n) - 1, 0), u_acc), abs_sum)


def elementwise_rounding_bound(value_abs, u, underflow: float = 0.0) -> np.ndarray:
    """|fl(x) - x| <= u |x| + underflow: pass half the format's smallest subnormal as `underflow`
    where values can fall below the normal range (there the error is absolute, not relative)."""
    return round_up(_times(u, value_abs) + underflow)


def _with_rounding(propagated, out_abs, u_out) -> np.ndarray:
    """Propagated error plus the rounding of the op's own result.

    The op rounds its result computed from perturbed inputs, z, with |z| <= out_abs + propagated, so the
    rounding adds u_out * (out_abs + propagated): the second term is tiny but keeps the bound sound.
    """
    propagated = np.asarray(propagated, dtype=np.float64)
    return round_up(propagated + _times(u_out, np.asarray(out_abs, dtype=np.float64) + propagated))


def propagate_unary(err_in, derivative_bound, out_abs, u_out) -> np.ndarray:
    """Error of y = f(x) computed from x + err: derivative_bound * err_in + u_out * |y| (+ second order).

    Sound by the mean value theorem when derivative_bound is max |f'| over the input interval widened by
    err_in (interval.derivative_bound of that interval); over the unwidened interval it is first order.
    """
    return _with_rounding(_times(derivative_bound, err_in), out_abs, u_out)


def propagate_binary_add(err_a, err_b, out_abs, u_out) -> np.ndarray:
    """Error of a + b computed from perturbed inputs: err_a + err_b, plus the rounding of the sum."""
    return _with_rounding(round_up(np.asarray(err_a, dtype=np.float64) + err_b), out_abs, u_out)


def propagate_binary_mul(err_a, err_b, abs_a, abs_b, u_out) -> np.ndarray:
    """Error of a * b from perturbed inputs: |a| err_b + |b| err_a + err_a err_b, plus the product's rounding.

    (a + da)(b + db) - ab = a db + b da + da db exactly: keeping da db makes this a bound, not an estimate.
    """
    propagated = round_up(_times(abs_a, err_b) + _times(abs_b, err_a) + _times(err_a, err_b))
    return _with_rounding(propagated, _times(abs_a, abs_b), u_out)
