"""metrics.Compared shares work between metrics and keeps reference-only values per reference array:
every value must equal the one computed from scratch (a fresh copy of the reference, nothing cached),
bit for bit, including rows that blew up and masked (-inf) logits."""
import numpy as np
import pytest
from scipy.special import log_softmax

from luminal_num.error.budget import Budget
from luminal_num.error.metrics import METRICS, Compared, allclose_violation, kl_rows


def _logits(rng, rows=6, width=50):
    ref = rng.standard_normal((rows, width)) * 4
    ref[1, :7] = -np.inf  # masked tokens, matching in y
    y = ref + rng.standard_normal(ref.shape) * 1e-2
    y[1, :7] = -np.inf
    return y.astype(np.float32), ref


@pytest.mark.parametrize("blow_up", [None, "nan", "inf"])
def test_every_metric_equals_its_value_from_a_fresh_reference(blow_up):
    rng = np.random.default_rng(3)
    y, ref = _logits(rng)
    if blow_up == "nan":
        y[3, 5] = np.nan
    elif blow_up == "inf":
        y[4, 9] = np.inf
    other = ref[::-1].copy()  # same shape, other values: a cache keyed on anything but the array would mix them
    for i in range(4):  # each reference's values are cached after its first pass; each y is new
        y = y + np.float32(1e-3)
        r = ref if i % 2 else other
        shared = Compared(y, r)
        for name, metric in METRICS.items():
            fresh = metric(y.copy(), r.copy())
            got = metric.of(shared)
            assert np.array_equal(np.float64(got), np.float64(fresh), equal_nan=True), name


def test_kl_rows_match_scipy_log_softmax_and_blown_rows_are_inf():
    rng = np.random.default_rng(4)
    y, ref = _logits(rng)
    y[2, 0] = np.nan
    got = kl_rows(y, ref)
    p, q = log_softmax(ref, axis=-1), log_softmax(y.astype(np.float64), axis=-1)
    with np.errstate(invalid="ignore"):  # the NaN row
        want = np.where(np.isneginf(p), 0.0, np.exp(p) * (p - q)).sum(-1)
    ok = np.arange(len(ref)) != 2
    np.testing.assert_allclose(got[ok], want[ok], rtol=1e-12, atol=1e-15)
    assert got[2] == np.inf


def test_allclose_with_atol_inf_is_zero_unless_something_blew_up():
    rng = np.random.default_rng(5)
    ref = rng.standard_normal((4, 8))
    y = ref * 3.0
    assert allclose_violation(y, ref, np.inf, 0.0) == 0.0
    y[0, 0] = np.nan
    assert allclose_violation(y, ref, np.inf, np.inf) == np.inf


def test_a_budget_judges_a_compared_output_as_the_raw_one():
    rng = np.random.default_rng(6)
    y, ref = _logits(rng)
    budget = Budget.parse("atol=1e-2,rtol=0,kl_logits<=0.001,top1>=0.9,kl_max<=0.01")
    raw = budget.check({"logits": y}, {"logits": ref})
    shared = budget.check({"logits": Compared(y, ref)}, {"logits": ref})
    assert raw == shared


def test_a_mismatched_shape_and_a_nan_reference_still_raise():
    with pytest.raises(ValueError, match="shape"):
        Compared(np.zeros(3), np.zeros(4))
    ref = np.zeros(3)
    ref[1] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        Compared(np.zeros(3), ref)
