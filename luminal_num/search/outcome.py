"""What a search returns (SearchResult, with its SearchStats) and what it needs of the numerics gate (Gate)."""
from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Callable, Mapping, Protocol

from ..codegen.llir import Program
from ..error.headroom import HeadroomEstimate
from ..error.judge import JudgeSummary
from ..error.verdict import Verdict
from .front import Evaluated


class Gate(Protocol):
    """What the search needs of the numerics gate (error/judge.py Judge), and nothing else."""

    def judge(self, program: Program | Callable[[], Program], changes: frozenset = frozenset(), candidates=None,
              predict: bool = True, tentative: bool = True) -> Verdict: ...
    def confirm(self, program: Program, changes: frozenset = frozenset(), candidates=None) -> Verdict: ...
    def note_isolated(self, change: tuple, verdict: Verdict) -> None: ...
    def rebiased(self, verdict: Verdict) -> Verdict: ...
    def composed_share(self, choices) -> float: ...
    def has_outputs(self, program: Program) -> bool: ...
    def summary(self) -> JudgeSummary: ...
    @property
    def per_chunk(self) -> bool: ...
    @property
    def measured(self) -> int: ...
    @property
    def latency_bindings(self) -> Mapping[str, int]: ...


@dataclass(frozen=True)
class SearchStats:
    """What a search did: candidates judged, wall time, the gate's verdict counts and calibration figures, the
    baselines' sources, the per-layer allocation's figures, whether Ctrl-C stopped it, and the headroom
    (compile's plan stage adds it)."""
    candidates: int
    seconds: float
    judge: JudgeSummary
    baseline_sources: Mapping[str, str]
    allocation: Mapping[str, float | int | str]
    interrupted: bool = False
    headroom: HeadroomEstimate | None = None
    positions: PositionsRecord | None = None  # the chosen plan judged on pooled teacher-forced positions
    # baselines the space could not offer as they are named (recipes.baselines), each with its one-line reason
    refused_baselines: Mapping[str, str] = MappingProxyType({})

    @property
    def gate(self):
        return self.judge.gate

    @property
    def headroom_share(self) -> float:
        """The share of the budget a plan could use on the calibration set (1 when none was chosen)."""
        return self.headroom.headroom if self.headroom is not None else 1.0

    def record(self, with_seconds: bool = True) -> dict:
        """As plan.json's `search` record (without wall-clock seconds: the same seed gives the same bytes)."""
        out = {"candidates": self.candidates, **self.judge.record(), "baseline_sources": dict(self.baseline_sources),
               **self.allocation}
        if with_seconds:
            out["seconds"] = self.seconds
        if self.interrupted:
            out["interrupted"] = True
        if self.headroom is not None:
            out.update(self.headroom.as_dict())
        if self.positions is not None:
            out["positions"] = self.positions.as_dict()
        if self.refused_baselines:
            out["refused_baselines"] = dict(self.refused_baselines)
        return out


@dataclass(frozen=True)
class PositionsRecord:
    """The positions stage: how many teacher-forced positions the chosen plan was judged on (pooled), how
    many plans were judged there, and every row metric of the chosen plan over them (llama-perplexity's
    KL mean / p99 / max, same-top-1 rate, perplexity ratio), or why the stage did not judge."""
    positions: int
    judged: int
    metrics: Mapping[str, float]
    skipped: str = ""
    rows: int = 0  # decode rows per run the positions ran at (the workload's, or wider: compiler.POSITION_ROWS)

    def as_dict(self) -> dict:
        out = {"positions": self.positions, "judged": self.judged, "rows": self.rows,
               "metrics": {k: repr(float(v)) for k, v in sorted(self.metrics.items())}}
        if self.skipped:
            out["skipped"] = self.skipped
        return out


@dataclass(frozen=True)
class SearchResult:
    evaluated: list[Evaluated]
    baselines: dict[str, Evaluated]
    chosen: Evaluated | None
    stats: SearchStats

    def passing(self) -> list[Evaluated]:
        return [e for e in self.evaluated if e.verdict.passed and e.latency is not None]


@dataclass(frozen=True)
class InvariancePrice:
    """What batch invariance costs the chosen genome (issue 37): its latency as the invariant plan runs it
    next to the same genome lowered without invariance, on the plan's target and by the same method."""
    target: str
    source: str           # "modelled" or "measured"
    invariant_s: float
    plain_s: float

    @property
    def ratio(self) -> float:
        return self.invariant_s / self.plain_s if self.plain_s > 0 else float("inf")

    def describe(self) -> str:
        return (f"price of batch invariance: {self.invariant_s * 1e6:.1f} us invariant vs {self.plain_s * 1e6:.1f} us "
                f"for the same genome without it (x{self.ratio:.2f}, {self.source} on {self.target})")
