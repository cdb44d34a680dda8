"""Interval transfer functions: exact results by hand, and soundness against exact rationals / mpmath."""
import math
from fractions import Fraction

import mpmath
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from luminal_num.dtypes.formats import BF16, F16, F8E4M3, TF32
from luminal_num.error.highprec import mp_softmax
from luminal_num.hlir.ops import Op
from luminal_num.error.interval import (NO_TRANSFER, TRANSFERS, Interval, IntervalArray, add, cast, derivative_bound, exp2,
                                        hull, intersection, less_than, log2, max_reduce, mod, mul, recip, sin,
                                        softmax, sqrt, sum_reduce, transfer)

I = Interval
OP = {op.decl.name: op for op in Op}  # the tables are keyed by Op; the tests name ops by their declared names
INF = math.inf
SETTINGS = settings(max_examples=150, deadline=None)

# ---- strategies ------------------------------------------------------------------------------------

number = st.one_of(st.floats(-1e4, 1e4), st.integers(-16, 16).map(float),
                   st.sampled_from([0.0, -0.0, 0.5, math.pi, -math.pi / 2, 1e-300, 3.0e-310]))


@st.composite
def interval(draw, low=-1e4, high=1e4):
    a, b = sorted((min(max(draw(number), low), high), min(max(draw(number), low), high)))
    return Interval(a, b)


@st.composite
def points(draw, x: Interval, count=4):
    lo, hi = x.bounds()
    ts = draw(st.lists(st.floats(0, 1), min_size=1, max_size=count))
    return [lo, hi] + [min(max(lo + t * (hi - lo), lo), hi) for t in ts]


def encloses(result: Interval, exact) -> bool:
    """lo <= exact <= hi with exact a Fraction or an mpf (compared exactly with the float endpoints)."""
    lo, hi = result.bounds()
    if isinstance(exact, Fraction):
        return (lo == -INF or Fraction(lo) <= exact) and (hi == INF or exact <= Fraction(hi))
    return lo <= exact <= hi


# ---- exact results by hand -------------------------------------------------------------------------

@pytest.mark.parametrize("result,expected", [
    (I(1, 2) + I(3, 4), (4, 6)),
    (I(1, 2) * I(3, 4), (3, 8)),
    (I(-1, 2) * I(-3, 4), (-6, 8)),       # mixed signs: lo = 2 * -3, hi = 2 * 4
    (I(-2, -1) * I(-4, -3), (3, 8)),      # both negative
    (I(-2, -1) * I(3, 4), (-8, -3)),
    (I(0, 1) * I(5, 7), (0, 7)),          # exact zero stays exactly 0 (no -5e-324)
    (recip(I(2, 4)), (0.25, 0.5)),
    (recip(I(-4, -2)), (-0.5, -0.25)),
    (recip(I(-1, 1)), (-INF, INF)),       # contains 0
    (recip(I(0, 1)), (-INF, INF)),        # touches 0: -0 would give -inf
    (recip(I(1, INF)), (0, 1)),
    (sqrt(I(4, 9)), (2, 3)),
    (exp2(I(0, 3)), (1, 8)),
    (exp2(I(-INF, 0)), (0, 1)),
    (log2(I(1, 8)), (0, 3)),
    (log2(I(0, 1)), (-INF, 0)),
    (less_than(I(1, 2), I(3, 4)), (1, 1)),
    (less_than(I(3, 4), I(1, 2)), (0, 0)),
    (less_than(I(1, 3), I(2, 4)), (0, 1)),
    (mod(I(4, 5), I(3, 3)), (1, 2)),      # one period: exact images
    (mod(I(5, 7), I(3, 3)), (0, 3)),      # wraps at 6
    (mod(I(-5, -4), I(3, 3)), (-2, -1)),  # fmod keeps the dividend's sign
    (mod(I(-1, 5), I(3, 3)), (-1, 3)),
    (max_reduce(I([1.0, 0.0, -3.0], [2.0, 5.0, -1.0])), (1, 5)),
    (cast(I(0.1, 65510.0), F16), (0.0999755859375, 65504.0)),
    (cast(I(1.0, 1.00390625), BF16), (1.0, 1.0)),  # 1 + 2^-8 is a tie -> 1
])
def test_exact_results(result, expected):
    assert result.bounds() == expected
    assert not result.nan


def test_sin_extrema_by_hand():
    s = sin(I(0, math.pi))  # holds pi/2 -> hi 1; sin(0) = 0 exactly, sin(fl(pi)) = 1.2e-16 > 0
    assert s.bounds() == (0.0, 1.0)
    lo, hi = sin(I(1, 2)).bounds()  # pi/2 = 1.5707... inside; min at x = 1 (sin 1 < sin 2)
    assert hi == 1.0 and lo <= math.sin(1.0) and math.sin(1.0) - lo < 1e-15
    lo, hi = sin(I(2, 4)).bounds()  # no extremum inside (pi/2, 3pi/2 = 4.712 outside): monotone
    assert lo <= math.sin(4.0) < lo + 1e-15 and hi - 1e-15 < math.sin(2.0) <= hi
    lo, hi = sin(I(4, 5)).bounds()  # 3pi/2 = 4.712 inside -> lo = -1
    assert lo == -1.0 and math.sin(4.0) <= hi < math.sin(4.0) + 1e-15
    assert sin(I(-2, -1)).bounds()[0] == -1.0  # -pi/2 inside
    assert sin(I(0, 7)).bounds() == (-1.0, 1.0)
    assert sin(I(1e6, 1e6 + 7)).bounds() == (-1.0, 1.0)  # wider than a period anywhere
    k = 1000  # pi/2 + 2k pi lies just above fl(x) below and below fl(x) above
    peak = math.pi / 2 + 2 * k * math.pi
    assert sin(I(peak - 1e-9, peak + 1e-9)).bounds()[1] == 1.0
    assert sin(I(peak + 1e-3, peak + 2e-3)).bounds()[1] < 1.0
    assert sin(I(-INF, 0)).nan


def test_nan_flags():
    assert sqrt(I(-1, 4)).nan and sqrt(I(-1, 4)).bounds() == (0, 2)
    assert log2(I(-1, 4)).nan
    assert not sqrt(I(-0.0, 4)).nan  # sqrt(-0) = -0, not NaN
    assert (I(-INF, 0) + I(0, INF)).nan  # inf - inf
    assert not (I(-INF, 0) + I(0, 1)).nan
    assert (I(0, 1) * I(1, INF)).nan  # 0 * inf
    assert not (I(0.5, 1) * I(1, INF)).nan
    assert mod(I(0, INF), I(3, 3)).nan
    assert softmax(I([0.0, 0.0], [1.0, INF])).nan.all()  # +inf - inf inside softmax
    assert softmax(I([-INF, -INF], [0.0, 0.0])).nan.all()  # all -inf: 0/0
    assert not softmax(I([-INF, 0.0], [0.0, 0.0])).nan.any()
    assert cast(I(0, 500), F8E4M3).nan  # E4M3 has no inf: overflow is NaN
    assert not cast(I(0, 448), F8E4M3).nan
    assert not less_than(I(-INF, INF, True), I(0, 1)).nan  # comparisons never give NaN ...
    assert less_than(I(-2, -1, True), I(0, 1)).bounds() == (0, 1)  # ... but NaN < x is false


def test_reductions_and_softmax_by_hand():
    assert sum_reduce(I([0.0, 1.0, 2.0], [1.0, 2.0, 3.0])).bounds()[0] <= 3.0
    assert sum_reduce(I(1.0, 2.0), n=10).bounds() == (10, 20)  # a per-tensor summary summed 10 times
    assert sum_reduce(I(0.1, 0.1), n=10).bounds() == (1.0, 1.0000000000000002)  # fl(0.1) > 0.1
    lo, hi = softmax(I(0.0, 0.0), n=4).bounds()  # summary in, summary out: every element 1/4
    assert lo <= 0.25 <= hi and hi - lo < 1e-14
    one = softmax(I(np.array([3.0]), np.array([7.0])))  # a single element is exactly 1
    assert one.lo.tolist() == [1.0] and one.hi.tolist() == [1.0]
    # [0,1] and [2,3]: y_0 in [1/(1+e^3), 1/(1+e^1)]
    s = softmax(I([0.0, 2.0], [1.0, 3.0]))
    assert s.lo[0] <= 1 / (1 + math.e ** 3) < s.lo[0] + 1e-15 and s.hi[0] - 1e-15 < 1 / (1 + math.e) <= s.hi[0]
    assert softmax(I(np.zeros((2, 3)), np.ones((2, 3))), axis=0).shape == (2, 3)


def test_derivative_bounds_by_hand():
    assert derivative_bound(OP["Exp2"], I(0, 1)) == pytest.approx(2 * math.log(2), rel=1e-14)
    assert derivative_bound(OP["Log2"], I(1, 2)) == pytest.approx(1 / math.log(2), rel=1e-14)
    assert derivative_bound(OP["Sqrt"], I(4, 9)) == pytest.approx(0.25, rel=1e-14)
    assert derivative_bound(OP["Recip"], I(2, 4)) == pytest.approx(0.25, rel=1e-14)
    assert derivative_bound(OP["Recip"], I(-4, -2)) == pytest.approx(0.25, rel=1e-14)
    assert derivative_bound(OP["Sin"], I(3, 3.2)) == 1.0  # pi inside: |cos| = 1
    assert derivative_bound(OP["Sin"], I(1, 1.2)) == pytest.approx(math.cos(1.0), rel=1e-14)
    for op, x in [("Recip", I(-1, 1)), ("Log2", I(0, 1)), ("Sqrt", I(0, 1)), ("Log2", I(-1, 1)),
                  ("Exp2", I(0, INF))]:
        assert derivative_bound(OP[op], x) == INF
    slopes = derivative_bound(OP["Recip"], I([1.0, 2.0], [2.0, 4.0]))
    assert slopes.shape == (2,) and slopes[1] == pytest.approx(0.25, rel=1e-14)
    with pytest.raises(KeyError, match="no derivative bound for Add"):
        derivative_bound(OP["Add"], I(0, 1))


def test_interval_table_covers_every_op_once():
    """Every hlir Op has an interval transfer or a stated reason why its interval comes from elsewhere."""
    assert set(TRANSFERS) | set(NO_TRANSFER) == set(Op) and not set(TRANSFERS) & set(NO_TRANSFER)
    assert all(t.op is op and t.arity == op.decl.arity for op, t in TRANSFERS.items())
    with pytest.raises(TypeError, match="keyed by hlir.ops.Op"):
        transfer("Add", I(1, 2), I(3, 4))  # strings are refused, not looked up


def test_static_kernel_table_covers_every_kernel_kind():
    from luminal_num.codegen.llir import KernelKind
    from luminal_num.error.static import KERNEL_TRANSFERS
    assert set(KERNEL_TRANSFERS) == set(KernelKind)


def test_table_and_helpers():
    assert {"Add", "Mul", "Recip", "Sqrt", "Exp2", "Log2", "Sin", "Mod", "LessThan", "SumReduce",
            "MaxReduce", "Softmax", "Cast"} == {op.decl.name for op in TRANSFERS}
    assert transfer(OP["Add"], I(1, 2), I(3, 4)).bounds() == (4, 6)
    assert transfer(OP["SumReduce"], I(1.0, 1.0), axis=0, n=4).bounds() == (4, 4)
    with pytest.raises(KeyError, match="no interval transfer for Gather"):
        transfer(OP["Gather"], I(0, 1))
    with pytest.raises(TypeError, match="takes 2"):
        transfer(OP["Mul"], I(0, 1))
    with pytest.raises(ValueError, match="empty interval"):
        Interval(2, 1)
    with pytest.raises(ValueError, match="empty intersection"):
        intersection(I(0, 1), I(2, 3))
    assert intersection(I(0, 2), I(1, 3)).bounds() == (1, 2)
    assert hull(I(0, 1), I(2, 3)).bounds() == (0, 3)
    assert IntervalArray is Interval
    assert (I(1, 2) + I(3, 4)).same_as(I(4, 6)) and not (I(1, 2) + I(3, 4)).same_as(I(4, 7))
    assert Interval.of_values([3.0, -1.0, np.nan]).bounds() == (-1.0, 3.0)
    assert Interval.of_values([3.0, -1.0, np.nan]).nan
    assert cast(I(1.0, 3.0), TF32).contains([1.0, 3.0]).all()


@SETTINGS
@given(st.integers(0, 2 ** 32 - 1))
def test_array_transfer_equals_scalar_transfers(seed):
    """One implementation: an elementwise array transfer is exactly the per-element scalar transfer."""
    rng = np.random.default_rng(seed)
    a_lo, b_lo = rng.normal(size=(2, 6)) * 10
    a = I(a_lo, a_lo + rng.exponential(size=6))
    b = I(b_lo, b_lo + rng.exponential(size=6))
    for op in (add, mul, less_than):
        whole = op(a, b)
        for k in range(6):
            assert whole.lo[k] == op(I(a.lo[k], a.hi[k]), I(b.lo[k], b.hi[k])).lo
            assert whole.hi[k] == op(I(a.lo[k], a.hi[k]), I(b.lo[k], b.hi[k])).hi
    for op in (recip, sqrt, exp2, log2, sin):
        whole = op(a)
        assert all(whole.lo[k] == op(I(a.lo[k], a.hi[k])).lo for k in range(6))


# ---- soundness: every point's exact image lies inside ----------------------------------------------

EXACT_BINARY = {"Add": lambda x, y: Fraction(x) + Fraction(y), "Mul": lambda x, y: Fraction(x) * Fraction(y)}


@pytest.mark.parametrize("op", list(EXACT_BINARY))
@SETTINGS
@given(st.data())
def test_binary_soundness(op, data):
    a, b = data.draw(interval()), data.draw(interval())
    result = transfer(OP[op], a, b)
    for x in data.draw(points(a)):
        for y in data.draw(points(b)):
            assert encloses(result, EXACT_BINARY[op](x, y)), (op, a, b, x, y, result)


@SETTINGS
@given(st.data())
def test_recip_soundness(data):
    a = data.draw(interval())
    result = recip(a)
    for x in data.draw(points(a)):
        if x != 0:
            assert encloses(result, 1 / Fraction(x))


MP_UNARY = {"Sqrt": (mpmath.sqrt, 0.0), "Exp2": (lambda x: mpmath.mpf(2) ** x, -INF),
            "Log2": (lambda x: mpmath.log(x, 2) if x else mpmath.mpf("-inf"), 0.0), "Sin": (mpmath.sin, -INF)}


@pytest.mark.parametrize("op", list(MP_UNARY))
@SETTINGS
@given(st.data())
def test_transcendental_soundness(op, data):
    f, domain_lo = MP_UNARY[op]
    a = data.draw(interval())
    result = transfer(OP[op], a)
    assert bool(result.nan) == (a.bounds()[0] < domain_lo)
    with mpmath.workprec(200):
        for x in data.draw(points(a)):
            if x >= domain_lo:
                assert encloses(result, f(mpmath.mpf(x))), (op, a, x, result)


@pytest.mark.parametrize("op", list(MP_UNARY) + ["Recip"])
@SETTINGS
@given(st.data())
def test_derivative_bound_dominates_slopes(op, data):
    f = MP_UNARY[op][0] if op != "Recip" else (lambda x: 1 / x)
    a = data.draw(interval(low=-50.0, high=50.0))
    bound = derivative_bound(OP[op], a)
    pts = data.draw(points(a, count=6))
    for x1, x2 in zip(pts, pts[1:]):
        if x1 == x2 or bound == INF:
            continue
        # f(x1) - f(x2) cancels about log2(1/|x1 - x2|) bits: carry that many more
        with mpmath.workprec(200 + max(0, -math.frexp(abs(x1 - x2))[1])):
            slope = abs((f(mpmath.mpf(x1)) - f(mpmath.mpf(x2))) / (mpmath.mpf(x1) - mpmath.mpf(x2)))
        assert slope <= bound, (op, a, x1, x2, bound)


@SETTINGS
@given(st.data())
def test_mod_soundness(data):
    a = data.draw(interval())
    b = data.draw(st.sampled_from([0.5, 1.0, 3.0, math.pi, 7.25, 1e3]))
    result = mod(a, I(b, b))
    for x in data.draw(points(a)):
        assert encloses(result, Fraction(math.fmod(x, b)))  # fmod is exact


@SETTINGS
@given(st.data())
def test_less_than_soundness(data):
    a, b = data.draw(interval()), data.draw(interval())
    result = less_than(a, b)
    for x in data.draw(points(a)):
        for y in data.draw(points(b)):
            assert result.contains(float(x < y))


@st.composite
def interval_vector(draw, max_n=6):
    n = draw(st.integers(1, max_n))
    ends = [sorted((draw(number), draw(number))) for _ in range(n)]
    return Interval(np.array([e[0] for e in ends]), np.array([e[1] for e in ends]))


@st.composite
def vector_points(draw, x: Interval):
    ts = np.array(draw(st.lists(st.floats(0, 1), min_size=x.shape[0], max_size=x.shape[0])))
    return np.clip(x.lo + ts * (x.hi - x.lo), x.lo, x.hi)


@SETTINGS
@given(st.data())
def test_reduction_soundness(data):
    a = data.draw(interval_vector())
    total, biggest = sum_reduce(a), max_reduce(a)
    for _ in range(3):
        x = data.draw(vector_points(a))
        assert encloses(total, sum(Fraction(v) for v in x))
        assert biggest.contains(x.max())


@SETTINGS
@given(st.data())
def test_softmax_soundness(data):
    a = data.draw(interval_vector())
    a = Interval(a.lo / 100, a.hi / 100)  # logits of a realistic size (up to 100)
    result = softmax(a)
    for _ in range(3):
        exact = mp_softmax(data.draw(vector_points(a)), prec=128)
        for k, value in enumerate(exact):
            assert result.lo[k] <= value <= result.hi[k], (a, k, value, result)


@SETTINGS
@given(st.data())
def test_cast_soundness(data):
    a = data.draw(interval())
    for fmt in (F16, BF16, F8E4M3):
        result = cast(a, fmt)
        for x in data.draw(points(a)):
            rounded = float(np.float64(x).astype(fmt.storage))
            assert result.contains(rounded) or (np.isnan(rounded) and result.nan)


# ---- rounding-error bounds: gamma by hand, propagation against exact arithmetic ---------------------

def test_gamma_by_hand():
    from luminal_num.error.rounding_bounds import elementwise_rounding_bound, gamma, round_up
    # gamma_2 at u = 2^-8: (2/256) / (1 - 2/256) = 2/254 = 1/127
    assert 1 / 127 <= gamma(2, 2.0 ** -8) <= 1 / 127 * (1 + 2.0 ** -45)
    assert gamma(0, 2.0 ** -8) == 0.0
    assert gamma(256, 2.0 ** -8) == INF and gamma(300, 2.0 ** -8) == INF  # n u >= 1: no bound
    assert gamma(np.array([1, 2]), 2.0 ** -24).shape == (2,)
    assert round_up(0.0) == 0.0 and round_up(1.0) > 1.0
    assert elementwise_rounding_bound(3.0, 2.0 ** -11, underflow=2.0 ** -25) >= 3 * 2.0 ** -11 + 2.0 ** -25


def _round_to_bits(value, bits: int):
    """value rounded to nearest with a `bits`-bit significand (unbounded exponent), in mpmath."""
    with mpmath.workprec(bits):
        return +value


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 2 ** 32 - 1), st.integers(1, 200))
def test_dot_bound_holds_for_fp32_dots(seed, k):
    from luminal_num.error.rounding_bounds import dot_bound
    rng = np.random.default_rng(seed)
    x, y = rng.normal(size=k).astype(np.float32), rng.normal(size=k).astype(np.float32)
    computed = np.float32(0)
    for a, b in zip(x, y):  # recursive FP32 dot, every operation rounded to FP32
        computed = np.float32(computed + np.float32(a * b))
    exact = sum((Fraction(float(a)) * Fraction(float(b)) for a, b in zip(x, y)), Fraction(0))
    abs_dot = float(np.abs(x.astype(np.float64)) @ np.abs(y.astype(np.float64)))
    assert abs(Fraction(float(computed)) - exact) <= Fraction(float(dot_bound(k, abs_dot, 2.0 ** -24)))


PROPAGATED = {"Exp2": lambda x: mpmath.mpf(2) ** x, "Sin": mpmath.sin, "Sqrt": mpmath.sqrt,
              "Log2": lambda x: mpmath.log(x, 2), "Recip": lambda x: 1 / x}


@pytest.mark.parametrize("op", list(PROPAGATED))
@settings(max_examples=100, deadline=None)
@given(st.data())
def test_propagate_unary_bounds_a_perturbed_rounded_evaluation(op, data):
    """|fl24(f(x + d)) - f(x)| <= propagate_unary(err, max|f'| on x's interval widened by err, max|f|, 2^-24)."""
    from luminal_num.error.rounding_bounds import propagate_unary
    f = PROPAGATED[op]
    x = data.draw(st.floats(0.5, 20.0))
    err = data.draw(st.floats(0, 0.25))
    d = data.draw(st.floats(-1, 1)) * err
    widened = Interval(x - err, x + err)
    out_abs = transfer(OP[op], Interval(x, x)).magnitude
    bound = propagate_unary(err, derivative_bound(OP[op], widened), out_abs, 2.0 ** -24)
    with mpmath.workprec(200):
        exact = f(mpmath.mpf(x))
        computed = _round_to_bits(f(mpmath.mpf(x) + mpmath.mpf(d)), 24)
        assert abs(computed - exact) <= bound


@settings(max_examples=200, deadline=None)
@given(st.floats(-100, 100), st.floats(-100, 100), st.floats(0, 1), st.floats(0, 1),
       st.floats(-1, 1), st.floats(-1, 1))
def test_propagate_binary_bounds_perturbed_rounded_ops(a, b, err_a, err_b, ta, tb):
    from luminal_num.error.rounding_bounds import propagate_binary_add, propagate_binary_mul
    with mpmath.workprec(200):
        a_hat, b_hat = mpmath.mpf(a) + ta * err_a, mpmath.mpf(b) + tb * err_b
        total = _round_to_bits(a_hat + b_hat, 24)
        product = _round_to_bits(a_hat * b_hat, 24)
        assert abs(total - (mpmath.mpf(a) + b)) <= propagate_binary_add(err_a, err_b, abs(a + b), 2.0 ** -24)
        assert abs(product - mpmath.mpf(a) * b) <= propagate_binary_mul(err_a, err_b, abs(a), abs(b), 2.0 ** -24)
