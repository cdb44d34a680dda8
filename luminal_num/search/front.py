"""The evaluated candidates, their epsilon-Pareto front (latency, share of the budget) and the choice.

Every member of the front and the chosen plan is confirmed end to end (search.confirm_finalists), so ties
are merged where the data cannot rank plans: latencies within the cost model's resolution, shares within
the spread between calibration splits (the headroom's floor). A plan already measured stands for a
predicted one it ties with.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from ..codegen.llir import Program
from ..error.headroom import FLOOR as HEADROOM_FLOOR
from ..error.verdict import PREDICTED_SOURCES, Verdict
from ..runtime.cost import Latency
from .space import Genome


class Stage(enum.StrEnum):
    """Which step of the search proposed a candidate (its text is the reports' `stage` column)."""
    BASELINE = "baseline"        # a peer recipe (FP32, TF32, autocast, weight-only)
    UNIFORM = "uniform"          # one Gemm variant on every Gemm
    SENSITIVITY = "sensitivity"  # one change alone
    GREEDY = "greedy"            # changes added by gain per unit of error
    CROSSOVER = "crossover"      # a passing peer recipe with the fastest plan's changes on the knobs it leaves
    LAYER = "layer"              # per-layer overrides and allocations
    MUTATION = "mutation"        # random changes to a front member


@dataclass(frozen=True)
class Evaluated:
    id: int
    genome: Genome
    verdict: Verdict
    latency: Latency | None   # None when the gate rejected it (latency is never spent on those)
    label: str = ""
    stage: Stage | None = None
    program: Program | None = field(default=None, repr=False, compare=False)  # what was judged (lowered once)
    # end-to-end measurements this candidate cost (its own and its confirmation's); 0 when a cache hit
    # (the same program measured for another genome), the static bound, its chunks or a prediction decided
    end_to_end_runs: int = 0

    @property
    def latency_s(self) -> float:
        return self.latency.total_s if self.latency is not None else float("nan")


def front(evaluated: list[Evaluated]) -> list[Evaluated]:
    """The (latency, budget share) Pareto front of the passing candidates, ties merged (an epsilon-Pareto
    front, Laumanns et al. 2002): the chosen plan first, then one point per FRONT_TIE bucket of latency,
    kept only when its share is below every faster point's by more than ERROR_TIE. Every member is
    confirmed end to end, so a point that buys nothing measurable would cost a run (and, measured a
    little above its prediction, expose the next such point: a cascade of confirmations)."""
    passing = sorted((e for e in evaluated if e.verdict.passed and e.latency is not None),
                     key=lambda e: (e.latency_s, share(e), e.id))
    chosen = choose(passing)
    if chosen is None:
        return []
    buckets: list[list[Evaluated]] = []
    for e in passing:
        if e.latency_s <= chosen.latency_s * (1 + LATENCY_TIE):
            continue  # choose()'s tie: the chosen plan stands for it
        if buckets and e.latency_s <= buckets[-1][0].latency_s * (1 + FRONT_TIE):
            buckets[-1].append(e)
        else:
            buckets.append([e])
    out, best_err = [chosen], share(chosen)
    for b in buckets:
        pick = _tie_pick(b)
        if share(pick) * ERROR_TIE < best_err:
            out.append(pick)
            best_err = share(pick)
    return out


def reported_front(evaluated: list[Evaluated], interrupted: bool) -> list[Evaluated]:
    """The front reports show. An interrupted search confirms nothing more and chooses among measured and
    certified verdicts only (search.confirm), so its front does too: a predicted plan could otherwise
    stand on it dominating the chosen one."""
    if interrupted:
        evaluated = [e for e in evaluated if e.verdict.source not in PREDICTED_SOURCES]
    return front(evaluated)


def share(e: Evaluated) -> float:
    """The share of the gate a candidate uses over every metric (allclose alone when not recorded)."""
    return e.verdict.share.rank()


LATENCY_TIE = 1e-3  # relative: latencies this close are a tie for the chosen plan, broken by lower error
# the front's latency buckets beyond the chosen plan: a point under 1% faster than a more accurate one
# buys nothing the cost model resolves
FRONT_TIE = 1e-2
# shares within this factor are a tie: the headroom's floor, the least spread between calibration splits
# the gate assumes (MiniLM measures 1.29 at the 90% quantile): the data cannot rank plans closer than that
ERROR_TIE = HEADROOM_FLOOR


def choose(passing: list[Evaluated]) -> Evaluated | None:
    """The fastest passing candidate; among those within LATENCY_TIE of it, the most accurate (up to
    ERROR_TIE, where one already measured end to end is preferred: it needs no confirmation)."""
    if not passing:
        return None
    fastest = min(e.latency_s for e in passing)
    return _tie_pick([e for e in passing if e.latency_s <= fastest * (1 + LATENCY_TIE)])


def _tie_pick(tied: list[Evaluated]) -> Evaluated:
    """Among candidates of one latency tie: those within ERROR_TIE of the most accurate, measured ones
    first, then by _choice_key."""
    best = min(share(e) for e in tied)
    near = [e for e in tied if share(e) <= best * ERROR_TIE]
    return min(near, key=lambda e: (e.verdict.source in PREDICTED_SOURCES, *_choice_key(e)))


def _choice_key(e: Evaluated) -> tuple:
    """Among tied latencies: the most accurate (share of the budget over every metric), then the fewest changes."""
    return (share(e), len(e.genome), e.latency_s, e.id)
