"""audit of an LLM decode plan on teacher-forced positions of the held-out prompts, pooled (report/audit.py):
the pooled metrics equal a recomputation written here, the pooled verdict (not an 8-row batch's) decides, a
budget row statistics cannot judge falls back to per batch and says why, and the CLI's --positions."""
from __future__ import annotations

import numpy as np
import pytest

from luminal_num.cli import EXIT_CONTRACT, EXIT_OK, main
from luminal_num.error.budget import Budget
from luminal_num.models.llm import Prompt
from luminal_num.models.registry import llm_job
from luminal_num.report.audit import audit
from luminal_num.runtime.cpu import CpuRuntime
from luminal_num.search.plan import Plan
from test_llm_positions import PROMPTS, _metrics, _Skewed, tiny  # noqa: F401 (tiny: the shared fixture)

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
HELDOUT = ("a cat and a dog", "the end")


@pytest.fixture(scope="module")
def compiled(tiny):
    """test_llm_positions' tiny Llama GGUF and prompts, a held-out file and a plan compiled with --heldout
    (one CLI compile, ~2 s)."""
    root, model = tiny
    (root / "held.txt").write_text("\n".join(HELDOUT) + "\n", encoding="utf-8")
    assert main(["compile", "--model", str(model), "--workload", "decode:2@16", "--candidates", "2", "--quiet",
                 "--calibration", str(root / "mine.txt"), "--heldout", str(root / "held.txt"),
                 "--positions", "40", "--out", str(root / "plan")]) == EXIT_OK
    return root, model


def _job(model, minimum=40):
    return llm_job(str(model), "decode:2@16", [Prompt(p, False) for p in PROMPTS],
                   [Prompt(p, False) for p in HELDOUT], positions_minimum=minimum)


def test_the_held_out_positions_are_the_held_out_prompts_windows(compiled):
    _, model = compiled
    job = _job(model)
    held = job.llm.heldout_positions
    assert held.prompts == tuple(Prompt(p, False) for p in HELDOUT) and held.positions == 48  # ceil(40/16) x 16
    assert held.graph is job.graph and job.llm.positions.prompts != held.prompts
    assert llm_job(str(model), "decode:2@16", positions_minimum=0).llm.heldout_positions is None


def test_audit_pools_the_budget_over_every_held_out_position(compiled):
    root, model = compiled
    job = _job(model)
    plan = Plan.load(root / "plan" / "plan.json")
    result = audit(plan, job.graph, list(job.heldout), positions=job.llm.heldout_positions)
    assert result.passed and result.positions == 48 and not result.not_pooled
    assert "on 48 teacher-forced positions of the audited prompts (pooled)" in result.reason
    program, _ = plan.program(job.graph)  # recomputed here: the plan's program, each step against its FP64 logits
    runtime = CpuRuntime(program, job.graph.weights, plan.scales, plan.stored_weights)
    ys, refs, targets = [], [], []
    for b in job.llm.heldout_positions.batches():
        y = np.asarray(runtime.run(b.inputs).outputs["logits"], np.float64).reshape(b.reference.shape)
        ys.append(y[:b.rows]), refs.append(b.reference[:b.rows]), targets.append(b.targets[:b.rows])
    want = _metrics(ys, refs, targets)
    audited = dict(zip(result.metrics["metric"], result.metrics["audit"]))
    assert set(audited) == {m.name for m in plan.budget.metrics}
    for name, value in audited.items():
        assert value == pytest.approx(want[name], rel=1e-9, abs=1e-15), name


def test_the_pooled_verdict_decides_not_the_batches(compiled):
    """References turned to noise on the positions only: every batch passes, the pooled verdict breaks."""
    root, model = compiled
    job = _job(model, minimum=16)
    plan = Plan.load(root / "plan" / "plan.json")
    result = audit(plan, job.graph, list(job.heldout), positions=_Skewed(job.llm.heldout_positions, bad=1))
    assert result.outputs["passes"].all()
    assert not result.passed and "teacher-forced positions of the audited prompts (pooled)" in result.reason


def test_a_budget_row_statistics_cannot_judge_is_audited_per_batch(compiled):
    root, model = compiled
    job = _job(model, minimum=16)
    plan = Plan.load(root / "plan" / "plan.json")
    plan = plan.with_fields(budget=Budget.parse("atol=inf,rtol=inf,outputs=logits,cosine>=0.9").to_dict())
    result = audit(plan, job.graph, list(job.heldout), positions=job.llm.heldout_positions)
    assert result.positions == 0 and "cosine is not a row metric" in result.not_pooled and result.passed


def test_cli_audit_pools_by_default_and_per_batch_with_positions_0(compiled, capsys):
    root, _ = compiled
    capsys.readouterr()
    assert main(["audit", "--plan", str(root / "plan" / "plan.json"), "--positions", "40",
                 "--out", str(root / "a40")]) == EXIT_OK
    out = capsys.readouterr().out
    assert "audit: pooled over 48 teacher-forced positions of the audited prompts" in out
    assert "on 48 teacher-forced positions of the audited prompts (pooled)" in out
    assert "teacher-forced positions" in (root / "a40" / "audit.html").read_text()
    assert main(["audit", "--plan", str(root / "plan" / "plan.json"), "--positions", "0",
                 "--out", str(root / "a0")]) in (EXIT_OK, EXIT_CONTRACT)
    out = capsys.readouterr().out
    assert "audit: worst over these batches" in out and "(pooled)" not in out


def test_positions_run_in_groups_give_each_step_its_own_statistics_and_stop_at_a_failing_step():
    """run_positions runs STEPS_TOGETHER steps kernel by kernel together: the statistics are those of each step
    run alone, and a step whose run fails ends the pass with its reason and the steps before it (as before)."""
    from dataclasses import dataclass as dc
    from luminal_num.error import pooled
    rng = np.random.default_rng(5)

    @dc
    class Step:
        inputs: dict
        reference: np.ndarray
        targets: np.ndarray
        rows: int

    steps = [Step({"i": np.array(i)}, rng.standard_normal((3, 7)), rng.integers(0, 7, 3), 3 - (i == 6)) for i in range(7)]
    outs = [s.reference + 0.1 * rng.standard_normal(s.reference.shape) for s in steps]

    class Source:
        output = "logits"

        def batches(self):
            yield from steps

    class Runtime:  # the CpuRuntime surface run_positions uses; step `bad` raises as a REJECT overflow would
        def __init__(self, bad=None):
            self.bad, self.together = bad, []

        def run(self, inputs):
            i = int(inputs["i"])
            if i == self.bad:
                raise ValueError(f"step {i} overflows")
            return type("R", (), {"outputs": {"logits": outs[i]}})()

        def run_many(self, batch_inputs):
            self.together.append([int(b["i"]) for b in batch_inputs])
            return [self.run(b) for b in batch_inputs]

    rt = Runtime()
    stats, failed = pooled.run_positions(rt, Source())
    want = pooled.RowStats.concat([pooled.batch_stats(o, s) for o, s in zip(outs, steps)])
    assert failed is None and rt.together == [[0, 1, 2, 3], [4, 5, 6]] and pooled.STEPS_TOGETHER == 4
    assert stats.rows == want.rows == 20 and np.array_equal(stats.kl, want.kl) and np.array_equal(stats.top1, want.top1)
    stats, failed = pooled.run_positions(Runtime(bad=5), Source())
    assert failed == "step 5 overflows" and stats.rows == 5 * 3  # steps 0-4 counted, 5 failed, 6 never run
