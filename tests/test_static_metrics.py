"""Metric limits certified from an elementwise error bound (error/static_metrics.py): every y within the bound
of the reference, measured with error/metrics.py (the metric the gate computes), stays within the certified
value: random deviations, the box's corners, and the adversarial ones each derivation's worst case names
(a deviation orthogonal to the reference row for cosine, all of the bound pushed against the top-1 margin)."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from luminal_num.error.metrics import METRICS
from luminal_num.error.static_metrics import METRIC_BOUNDS, metric_bound

HIGHER = {"cosine", "top1_agreement", "greedy_agreement"}


def _deviations(rng, ref, err):
    """y - ref within |d| <= err: uniform, corners, the top-1 attack, and a rescaled orthogonal push."""
    yield rng.uniform(-1, 1, ref.shape) * err
    yield np.where(rng.integers(0, 2, ref.shape) == 1, err, -err)
    rows = ref.reshape(-1, ref.shape[-1])
    top = np.argmax(rows, axis=-1)
    attack = np.array(err.reshape(rows.shape))  # every other logit up, the top one down
    attack[np.arange(rows.shape[0]), top] *= -1
    yield attack.reshape(ref.shape)
    e2 = err.reshape(rows.shape)
    ortho = rng.standard_normal(rows.shape)
    ortho -= rows * (np.sum(ortho * rows, -1, keepdims=True) / np.maximum(np.sum(rows * rows, -1, keepdims=True), 1e-300))
    with np.errstate(divide="ignore", invalid="ignore"):
        scale = np.nan_to_num(np.min(np.where(ortho != 0, e2 / np.abs(ortho), np.inf), -1, keepdims=True), posinf=0.0)
    yield (ortho * scale).reshape(ref.shape)


def _check(ref, err, seed):
    rng = np.random.default_rng(seed)
    for name in METRIC_BOUNDS:
        for d in _deviations(rng, ref, err):
            y = ref + np.clip(d, -err, err)
            # y is formed in FP64: |y - ref| may pass err by half an ulp of ref; the bound is of what y is
            bound = metric_bound(name, np.maximum(err, np.abs(y - ref)), ref)
            value = METRICS[name](y, ref)
            if name in HIGHER:
                assert value >= bound, (name, value, bound)
            else:
                assert value <= bound, (name, value, bound)


@settings(deadline=None, max_examples=80, derandomize=True)
@given(seed=st.integers(0, 2 ** 32 - 1), rows=st.integers(1, 4), width=st.integers(1, 40),
       ref_scale=st.sampled_from([1e-3, 1.0, 30.0, 1e6]), err_scale=st.sampled_from([0.0, 1e-9, 1e-3, 0.3, 5.0]),
       ties=st.booleans())
def test_metrics_of_outputs_within_the_bound_stay_within_the_certified_value(seed, rows, width, ref_scale, err_scale, ties):
    rng = np.random.default_rng(seed)
    ref = rng.standard_normal((rows, width)) * ref_scale
    if ties:  # repeated logits: the top-1 margin is 0 there
        ref = np.round(ref / ref_scale * 2) / 2 * ref_scale
    err = rng.uniform(0, 1, ref.shape) * err_scale * ref_scale
    _check(ref, err, seed)


def test_hand_derived_values():
    ref = np.array([[3.0, 4.0]])  # |ref| = 5
    err = np.array([[3.0, 0.0]])  # |d| <= 3: sin <= 3/5, cos >= 4/5
    assert metric_bound("cosine", err, ref) == pytest.approx(0.8, abs=1e-9)
    assert metric_bound("cosine", err, ref) <= 0.8
    assert metric_bound("kl_max", np.full((1, 3), 0.2), np.zeros((1, 3))) == pytest.approx(0.02, rel=1e-6)
    logits = np.array([[1.0, 0.9, -1.0], [2.0, 0.0, 0.0]])
    assert metric_bound("top1_agreement", np.full(logits.shape, 0.06), logits) == 0.5  # margin 0.1 < 0.12
    assert metric_bound("top1_agreement", np.full(logits.shape, 0.04), logits) == 1.0
    assert metric_bound("greedy_agreement", np.full(logits.shape, 0.06), logits) == 0.0


def test_no_bound_where_none_is_derived():
    ref = np.ones((2, 3))
    assert metric_bound("max_ulp_f32", np.zeros_like(ref), ref) is None
    assert metric_bound("kl_logits", np.zeros_like(ref), np.where(ref > 0, -np.inf, 0)) is None  # masked reference
    assert metric_bound("kl_logits", np.full(ref.shape, np.inf), ref) == np.inf
    assert metric_bound("top1_agreement", np.full(ref.shape, np.inf), ref) == 0.0


# -- the static decider under metric budgets (error/deciders.py StaticBound) --------------------------------

def _head_graph():
    from luminal_num.hlir import Graph
    rng = np.random.default_rng(0)
    g = Graph()
    x = g.input("x", (6, 32))
    y = x.rms_norm(g.weight("g", 1 + 0.1 * rng.standard_normal(32))) @ g.weight("w", rng.standard_normal((32, 50)) / 6)
    g.output(y, "logits")
    return g, [{"x": rng.standard_normal((6, 32))}, {"x": 3 * rng.standard_normal((6, 32))}]


def test_metric_budget_certified_statically_and_above_the_measured_share():
    """A KL / top-1 / cosine budget (atol=inf) is certified from the bound alone, without a run (with the static
    stage on: "auto" leaves metric budgets to measurement); the share it states is at least the share the
    measurement finds (the bound is an upper bound of each metric)."""
    from luminal_num.error.budget import Budget
    from luminal_num.error.judge import Judge
    from luminal_num.search.space import SearchSpace
    g, cal = _head_graph()
    program = SearchSpace.build(g).program(frozenset())
    budget = Budget.parse("atol=inf,rtol=inf,kl_logits<=1e-3,kl_max<=1e-2,top1>=0.9,cosine>=0.999")
    assert Judge(g, budget, cal, use_static="auto").judge(program).source == "measured"  # "auto": metrics measured
    judge = Judge(g, budget, cal, use_static=True)
    v = judge.judge(program)
    assert v.passed and v.source == "static" and judge.stats.measured == 0
    measured = Judge(g, budget, cal, use_static=False).judge(program)
    assert measured.source == "measured" and measured.passed
    assert 0 < measured.share.gate <= v.share.gate <= 1


def test_metric_budgets_the_bound_cannot_decide_are_measured():
    from luminal_num.error.budget import Budget
    from luminal_num.error.judge import Judge
    from luminal_num.search.space import SearchSpace
    g, cal = _head_graph()
    program = SearchSpace.build(g).program(frozenset())
    for text in ("atol=inf,rtol=inf,kl_logits<=1e-30", "atol=inf,rtol=inf,max_ulp_f32<=4"):
        judge = Judge(g, Budget.parse(text), cal, use_static=True)
        v = judge.judge(program)
        assert v.source == "measured" and judge.stats.static == 0, text
