"""Teacher-forced positions over the calibration prompts (models/llm_positions.py), the search's measurements on
them (compiler.PositionsJudge) and the compile's positions stage (compiler.positions_stage): the streamed decode
steps compute the FP64 runner's function, every measured verdict and the chosen plan's pooled metrics equal a
recomputation written here, and a plan the positions reject is replaced."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from luminal_num.cli import EXIT_OK, main
from luminal_num.compiler import POSITION_ROWS, BudgetUnreachable, compile
from luminal_num.error.budget import Budget
from luminal_num.hlir.evaluate import evaluate_nodes
from luminal_num.hlir.partition import partition
from luminal_num.models.llm import Prompt
from luminal_num.models.llm_positions import PositionBatch
from luminal_num.models.registry import llm_job
from luminal_num.runtime.cpu import CpuRuntime
from luminal_num.search.search import SearchOptions
from luminal_num.search.space import SearchSpace
from tiny_gguf import tiny_config, write_tiny_gguf

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
PROMPTS = ("the cat sat on", "a dog ran", "the end of the")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("positions")
    model = root / "tiny.gguf"
    write_tiny_gguf(model, tiny_config(max_position_embeddings=256))
    (root / "mine.txt").write_text("\n".join(PROMPTS) + "\n", encoding="utf-8")
    return root, model


def _job(model, minimum=40):
    return llm_job(str(model), "decode:2@16", [Prompt(p, False) for p in PROMPTS], [Prompt("a cat", False)],
                   positions_minimum=minimum)


def test_windows_stream_the_fp64_function_at_every_position(tiny):
    _, model = tiny
    job = _job(model)
    source = job.llm.positions
    assert source.positions == 48 and len(source.windows) == 3  # ceil(40 / 16) windows, one per prompt here
    first = job.llm.model.encode(Prompt(PROMPTS[0], False))
    assert source.windows[0][:len(first)] == tuple(first) and all(len(w) == 16 for w in source.windows)
    greedy, _ = job.llm.model.fp64.greedy(first, 16 - len(first))  # the continuation is FP64's own
    assert source.windows[0][len(first):] == tuple(greedy)
    batches = list(source.batches())
    assert len(batches) == 2 * 16 and [b.rows for b in batches[::16]] == [2, 1]  # the short group counts once
    out = job.graph.outputs["logits"]
    for i, b in enumerate(batches):
        group, step = divmod(i, 16)
        y = np.asarray(evaluate_nodes(job.graph, b.inputs, keep={out})[out]).reshape(b.reference.shape)
        assert np.max(np.abs(y - b.reference)) <= 1e-12 * np.max(np.abs(b.reference))  # the graph's FP64 = the runner's
        windows = source.windows[2 * group:2 * group + b.rows]
        want = [w[step + 1] if step + 1 < 16 else int(np.argmax(b.reference[j])) for j, w in enumerate(windows)]
        assert list(b.targets[:b.rows]) == want


def test_a_wider_step_computes_each_row_as_the_workloads_step(tiny):
    """The positions run 32 rows a step: each row is the same function as in the workload's 2-row step (bit for
    bit under a batch-invariant lowering, so any difference would be the rows' coupling, not BLAS order)."""
    _, model = tiny
    source = _job(model).llm.positions
    wide = source.widened(POSITION_ROWS)
    rows = {}
    for s, width in ((source, 2), (wide, POSITION_ROWS)):
        space = SearchSpace.build(s.graph).with_batch_invariance(True)
        runtime = CpuRuntime(space.program(frozenset()), s.graph.weights)
        got = rows.setdefault(width, {})
        for i, b in enumerate(s.batches()):
            group, step = divmod(i, 16)
            y = np.asarray(runtime.run(b.inputs).outputs["logits"]).reshape(b.reference.shape)
            for j in range(b.rows):
                got[(group * width + j, step)] = (y[j], b.reference[j], b.targets[j])
    assert len(rows[2]) == len(rows[POSITION_ROWS]) == 48
    for key, (y, ref, target) in rows[2].items():
        y_wide, ref_wide, target_wide = rows[POSITION_ROWS][key]
        assert np.array_equal(y, y_wide) and target == target_wide
        assert np.max(np.abs(ref - ref_wide)) <= 1e-12 * np.max(np.abs(ref))  # FP64 at 2 or 32 sequences a pass


def _metrics(ys, refs, targets):
    """KL mean/max, top-1 rate and perplexity ratio over all rows, from softmax rows computed here."""
    y, r, t = np.concatenate(ys), np.concatenate(refs), np.concatenate(targets)
    log_q = y - y.max(1, keepdims=True)
    log_q -= np.log(np.exp(log_q).sum(1, keepdims=True))
    log_p = r - r.max(1, keepdims=True)
    log_p -= np.log(np.exp(log_p).sum(1, keepdims=True))
    kl = (np.exp(log_p) * (log_p - log_q)).sum(1)
    rows = np.arange(len(t))
    return {"kl_logits": kl.mean(), "kl_max": kl.max(), "top1_agreement": np.mean(y.argmax(1) == r.argmax(1)),
            "ppl_ratio": np.exp(np.mean(-log_q[rows, t]) - np.mean(-log_p[rows, t]))}


def _plan_metrics(job, plan):
    """The plan's pooled metrics over the job's positions, 32 rows a step (its genome lowered there), from
    _metrics' softmax rows."""
    wide = job.llm.positions.widened(POSITION_ROWS)
    space = SearchSpace.build(wide.graph)
    runtime = CpuRuntime(space.program(plan.genome(space)), wide.graph.weights)
    ys, refs, targets = [], [], []
    for b in wide.batches():
        ys.append(np.asarray(runtime.run(b.inputs).outputs["logits"], np.float64).reshape(b.reference.shape)[:b.rows])
        refs.append(b.reference[:b.rows])
        targets.append(b.targets[:b.rows])
    return _metrics(ys, refs, targets)


def _options():
    return SearchOptions(max_candidates=3, progress=False, workers=1, headroom=0.5)


def test_the_chosen_plan_is_judged_on_every_position_pooled(tiny):
    _, model = tiny
    job = _job(model)
    result = compile(job.graph, Budget.parse(job.default_budget), "h200", job.calibration, _options(),
                     positions=job.llm.positions)
    record = result.search.stats.positions
    assert record.positions == 48 and record.judged == 1 and not record.skipped
    assert "on 48 teacher-forced positions" in result.plan.verdict.reason
    assert record.rows == POSITION_ROWS  # the plan's genome ran 32 rows a step: the plan, lowered there
    for name, value in _plan_metrics(job, result.plan).items():
        assert record.metrics[name] == pytest.approx(value, rel=1e-9, abs=1e-15), name
    assert record.metrics["kl_p99"] <= record.metrics["kl_max"]
    recorded = result.plan.verdict.metrics  # plan.json's verdict.metrics: the pooled values the budget limits
    limited = {m.name for m in Budget.parse(job.default_budget).metrics}
    assert recorded and set(recorded) <= limited
    for name, value in recorded.items():
        assert value == pytest.approx(record.metrics[name], rel=1e-9, abs=1e-15), name


@dataclasses.dataclass
class _Skewed:
    """A source whose references are replaced by noise in the first `bad` passes (every plan fails there)."""
    inner: object
    bad: int
    output: str = "logits"
    count: list = dataclasses.field(default_factory=lambda: [0])  # passes, shared with the widened source

    positions = property(lambda self: self.inner.positions)
    graph = property(lambda self: self.inner.graph)
    rows = property(lambda self: self.inner.rows)
    held_bytes = property(lambda self: self.inner.held_bytes)

    def release(self):
        self.inner.release()
    passes = property(lambda self: self.count[0])

    def widened(self, rows: int) -> "_Skewed":
        return _Skewed(self.inner.widened(rows), self.bad, self.output, self.count)

    def batches(self):
        self.count[0] += 1
        rng = np.random.default_rng(self.passes)
        for b in self.inner.batches():
            ref = b.reference + (50 * rng.normal(size=b.reference.shape) if self.passes <= self.bad else 0)
            yield PositionBatch(b.inputs, ref, b.targets, b.rows)


def _rejected_on_positions(result):
    return [e for e in result.evaluated if not e.verdict.passed and "teacher-forced positions" in e.verdict.reason]


def test_a_plan_the_positions_reject_is_replaced_by_the_next_choice(tiny):
    """The first pass over the positions (the FP32 baseline's measurement, in the search) sees skewed references
    and rejects: another plan is chosen, on its own pass; the calibration batches would have passed both."""
    _, model = tiny
    job = _job(model, minimum=16)
    skewed = _Skewed(job.llm.positions, bad=1)
    result = compile(job.graph, Budget.parse(job.default_budget), "h200", job.calibration, _options(),
                     positions=skewed)
    assert result.search.stats.positions.judged == skewed.passes >= 2
    (first,) = _rejected_on_positions(result.search)
    assert first.genome == frozenset() and first.stage.value == "baseline"  # FP32, rejected in the search
    assert result.search.chosen.id != first.id and result.search.chosen.verdict.passed
    assert "on 16 teacher-forced positions" in result.search.chosen.verdict.reason


def test_every_measurement_of_the_search_is_a_pass_over_the_positions(tiny):
    """An LLM decode search measures on the positions (compiler.PositionsJudge behind judge.EndToEnd): every
    measured verdict names them, one pass per program, and the plan measured after FP32 was rejected there has
    the pooled metrics recomputed here, at 32 rows a step, from softmax rows written in this file."""
    from luminal_num.error.verdict import VerdictSource, program_key
    _, model = tiny
    job = _job(model)
    skewed = _Skewed(job.llm.positions, bad=1)  # FP32's pass (the first) fails: another plan is measured
    result = compile(job.graph, Budget.parse(job.default_budget), "h200", job.calibration, _options(),
                     positions=skewed)
    measured = [e for e in result.search.evaluated if e.verdict.source == VerdictSource.MEASURED]
    chosen = result.search.chosen
    assert chosen.genome and chosen in measured and len(measured) >= 2
    assert all("on 48 teacher-forced positions" in e.verdict.reason for e in measured)
    assert result.search.stats.positions.judged == skewed.passes == len({program_key(e.program) for e in measured})
    want = _plan_metrics(job, result.plan)
    assert chosen.verdict.metrics
    for name, value in chosen.verdict.metrics.items():
        assert value == pytest.approx(want[name], rel=1e-9, abs=1e-15), name


def test_a_judge_with_positions_takes_its_verdicts_from_them(tiny):
    """judge.EndToEnd with a PooledJudge: the verdict of a measurement is the pooled one (given here), a single
    change still keeps its calibration-batch outputs (the first-order prediction composes them), and the
    calibrator's bands observe the pooled share."""
    from luminal_num.error.calibrate import BandKind
    from luminal_num.error.judge import Judge
    from luminal_num.error.predict import Prediction
    from luminal_num.error.share import Share
    from luminal_num.error.verdict import Verdict, VerdictSource, program_key
    from luminal_num.search.recipes import BF16_WEIGHTS, pick
    _, model = tiny
    job = _job(model, minimum=16)
    space = SearchSpace.build(job.graph)
    seen = []

    class Given:
        def verdict(self, program, genome):
            seen.append(genome)
            share = 0.25 * len(seen)
            return Verdict(True, VerdictSource.MEASURED, Share(share, share, share), 0.0, None, "given")
    budget = Budget.parse(job.default_budget)
    judge = Judge(job.graph, budget, job.calibration, positions=Given())
    assert judge.ev.checker.pooled  # its predictions pool the batches' rows too (predict.ShareCheck)
    fp32 = judge.judge(space.program(frozenset()), frozenset(), predict=False)
    assert fp32.reason == "given" and fp32.share.gate == 0.25 and seen == [frozenset()]
    base = program_key(space.program(frozenset()))
    single = next(g for g in (frozenset([(site, k.cls, t)]) for site, ks in space.knobs.items() for k in ks
                              for t in k.tags) if program_key(space.program(g)) != base)
    v = judge.judge(space.program(single), single, predict=False)
    assert v.reason == "given" and v.share.gate == 0.5 and seen[-1] == single
    assert judge.measured == 2 and next(iter(single)) in judge.first_order.deltas.deltas
    bf16 = pick(space, BF16_WEIGHTS.__contains__)  # a prediction the next measurement checks: against the pooled share
    program = space.program(bf16)
    judge.calibrator.expect(BandKind.FIRST_ORDER, program_key(program), Prediction(Share(0.1, 0.1, 0.1), "p"))
    assert judge.judge(program, bf16, predict=False).share.gate == 0.75
    assert judge.calibrator.band(BandKind.FIRST_ORDER).observed == [(0.1, 0.75)]


def test_the_program_key_tells_programs_apart_and_not_lowerings(tiny):
    from luminal_num.error.verdict import program_key as program_digest
    from luminal_num.search.recipes import BF16_WEIGHTS, pick
    _, model = tiny
    job = _job(model, minimum=16)
    space = SearchSpace.saturated(job.graph, partition(job.graph))
    fp32, bf16 = frozenset(), pick(space, BF16_WEIGHTS.__contains__)
    assert program_digest(space.program(fp32)) == program_digest(space.program(fp32))
    assert program_digest(space.program(fp32)) != program_digest(space.program(bf16))


@pytest.mark.slow
def test_when_the_positions_reject_every_plan_the_budget_is_unreachable(tiny):
    _, model = tiny
    job = _job(model, minimum=16)
    skewed = _Skewed(job.llm.positions, bad=99)
    with pytest.raises(BudgetUnreachable) as caught:
        compile(job.graph, Budget.parse(job.default_budget), "h200", job.calibration, _options(), positions=skewed)
    result = caught.value.result
    rejected = _rejected_on_positions(result)
    assert rejected and result.chosen is None and result.stats.positions.judged == skewed.passes
    assert result.stats.positions.skipped == "no plan passed"


def test_cli_text_calibration_and_positions_option(tiny, capsys):
    root, model = tiny
    args = ["compile", "--model", str(model), "--workload", "decode:2@16", "--candidates", "1", "--quiet",
            "--calibration", str(root / "mine.txt")]
    assert main([*args, "--positions", "40", "--out", str(root / "on")]) == EXIT_OK
    out = capsys.readouterr().out
    assert "chosen plan on 48 teacher-forced positions (pooled" in out
    record = json.loads((root / "on" / "plan.json").read_text())["search"]["positions"]
    assert record["positions"] == 48 and set(record["metrics"]) == {"kl_logits", "kl_p99", "kl_max",
                                                                     "top1_agreement", "ppl_ratio"}


@pytest.mark.slow
def test_a_budget_row_statistics_cannot_judge_skips_the_stage_and_says_why(tiny):
    _, model = tiny
    job = _job(model, minimum=16)
    result = compile(job.graph, Budget.parse("atol=inf,rtol=inf,outputs=logits,cosine>=0.9"), "h200",
                     job.calibration, _options(), positions=job.llm.positions)
    record = result.search.stats.positions
    assert record.judged == 0 and "cosine is not a row metric" in record.skipped
    assert "teacher-forced" not in result.plan.verdict.reason


@pytest.mark.parametrize("minimum", [40, 512])  # 3 windows (one short group of 32 rows), 32 windows (one full group)
def test_gptq_hessians_come_from_every_teacher_forced_position(tiny, minimum):
    """A compile offered GPTQ on an LLM with positions takes each weight's Hessian over every position (32 rows a
    step), each position once: equal to X^T X over the same rows recomputed here from the FP64 node values;
    the same inputs give the same bytes, and the 6 calibration rows' Hessians are not what it uses."""
    from luminal_num.compiler import reference_stage
    from hessian_truth import independent_hessians
    _, model = tiny
    job = _job(model, minimum)
    space = SearchSpace.build(job.graph, calibrated=True)
    got = reference_stage(job.graph, job.calibration, space, job.llm.positions).hessians
    wide = job.llm.positions.widened(POSITION_ROWS)
    batches = list(wide.batches())
    truth = independent_hessians(wide.graph, [b.inputs for b in batches], [b.rows for b in batches], POSITION_ROWS)
    assert truth and set(truth) == {n for n, w in job.graph.weights.items() if got.of(w) is not None}
    for name, h in truth.items():
        mine = got.of(job.graph.weights[name])
        assert mine.rows == job.llm.positions.positions  # 48 or 512: each position once
        np.testing.assert_allclose(mine.sum_xx, h, rtol=1e-12, atol=1e-12 * np.abs(h).max())
    again = reference_stage(job.graph, job.calibration, space, job.llm.positions).hessians
    assert all(again.by_weight[k].sum_xx.tobytes() == h.sum_xx.tobytes() for k, h in got.by_weight.items())
    batch_only = reference_stage(job.graph, job.calibration, space).hessians
    assert all(h.rows == sum(len(b["ids"]) for b in job.calibration) for h in batch_only.by_weight.values())


def test_the_memory_plan_leaves_room_for_the_positions_and_they_give_it_back(tiny, monkeypatch):
    """The wider step is built before the search's caches are sized, and their FP64 passes' most (held_bytes)
    is reserved there; after the positions stage the source holds no FP64 pass."""
    from luminal_num.memory import MemoryPlan
    _, model = tiny
    job = _job(model, minimum=16)
    source = job.llm.positions
    seen = []
    fit = MemoryPlan.fit

    def recording(self, stage, growing=0):
        seen.append((stage, growing, "fp64" in source._made))
        return fit(self, stage, growing)
    monkeypatch.setattr(MemoryPlan, "fit", recording)
    compile(job.graph, Budget.parse(job.default_budget), "h200", job.calibration, _options(), positions=source)
    (search,) = [s for s in seen if s[0] == "search"]
    assert search[1] >= source.held_bytes > 0 and not search[2]  # reserved before any pass held one
    assert "fp64" not in source._made  # released by the positions stage
