"""Row metrics pooled over many batches: an LLM judged on thousands of teacher-forced positions.

Why: a decode step of 8 sequences gives 8 rows; top-1 agreement over 24 rows moves by 1/24 with one
flipped token. llama.cpp's `llama-perplexity --kl-divergence` judges a quantization over thousands of
tokens. Here each batch's logits are compared with FP64 and reduced to per-row statistics (KL, top-1
agreement, the next token's -log q and -log p), which are kept; the logits are not. Every row metric
(metrics.Metric.rows) is then computed over all rows of all batches together, exactly as if one batch held
them all: KL mean, p99 and max, top-1 rate, perplexity ratio. A budget with allclose on or with a limit on
another metric (max_abs, cosine ...) cannot be judged from row statistics: `refusal` says so in one line.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Iterator, Protocol, Sequence

import numpy as np
from tqdm import tqdm

from ..codegen.llir import Program
from ..hlir.graph import Graph
from ..hlir.weightcache import WEIGHTS
from ..runtime.cpu import CpuRuntime
from .budget import Budget, BudgetVerdict
from .metric_values import MetricValues
from .metrics import METRICS, Compared
from .predict import budget_ratio
from .share import Share
from .verdict import Verdict, VerdictSource


@dataclass(frozen=True)
class RowStats:
    """Per row: KL(FP64 || plan), whether the argmax agrees, -log q(t), -log p(t) of its next token t, and
    max |y - ref| (what the verdict reports as its max_abs; inf on a blown row)."""
    kl: np.ndarray
    top1: np.ndarray
    nll: np.ndarray
    nll_ref: np.ndarray
    max_abs: np.ndarray

    @staticmethod
    def of(compared: Compared, rows: int | None = None) -> "RowStats":
        """The first `rows` rows' statistics (None: every row)."""
        nll, nll_ref = compared.target_nll
        keep = slice(None) if rows is None else slice(0, rows)
        kl = compared.kl_rows
        with np.errstate(invalid="ignore"):
            diff = np.abs(compared.y - compared.ref).reshape(kl.size, -1) if kl.size else np.zeros((0, 1))
        worst = np.where(np.isinf(kl), np.inf, np.nan_to_num(diff, nan=np.inf).max(axis=1))
        return RowStats(kl[keep], compared.top1_agrees[keep], nll[keep], nll_ref[keep], worst[keep])

    @staticmethod
    def concat(parts: Sequence["RowStats"]) -> "RowStats":
        if not parts:
            return RowStats(np.zeros(0), np.zeros(0, bool), np.zeros(0), np.zeros(0), np.zeros(0))
        return RowStats(*(np.concatenate([getattr(p, f.name) for p in parts]) for f in dataclasses.fields(RowStats)))

    @property
    def rows(self) -> int:
        return int(self.kl.size)


class PooledRows(Compared):
    """What the row metrics read of a metrics.Compared, over every row pooled (Budget.check takes it as an
    output's comparison). Only row metrics may read it: anything else fails loudly."""

    def __init__(self, stats: RowStats):  # no logits to compare: the rows' statistics are given
        self.stats = stats
        self.kl_rows, self.top1_agrees = stats.kl, stats.top1
        self.target_nll = (stats.nll, stats.nll_ref)
        self.blown_any = bool(np.isinf(stats.kl).any())  # allclose_of with atol=inf reads only this

    @property
    def pair(self):
        raise TypeError("pooled positions keep row statistics only: no elementwise metric can be computed")


def refusal(budget: Budget, output: str = "logits") -> str | None:
    """Why `budget` cannot be judged from pooled row statistics of `output` (None: it can)."""
    others = [name for name in budget.outputs or () if name != output]
    if budget.outputs is None or others:
        return f"it judges {', '.join(others) or 'every output'}, the positions keep {output} only"
    if budget.allclose_applies and not math.isinf(budget.atol):
        return f"its allclose test (atol={budget.atol!r}) needs every logit, not row statistics"
    other = [m.name for m in budget.metrics if not METRICS[m.name].rows]
    if other:
        verb = "is not a row metric" if len(other) == 1 else "are not row metrics"
        return f"{', '.join(other)} {verb} (row metrics: {', '.join(n for n, m in METRICS.items() if m.rows)})"
    return None


class PositionBatch(Protocol):
    """One step of the workload over real positions: its inputs, the FP64 reference of the source's output
    and each row's next token; only the first `rows` rows are positions (models/llm_positions.py makes them)."""
    inputs: dict[str, np.ndarray]
    reference: np.ndarray  # (batch rows, vocab) FP64 logits
    targets: np.ndarray    # (batch rows,) next tokens
    rows: int


class PositionSource(Protocol):
    """Teacher-forced positions streamed batch by batch (models/llm_positions.py) through `graph`; `widened(n)`
    streams the same positions n rows a step, through the graph rebuilt with n rows."""
    output: str

    @property
    def positions(self) -> int: ...

    @property
    def graph(self) -> Graph: ...

    @property
    def rows(self) -> int: ...  # decode rows per step

    @property
    def held_bytes(self) -> int: ...  # the most it keeps between passes (a compile's memory plan reserves it)

    def widened(self, rows: int) -> "PositionSource": ...

    def release(self) -> None: ...  # drop what it keeps between passes (held_bytes at most)

    def batches(self) -> Iterator[PositionBatch]: ...


class PooledJudge(Protocol):
    """Judges a whole program on teacher-forced positions, pooled (the compile's: compiler.PositionsJudge). With
    one, the judge's every end-to-end measurement is a pass over the positions (error/judge.py EndToEnd)."""

    def verdict(self, program: Program, genome: frozenset) -> Verdict: ...


def batch_stats(y: np.ndarray, batch: PositionBatch) -> RowStats:
    """Row statistics of one batch's output logits against its FP64 reference (its real rows only)."""
    y = np.asarray(y).reshape(batch.reference.shape)
    return RowStats.of(Compared(y, batch.reference, batch.targets), batch.rows)


def check_pooled(budget: Budget, output: str, stats: RowStats) -> BudgetVerdict:
    """The budget's row metrics over the pooled rows (a budget refusal() refuses raises ValueError)."""
    why = refusal(budget, output)
    if why is not None:
        raise ValueError(f"budget {budget} cannot be judged on pooled positions: {why}")
    pooled = PooledRows(stats)
    return budget.check({output: pooled}, {output: pooled})


STEPS_TOGETHER = 4  # steps run kernel by kernel together (CpuRuntime.run_many): a weight form made once for 4


def run_positions(runtime: CpuRuntime, source: PositionSource, steps_together: int = STEPS_TOGETHER,
                  progress: bool = False) -> tuple[RowStats, str | None]:
    """The runtime on every batch of `source`, `steps_together` at a time (fewer: less memory for the steps'
    inputs, more weight forms made again): the rows' statistics, and why a run failed (None: none did; the
    statistics are then those of the batches before the failing one). `progress`: a bar over the positions
    (a pass over SmolLM2's 2,048 takes a minute or more)."""
    if steps_together < 1:
        raise ValueError(f"steps_together must be >= 1, got {steps_together}")
    parts = []
    group: list[PositionBatch] = []
    with tqdm(total=source.positions if progress else None, desc="positions", unit="pos", position=2,
              leave=False, disable=not progress) as bar:
        for batch in source.batches():  # a step's inputs (its KV caches) live only while its group runs
            group.append(batch)
            if len(group) == steps_together:
                failed = _run_group(runtime, source, group, parts)
                bar.update(sum(b.rows for b in group))
                if failed is not None:
                    return RowStats.concat(parts), failed
                group = []
        failed = _run_group(runtime, source, group, parts) if group else None
    return RowStats.concat(parts), failed


def _run_group(runtime: CpuRuntime, source: PositionSource, group: Sequence[PositionBatch], parts: list) -> str | None:
    """Run the group's steps together (one by one when one fails: the batches before it count, as alone)."""
    try:
        with WEIGHTS.scanning():  # whole-model runs (hlir/weightcache.py)
            outs = [r.outputs[source.output] for r in runtime.run_many([b.inputs for b in group])]
    except (ValueError, FloatingPointError):  # e.g. a REJECT overflow policy: find the step, as run alone
        for batch in group:
            try:
                with WEIGHTS.scanning():
                    out = runtime.run(batch.inputs).outputs[source.output]
            except (ValueError, FloatingPointError) as exc:
                return str(exc)
            parts.append(batch_stats(out, batch))
        return None
    parts.extend(batch_stats(out, batch) for out, batch in zip(outs, group))
    return None


def judge_positions(program: Program, weights, source: PositionSource, gate: Budget, budget: Budget,
                    steps_together: int = STEPS_TOGETHER, progress: bool = False) -> tuple[Verdict, RowStats]:
    """The program run on every batch of `source` and judged against `gate` on all rows pooled; the verdict
    also carries its share of the user's `budget` (a run that fails is a rejection, as end to end)."""
    stats, failed = run_positions(CpuRuntime(program, weights), source, steps_together, progress)
    if failed is not None:
        return Verdict(False, VerdictSource.MEASURED, Share(np.inf, np.inf, np.inf), np.inf, None,
                       f"run failed on the pooled positions: {failed}"), stats
    verdict = check_pooled(gate, source.output, stats)
    ratio = budget_ratio(gate, verdict)
    on = f" on {stats.rows} teacher-forced positions"
    return Verdict(verdict.passed, VerdictSource.MEASURED, Share(ratio, verdict.worst_allclose,
                                                                  check_pooled(budget, source.output, stats).worst_allclose),
                   float(stats.max_abs.max()) if stats.rows else 0.0, None, verdict.reason + on,
                   metrics=MetricValues.worst_of([verdict])), stats
