"""References more precise than FP64: error-free transformations, double-double sums/dots, mpmath evaluators.

Why: the compiler's judge is the FP64 evaluation of a graph. These evaluators let tests show, on small
inputs, that FP64's own error (a small multiple of 2^-53) is far below the errors being judged (FP32 and
lower precisions round at 2^-24 and coarser), so FP64 is a sound judge. The error-free transformations
(`two_sum`, `two_prod`) also give the interval analysis exact directed rounding (`*_directed`): the
sign of the rounding error says which way the nearest result was rounded.
"""
from __future__ import annotations

from dataclasses import dataclass

import mpmath
import numpy as np

_SPLITTER = 2.0 ** 27 + 1.0  # Dekker: splits a double into two 26-bit halves
_SPLIT_SAFE = 2.0 ** 995  # above this, _SPLITTER * x overflows
_PRODUCT_EXACT_MIN = 2.0 ** -960  # below this, the product's error term may underflow (no longer exact)


def two_sum(a, b) -> tuple[np.ndarray, np.ndarray]:
    """Knuth's TwoSum: s = fl(a + b) and e with s + e == a + b exactly (barring overflow)."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        s = a + b
        b_virtual = s - a
        e = (a - (s - b_virtual)) + (b - b_virtual)
    return s, e


def quick_two_sum(a, b) -> tuple[np.ndarray, np.ndarray]:
    """Fast2Sum: exact like two_sum but only valid when |a| >= |b|."""
    s = a + b
    return s, b - (s - a)


def _split(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    c = _SPLITTER * a
    high = c - (c - a)
    return high, a - high


def two_prod(a, b) -> tuple[np.ndarray, np.ndarray]:
    """Dekker's TwoProd: p = fl(a * b) and e with p + e == a * b exactly where `two_prod_exact(a, b, p)`.

    math.fma would do this in one step but only exists from Python 3.13; Dekker's split works in numpy.
    """
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        p = a * b
        a_hi, a_lo = _split(a)
        b_hi, b_lo = _split(b)
        e = ((a_hi * b_hi - p) + a_hi * b_lo + a_lo * b_hi) + a_lo * b_lo
    return p, e


def two_prod_exact(a, b, p) -> np.ndarray:
    """Where two_prod's error term is exact: no overflow in the split, no underflow in the error."""
    with np.errstate(invalid="ignore"):
        return ((np.abs(a) < _SPLIT_SAFE) & (np.abs(b) < _SPLIT_SAFE)
                & (np.abs(p) >= _PRODUCT_EXACT_MIN) & np.isfinite(p))


# ---- directed rounding: (down, up) bounds of an exact result from its nearest rounding -------------

def directed(r, residual) -> tuple[np.ndarray, np.ndarray]:
    """(down, up) bounds of a true value from its nearest rounding r and residual = true - r.

    Only the residual's sign is used; NaN residual means unknown, and both sides move one ulp.
    """
    unknown = np.isnan(residual)
    with np.errstate(over="ignore"):  # stepping past the largest double to inf is the intended bound
        down = np.where((residual < 0) | unknown, np.nextafter(r, -np.inf), r)
        up = np.where((residual > 0) | unknown, np.nextafter(r, np.inf), r)
    return down, up


def add_directed(x, y):
    """x + y rounded down and up, exactly (TwoSum's error gives the direction; unknown on overflow)."""
    s, e = two_sum(x, y)
    return directed(s, np.where(np.isfinite(s), e, np.nan))


# The residuals below are taken on significands scaled into [0.5, 2) by exact powers of two (frexp /
# ldexp), where TwoProd is always exact: the sign is right over the whole exponent range.

def mul_directed(x, y):
    """x * y rounded down and up; exact when an operand is 0 or inf.

    With x = a 2^i, y = b 2^j: x y - p = 2^(i+j) ((a b) - q) for q = p 2^-(i+j), and a b = p' + e' by
    TwoProd. p' - q is exact (Sterbenz: both round a b, p possibly in the subnormal grid), so the sign of
    (p' - q) + e' is the residual's, even when p underflowed to a subnormal or to 0.
    """
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    (a, i), (b, j) = np.frexp(x), np.frexp(y)
    with np.errstate(invalid="ignore", over="ignore"):
        p = x * y
        p_scaled, e = two_prod(a, b)
        residual = (p_scaled - np.ldexp(p, -(i + j))) + e
    exact = (x == 0) | (y == 0) | (np.isinf(p) & (np.isinf(x) | np.isinf(y)))
    residual = np.where(np.isfinite(p), residual, np.nan)
    return directed(np.where(np.isnan(p), 0.0, p), np.where(exact, 0.0, residual))  # 0*inf: limit 0


def recip_directed(x):
    """1/x for x != 0: sign(1/x - r) = sign(1 - r x) sign(x), with r x = m x' for r = m 2^k, x' = x 2^k,
    and 1 - m x' exact (Sterbenz)."""
    x = np.asarray(x, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        r = 1.0 / x
        m, k = np.frexp(r)
        p, e = two_prod(m, np.ldexp(x, k))
        residual = np.where(r == 0, np.sign(x), ((1.0 - p) - e) * np.sign(x))
    return directed(r, np.where(np.isinf(x), 0.0, np.where(np.isfinite(r), residual, np.nan)))


def sqrt_directed(x):
    """sqrt(x) for x >= 0: sign(sqrt(x) - r) = sign(x' - m^2) for r = m 2^k, x' = x 4^-k (exact, Sterbenz)."""
    x = np.asarray(x, dtype=np.float64)
    r = np.sqrt(x)
    m, k = np.frexp(r)
    p, e = two_prod(m, m)
    with np.errstate(invalid="ignore"):
        residual = (np.ldexp(x, -2 * k) - p) - e
    return directed(r, np.where((x == 0) | np.isinf(x), 0.0, residual))


@dataclass(frozen=True, eq=False)
class DoubleDouble:
    """An unevaluated sum hi + lo (|lo| <= ulp(hi)/2): about 106 significant bits, elementwise."""

    hi: np.ndarray
    lo: np.ndarray

    def to_mpf(self, prec: int = 200):
        """The exact value hi + lo as mpmath numbers (0-d -> one mpf, else an object array)."""
        with mpmath.workprec(prec):
            values = [mpmath.mpf(float(h)) + mpmath.mpf(float(l))
                      for h, l in zip(np.ravel(self.hi), np.ravel(self.lo))]
        if np.ndim(self.hi) == 0:
            return values[0]
        return np.array(values, dtype=object).reshape(np.shape(self.hi))


def dd_add(x: DoubleDouble, y: DoubleDouble) -> DoubleDouble:
    """Accurate double-double addition (QD library's ieee_add): relative error about 2 u^2 of the sum."""
    s, e = two_sum(x.hi, y.hi)
    t, f = two_sum(x.lo, y.lo)
    s, e = quick_two_sum(s, e + t)
    s, e = quick_two_sum(s, e + f)
    return DoubleDouble(s, e)


def _dd_accumulate(terms_hi: np.ndarray, terms_lo: np.ndarray) -> DoubleDouble:
    """Sum double-double terms along the last axis, one accurate dd_add per term."""
    total = DoubleDouble(np.zeros(terms_hi.shape[:-1]), np.zeros(terms_hi.shape[:-1]))
    for k in range(terms_hi.shape[-1]):
        total = dd_add(total, DoubleDouble(terms_hi[..., k], terms_lo[..., k]))
    return total


def dd_sum(x) -> DoubleDouble:
    """Double-double sum along the last axis."""
    x = np.asarray(x, dtype=np.float64)
    return _dd_accumulate(x, np.zeros_like(x))


def dd_dot(a, b) -> DoubleDouble:
    """Double-double dot product along the last axis: each product exact by two_prod, summed in dd.

    Error <= about 2 n u^2 sum|a_i b_i| (u = 2^-53): ~1e-30 relative on well-conditioned data.
    """
    a, b = np.broadcast_arrays(np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64))
    p, e = two_prod(a, b)
    if not two_prod_exact(a, b, p)[a * b != 0].all():
        raise ValueError("dd_dot: a product is outside Dekker's exact range (|x| > 2^995 or |a*b| < 2^-960)")
    return _dd_accumulate(p, e)


# ---- mpmath evaluators (object arrays of mpf, small inputs only: ~10^4 slower than FP64) ----

def to_mp(x) -> np.ndarray:
    """float64 array -> object array of mpf (exact: every double is an mpf at >= 53 bits)."""
    x = np.asarray(x, dtype=np.float64)
    return np.array([mpmath.mpf(float(v)) for v in x.ravel()], dtype=object).reshape(x.shape)


def mp_to_float(x) -> np.ndarray:
    """Object array of mpf -> float64, each correctly rounded."""
    x = np.asarray(x, dtype=object)
    return np.array([float(v) for v in x.ravel()], dtype=np.float64).reshape(x.shape)


def mp_matmul(a, b, prec: int = 128) -> np.ndarray:
    """a @ b for 2-D float arrays, every dot product evaluated at `prec` bits."""
    a_mp, b_mp = to_mp(a), to_mp(b)
    if a_mp.ndim != 2 or b_mp.ndim != 2 or a_mp.shape[1] != b_mp.shape[0]:
        raise ValueError(f"mp_matmul needs (m, k) @ (k, n), got {a_mp.shape} @ {b_mp.shape}")
    out = np.empty((a_mp.shape[0], b_mp.shape[1]), dtype=object)
    with mpmath.workprec(prec):
        for i in range(out.shape[0]):
            for j in range(out.shape[1]):
                out[i, j] = mpmath.fdot(a_mp[i, :], b_mp[:, j])
    return out


def _map_rows(x, axis: int, prec: int, row_fn) -> np.ndarray:
    """Apply row_fn (list of mpf -> list of mpf) to every 1-D slice along `axis` at `prec` bits."""
    moved = np.moveaxis(to_mp(x), axis, -1)
    out = np.empty_like(moved)
    with mpmath.workprec(prec):
        for index in np.ndindex(moved.shape[:-1]):
            out[index] = row_fn(list(moved[index]))
    return np.moveaxis(out, -1, axis)


def mp_softmax(x, axis: int = -1, prec: int = 128) -> np.ndarray:
    """softmax along `axis` at `prec` bits (no max-subtraction needed: mpmath has a huge exponent range)."""
    def row(values):
        exps = [mpmath.exp(v) for v in values]
        total = mpmath.fsum(exps)
        return [e / total for e in exps]
    return _map_rows(x, axis, prec, row)


def mp_layer_norm(x, eps: float = 1e-5, weight=None, bias=None, prec: int = 128) -> np.ndarray:
    """Layer norm over the last axis, biased variance (as PyTorch): (x - mean) / sqrt(var + eps) * w + b."""
    x = np.asarray(x, dtype=np.float64)
    n = x.shape[-1]
    w = to_mp(np.ones(n) if weight is None else weight)
    b = to_mp(np.zeros(n) if bias is None else bias)

    def row(values):
        mean = mpmath.fsum(values) / n
        var = mpmath.fsum((v - mean) ** 2 for v in values) / n
        inv_std = 1 / mpmath.sqrt(var + mpmath.mpf(eps))
        return [(v - mean) * inv_std * w[k] + b[k] for k, v in enumerate(values)]
    return _map_rows(x, -1, prec, row)
