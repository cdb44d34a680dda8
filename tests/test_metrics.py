"""Error metrics against hand-computed values and ml_dtypes step counting; budgets: parsing and verdicts."""
import json
import math
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from luminal_num.dtypes.formats import BF16, F16, F32, F8E4M3, F8E5M2
from luminal_num.error.budget import Budget, BudgetSyntaxError, MetricLimit
from luminal_num.error.metrics import (METRICS, TINY, Direction, allclose_violation, cosine, get_metric,
                                       kl_logits, max_abs, max_rel, max_ulp, rel_l2, top1_agreement,
                                       ulp_formats)

# ---- hand-computed values --------------------------------------------------------------------------


def test_max_abs_by_hand():
    # |[1, 2.5, -3] - [1, 2, -1]| = [0, 0.5, 2] -> 2
    assert max_abs([1.0, 2.5, -3.0], [1.0, 2.0, -1.0]) == 2.0
    assert max_abs(np.zeros((0,)), np.zeros((0,))) == 0.0


def test_max_rel_by_hand_and_floor():
    # |[1.5, 2, 0] - [1, 4, 0]| / [1, 4, floor] = [0.5, 0.5, 0]
    assert max_rel([1.5, 2.0, 0.0], [1.0, 4.0, 0.0]) == 0.5
    # ref = 0: the floor (2^-1022) keeps it finite but huge: relative error at 0 is meaningless
    assert max_rel([2.0 ** -1000], [0.0]) == 2.0 ** 22
    assert max_rel([1e-3], [0.0], floor=1.0) == 1e-3
    assert TINY == 2.0 ** -1022


def test_rel_l2_by_hand():
    # ||[3, 5] - [3, 4]|| / ||[3, 4]|| = 1 / 5
    assert rel_l2([3.0, 5.0], [3.0, 4.0]) == 0.2
    assert rel_l2([0.0, 0.0], [0.0, 0.0]) == 0.0
    assert rel_l2([1.0, 0.0], [0.0, 0.0]) == math.inf
    # scaled norms: squares of 1e200 would overflow
    assert rel_l2([3e200, 5e200], [3e200, 4e200]) == pytest.approx(0.2, rel=1e-15)


def test_cosine_by_hand():
    # row 0: identical -> 1; row 1: <(1,1),(1,0)> / (sqrt 2 * 1) = 1/sqrt(2); min over rows
    assert cosine([[1.0, 0.0], [1.0, 1.0]], [[1.0, 0.0], [1.0, 0.0]]) == pytest.approx(2 ** -0.5, rel=1e-15)
    assert cosine([[0.0, 0.0]], [[0.0, 0.0]]) == 1.0  # both zero: identical
    assert cosine([[0.0, 0.0]], [[1.0, 0.0]]) == 0.0
    assert cosine([[-1.0, -2.0]], [[1.0, 2.0]]) == -1.0
    assert cosine([[1e300, 1e300]], [[1e300, 1e300]]) == 1.0  # no overflow


def test_kl_by_hand():
    # p = softmax([0, ln 3]) = [1/4, 3/4], q = softmax([0, 0]) = [1/2, 1/2]
    # KL(p || q) = 1/4 ln(1/2) + 3/4 ln(3/2)
    expected = 0.25 * math.log(0.5) + 0.75 * math.log(1.5)
    assert kl_logits([[0.0, 0.0]], [[0.0, math.log(3.0)]]) == pytest.approx(expected, rel=1e-14)
    # mean over rows: second row identical -> 0
    assert kl_logits([[0.0, 0.0], [5.0, 1.0]], [[0.0, math.log(3.0)], [5.0, 1.0]]) == \
        pytest.approx(expected / 2, rel=1e-14)
    # masked logits (-inf in both) are probability 0 in both: no contribution, no NaN
    assert kl_logits([[0.0, -math.inf]], [[0.0, -math.inf]]) == 0.0
    # stable: logits of 1e4 do not overflow
    assert kl_logits([[1e4, 1e4]], [[1e4, 1e4 + math.log(3.0)]]) == pytest.approx(expected, rel=1e-9)


def test_top1_by_hand():
    # argmax rows: y -> [1, 0], ref -> [1, 1]: half agree
    assert top1_agreement([[0.0, 1.0], [1.0, 0.0]], [[0.0, 1.0], [0.0, 1.0]]) == 0.5
    assert top1_agreement([[3.0, 1.0, 2.0]], [[9.0, 0.0, 8.0]]) == 1.0


def test_allclose_violation_by_hand():
    # |[1.5, 2] - [1, 2]| = [0.5, 0]; tolerance 0.25 + 0.25 |ref| = [0.5, 0.75] -> max ratio 1 (a pass)
    assert allclose_violation([1.5, 2.0], [1.0, 2.0], atol=0.25, rtol=0.25) == 1.0
    assert allclose_violation([1.0], [1.0], 0.0, 0.0) == 0.0  # exact passes even with no tolerance
    assert allclose_violation([1.0], [1.5], 0.0, 0.0) == math.inf
    assert allclose_violation([1e-9], [0.0], 0.0, math.inf) == math.inf  # rtol cannot excuse error at 0
    assert allclose_violation([1e9], [1.0], math.inf, 0.0) == 0.0  # atol=inf: allclose off


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 2 ** 32 - 1), st.floats(1e-6, 1e-1), st.floats(0, 1e-1))
def test_allclose_violation_agrees_with_numpy(seed, atol, rtol):
    rng = np.random.default_rng(seed)
    ref = rng.normal(size=20)
    y = ref + rng.normal(size=20) * rng.choice([1e-6, 1e-3, 1e-1])
    ratio = allclose_violation(y, ref, atol, rtol)
    if abs(ratio - 1.0) > 1e-9:  # away from the boundary both must agree
        assert (ratio <= 1.0) == np.allclose(y, ref, atol=atol, rtol=rtol)


# ---- non-finite policy -----------------------------------------------------------------------------

LOWER = [m for m in METRICS.values() if m.direction is Direction.LOWER]


@pytest.mark.parametrize("metric", LOWER, ids=lambda m: m.name)
def test_nan_output_is_worst(metric):
    assert metric([[1.0, np.nan]], [[1.0, 2.0]]) == math.inf


@pytest.mark.parametrize("metric", LOWER, ids=lambda m: m.name)
def test_overflow_output_is_worst_and_matched_inf_is_exact(metric):
    assert metric([[1.0, np.inf]], [[1.0, 2.0]]) == math.inf
    if not metric.rows:  # +inf logits have no softmax (the row metrics read logits)
        assert metric([[1.0, np.inf]], [[1.0, np.inf]]) == 0.0


@pytest.mark.parametrize("metric", list(METRICS.values()), ids=lambda m: m.name)
def test_nan_reference_raises(metric):
    with pytest.raises(ValueError, match="NaN"):
        metric([[1.0, 2.0]], [[1.0, np.nan]])


def test_non_finite_in_higher_is_better_metrics():
    assert cosine([[1.0, 2.0], [1.0, np.nan]], [[1.0, 2.0], [1.0, 1.0]]) == -math.inf
    assert top1_agreement([[0.0, 1.0], [np.nan, 0.0]], [[0.0, 1.0], [1.0, 0.0]]) == 0.5  # NaN row disagrees
    assert allclose_violation([np.nan], [1.0], 1.0, 1.0) == math.inf


# ---- ULP distance ----------------------------------------------------------------------------------

ULP_DTYPES = {F32: np.float32, F16: np.float16, BF16: ml_dtypes.bfloat16,
              F8E4M3: ml_dtypes.float8_e4m3fn, F8E5M2: ml_dtypes.float8_e5m2}


def test_ulp_formats_are_the_stored_floats():
    assert {f.name for f in ulp_formats()} == {"f64", "f32", "f16", "bf16", "f8e4m3", "f8e5m2"}


def _walk(start, steps: int, direction: float, dtype):
    """Step `steps` times with nextafter in dtype; stops early at the last finite value."""
    x = np.array(start, dtype=dtype)
    toward = np.array(direction, dtype=dtype)
    done = 0
    for _ in range(steps):
        nxt = np.nextafter(x, toward)
        if not np.isfinite(nxt.astype(np.float64)) or nxt == x:
            break
        x, done = nxt, done + 1
    return x, done


def _random_value(draw, dtype):
    bits = draw(st.integers(0, 2 ** (8 * np.dtype(dtype).itemsize) - 1))
    uint = {1: np.uint8, 2: np.uint16, 4: np.uint32}[np.dtype(dtype).itemsize]
    value = np.array(bits, dtype=uint).view(dtype)
    with np.errstate(invalid="ignore"):
        return value if np.isfinite(value.astype(np.float64)) else np.array(1.0, dtype=dtype)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_max_ulp_counts_nextafter_steps(data):
    fmt = data.draw(st.sampled_from(list(ULP_DTYPES)))
    dtype = ULP_DTYPES[fmt]
    start = _random_value(data.draw, dtype)
    direction = data.draw(st.sampled_from([np.inf, -np.inf])) if fmt.has_inf else \
        data.draw(st.sampled_from([448.0, -448.0]))
    end, steps = _walk(start, data.draw(st.integers(0, 40)), direction, dtype)
    y, ref = start.astype(np.float64), end.astype(np.float64)
    assert max_ulp(y, ref, fmt) == steps
    # a reference strictly inside the gap next to `end`, nearer to end: still `steps` after rounding
    beyond, extra = _walk(end, 1, direction, dtype)
    if extra:
        gap = Fraction(float(beyond.astype(np.float64))) - Fraction(float(ref))
        nudged = float(Fraction(float(ref)) + gap * Fraction(data.draw(st.integers(0, 99)), 256))
        assert max_ulp(y, nudged, fmt) == steps


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_ordinal_agrees_with_bit_patterns(data):
    """For representable values the arithmetic ULP count equals the sign-magnitude bit pattern distance."""
    fmt = data.draw(st.sampled_from(list(ULP_DTYPES)))
    dtype = ULP_DTYPES[fmt]
    a, b = _random_value(data.draw, dtype), _random_value(data.draw, dtype)
    nbits = 8 * np.dtype(dtype).itemsize
    uint = {8: np.uint8, 16: np.uint16, 32: np.uint32}[nbits]

    def signed(v):
        bits = int(v.view(uint))
        magnitude = bits & ((1 << (nbits - 1)) - 1)
        return -magnitude if bits >> (nbits - 1) else magnitude
    assert max_ulp(a.astype(np.float64), b.astype(np.float64), fmt) == abs(signed(a) - signed(b))


def test_max_ulp_special_cases():
    # bf16: 1 + 2^-8 + 2^-30 is just above the midpoint of 1 and 1 + 2^-7: rounds up (1 ulp from 1.0).
    # ml_dtypes < 0.7 casts float64 via FP32 and double-rounds it to 1.0 (0.7 rounds it once), which is
    # why max_ulp never relies on the library's cast: the answer must not depend on its version.
    assert max_ulp([1.0], [1 + 2 ** -8 + 2 ** -30], BF16) == 1.0
    assert max_ulp([1.0], [1 + 2 ** -8], BF16) == 0.0  # exact tie -> even (1.0)
    assert max_ulp([-(2.0 ** -149)], [2.0 ** -149], F32) == 2.0  # across zero: -min, 0, +min
    assert max_ulp([-0.0], [0.0], F32) == 0.0
    assert max_ulp([65504.0], [1e10], F16) == 1.0  # ref rounds to inf, one step past max
    assert max_ulp([448.0], [464.0], F8E4M3) == 0.0  # tie at the top rounds to even 448
    assert max_ulp([448.0], [465.0], F8E4M3) == math.inf  # beyond E4M3's range: no value holds it
    assert max_ulp([1.0], [1.0 + 2 ** -52], F32) == 0.0
    assert METRICS["max_ulp_bf16"]([1.0], [1.0078125]) == 1.0
    assert get_metric("ulp_f16") is METRICS["max_ulp_f16"]


# ---- budgets ---------------------------------------------------------------------------------------

def test_parse_examples():
    b = Budget.parse("atol=1e-3,rtol=1e-2")
    assert (b.atol, b.rtol, b.outputs, b.metrics) == (1e-3, 1e-2, None, ())
    b = Budget.parse(" atol = 1e-3 , rtol=0, cosine>=0.9999 ,outputs=logits|hidden,top1>=0.99,kl<=1e-3")
    assert b.outputs == ("logits", "hidden")
    assert b.metrics == (MetricLimit("cosine", 0.9999), MetricLimit("top1_agreement", 0.99),
                         MetricLimit("kl_logits", 1e-3))
    assert Budget.parse("atol=0x1p-10,rtol=inf").atol == 2.0 ** -10


@settings(max_examples=100, deadline=None)
@given(st.floats(0, 1e300), st.floats(0, 1), st.floats(-1, 1), st.booleans())
def test_budget_round_trips_exactly(atol, rtol, limit, named):
    b = Budget(atol, rtol, ("out",) if named else None, (MetricLimit("cosine", limit),
                                                        MetricLimit("max_ulp_bf16", abs(limit) * 7)))
    assert Budget.parse(str(b)) == b
    assert Budget.from_dict(json.loads(json.dumps(b.to_dict()))) == b


BAD = [
    ("atol=abc,rtol=0", "atol=abc"),
    ("atol=1e-3,rtol=0,cosine<=0.9", "cosine<=0.9"),
    ("atol=1e-3,rtol=0,kl>=0.1", "kl>=0.1"),
    ("atol=1e-3,rtol=0,foo=1", "foo=1"),
    ("atol=1e-3,rtol=0,ulp_f12<=2", "ulp_f12<=2"),
    ("atol=-1,rtol=0", "atol=-1"),
    ("atol=1e-3,rtol=nan", "rtol=nan"),
    ("atol=1,atol=2,rtol=0", "atol=2"),
    ("atol=1,rtol=0,cosine>=0.9,cos>=0.8", "cos>=0.8"),
    ("atol=1,rtol=0,outputs=a||b", "outputs=a||b"),
    ("atol=1,rtol=0,outputs=", "outputs="),
    ("atol>=1,rtol=0", "atol>=1"),
    ("atol=1,rtol=0,x y", "x y"),
    ("atol=1,rtol=0,cosine>=0.9x", "cosine>=0.9x"),
]


@pytest.mark.parametrize("text,token", BAD)
def test_parse_names_the_bad_token(text, token):
    with pytest.raises(BudgetSyntaxError) as error:
        Budget.parse(text)
    assert error.value.token == token
    assert repr(token) in str(error.value)


def test_parse_empty_token_and_missing_tolerance():
    with pytest.raises(BudgetSyntaxError, match="empty token #2"):
        Budget.parse("atol=1,,rtol=0")
    with pytest.raises(BudgetSyntaxError, match="lacks rtol"):
        Budget.parse("atol=1,cosine>=0.9")


def test_check_verdicts():
    ref = {"logits": np.array([[1.0, 2.0, 3.0]]), "hidden": np.ones((2, 3))}
    close = {"logits": ref["logits"] + 1e-4, "hidden": ref["hidden"] + 2e-3}
    budget = Budget.parse("atol=1e-3,rtol=0,cosine>=0.9999")
    verdict = budget.check(close, ref)
    assert not verdict.passed
    assert verdict.reason.startswith("output 'hidden': allclose ratio")
    assert verdict.worst_allclose == pytest.approx(2.0, rel=1e-9)
    assert verdict.value("logits", "allclose") == pytest.approx(0.1, rel=1e-9)
    assert verdict.value("hidden", "cos") == 1.0
    with pytest.raises(KeyError, match="'nope' was not judged"):
        verdict.value("nope", "cosine")
    # judging only logits passes; the huge error on hidden is not judged
    only_logits = Budget.parse("atol=1e-3,rtol=0,cosine>=0.9999,outputs=logits").check(close, ref)
    assert only_logits.passed and [v.name for v in only_logits.outputs] == ["logits"]
    assert "within budget" in only_logits.reason
    # a metric failure is named
    flipped = {"logits": ref["logits"][:, ::-1].copy(), "hidden": ref["hidden"]}
    failing = Budget.parse("atol=inf,rtol=0,top1>=1,outputs=logits").check(flipped, ref)
    assert not failing.passed and "top1_agreement=0.0 violates top1_agreement>=1.0" in failing.reason
    # NaN output fails with an inf ratio
    nan_out = {"logits": np.full((1, 3), np.nan), "hidden": ref["hidden"]}
    assert Budget.parse("atol=1,rtol=1").check(nan_out, ref).worst_allclose == math.inf
    assert json.loads(json.dumps(verdict.to_dict()))["passed"] is False


def test_check_missing_output():
    with pytest.raises(KeyError, match="'logits' is missing from the reference"):
        Budget.parse("atol=1,rtol=0,outputs=logits").check({"x": np.ones(1)}, {"x": np.ones(1)})
    with pytest.raises(KeyError, match="candidate outputs"):
        Budget.parse("atol=1,rtol=0").check({}, {"x": np.ones(1)})
