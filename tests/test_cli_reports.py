"""What a new user reads after a compile (issue 36's report items), on the tiny GGUF under the LLM budget:
baselines keep their recipe's name when chosen, an atol=inf plan is not summed up as "allclose ratio 0",
plan.json states the share of the budget over every metric, `inspect` prints no NaN, the layer map names
Gemms by their weights (q+k+v, o, gate+up, down, lm_head), shows weight storage, draws every group and is
on pareto.html; an interrupted search's front holds no predicted plan."""
from __future__ import annotations

import base64
import contextlib
import io
import json
import re

import pandas as pd
import pytest

from luminal_num.cli import EXIT_OK, main
from luminal_num.error.share import Share
from luminal_num.error.verdict import Verdict, VerdictSource
from luminal_num.report.layer_map import weight_role
from luminal_num.report.numbers import fmt_num
from luminal_num.runtime.cost import Latency
from luminal_num.search.front import Evaluated, Stage, front, reported_front
from tiny_gguf import tiny_config, write_tiny_gguf

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """(report folder, compile's stdout) of the tiny GGUF at decode:2@32 with a few candidates."""
    root = tmp_path_factory.mktemp("reports")
    write_tiny_gguf(root / "tiny.gguf", tiny_config(max_position_embeddings=256))
    (root / "p.txt").write_text("the cat sat on\n", encoding="utf-8")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(["compile", "--model", str(root / "tiny.gguf"), "--workload", "decode:2@32", "--calibration",
                   str(root / "p.txt"), "--candidates", "12", "--quiet", "--out", str(root / "report")])
    assert rc == EXIT_OK
    return root / "report", out.getvalue()


def test_baselines_keep_their_recipe_names_and_the_chosen_one_is_marked(compiled):
    report, stdout = compiled
    table = pd.read_csv(report / "pareto.csv", keep_default_na=False)
    baselines = table[table.stage == "baseline"]
    assert "chosen" not in set(table.label)
    assert {"FP32 everywhere", "TF32 flag", "W8A16 INT8 per-channel"} <= set(baselines.label)
    (chosen,) = table[table.chosen.astype(str) == "True"].itertuples()
    block = stdout[stdout.index("Baselines:"):stdout.index("Chosen plan")]
    if chosen.stage == "baseline":
        assert f"{chosen.label} (chosen)" in block
        assert f"Chosen plan ({chosen.label}): " in stdout
    assert "chosen" not in block.replace("(chosen)", "")


def test_an_llm_plan_is_summed_up_by_its_metrics_not_allclose_0(compiled):
    report, stdout = compiled
    line = next(ln for ln in stdout.splitlines() if ln.startswith("Chosen plan"))
    assert "allclose ratio" not in line and "budget share" in line
    values = stdout.splitlines()[stdout.splitlines().index(line) + 1]
    plan = json.loads((report / "plan.json").read_text())
    recorded = plan["verdict"]["metrics"]
    assert set(recorded) == {"top1_agreement", "kl_logits", "kl_max"}  # every metric of the LLM budget
    pooled = plan["search"]["positions"]["positions"]  # the compile's default positions: the verdict is theirs
    assert pooled >= 2000 and f"measured, pooled over {pooled} teacher-forced positions: " in values
    for name, value in recorded.items():  # each value beside the limit it was judged by and the user's
        assert re.search(rf"{name} {re.escape(fmt_num(value, 4))} \(judged [<>]=\S+, budget [<>]=\S+\)", values)
    table = pd.read_csv(report / "pareto.csv", keep_default_na=False)
    chosen = table[table.chosen.astype(str) == "True"].iloc[0]
    assert plan["verdict"]["budget_share"] == pytest.approx(float(chosen.budget_share), rel=1e-12)
    for name, value in recorded.items():  # pareto.csv: one column per metric
        assert float(chosen[name]) == pytest.approx(value, rel=1e-12, abs=0)
    assert plan["verdict"]["error"] == 0.0  # allclose alone, switched off by atol=rtol=inf: why it is not shown


def test_inspect_prints_no_nan_for_a_kernel_without_an_epilogue(compiled, capsys):
    report, _ = compiled
    capsys.readouterr()
    assert main(["inspect", "--plan", str(report / "plan.json")]) == EXIT_OK
    out = capsys.readouterr().out
    assert "epilogue" in out and "NaN" not in out and "nan" not in out.split("\n", 3)[3]
    assert "(budget share " in out.splitlines()[1]
    pooled = json.loads((report / "plan.json").read_text())["search"]["positions"]["positions"]
    assert out.splitlines()[2].startswith(f"measured, pooled over {pooled} teacher-forced positions: top1_agreement ")


def test_pareto_prints_the_metric_columns_compile_printed(compiled, capsys):
    report, stdout = compiled
    capsys.readouterr()
    assert main(["pareto", str(report)]) == EXIT_OK
    header = capsys.readouterr().out.splitlines()[0].split()
    printed = stdout[stdout.index("Pareto front"):].splitlines()[1].split()
    assert header[:5] == printed[:5] == ["candidate", "budget_share", "top1_agreement", "kl_logits", "kl_max"]


def test_audit_prints_each_recorded_metric_value_next_to_the_remeasured_one(compiled, capsys):
    report, _ = compiled
    plan = json.loads((report / "plan.json").read_text())
    capsys.readouterr()
    assert main(["audit", "--plan", str(report / "plan.json"), "--out", str(report.parent / "audit")]) == EXIT_OK
    out = capsys.readouterr().out
    table = out[out.index("metrics (plan: "):out.index("audit: PASSED")].splitlines()
    assert table[1].split() == ["metric", "limit", "plan", "audit"]
    rows = {r.split()[0]: r.split()[1:] for r in table[2:] if r.strip()}
    assert set(rows) == set(plan["verdict"]["metrics"])
    for name, value in plan["verdict"]["metrics"].items():
        assert rows[name][1] == fmt_num(value)
    assert "(plan recorded top1_agreement " in out  # not its allclose share, 0 under atol=inf
    assert "Metrics: the plan's value" in (report.parent / "audit" / "audit.html").read_text()


def test_the_layer_map_names_gemms_by_their_weights_draws_every_group_and_is_on_the_page(compiled):
    report, _ = compiled
    table = pd.read_csv(report / "layer_map.csv")
    gemm_names = set(table[table.kind.str.startswith("gemm")].op)
    assert {"q+k+v", "o", "gate+up", "down", "lm_head"} <= gemm_names
    assert not any(n.startswith("K") or n in ("SumReduce", "Add", "Mul") for n in table.op)
    assert sorted(table.group.unique()) == [0, 1, 2]  # embedding, the layers, the head
    page = (report / "pareto.html").read_text()
    images = re.findall(r'<img [^>]*src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert len(images) == 2 and base64.b64decode(images[1]) == (report / "layer_map.png").read_bytes()


@pytest.mark.parametrize("name, role", [
    ("model.layers.3.self_attn.q_proj.weight", "q"), ("model.layers.12.mlp.down_proj.weight", "down"),
    ("lm_head.weight", "lm_head"), ("model.embed_tokens.weight", "embed_tokens"),
    ("encoder.layer.0.attention.output.dense.weight", "attention.output.dense"),
    ("encoder.layer.5.attention.self.query.weight", "query"), ("w", "w"),
])
def test_weight_roles(name, role):
    assert weight_role(name) == role


def _evaluated(i: int, latency_s: float, share: float, source: VerdictSource) -> Evaluated:
    verdict = Verdict(True, source, Share(share, share, share), 0.0, None, "")
    return Evaluated(i, frozenset(), verdict, Latency(latency_s, (), "modelled", "h200", True), stage=Stage.GREEDY)


def test_an_interrupted_searchs_front_holds_no_predicted_plan():
    """The chosen plan of an interrupted search stands on measurements only; a faster, more accurate plan
    that was only predicted dominated it on the PARTIAL report's front."""
    measured = _evaluated(0, 2e-5, 0.3, VerdictSource.MEASURED)
    predicted = _evaluated(1, 1e-5, 0.1, VerdictSource.CHUNKS)
    assert [e.id for e in front([measured, predicted])] == [1]  # a complete search confirms it first
    assert [e.id for e in reported_front([measured, predicted], interrupted=True)] == [0]
    assert [e.id for e in reported_front([measured, predicted], interrupted=False)] == [1]


def test_generate_says_it_is_a_check_and_prints_both_rates(compiled, capsys):
    report, _ = compiled
    capsys.readouterr()
    assert main(["generate", "--plan", str(report / "plan.json"), "--prompt", "the cat", "--tokens", "3"]) == EXIT_OK
    lines = capsys.readouterr().out.splitlines()
    prompt_tokens = int(re.match(r"prompt \((\d+) tokens\)", lines[0]).group(1))
    speed = re.fullmatch(r"speed \(a check, not a server: every step runs all slots of decode:2@32\): plan (\d+) steps "
                         r"in [\d.]+ s on the cpu backend \(\S+ steps/s, \S+ generated tokens/s\); FP64 reference "
                         r"(\d+) tokens in [\d.]+ s \(\S+ tokens/s\)", lines[-1])
    assert speed, lines[-1]
    assert int(speed.group(1)) == prompt_tokens + 3 - 1 and int(speed.group(2)) == 3  # a decode step per token fed


@pytest.mark.parametrize("text, shown", [
    ("within budget top1_agreement>=0.964193979565321,kl_logits<=0.0143265432: worst kl_logits 3.056e-14",
     "within budget top1_agreement>=0.9642,kl_logits<=0.01433: worst kl_logits 3.056e-14"),
    ("gemm:f8e4m3_tensor T-779 v0.1.0 atol=0.005 x=-12.3456789 y=1.2345678e-05",
     "gemm:f8e4m3_tensor T-779 v0.1.0 atol=0.005 x=-12.35 y=1.235e-05"),
])
def test_long_decimals_in_messages_are_shown_with_4_digits(text, shown):
    """Limits scaled by the headroom were printed as reprs (top1_agreement>=0.964193979565321); names, short
    numbers and versions are left as they are. Files (pareto.csv, plan.json) keep the exact text."""
    from luminal_num.report.numbers import fmt_numbers_in
    assert fmt_numbers_in(text) == shown
