"""Token-level metrics for LLM budgets, against hand-derived values."""
import math

import numpy as np
import pytest

from luminal_num.error.budget import Budget
from luminal_num.error.metrics import (METRICS, greedy_agreement, greedy_agreement_length, kl_logits, kl_max,
                                       kl_rows)
from luminal_num.models.llm import LLM_DEFAULT_BUDGET


def test_kl_max_and_rows_by_hand():
    # KL([1/4, 3/4] || [1/2, 1/2]) = 1/4 ln(1/2) + 3/4 ln(3/2)
    one = 0.25 * math.log(0.5) + 0.75 * math.log(1.5)
    y, ref = [[0.0, 0.0], [2.0, 1.0]], [[0.0, math.log(3.0)], [2.0, 1.0]]
    np.testing.assert_allclose(kl_rows(y, ref), [one, 0.0], rtol=1e-14, atol=0)
    assert kl_max(y, ref) == pytest.approx(one, rel=1e-14)
    assert kl_logits(y, ref) == pytest.approx(one / 2, rel=1e-14)
    assert kl_max([[0.0, np.nan]], [[0.0, 1.0]]) == math.inf


def test_greedy_agreement_counts_leading_positions():
    ref = np.array([[0, 1.0, 0], [1.0, 0, 0], [0, 0, 1.0], [0, 1.0, 0]])
    same = ref.copy()
    assert greedy_agreement_length(same, ref) == 4 and greedy_agreement(same, ref) == 1.0
    third_wrong = ref.copy()
    third_wrong[2] = [2.0, 0, 0]
    assert greedy_agreement_length(third_wrong, ref) == 2 and greedy_agreement(third_wrong, ref) == 0.5
    third_wrong[0] = [np.nan, 0, 0]  # a blown first position: nothing agrees
    assert greedy_agreement_length(third_wrong, ref) == 0
    last_wrong = ref.copy()
    last_wrong[3] = [0, 0, 5.0]
    assert greedy_agreement_length(last_wrong, ref) == 3


def test_default_llm_budget_is_token_level_and_parses():
    b = Budget.parse(LLM_DEFAULT_BUDGET)
    assert b.outputs == ("logits",) and math.isinf(b.atol)
    assert {m.name for m in b.metrics} == {"top1_agreement", "kl_logits", "kl_max"}
    assert Budget.parse("atol=inf,rtol=inf,greedy>=0.75,kl_max<=0.1").metrics[0].name == "greedy_agreement"
    assert "kl_max" in METRICS and "greedy_agreement" in METRICS
    tight = b.tightened(0.5)
    assert dict((m.name, m.limit) for m in tight.metrics)["kl_max"] == dict((m.name, m.limit) for m in b.metrics)["kl_max"] / 2
