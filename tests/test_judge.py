"""The judge as a chain of deciders with one calibrator (issue 34): the chain's order, and bands that are the
same whatever order measurements report in (a distributed executor returns them in completion order)."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from luminal_num.error.budget import Budget
from luminal_num.error.calibrate import BandKind, Calibrator, Observation
from luminal_num.error.deciders import (Composed, FirstOrder, KnownPrograms, Lowering, Measurement, PrunedChanges,
                                        StaticBound)
from luminal_num.error.judge import Judge
from luminal_num.error.predict import Prediction, SETTLE
from luminal_num.error.share import Share


def _calibrator_with_predictions(n: int) -> Calibrator:
    cal = Calibrator((BandKind.FIRST_ORDER, BandKind.SCALED, BandKind.EXACT))
    for i in range(n):
        p = Prediction(Share(0.1 * (i + 1), 0.0, 0.0), "")
        cal.expect(BandKind.SCALED, f"k{i}", p)
        cal.expect(BandKind.EXACT, f"k{i}", Prediction(Share(0.12 * (i + 1), 0.0, 0.0), ""))
        if i % 2:
            cal.expect(BandKind.FIRST_ORDER, f"k{i}", p)
    return cal


def _bands(cal: Calibrator) -> dict:
    return {k: (b.margin, b.bias, b.mismatches, tuple(b.observed)) for k, b in cal.bands.items()}


# measured shares far from the predictions (mismatches widen the band; SETTLE checks re-centre it): the band's
# state after each observation depends on the ones before, so an order change would show
MEASURED = [0.5, 0.05, 0.9, 0.2, 1.4, 0.33, 0.6, 0.07]


def test_bands_do_not_depend_on_the_order_results_arrive_in():
    assert len(MEASURED) > SETTLE
    in_order = _calibrator_with_predictions(len(MEASURED))
    tickets = [in_order.ticket() for _ in MEASURED]
    for t, m in zip(tickets, MEASURED):
        in_order.report(t, Observation(f"k{t}", m))
    rng = np.random.default_rng(0)
    for _ in range(5):
        shuffled = _calibrator_with_predictions(len(MEASURED))
        tickets = [shuffled.ticket() for _ in MEASURED]
        for t in rng.permutation(tickets):
            shuffled.report(int(t), Observation(f"k{t}", MEASURED[t]))
        assert _bands(shuffled) == _bands(in_order)
    # control: applying the same observations in another order does change the bands
    other = _calibrator_with_predictions(len(MEASURED))
    for t in reversed([other.ticket() for _ in MEASURED]):
        other._apply(Observation(f"k{t}", MEASURED[t]))
    assert _bands(other) != _bands(in_order)


def test_a_result_waits_for_every_earlier_ticket_and_a_withdrawn_one_releases_it():
    cal = _calibrator_with_predictions(3)
    a, b, c = (cal.ticket() for _ in range(3))
    cal.report(c, Observation("k2", 0.3))
    cal.report(b, Observation("k1", 0.2))
    assert all(not band.observed for band in cal.bands.values())  # held back: ticket a has not reported
    cal.report(a, None)  # a was withdrawn (its measurement raised or was interrupted)
    assert [m for _, m in cal.band(BandKind.SCALED).observed] == [0.2, 0.3]
    with pytest.raises(ValueError, match="not issued or already reported"):
        cal.report(b, Observation("k1", 0.2))


def test_the_chain_runs_cheapest_first(job):
    judge = Judge(job.graph, Budget.parse(job.default_budget), list(job.calibration), use_static=False)
    assert [type(d) for d in judge.chain] == [KnownPrograms, PrunedChanges, StaticBound, Lowering, FirstOrder,
                                              Measurement]
    assert not judge.per_chunk and Composed not in map(type, judge.chain)


@pytest.mark.parametrize("order", list(itertools.permutations(range(3))))
def test_rebiased_follows_the_band_whatever_order_the_runs_came_in(order):
    """A composed verdict re-corrected after three runs is the same for every order they reported in."""
    from luminal_num.error.verdict import Verdict
    cal = Calibrator((BandKind.SCALED,))
    keys = [f"k{i}" for i in range(SETTLE + 3)]
    for i, k in enumerate(keys):
        cal.expect(BandKind.SCALED, k, Prediction(Share(0.5, 0.0, 0.0), ""))
    tickets = [cal.ticket() for _ in keys]
    first = tickets[:SETTLE]
    for t in first:
        cal.report(t, Observation(keys[t], 0.6))
    for j in order:
        t = tickets[SETTLE + j]
        cal.report(t, Observation(keys[t], 0.6 + 0.1 * j))
    v = cal.rebiased(Verdict(True, "chunks", Share(0.8, 0.8, 0.4), float("nan"), None, "", False, 1.0))
    ref = Calibrator((BandKind.SCALED,))
    for k in keys:
        ref.expect(BandKind.SCALED, k, Prediction(Share(0.5, 0.0, 0.0), ""))
    for t in [ref.ticket() for _ in keys]:
        ref.report(t, Observation(keys[t], 0.6 if t < SETTLE else 0.6 + 0.1 * (t - SETTLE)))
    w = ref.rebiased(Verdict(True, "chunks", Share(0.8, 0.8, 0.4), float("nan"), None, "", False, 1.0))
    assert (v.passed, v.share, v.bias, v.tentative) == (w.passed, w.share, w.bias, w.tentative)
    assert v.bias == pytest.approx(ref.band(BandKind.SCALED).bias) and v.bias != 1.0


def test_one_share_answers_each_question_a_verdict_was_asked():
    """Hand-derived: the search ranks by the gate share over every metric (allclose where none was
    computed), reports show the user's share (gate share x headroom, the user's allclose share where none),
    and a re-bias scales all three."""
    measured = Share(0.6, 0.2, 0.1)
    static = Share(float("nan"), 0.4, 0.2)
    assert measured.rank() == 0.6 and static.rank() == 0.4
    assert measured.of_budget(0.5) == 0.3 and static.of_budget(0.5) == 0.2
    assert measured.times(2.0) == Share(1.2, 0.4, 0.2)
    gone = Share.unreachable()
    assert gone.rank() == float("inf") and gone.of_budget(0.5) == float("inf")


def test_first_order_deltas_keep_only_the_compared_outputs_and_predict_as_from_all_of_them():
    """An LLM step's budget compares the logits; its other outputs (KV caches, 16x the logits) are never
    read by a prediction, so a single change's deviations of them are not kept."""
    from luminal_num.error.predict import FirstOrderDeltas, ShareCheck
    rng = np.random.default_rng(0)
    refs = tuple({"logits": rng.normal(size=(4, 50)), "cache": rng.normal(size=(64, 8))} for _ in range(2))
    singles = {c: tuple({k: v + rng.normal(scale=s, size=v.shape) for k, v in r.items()} for r in refs)
               for c, s in (("a", 1e-3), ("b", 3e-3))}

    def by_hand(budget: Budget, changes) -> list:  # FP64 reference plus the sum of the singles' deviations
        return [{k: r[k] + sum(singles[c][b][k] - r[k] for c in changes) for k in r} for b, r in enumerate(refs)]

    for text, kept in (("atol=1e-2,rtol=0,outputs=logits", {"logits"}), ("atol=1e-2,rtol=0", {"logits", "cache"})):
        budget = Budget.parse(text)
        check = ShareCheck(budget, budget, refs)
        deltas = FirstOrderDeltas(check)
        for c, outs in singles.items():
            deltas.record(c, outs)
        assert all(set(b) == kept for d in deltas.deltas.values() for b in d)
        for changes in (["a"], ["a", "b"]):
            assert deltas.predict(changes) == check.check(by_hand(budget, changes))


def test_a_pooled_share_check_judges_every_batchs_rows_together():
    """With measurements pooled over teacher-forced positions, a prediction estimates the same pooled statistic:
    one flipped token among 3 batches of 8 rows is top-1 23/24, not the worst batch's 7/8; KL mean is the mean
    over all 24 rows and KL max their max. The values are derived here from softmax rows written in the test."""
    from luminal_num.error.predict import ShareCheck
    rng = np.random.default_rng(1)
    refs = tuple({"logits": rng.normal(size=(8, 40)) * 3} for _ in range(3))
    preds = [{"logits": r["logits"] + rng.normal(scale=0.05, size=(8, 40))} for r in refs]
    row = preds[1]["logits"][2]
    top = int(np.argmax(refs[1]["logits"][2]))
    row[top] = refs[1]["logits"][2].min() - 1.0  # row 2 of batch 1: its FP64 argmax is now its smallest logit
    budget = Budget.parse("atol=inf,rtol=inf,outputs=logits,top1>=0.9,kl<=0.5,kl_max<=10")
    y = np.concatenate([p["logits"] for p in preds])
    r = np.concatenate([b["logits"] for b in refs])
    log_q = y - np.log(np.exp(y - y.max(1, keepdims=True)).sum(1, keepdims=True)) - y.max(1, keepdims=True)
    log_p = r - np.log(np.exp(r - r.max(1, keepdims=True)).sum(1, keepdims=True)) - r.max(1, keepdims=True)
    kl = (np.exp(log_p) * (log_p - log_q)).sum(1)
    top1 = float(np.mean(y.argmax(1) == r.argmax(1)))
    assert top1 == 23 / 24
    pooled = ShareCheck(budget, budget, refs, pooled=True).check(preds)
    want = max((1 - top1) / 0.1, kl.mean() / 0.5, kl.max() / 10)
    assert pooled.share.gate == pytest.approx(want, rel=1e-9)
    worst = ShareCheck(budget, budget, refs).check(preds)  # per batch, the worst: one flip in 8 rows
    assert worst.share.gate == pytest.approx(max((1 / 8) / 0.1, kl[8:16].mean() / 0.5, kl.max() / 10), rel=1e-9)
    assert worst.share.gate > 1.0 >= pooled.share.gate
