"""Row metrics pooled over batches (error/pooled.py) and the new LLM metrics kl_p99 and ppl_ratio, each
against an FP64 implementation written here from the definitions (python floats, math.fsum, row by row)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from luminal_num.error.budget import Budget, BudgetSyntaxError, MetricLimit
from luminal_num.error.metrics import METRICS, Compared, kl_p99, ppl_ratio
from luminal_num.error.pooled import PooledRows, RowStats, check_pooled, refusal
from luminal_num.error.predict import budget_ratio


def _softmax_row(x) -> list[float]:
    m = max(x)
    e = [math.exp(v - m) for v in x]
    s = math.fsum(e)
    return [v / s for v in e]


def _kl_row(y, ref) -> float:
    p, q = _softmax_row(ref), _softmax_row(y)
    return math.fsum(pi * (math.log(pi) - math.log(qi)) for pi, qi in zip(p, q) if pi > 0)


def _nll(x, t) -> float:
    m = max(x)
    return -(x[t] - m - math.log(math.fsum(math.exp(v - m) for v in x)))


def _reference_metrics(ys, refs, targets) -> dict[str, float]:
    """KL mean / p99 / max, top-1 rate and perplexity ratio over every row of every batch, one row at a time."""
    kls, agree, nll_y, nll_r = [], [], [], []
    for y, ref, t in zip(ys, refs, targets):
        for yr, rr, tr in zip(y.tolist(), ref.tolist(), t.tolist()):
            kls.append(_kl_row(yr, rr))
            agree.append(yr.index(max(yr)) == rr.index(max(rr)))
            nll_y.append(_nll(yr, tr))
            nll_r.append(_nll(rr, tr))
    n = len(kls)
    ordered = sorted(kls)
    p99 = ordered[math.ceil(0.99 * n) - 1]  # the smallest value at least 99% of the rows do not exceed
    return {"kl_logits": math.fsum(kls) / n, "kl_p99": p99, "kl_max": max(kls), "top1_agreement": sum(agree) / n,
            "ppl_ratio": math.exp(math.fsum(nll_y) / n - math.fsum(nll_r) / n)}


def _batches(seed: int, sizes=(8, 8, 5), vocab: int = 50, noise: float = 0.3):
    rng = np.random.default_rng(seed)
    refs = [rng.normal(0, 3, (b, vocab)) for b in sizes]
    ys = [r + rng.normal(0, noise, r.shape) for r in refs]
    targets = [rng.integers(0, vocab, b) for b in sizes]
    return ys, refs, targets


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_pooled_row_metrics_match_fp64_written_from_the_definitions(seed):
    ys, refs, targets = _batches(seed)
    stats = RowStats.concat([RowStats.of(Compared(y, r, t)) for y, r, t in zip(ys, refs, targets)])
    want = _reference_metrics(ys, refs, targets)
    pooled = PooledRows(stats)
    assert stats.rows == 21
    for name, value in want.items():
        assert METRICS[name].of(pooled) == pytest.approx(value, rel=1e-10, abs=1e-15), name
    assert stats.max_abs.max() == max(float(np.max(np.abs(y - r))) for y, r in zip(ys, refs))


def test_pooling_is_not_the_worst_batch():
    """Pooled KL mean is the mean over all rows, not the worst batch's mean (what per-batch checks take)."""
    ys, refs, targets = _batches(3, sizes=(8, 8), noise=0.1)
    ys[1] = refs[1] + 1.0 * np.random.default_rng(9).normal(size=refs[1].shape)  # one noisier batch
    per_batch = [METRICS["kl_logits"](y, r) for y, r in zip(ys, refs)]
    pooled = METRICS["kl_logits"].of(PooledRows(RowStats.concat([RowStats.of(Compared(y, r, t))
                                                                  for y, r, t in zip(ys, refs, targets)])))
    assert pooled == pytest.approx(sum(per_batch) / 2, rel=1e-12) and pooled < max(per_batch)


def test_kl_p99_and_ppl_ratio_alone():
    ys, refs, targets = _batches(4, sizes=(200,))
    want = _reference_metrics(ys, refs, targets)
    assert kl_p99(ys[0], refs[0]) == pytest.approx(want["kl_p99"], rel=1e-10)
    assert ppl_ratio(ys[0], refs[0], targets[0]) == pytest.approx(want["ppl_ratio"], rel=1e-10)
    # without targets the next token is FP64's argmax (the greedy token teacher forcing feeds)
    greedy = [np.argmax(refs[0], -1)]
    assert ppl_ratio(ys[0], refs[0]) == pytest.approx(_reference_metrics(ys, refs, greedy)["ppl_ratio"], rel=1e-10)
    assert ppl_ratio(refs[0], refs[0], targets[0]) == 1.0 and kl_p99(refs[0], refs[0]) == 0.0


def test_blown_row_and_only_some_rows_counted():
    y = np.array([[0.0, 1.0, 2.0], [np.nan, 0.0, 0.0]])
    ref = np.array([[0.0, 1.0, 2.0], [1.0, 0.0, 0.0]])
    assert ppl_ratio(y, ref) == math.inf and kl_p99(y, ref) == math.inf
    assert RowStats.of(Compared(y, ref), rows=1).rows == 1  # a repeated window's rows are not counted
    assert METRICS["ppl_ratio"].of(PooledRows(RowStats.of(Compared(y, ref), rows=1))) == 1.0
    with pytest.raises(ValueError, match="target tokens"):
        ppl_ratio(y, ref, [0, 1, 2])


def test_budget_terms_parse_tighten_and_share():
    b = Budget.parse("atol=inf,rtol=inf,outputs=logits,kl_p99<=0.05,ppl_ratio<=1.1,top1>=0.9")
    assert [m.name for m in b.metrics] == ["kl_p99", "ppl_ratio", "top1_agreement"]
    assert Budget.parse(str(b)) == b and Budget.from_dict(b.to_dict()) == b
    t = b.tightened(0.5)
    assert [m.limit for m in t.metrics] == pytest.approx([0.025, 1.05, 0.95])  # distance from perfect (1 for ppl)
    ppl = METRICS["ppl_ratio"]
    assert ppl.share(1.05, 1.1) == pytest.approx(0.5) and ppl.share(0.97, 1.1) == 0.0  # beating FP64 uses nothing
    assert ppl.share(math.inf, 1.1) == math.inf
    with pytest.raises(ValueError, match="better than the reference"):
        MetricLimit("ppl_ratio", 0.9)
    with pytest.raises(BudgetSyntaxError):
        Budget.parse("atol=inf,rtol=inf,ppl_ratio>=1.1")


def test_check_pooled_and_refusals():
    ys, refs, targets = _batches(5)
    stats = RowStats.concat([RowStats.of(Compared(y, r, t)) for y, r, t in zip(ys, refs, targets)])
    want = _reference_metrics(ys, refs, targets)
    budget = Budget.parse(f"atol=inf,rtol=inf,outputs=logits,kl<={want['kl_logits'] * 2!r},ppl_ratio<=1.5")
    verdict = check_pooled(budget, "logits", stats)
    ppl_share = max(want["ppl_ratio"] - 1, 0.0) / 0.5  # a ratio below 1 (better than FP64 on these tokens) uses 0
    assert verdict.passed and budget_ratio(budget, verdict) == pytest.approx(max(0.5, ppl_share), rel=1e-9)
    assert not check_pooled(Budget.parse(f"atol=inf,rtol=inf,outputs=logits,kl_max<={want['kl_max'] / 2!r}"),
                            "logits", stats).passed
    assert "allclose" in refusal(Budget.parse("atol=1e-3,rtol=0,outputs=logits"))
    assert "cosine" in refusal(Budget.parse("atol=inf,rtol=inf,outputs=logits,cosine>=0.99"))
    assert "every output" in refusal(Budget.parse("atol=inf,rtol=inf,kl<=0.1"))
    assert "k_cache" in refusal(Budget.parse("atol=inf,rtol=inf,outputs=logits|k_cache,kl<=0.1"))
    with pytest.raises(ValueError, match="cannot be judged on pooled positions"):
        check_pooled(Budget.parse("atol=inf,rtol=inf,outputs=logits,max_abs<=1"), "logits", stats)
