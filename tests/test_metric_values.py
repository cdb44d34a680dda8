"""Per-metric values recorded with every verdict (issue 36): a verdict carries the worst value of each budget
metric over the calibration batches (KL mean, KL max, top-1 agreement ...), plan.json, pareto.csv, `inspect` and
`audit` state them. Checked against an FP64 numpy computation of the metrics written here, independently of
error/metrics.py, on the very outputs the plans produce (llama-tiny, an LLM budget, a few candidates)."""
from __future__ import annotations

import json
import math
import warnings

import numpy as np
import pytest

from luminal_num.compiler import compile as compile_plan
from luminal_num.error.budget import Budget
from luminal_num.error.judge import Judge
from luminal_num.error.metric_values import MetricValues
from luminal_num.error.share import Share
from luminal_num.error.verdict import PREDICTED_SOURCES, Verdict, VerdictSource, program_key
from luminal_num.error.verdict_store import STORE_FORMAT, VerdictCacheWarning, VerdictStore, context_key
from luminal_num.hlir.evaluate import evaluate
from luminal_num.models.registry import load_job
from luminal_num.report.audit import audit
from luminal_num.report.compile_report import candidate_rows
from luminal_num.runtime.cpu import CpuRuntime
from luminal_num.search.plan import Plan, PlanError
from luminal_num.search.search import SearchOptions

BUDGET = "atol=inf,rtol=inf,outputs=logits,kl<=0.05,kl_max<=0.2,top1>=0.5"
NAMES = ("kl_logits", "kl_max", "top1_agreement")


def _independent(y: np.ndarray, ref: np.ndarray) -> dict[str, float]:
    """KL(softmax(ref) || softmax(y)) per row (its mean and max) and top-1 agreement, in FP64 numpy."""
    def log_softmax(x):
        x = np.asarray(x, np.float64).reshape(-1, x.shape[-1])
        m = x.max(axis=1, keepdims=True)
        return (x - m) - np.log(np.exp(x - m).sum(axis=1, keepdims=True))
    lp, lq = log_softmax(ref), log_softmax(y)
    kl = (np.exp(lp) * (lp - lq)).sum(axis=1)
    top = np.argmax(np.asarray(y).reshape(lp.shape), 1) == np.argmax(np.asarray(ref).reshape(lp.shape), 1)
    return {"kl_logits": float(kl.mean()), "kl_max": float(kl.max()), "top1_agreement": float(top.mean())}


def _worst(per_batch: list[dict[str, float]]) -> dict[str, float]:
    return {"kl_logits": max(b["kl_logits"] for b in per_batch), "kl_max": max(b["kl_max"] for b in per_batch),
            "top1_agreement": min(b["top1_agreement"] for b in per_batch)}


def _close(got: float, want: float) -> bool:
    return math.isclose(got, want, rel_tol=1e-6, abs_tol=1e-15)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """llama-tiny compiled under an LLM budget with its verdicts cached on disk: (job, result, cache dir)."""
    job = load_job("llama-tiny")
    cache = tmp_path_factory.mktemp("verdicts")
    result = compile_plan(job.graph, Budget.parse(BUDGET), "h200", job.calibration,
                          SearchOptions(seed=0, max_candidates=10, progress=False), cache_dir=cache)
    return job, result, cache


def test_measured_values_equal_an_independent_fp64_computation(compiled):
    job, result, _ = compiled
    refs = [evaluate(job.graph, batch)["logits"] for batch in job.calibration]
    measured = [e for e in result.search.evaluated if e.verdict.source == VerdictSource.MEASURED and e.program]
    assert len(measured) >= 4 and any(e.verdict.metrics["kl_logits"] > 1e-4 for e in measured)  # not only ~0 KLs
    gate = Budget.parse(BUDGET).gate(result.search.stats.headroom_share)
    limits = {m.name: m.limit for m in gate.metrics}
    for e in measured:  # passes and rejects alike (which occur depends on the BLAS kernel's bits: see below)
        runtime = CpuRuntime(e.program, job.graph.weights)
        per_batch = [_independent(runtime.run(batch).outputs["logits"], ref) for batch, ref in zip(job.calibration, refs)]
        fails = [b["kl_logits"] > limits["kl_logits"] or b["kl_max"] > limits["kl_max"]
                 or b["top1_agreement"] < limits["top1_agreement"] for b in per_batch]
        assert e.verdict.passed == (not any(fails)), e.label
        # a reject is measured up to its first failing batch: its values are those of the batches run
        want = _worst(per_batch[:fails.index(True) + 1] if any(fails) else per_batch)
        assert set(e.verdict.metrics) == set(NAMES), e.label
        for name in NAMES:
            assert _close(e.verdict.metrics[name], want[name]), (e.label, name, e.verdict.metrics[name], want[name])


def test_a_measured_reject_records_the_values_of_the_batches_it_ran(compiled):
    """A reject whatever the search's trajectory (on another BLAS kernel the search above measured none): a
    measured program under a KL limit no rounding meets fails on its first batch, and its values are that
    batch's, as an independent FP64 computation gives them."""
    job, result, _ = compiled
    measured = [e for e in result.search.evaluated if e.verdict.source == VerdictSource.MEASURED and e.program]
    lossy = max(measured, key=lambda e: e.verdict.metrics["kl_logits"])
    strict = Budget.parse("atol=inf,rtol=inf,outputs=logits,kl<=1e-30,kl_max<=0.2,top1>=0.5")
    verdict, _ = Judge(job.graph, strict, job.calibration, use_static=False, use_prediction=False).runner.measure(
        lossy.program)
    ref = evaluate(job.graph, job.calibration[0])["logits"]
    first = _independent(CpuRuntime(lossy.program, job.graph.weights).run(job.calibration[0]).outputs["logits"], ref)
    assert first["kl_logits"] > 1e-30 and not verdict.passed
    for name in NAMES:
        assert _close(verdict.metrics[name], first[name]), (name, verdict.metrics[name], first[name])


def test_predicted_verdicts_carry_predicted_values_and_pruned_ones_none(compiled):
    _, result, _ = compiled
    predicted = [e.verdict for e in result.search.evaluated if e.verdict.source in PREDICTED_SOURCES]
    assert predicted, "no predicted verdict in this search: the case this test is for did not occur"
    for v in predicted:  # the composed outputs' values, one per budget metric, each in its metric's range
        assert set(v.metrics) == set(NAMES)
        assert all(v.metrics[n] >= 0 for n in ("kl_logits", "kl_max")) and 0 <= v.metrics["top1_agreement"] <= 1
    unreachable = Verdict(False, VerdictSource.CACHE, Share.unreachable(), np.nan, None, "pruned")
    assert len(unreachable.metrics) == 0 and "kl_logits" not in unreachable.metrics  # absent, never 0 or NaN


def test_a_passing_reason_states_the_recorded_worst_values(compiled):
    """The reason summed a pass up by one batch's values (the last one's, all allclose ratios being 0 under
    atol=inf) while the verdict records the worst over the batches: they now say the same."""
    _, result, _ = compiled
    v = result.search.chosen.verdict
    assert v.passed and v.source == VerdictSource.MEASURED
    assert v.reason.endswith(Budget.parse(BUDGET).gate(result.search.stats.headroom_share).within(v.metrics, 0.0)
                             .split(": ", 1)[1])


def test_plan_json_and_pareto_csv_record_the_values(compiled, tmp_path):
    job, result, _ = compiled
    chosen = result.search.chosen.verdict
    path = result.plan.save(tmp_path / "plan.json")
    plan = Plan.load(path)
    assert plan.verdict.metrics == chosen.metrics and set(plan.verdict.metrics) == set(NAMES)
    assert json.loads(path.read_text())["verdict"]["metrics"] == {n: chosen.metrics[n] for n in NAMES}
    rows = candidate_rows(result)
    assert [c for c in rows.columns if c in NAMES] == ["kl_logits", "kl_max", "top1_agreement"]  # the budget's order
    for e in result.search.evaluated:
        row = rows[rows.candidate == e.id].iloc[0]
        for n in NAMES:
            assert row[n] == e.verdict.metrics[n] if n in e.verdict.metrics else math.isnan(row[n])


@pytest.mark.parametrize("edit, message", [
    (lambda m: m.update(kl_logits=m["kl_logits"] * 0.5), "verdict changed since it was written"),
    (lambda m: m.update(top1_agreement="1"), "verdict.metrics must be an object of metric name: number"),
    (lambda m: m.update(no_such_metric=0.0), "verdict.metrics must be"),
])
def test_plan_json_refuses_edited_values(compiled, tmp_path, edit, message):
    _, result, _ = compiled
    path = result.plan.save(tmp_path / "plan.json")
    data = json.loads(path.read_text())
    edit(data["verdict"]["metrics"])
    path.write_text(json.dumps(data))
    with pytest.raises(PlanError, match=message):
        Plan.load(path)


def test_the_verdict_cache_stores_the_values_it_measured(compiled):
    job, result, cache = compiled
    budget = Budget.parse(BUDGET)
    gate = budget.gate(result.search.stats.headroom_share)
    store = VerdictStore.open(cache, context_key(job.graph, job.calibration, gate, budget))
    measured = {program_key(e.program): e.verdict for e in result.search.evaluated
                if e.verdict.source == VerdictSource.MEASURED and e.program}
    assert store.loaded == len(store.entries) > 0 and set(store.entries) <= set(measured)
    for key in store.entries:
        assert store.get(key) == measured[key] and set(store.get(key).metrics) == set(NAMES)


def test_values_round_trip_through_the_cache_non_finite_included(tmp_path):
    v = Verdict(False, VerdictSource.MEASURED, Share(np.inf, 0.0, 0.0), np.inf, None, "blew up",
                metrics=MetricValues.of({"kl_logits": np.inf, "top1_agreement": 0.0, "cosine": -np.inf}))
    VerdictStore(tmp_path, "ctx").put("k", v)
    assert VerdictStore.open(tmp_path, "ctx").get("k") == v


def test_a_cache_file_from_before_metric_values_is_ignored_with_a_warning(tmp_path):
    """A version-2 file (verdicts without metric values) would give a plan no values: measured again."""
    v2 = {"format": STORE_FORMAT, "version": 2, "context": "ctx", "verdicts": {"k": {
        "passed": True, "source": "measured", "reason": "ok", "tentative": False, "exact": False, "bias": None,
        "max_abs": 1e-3, "bound": None, "share": {"gate": 0.5, "allclose": 0.0, "user_allclose": 0.0}}}}
    VerdictStore(tmp_path, "ctx").path.write_text(json.dumps(v2))
    with pytest.warns(VerdictCacheWarning, match="older compiler .*no metric values"):
        store = VerdictStore.open(tmp_path, "ctx")
    assert store.entries == {} and store.get("k") is None
    v = Verdict(True, VerdictSource.MEASURED, Share(0.5, 0.0, 0.0), 1e-3, None, "ok",
                metrics=MetricValues.of({"kl_logits": 1e-3}))
    store.put("k", v)  # rewritten in this version
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert VerdictStore.open(tmp_path, "ctx").get("k") == v


def test_audit_prints_the_recorded_value_next_to_the_remeasured_one(compiled, tmp_path):
    job, result, _ = compiled
    plan = Plan.load(result.plan.save(tmp_path / "plan.json"))
    got = audit(plan, job.graph, job.heldout)
    program, _ = plan.program(job.graph)
    runtime = CpuRuntime(program, job.graph.weights, plan.scales, plan.stored_weights)
    want = _worst([_independent(runtime.run(batch).outputs["logits"], evaluate(job.graph, batch)["logits"])
                   for batch in job.heldout])
    table = got.metrics.set_index("metric")
    assert list(table.index) == list(NAMES)
    for n in NAMES:
        assert table.loc[n, "plan"] == plan.verdict.metrics[n]
        assert _close(table.loc[n, "audit"], want[n]), (n, table.loc[n, "audit"], want[n])


def test_worst_of_takes_each_metrics_own_direction():
    budget = Budget.parse("atol=inf,rtol=inf,kl<=1,top1>=0.1")
    ref = np.array([[0.0, 1.0, 2.0], [2.0, 1.0, 0.0]])
    a = budget.check({"y": ref + [[0.0, 0.0, 0.5], [0.0, 0.0, 0.0]]}, {"y": ref})
    b = budget.check({"y": ref + [[0.0, 0.0, 0.0], [0.0, 3.0, 0.0]]}, {"y": ref})
    worst = MetricValues.worst_of([a, b])
    assert worst["kl_logits"] == max(a.value("y", "kl"), b.value("y", "kl"))
    assert worst["top1_agreement"] == 0.5 == min(a.value("y", "top1"), b.value("y", "top1"))
    with pytest.raises(KeyError):
        MetricValues.of({"no_such_metric": 1.0})


def test_onnx_runtime_peers_record_their_metric_values():
    """The ORT peers beside an ONNX model's plans get the same metric columns, measured on their outputs."""
    pytest.importorskip("onnxruntime")
    import onnx
    from onnx import TensorProto, helper, numpy_helper
    from luminal_num.onnx.peers import peer_rows, run_peers
    rng = np.random.default_rng(0)
    w = rng.standard_normal((8, 5)).astype(np.float32)
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 5])],
                              [numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    batches = [{"x": rng.standard_normal((3, 8)).astype(np.float32)} for _ in range(2)]
    refs = [{"y": b["x"].astype(np.float64) @ w.astype(np.float64)} for b in batches]
    peers = run_peers(model, batches, refs, Budget.parse("atol=1,rtol=0,cosine>=0.9"), repeats=1)
    assert peers and all(set(p.metrics) == {"cosine"} for p in peers if p.passes)
    fp32 = next(p for p in peers if p.label == "ORT FP32")

    def cosine(y, r):  # min over rows, FP64
        return float(np.min((y * r).sum(1) / (np.linalg.norm(y, axis=1) * np.linalg.norm(r, axis=1))))
    import onnxruntime as ort
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    want = min(cosine(sess.run(None, b)[0].astype(np.float64), r["y"]) for b, r in zip(batches, refs))
    assert _close(fp32.metrics["cosine"], want)
    rows = peer_rows(peers, "cpu")
    np.testing.assert_array_equal(rows["cosine"], [p.metrics.get("cosine", math.nan) for p in peers])


def test_a_plan_written_before_metric_values_loads_and_records_none(compiled, tmp_path):
    """A plan from before verdicts held metric values (no verdict.metrics, its digest over that record) is read
    as recording none: audit's plan column is blank, not 0."""
    from luminal_num.search.plan_file import with_digest
    job, result, _ = compiled
    path = result.plan.save(tmp_path / "plan.json")
    data = json.loads(path.read_text())
    del data["verdict"]["metrics"]
    path.write_text(json.dumps(with_digest(data)))
    plan = Plan.load(path)
    assert len(plan.verdict.metrics) == 0
    table = audit(plan, job.graph, job.heldout[:1]).metrics.set_index("metric")
    assert table["plan"].isna().all() and not table["audit"].isna().any()
