"""Plan files and compile reports, on the 2-layer test transformer.

What is checked: the report files a compile writes (CSV, PNG, HTML, per-op table, plan) are complete
and agree with the search and the program; loading refuses missing, corrupt, foreign and mismatched
plans with PlanError; a valid plan rebuilds a program that computes exactly what was judged.
"""
import base64
import json
import re

import egglog
import numpy as np
import pandas as pd
import pytest
from matplotlib import image

from luminal_num.codegen.llir import KernelKind
from luminal_num.compiler import compile as compile_plan
from luminal_num.error.budget import Budget
from luminal_num.hlir.evaluate import evaluate
from luminal_num.models.testnets import transformer
from luminal_num.report.audit import audit
from luminal_num.report.compile_report import write_compile_report
from luminal_num.runtime.cpu import CpuRuntime
from luminal_num.search.plan import PLAN_FORMAT, PLAN_VERSION, Plan, PlanError, op_table
from luminal_num.search.search import SearchOptions

# Interval arithmetic in the static stage overflows to inf on purpose (an unbounded error is a verdict).
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
OPTIONS = SearchOptions(seed=0, max_candidates=30, progress=False)
OP_COLUMNS = ("kernel", "kind", "op", "dtype", "inputs", "shape", "accumulator", "precision", "quant", "scales")


@pytest.fixture(scope="module")
def compiled(job, space):
    return compile_plan(job.graph, Budget.parse(job.default_budget), "h200", job.calibration, OPTIONS, space=space)


@pytest.fixture(scope="module")
def report(compiled, tmp_path_factory):
    out = tmp_path_factory.mktemp("report")
    return out, write_compile_report(compiled, out, "transformer2: error vs latency")


@pytest.fixture()
def saved(compiled, tmp_path):
    return compiled.plan.save(tmp_path / "plan.json")


# -- 5. report files --------------------------------------------------------------------------------------

def test_report_writes_every_file(report, compiled):
    out, files = report
    expected = {"pareto.csv", "pareto.html", "pareto.png", "plan_ops.csv", "plan.json", "layer_map.csv", "layer_map.png",
                "kernels_per_chunk.csv"}
    assert {p.name for p in out.iterdir()} == expected | ({"plan_scales.npz"} if compiled.plan.scales else set())
    assert {k: p.parent for k, p in files.items()} == {k: out for k in ("csv", "png", "html", "ops", "plan", "chunks",
                                                                          "layer_map_csv", "layer_map_png")}


def test_pareto_png_loads(report):
    pixels = image.imread(report[1]["png"])
    assert pixels.ndim == 3 and pixels.shape[2] in (3, 4)
    assert min(pixels.shape[:2]) >= 200
    assert np.isfinite(pixels).all() and float(np.ptp(pixels[..., :3])) > 0.5  # something is drawn


def test_pareto_html_embeds_the_png_and_one_row_per_candidate(report, compiled):
    files = report[1]
    page = files["html"].read_text()
    embedded = re.search(r'<img [^>]*src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert embedded and base64.b64decode(embedded.group(1)) == files["png"].read_bytes()
    body = page[page.index("<tbody>"):page.index("</tbody>")]
    row_ids = [int(i) for i in re.findall(r"<tr[^>]*><td>(\d+)</td>", body)]
    evaluated = compiled.search.evaluated
    assert body.count("<tr") == len(evaluated)
    assert sorted(row_ids) == [e.id for e in evaluated]
    chosen = re.findall(r'<tr class="[^"]*\bchosen\b[^"]*"><td>(\d+)</td>', body)
    assert chosen == [str(compiled.search.chosen.id)]


def test_pareto_csv_has_every_candidate(report, compiled):
    table = pd.read_csv(report[1]["csv"])
    evaluated = {e.id: e for e in compiled.search.evaluated}
    assert sorted(table["candidate"]) == sorted(evaluated)
    for row in table.itertuples():
        e = evaluated[row.candidate]
        assert bool(row.passes) == e.verdict.passed and row.verdict_source == e.verdict.source
        assert (np.isnan(row.latency_s) and e.latency is None) or row.latency_s == e.latency_s
    assert table.loc[table["chosen"], "candidate"].tolist() == [compiled.search.chosen.id]
    baselines = {e.id: e.label for e in compiled.search.evaluated if e.stage == "baseline"}
    assert dict(zip(table.candidate[table.stage == "baseline"], table.label[table.stage == "baseline"])) == baselines
    assert table["on_front"].any()


def test_plan_ops_has_one_row_per_launched_kernel(report, compiled):
    ops = pd.read_csv(report[1]["ops"], keep_default_na=False, dtype=str)
    launched = compiled.program.launched()
    assert set(OP_COLUMNS) <= set(ops.columns)
    assert len(ops) == len(launched)
    assert ops["kernel"].tolist() == [str(k.id) for k in launched]
    assert ops["dtype"].tolist() == [k.dtype.name for k in launched]
    assert ops["precision"].tolist() == [k.precision or "" for k in launched]
    gemms = ops[ops["kind"] == KernelKind.GEMM.value]
    assert len(gemms) and (gemms["accumulator"] != "").all() and (gemms["quant"] != "").all()


def test_op_table_shows_a_group_change_in_every_chunk_of_the_group(job, space):
    """Identical layers share a choice space: one bf16 Gemm change runs in bf16 in each of the 2 layers."""
    group = next(g for g in space.part.groups if len(g.chunks) == 2)
    knob = next(k for k in space.knobs[group.key] if "gemm:bf16" in k.tags)
    program = space.program(frozenset([(group.key, knob.cls, "gemm:bf16")]))
    rows = op_table(program, job.graph.bind_symbols(job.calibration[0]))
    chunk_of = {k.id: k.chunk for k in program.launched()}
    gemm_precisions = [(chunk_of[r["kernel"]], r["precision"]) for r in rows if r["kind"] == KernelKind.GEMM.value]
    bf16 = [r for r in rows if r["precision"] == "bf16"]
    assert sorted(chunk for chunk, p in gemm_precisions if p == "bf16") == [c.index for c in group.chunks]
    assert all(r["quant"] == "A:bf16 B:bf16" and r["accumulator"] == "f32" for r in bf16)
    assert {p for _, p in gemm_precisions} == {"f32", "bf16"}


# -- 6. plan loading ----------------------------------------------------------------------------------------

def test_plan_round_trips_through_its_file(saved, compiled):
    loaded = Plan.load(saved)
    assert {k: v for k, v in loaded.data.items() if k != "scales_file"} == json.loads(compiled.plan.to_json())
    assert loaded.budget == compiled.plan.budget
    assert sorted(loaded.scales or {}) == sorted(compiled.plan.scales or {})


def _write(path, text: str):
    path.write_text(text)
    return path


@pytest.mark.parametrize("make, message", [
    (lambda d, plan: d / "absent.json", "does not exist"),
    (lambda d, plan: _write(d / "corrupt.json", "{not json"), "not valid JSON"),
    (lambda d, plan: _write(d / "list.json", "[1, 2]"), "not a luminal_num plan"),
    (lambda d, plan: _write(d / "other.json", json.dumps({**plan, "format": "someone.else"})),
     "not a luminal_num plan"),
    (lambda d, plan: _write(d / "v2.json", json.dumps({**plan, "version": PLAN_VERSION + 1})),
     f"plan version {PLAN_VERSION + 1}; this compiler reads {PLAN_VERSION}"),
    (lambda d, plan: _write(d / "nogenome.json", json.dumps({k: v for k, v in plan.items() if k != "genome"})),
     "missing the field 'genome'"),
    (lambda d, plan: _write(d / "v1.json", json.dumps({**plan, "version": 1})), "is a version-1 plan (no stored LLIR)"),
], ids=["missing", "corrupt", "not-an-object", "other-format", "other-version", "missing-field", "version-1"])
def test_bad_plan_files_raise_plan_error(tmp_path, compiled, make, message):
    path = make(tmp_path, compiled.plan.data)
    with pytest.raises(PlanError, match=re.escape(message)):
        Plan.load(path)
    assert compiled.plan.data["format"] == PLAN_FORMAT


def test_plan_for_another_graph_is_refused(saved):
    plan = Plan.load(saved)
    with pytest.raises(PlanError, match="graph hash mismatch"):
        plan.program(transformer(3).graph)


def test_tampered_choices_are_refused(saved, job, space):
    data = Plan.load(saved).data
    cls, index, op = data["groups"][0]["choices"][0]
    data["groups"][0]["choices"][0] = [cls, index, op + "X"]
    with pytest.raises(PlanError, match="recorded choices do not match"):
        Plan(data).program(job.graph, space)


def test_loaded_plan_rebuilds_the_judged_program(saved, compiled, job):
    """A fresh choice space, rebuilt from the file alone, computes bit for bit what was judged."""
    plan = Plan.load(saved)
    program, _ = plan.program(job.graph)
    inp = job.calibration[0]
    got = CpuRuntime(program, job.graph.weights).run(inp).outputs
    want = CpuRuntime(compiled.program, job.graph.weights).run(inp).outputs
    assert set(got) == set(want) == set(job.graph.outputs)
    for name in want:
        assert np.array_equal(got[name], want[name]), name
    verdict = plan.budget.check(got, evaluate(job.graph, inp))
    recorded = plan.data["verdict"]
    if recorded["source"] == "measured":
        assert verdict.worst_allclose == recorded["error"]
    else:  # a static certificate bounds what runs
        assert verdict.worst_allclose <= recorded["error"]
    assert verdict.passed and recorded["passed"]


def test_audit_of_a_saved_plan_builds_no_egraph(saved, job, monkeypatch):
    """The plan stores its LLIR: audit loads it, never saturating (egglog is made to fail loudly)."""
    def no_egraph(*a, **kw):
        raise AssertionError("audit built an e-graph")
    monkeypatch.setattr(egglog.EGraph, "__init__", no_egraph)
    result = audit(Plan.load(saved), job.graph, list(job.heldout))
    assert result.passed, result.reason


def test_a_corrupt_stored_llir_is_refused(saved, job):
    data = Plan.load(saved).data
    data["llir"]["kernels"][-1]["inputs"][0][0] = len(data["llir"]["kernels"])  # read an unwritten buffer
    with pytest.raises(PlanError, match="does not verify: kernel .* before it is written"):
        Plan(data).program(job.graph)


def test_stored_llir_that_the_choices_do_not_lower_to_is_refused(saved, job, space):
    data = Plan.load(saved).data
    k = next(k for k in data["llir"]["kernels"] if k["label"])
    k["label"] += " (edited)"
    with pytest.raises(PlanError, match="not what this compiler lowers"):
        Plan(data).program(job.graph, space)


def test_a_directory_is_not_a_plan(tmp_path):
    with pytest.raises(PlanError, match="is not a plan file"):
        Plan.load(tmp_path)


def test_a_genome_for_a_missing_group_is_refused(saved, job, space):
    data = Plan.load(saved).data
    data["genome"] = data["genome"] + [[len(space.part.groups), "any-class", "gemm:bf16"]]
    with pytest.raises(PlanError, match="names no group of this graph"):
        Plan(data).program(job.graph, space)


def test_recording_the_source_file_keeps_the_plans_weights_and_scales():
    """with_source used to rebuild the Plan from data and scales only: an ONNX plan with stored weights lost
    its weights file (issue 34's note)."""
    from luminal_num.search.plan import Plan
    stored, scales = {"w@int8_channel": object()}, {3: object()}
    plan = Plan({"format": "luminal_num.plan"}, scales, stored).with_source({"file": "m.onnx", "sha256": "ab"})
    assert plan.stored is stored and plan.scales is scales and plan.data["source"]["file"] == "m.onnx"
