"""A passing verdict's reason says something: under an LLM budget (atol = rtol = inf: every allclose ratio
is 0) it reports the worst value of each metric limit instead of "worst allclose ratio 0" (issue 36)."""
import numpy as np

from luminal_num.error.budget import Budget


def _logits():
    rng = np.random.default_rng(0)
    ref = rng.standard_normal((6, 11))
    return ref, ref + 1e-3 * rng.standard_normal(ref.shape)


def test_an_llm_budget_reports_its_metrics_not_allclose():
    ref, y = _logits()
    budget = Budget.parse("atol=inf,rtol=inf,outputs=logits,top1>=0.5,kl<=0.5")
    verdict = budget.check({"logits": y}, {"logits": ref})
    assert verdict.passed and "allclose" not in verdict.reason
    values = dict(verdict.outputs[0].metric_values)
    names = [m.name for m in budget.metrics]
    assert all(f"{n} {float(f'{values[n]:.4g}')!r}" in verdict.reason for n in names), verdict.reason


def test_a_finite_budget_keeps_the_allclose_ratio():
    ref, y = _logits()
    verdict = Budget.parse("atol=1e-2,rtol=0").check({"logits": y}, {"logits": ref})
    assert verdict.passed and "worst allclose ratio" in verdict.reason and "(logits)" in verdict.reason
