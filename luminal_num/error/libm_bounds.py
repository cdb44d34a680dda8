"""Outward-rounded endpoint bounds of libm functions for the interval transfers (error/interval.py).

numpy's float64 exp2/log2/exp/sin/cos are not correctly rounded: each point value is widened by LIBM_ULPS
ulps in the needed direction, except where the value is known exactly (exp2 of an integer, log2 of a
power of two, sin(0), exp(0)), so exact results such as log2(1) = 0 stay exact.
"""
from __future__ import annotations

import math
from typing import Callable

import numpy as np

INF = math.inf
# numpy's float64 exp2/log2/sin/cos may use SIMD (SVML) code documented at <= 4 ulp; 8 leaves margin.
LIBM_ULPS = 8


# ---- rounding helpers ------------------------------------------------------------------------------

def _step(x, ulps: int, toward: float) -> np.ndarray:
    with np.errstate(over="ignore"):
        for _ in range(ulps):
            x = np.nextafter(x, toward)
    return x


def ulps_down(x, ulps: int = 1) -> np.ndarray:
    return _step(x, ulps, -INF)


def ulps_up(x, ulps: int = 1) -> np.ndarray:
    return _step(x, ulps, INF)


# ---- libm endpoint functions: (down, up) bounds of f(x) for arrays x -----------------------------

def _libm(f: Callable, exact: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]):
    """Endpoint bounds of a libm function: exact where `exact` knows the value, else widened LIBM_ULPS."""
    def point(x):
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            value = f(x)
        known, exact_value = exact(x)
        return (np.where(known, exact_value, ulps_down(value, LIBM_ULPS)),
                np.where(known, exact_value, ulps_up(value, LIBM_ULPS)))
    return point


def _exp2_exact(x):
    """exp2 of an integer (or -inf) is a power of two: exact."""
    with np.errstate(invalid="ignore"):
        known = (x == np.floor(x)) & (x >= -1074) & (x <= 1023) | np.isinf(x)
        k = np.where(known & np.isfinite(x), x, 0).astype(np.int64)
    return known, np.where(np.isinf(x), np.where(x > 0, INF, 0.0), np.ldexp(1.0, k))


def _log2_exact(x):
    """log2 of a power of two is an integer: exact (so log2(1) is 0, not [-tiny, tiny])."""
    mantissa, exponent = np.frexp(x)
    known = (mantissa == 0.5) | (x == 0) | np.isinf(x)
    return known, np.where(x == 0, -INF, np.where(np.isinf(x), INF, exponent - 1.0))


def _zero_exact(x):
    return x == 0, np.zeros_like(x)


def _exp_exact(x):
    return (x == 0) | np.isinf(x), np.where(x > 0, INF, np.where(x == 0, 1.0, 0.0))


def _never_exact(x):
    return np.zeros(np.shape(x), bool), x


exp2_point = _libm(np.exp2, _exp2_exact)
log2_point = _libm(np.log2, _log2_exact)
sin_point = _libm(np.sin, _zero_exact)
exp_point = _libm(np.exp, _exp_exact)
cos_abs_point = _libm(lambda x: np.abs(np.cos(x)), _never_exact)
