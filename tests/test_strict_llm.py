"""bench.strict_llm on the 2-layer SmolLM2 decode job: the chosen plan passes the strict budget on its
teacher-forced positions (limits written out here), its reported latency is the latency model's own figure
for its genome, the calibration metrics agree with a numpy top-1 / KL written here, and a plan whose verdict
fails is never reported as chosen."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from bench.strict_llm import BF16, STRICT, TARGET, Judging, chosen_row, run
from luminal_num.error.budget import Budget
from luminal_num.runtime.cpu import CpuRuntime
from luminal_num.runtime.latency import modelled_latency
from luminal_num.search.front import LATENCY_TIE
from luminal_num.search.recipes import BF16_WEIGHTS, baselines, pick

LIMITS = {"top1": 0.999, "kl": 1e-3, "kl_p99": 1e-2, "kl_max": 5e-2}  # STRICT's limits, written out
POSITIONS = 256  # the positions stage's minimum here (the bench's default is 2,000: minutes at 2 layers)


@pytest.fixture(scope="module")
def strict():
    return run(layers=2, candidates=6, max_memory=4 << 30, positions=POSITIONS, megakernel=False)


def _row(table, role, label=None):
    rows = table[(table.role == role) & ((table.label == label) if label else True)]
    assert len(rows) == 1, rows
    return rows.iloc[0]


def test_budget_is_the_documented_one():
    b = Budget.parse(STRICT)
    assert {m.name: m.limit for m in b.metrics} == {"top1_agreement": 0.999, "kl_logits": 1e-3, "kl_p99": 1e-2,
                                                   "kl_max": 5e-2}


def test_chosen_passes_the_strict_budget_on_its_positions(strict):
    c = _row(strict.table, "chosen")
    assert c.gate_passes and c.pos_passes and c.positions >= POSITIONS and c.cal_positions == 24
    assert c.pos_top1 >= LIMITS["top1"] and c.cal_top1 >= LIMITS["top1"]
    for m in ("kl", "kl_p99", "kl_max"):
        assert c[f"pos_{m}"] <= LIMITS[m] and c[f"cal_{m}"] <= LIMITS[m]
    # the user's budget on every row's pooled values, as the limits written here read them
    t = strict.table
    for _, r in t[t.pos_top1.notna()].iterrows():
        assert r.pos_within_budget == (r.pos_top1 >= LIMITS["top1"] and all(r[f"pos_{m}"] <= LIMITS[m] for m in
                                                                             ("kl", "kl_p99", "kl_max"))), r.label
    assert c.pos_within_budget
    # the compile's own record agrees: its returned plan passed the pooled positions
    assert strict.result.search.chosen.verdict.passed
    assert strict.result.search.stats.positions.positions == c.positions


def test_reported_latency_is_the_models_figure(strict):
    t, space, job = strict.table, strict.space, strict.job
    bindings = job.graph.bind_symbols(job.calibration[0])
    chosen = strict.result.search.chosen
    model = modelled_latency(space.program(chosen.genome), TARGET, bindings)  # kernel by kernel: the demo's form
    c, bf16 = _row(t, "chosen"), _row(t, "reference", BF16)
    assert c.form == "kernels" and c.latency_us == model.total_s * 1e6
    bf16_model = modelled_latency(space.program(pick(space, BF16_WEIGHTS.__contains__)), TARGET, bindings)
    assert bf16.latency_us == bf16_model.total_s * 1e6
    assert c.vs_bf16_weights == c.latency_us / bf16.latency_us
    # the search's own baselines that pass both checks are never faster than the chosen plan (beyond a tie)
    offered = baselines(space)[0]
    for _, r in t[(t.role == "reference") & t.label.isin(list(offered))].iterrows():
        if r.gate_passes and r.pos_passes:
            assert c.latency_us <= r.latency_us * (1 + LATENCY_TIE), r.label


def _numpy_metrics(y, ref):
    """top-1 agreement and KL(softmax(ref) || softmax(y)) per row, float64, written here."""
    y, ref = y.reshape(-1, y.shape[-1]).astype(np.float64), ref.reshape(-1, ref.shape[-1])

    def log_softmax(x):
        z = x - x.max(axis=1, keepdims=True)
        return z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    lp, lq = log_softmax(ref), log_softmax(y)
    kl = (np.exp(lp) * (lp - lq)).sum(axis=1)
    return (y.argmax(1) == ref.argmax(1)), kl


def test_calibration_metrics_match_numpy(strict):
    """BF16 weights (a KL far above rounding noise) on the calibration batches: the bench's pooled values are
    numpy's over the same 24 rows."""
    job, space = strict.job, strict.space
    program = space.program(pick(space, BF16_WEIGHTS.__contains__))
    judging = Judging(job, space, Budget.parse(STRICT), strict.result.search.stats.headroom_share, positions=False)
    runtime = CpuRuntime(program, job.graph.weights)
    agree, kl = zip(*(_numpy_metrics(runtime.run(b).outputs["logits"], r.outputs(job.graph)["logits"])
                      for b, r in zip(job.calibration, judging.refs)))
    agree, kl = np.concatenate(agree), np.concatenate(kl)
    row = _row(strict.table, "reference", BF16)
    assert row.cal_positions == kl.size == 24
    assert row.cal_top1 == agree.mean()
    assert row.cal_kl == pytest.approx(kl.mean(), rel=1e-6)
    assert row.cal_kl_max == pytest.approx(kl.max(), rel=1e-6)


def test_a_failing_verdict_is_never_reported_as_chosen(strict):
    t = strict.table
    assert (t[t.role == "chosen"].gate_passes & t[t.role == "chosen"].pos_passes).all()
    result = strict.result
    chosen = result.search.chosen
    failed = dataclasses.replace(chosen, verdict=dataclasses.replace(chosen.verdict, passed=False, reason="fails"))
    broken = dataclasses.replace(result, search=dataclasses.replace(result.search, chosen=failed))
    judging = Judging(strict.job, strict.space, Budget.parse(STRICT), result.search.stats.headroom_share,
                      positions=False)
    with pytest.raises(AssertionError, match="verdict fails"):
        chosen_row(broken, judging, megakernel=False)
