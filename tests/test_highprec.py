"""Higher-precision references: EFTs exact, double-double ~ u^2, and FP64 a sound judge (error << 2^-24)."""
import math
from fractions import Fraction

import mpmath
import numpy as np
from hypothesis import given, settings, strategies as st

from luminal_num.error.highprec import (DoubleDouble, add_directed, dd_dot, dd_sum, mp_layer_norm, mp_matmul,
                                        mp_softmax, mp_to_float, mul_directed, recip_directed, sqrt_directed,
                                        to_mp, two_prod, two_prod_exact, two_sum)
from luminal_num.error.rounding_bounds import dot_bound, gamma, sum_bound

U = 2.0 ** -53
FP32_U = 2.0 ** -24
# FP64 must judge errors of FP32 and below: its own error has to be far under FP32's unit roundoff.
JUDGE_MARGIN = 2.0 ** -40

finite = st.floats(-1e150, 1e150, allow_nan=False, allow_infinity=False)


@settings(max_examples=300, deadline=None)
@given(finite, finite)
def test_two_sum_and_two_prod_are_exact(a, b):
    s, e = two_sum(a, b)
    assert Fraction(float(s)) + Fraction(float(e)) == Fraction(a) + Fraction(b)
    p, e = two_prod(a, b)
    if two_prod_exact(a, b, p):
        assert Fraction(float(p)) + Fraction(float(e)) == Fraction(a) * Fraction(b)


@settings(max_examples=300, deadline=None)
@given(st.floats(allow_nan=False, allow_infinity=False), st.floats(allow_nan=False, allow_infinity=False))
def test_directed_rounding_brackets_the_exact_result_tightly(a, b):
    """down <= exact <= up, and down == up exactly when the nearest rounding was exact."""
    def check(pair, exact):
        if not np.isfinite(pair[1]) or not np.isfinite(pair[0]):  # overflow: the far side is inf
            assert float(pair[0]) == np.finfo(np.float64).max or float(pair[1]) == -np.finfo(np.float64).max
            return
        down, up = (Fraction(float(v)) for v in pair)
        assert down <= exact <= up
        assert (down == up) == (down == exact)
        assert float(pair[1]) <= math.nextafter(float(pair[0]), math.inf)  # at most one ulp apart
    check(add_directed(a, b), Fraction(a) + Fraction(b))
    check(mul_directed(a, b), Fraction(a) * Fraction(b))
    if a != 0:
        check(recip_directed(a), 1 / Fraction(a))
    root_down, root_up = (Fraction(float(v)) for v in sqrt_directed(abs(a)))
    assert root_down ** 2 <= Fraction(abs(a)) <= root_up ** 2  # sqrt compared through squares


def _exact_dot(a, b) -> Fraction:
    return sum((Fraction(x) * Fraction(y) for x, y in zip(a, b)), Fraction(0))


def test_dd_dot_matches_mpmath_at_200_bits():
    rng = np.random.default_rng(0)
    worst = 0.0
    for _ in range(20):
        a, b = rng.normal(size=64), rng.normal(size=64)
        with mpmath.workprec(200):
            exact = mpmath.fdot(to_mp(a), to_mp(b))
            got = dd_dot(a, b).to_mpf()
            relative = abs(got - exact) / abs(exact)
            # a priori: each dd_add is off by <= ~2u^2 of its partial sum, partial sums <= sum|a b|
            bound = 4 * 64 * U * U * float(np.abs(a) @ np.abs(b)) / abs(exact)
        assert relative <= bound
        worst = max(worst, float(relative))
    assert worst < 1e-28  # FP64 alone would be ~1e-16


def test_dd_sum_and_batched_dd_dot():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(3, 50)) * 10.0 ** rng.integers(-5, 5, size=(3, 50))
    total = dd_sum(x)
    for row in range(3):
        exact = sum((Fraction(v) for v in x[row]), Fraction(0))
        got = Fraction(float(total.hi[row])) + Fraction(float(total.lo[row]))
        assert abs(got - exact) <= 4 * 50 * U * U * float(np.abs(x[row]).sum())
    a, b = rng.normal(size=(4, 16)), rng.normal(size=(4, 16))
    batched = dd_dot(a, b)
    assert isinstance(batched, DoubleDouble) and batched.hi.shape == (4,)
    assert all(float(batched.hi[k]) == float(dd_dot(a[k], b[k]).hi) for k in range(4))
    assert abs(Fraction(float(batched.hi[2])) + Fraction(float(batched.lo[2])) - _exact_dot(a[2], b[2])) \
        <= 4 * 16 * U * U * float(np.abs(a[2]) @ np.abs(b[2]))


def test_fp64_matmul_is_a_sound_judge():
    rng = np.random.default_rng(2)
    a, b = rng.normal(size=(8, 64)), rng.normal(size=(64, 8))
    exact = mp_matmul(a, b, prec=128)
    fp64 = a @ b
    with mpmath.workprec(128):
        error = np.array([[float(abs(mpmath.mpf(float(fp64[i, j])) - exact[i, j])) for j in range(8)]
                          for i in range(8)])
    abs_product = np.abs(a) @ np.abs(b)
    assert (error <= dot_bound(64, abs_product, U)).all()  # the gamma_k bound of rounding_bounds holds
    normwise = error.max() / np.abs(mp_to_float(exact)).max()
    assert normwise <= 64 * U < JUDGE_MARGIN  # a small multiple of 2^-53, far below FP32's 2^-24
    assert np.array_equal(mp_to_float(exact), mp_to_float(mp_matmul(a, b, prec=200)))  # 128 bits suffice


def _softmax64(x):
    shifted = x - x.max(axis=-1, keepdims=True)
    e = np.exp(shifted)
    return e / e.sum(axis=-1, keepdims=True)


def _layer_norm64(x, eps, w, b):
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * w + b


def _relative_to_mp(approx, exact) -> float:
    """max |approx - exact| / max |exact|, measured at 128 bits."""
    with mpmath.workprec(128):
        errors = [abs(mpmath.mpf(float(v)) - e) for v, e in zip(approx.ravel(), exact.ravel())]
    return float(max(errors)) / float(np.abs(mp_to_float(exact)).max())


def test_fp64_softmax_is_a_sound_judge():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(4, 32)) * 5.0
    exact = mp_softmax(x, prec=128)
    with mpmath.workprec(128):
        assert all(abs(mpmath.fsum(exact[r]) - 1) < mpmath.mpf(2) ** -120 for r in range(4))
    error = _relative_to_mp(_softmax64(x), exact)
    assert error <= 64 * U < JUDGE_MARGIN
    # elementwise relative error too (every probability, not just the largest): exp's few ulps + the sum
    with mpmath.workprec(128):
        elementwise = max(float(abs(mpmath.mpf(float(v)) - e) / e) for v, e in zip(_softmax64(x).ravel(),
                                                                                  exact.ravel()))
    assert elementwise <= float(gamma(32 + 8, U))
    assert np.array_equal(mp_softmax(x.T, axis=0, prec=128).T, exact)


def test_fp64_layer_norm_is_a_sound_judge():
    rng = np.random.default_rng(4)
    x = rng.normal(size=(4, 48)) * 3.0 + 1.0
    w, b = rng.normal(size=48), rng.normal(size=48)
    exact = mp_layer_norm(x, eps=1e-5, weight=w, bias=b, prec=128)
    error = _relative_to_mp(_layer_norm64(x, 1e-5, w, b), exact)
    assert error <= 64 * U < JUDGE_MARGIN
    plain = mp_to_float(mp_layer_norm(x, eps=0.0, prec=128))
    assert np.allclose(plain.mean(axis=-1), 0.0, atol=1e-15) and np.allclose(plain.var(axis=-1), 1.0, rtol=1e-14)


def test_sum_bound_holds_for_fp64_sums():
    rng = np.random.default_rng(5)
    for n in (2, 17, 1000):
        x = rng.normal(size=n) * 10.0 ** rng.integers(-3, 3, size=n)
        exact = sum((Fraction(v) for v in x), Fraction(0))
        for total in (float(np.sum(x)), math.fsum(x), float(sum(x))):  # pairwise, exact-rounded, recursive
            assert abs(Fraction(total) - exact) <= Fraction(float(sum_bound(n, np.abs(x).sum(), U)))
