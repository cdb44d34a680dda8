"""audit(plan, graph, inputs): re-check a saved plan's drift against FP64 on new inputs.

Per output: the budget's metrics and the allclose ratio, against the error recorded in the plan.
Per chunk (layer): drift of every exported value. Scale saturation: values outside the ranges seen on
the calibration set (static scales and the contract were judged there). The contract is broken when
any output leaves the budget.

An LLM decode plan is judged the way its compile judged it (issue 32): a budget of row metrics (KL, top-1,
perplexity ratio) over thousands of teacher-forced positions of held-out prompts, pooled (error/pooled.py);
a batch of 8 rows moves top-1 by 1/8 per flipped token, so each batch's own values are reported, not judged.
"""
from __future__ import annotations

import dataclasses
import html
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np
import pandas as pd

from ..error.metric_values import MetricValues
from ..error import pooled
from ..error.metrics import max_abs, rel_l2
from ..error.predict import budget_ratio
from ..hlir.evaluate import evaluate_nodes
from ..hlir.weightcache import WEIGHTS
from ..hlir.graph import Graph
from ..runtime.cpu import CpuRuntime
from ..search.plan import Plan, graph_key
from .files import atomic_files
from .numbers import fmt_num


@dataclass(frozen=True)
class AuditResult:
    passed: bool
    reason: str
    outputs: pd.DataFrame      # per batch and output: allclose ratio, metrics, max_abs
    drift: pd.DataFrame        # per batch, chunk and exported value: max_abs, rel_l2, outside calibration range
    plan_error: float
    audit_error: float
    budget_share: float = float("nan")  # worst share of the budget used over allclose and every metric (<= 1 passes)
    # each budget metric: the plan's recorded value (worst over the calibration batches) and the audit's
    # (worst over the audited batches); columns metric, limit, plan, audit
    metrics: pd.DataFrame = dataclasses.field(default_factory=pd.DataFrame)
    positions: int = 0         # teacher-forced positions the row metrics were pooled over (0: judged per batch)
    not_pooled: str = ""       # why positions were given but the budget was judged per batch

    @property
    def outside_range(self) -> int:
        return int(self.drift["outside_calibration"].sum()) if len(self.drift) else 0


def audit(plan: Plan, graph: Graph, batches: Sequence[Mapping[str, np.ndarray]], space=None,
          positions: pooled.PositionSource | None = None) -> AuditResult:
    """The plan on `batches` against FP64 (outputs, drift per chunk); with `positions` (an LLM decode job's
    held-out windows, through this graph), the budget is judged on their rows pooled, unless it names a
    metric row statistics cannot judge (then per batch, and `not_pooled` says why)."""
    if not batches:
        raise ValueError("audit needs at least one input batch")
    for i, inp in enumerate(batches):
        for name, arr in inp.items():
            a = np.asarray(arr)
            if a.dtype.kind == "f" and not np.all(np.isfinite(a)):
                raise ValueError(f"audit batch {i}: input {name!r} contains NaN or Inf")
    program, part = plan.program(graph, space)
    budget = plan.budget
    rt = CpuRuntime(program, graph.weights, plan.scales, plan.stored_weights)  # the plan's scales and weights files
    ranges = plan.calibration_ranges
    out_names = {nid: name for name, nid in graph.outputs.items()}
    chunk_of = {nid: c.index for c in part.chunks for nid in c.exported}
    out_rows, drift_rows, passed, reason, worst, share, measured = [], [], True, "", 0.0, 0.0, MetricValues()
    for b, inp in enumerate(batches):
        ref_nodes = evaluate_nodes(graph, inp)
        with WEIGHTS.scanning():
            res = rt.run(inp, keep_exports=True)
        refs = {name: ref_nodes[nid] for name, nid in graph.outputs.items()}
        verdict = budget.check(res.outputs, refs)
        worst = max(worst, verdict.worst_allclose)
        share = max(share, budget_ratio(budget, verdict))
        measured = measured.worse(MetricValues.worst_of([verdict]))
        if not verdict.passed and passed:
            passed, reason = False, f"batch {b}: {verdict.reason}"
        for ov in verdict.outputs:
            out_rows.append({"batch": b, "output": ov.name, "allclose_ratio": ov.allclose_ratio,
                             "max_abs": float(max_abs(res.outputs[ov.name], refs[ov.name])),
                             **{m: v for m, v in ov.metric_values}, "passes": not ov.failures})
        for nid, value in sorted(res.exports.items()):
            ref = ref_nodes[nid]
            key = out_names.get(nid, f"chunk{chunk_of[nid]}:%{nid}")
            lo, hi = ranges.get(key, [None, None])
            outside = lo is not None and ref.size > 0 and (float(np.min(ref)) < float(lo) or float(np.max(ref)) > float(hi))
            drift_rows.append({"batch": b, "chunk": chunk_of[nid], "value": key, "max_abs": float(max_abs(value, ref)),
                               "rel_l2": float(rel_l2(value, ref)), "outside_calibration": bool(outside)})
    not_pooled = "" if positions is None else (pooled.refusal(budget, positions.output) or "")
    judged_on = 0
    if positions is not None and not not_pooled:
        if positions.graph is not graph and graph_key(positions.graph) != graph_key(graph):
            raise ValueError("the held-out positions run through another graph than the audited one")
        passed, reason, measured, share, judged_on = _pooled(rt, budget, positions)
    plan_err = plan.verdict.error
    finite = math.isfinite(plan_err)
    if passed:
        recorded = fmt_num(plan_err) if finite else repr(plan_err)
        if not budget.allclose_applies and plan.verdict.metrics:  # its allclose share (0) says nothing
            recorded = plan.verdict.metrics.describe((m.name for m in budget.metrics), lambda v: fmt_num(v, 4))
        if judged_on:
            shown = (measured.describe((m.name for m in budget.metrics), lambda v: fmt_num(v, 4))
                     + f" on {judged_on} teacher-forced positions of the audited prompts (pooled)")
        elif budget.allclose_applies:
            shown = f"worst allclose ratio {fmt_num(worst)}"
        else:
            shown = budget.summary(out_rows, worst)
        reason = f"within budget {budget}: {shown} (plan recorded {recorded})"
    return AuditResult(passed, reason, pd.DataFrame(out_rows), pd.DataFrame(drift_rows),
                       plan_err if finite else float("nan"), worst, share,
                       metric_comparison(budget, plan.verdict.metrics, measured), judged_on, not_pooled)


def _pooled(runtime: CpuRuntime, budget, source: pooled.PositionSource):
    """(passed, reason, metric values, budget share, positions) of the plan's runtime on every position of
    `source`, its row statistics pooled (the compile's positions stage judges the same way)."""
    stats, failed = pooled.run_positions(runtime, source)
    if failed is not None:
        return False, f"run failed on the audited positions: {failed}", MetricValues(), math.inf, 0
    verdict = pooled.check_pooled(budget, source.output, stats)
    on = f" on {stats.rows} teacher-forced positions of the audited prompts (pooled)"
    return verdict.passed, "" if verdict.passed else verdict.reason + on, MetricValues.worst_of([verdict]), \
        budget_ratio(budget, verdict), stats.rows


def metric_comparison(budget, recorded: MetricValues, measured: MetricValues) -> pd.DataFrame:
    """Per budget metric: its limit, the value the plan recorded on the calibration set and the audit's on
    new inputs (NaN where the plan recorded none: a plan from before verdicts held them, a static verdict)."""
    return pd.DataFrame([{"metric": m.name, "limit": f"{m.operator}{fmt_num(m.limit, 4)}",
                          "plan": recorded.get(m.name, math.nan), "audit": measured.get(m.name, math.nan)}
                         for m in budget.metrics], columns=["metric", "limit", "plan", "audit"])


AUDIT_FILES = ("audit.csv", "audit_drift.csv", "audit.html")


def _html_table(frame: pd.DataFrame) -> str:
    """A table for people: numbers in 3 significant digits (the CSV files keep them exactly)."""
    formatted = frame.apply(lambda column: column.map(_shown))
    return formatted.to_html(index=False, escape=True)


def _shown(value) -> str:
    if isinstance(value, (bool, np.bool_)):
        return str(bool(value))
    if isinstance(value, (int, np.integer)):
        return str(int(value))
    if isinstance(value, (float, np.floating)):
        return fmt_num(value)
    return str(value)


def write_audit_report(result: AuditResult, out_dir: str | Path) -> dict[str, Path]:
    """audit.csv (outputs), audit_drift.csv (per layer), audit.html (both tables and the verdict), all or
    nothing: staged beside `out_dir` and moved in together."""
    out_dir = Path(out_dir)
    status = "PASSED" if result.passed else "CONTRACT BROKEN"
    page = (f"<!doctype html><html><head><meta charset='utf-8'><title>audit</title></head><body>"
            f"<h1>Audit: {status}</h1><p>{html.escape(result.reason)}</p>"
            f"<p>{result.outside_range} exported values left the calibration range.</p>"
            + (f"<p>The budget was judged on {result.positions} teacher-forced positions, pooled; the per-batch "
               f"values below are reported, not judged.</p>" if result.positions else "")
            + (f"<h2>Metrics: the plan's value (calibration set) and the audit's (worst batch)</h2>"
               f"{_html_table(result.metrics)}" if len(result.metrics) else "") +
            f"<h2>Outputs</h2>{_html_table(result.outputs)}"
            f"<h2>Drift per chunk</h2>{_html_table(result.drift)}</body></html>")
    csv_name, drift_name, html_name = AUDIT_FILES
    with atomic_files(out_dir) as staging:
        (staging / csv_name).write_text(result.outputs.to_csv(index=False), encoding="utf-8")
        (staging / drift_name).write_text(result.drift.to_csv(index=False), encoding="utf-8")
        (staging / html_name).write_text(page, encoding="utf-8")
    return {"csv": out_dir / csv_name, "drift": out_dir / drift_name, "html": out_dir / html_name}
