"""Allocating an error budget across chunks (layers): which choice each chunk takes so that the latency
gained is largest while the composed predicted error stays within the budget.

Each chunk has options (its current choice is the implicit option 0: no gain, no error); an option has
a latency gain and an error share, both measured with that chunk changed alone. This is a
multiple-choice knapsack. Two solvers on the same inputs:

- `allocate_greedy`: upgrades in order of gain per unit of error, each kept when the whole stays
  feasible (what the search did before; fast, but it can fill the budget with small cheap steps and
  then have no room for one large step that gains more).
- `allocate_lagrangian`: Lagrangian relaxation. For a price lambda on error each chunk independently
  takes argmax(gain - lambda * error); bisection on lambda finds the cheapest price whose selection is
  feasible and the dearest whose selection is not. The feasible one is filled (best feasible upgrade
  first), the infeasible one repaired (the downgrade that restores feasibility losing least gain, else
  the one losing least gain per unit of error freed) and filled; the better of the two stands.

Feasibility is `total(selection) <= budget`: by default the sum of the options' error shares (first-order
additivity); the search passes the composition of the chunks' measured effects instead. `dual_bound`
is the Lagrangian dual, an upper bound on the best gain under the additive model (tests check it).
`allocate` runs both solvers and returns the better, saying which won.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

NONE = -1  # a chunk keeps its current choice
BISECTIONS = 60


@dataclass(frozen=True)
class Option:
    gain: float   # latency saved when this chunk alone takes the option (s)
    error: float  # the share of the budget it adds, measured with this chunk alone changed


Selection = tuple[int, ...]  # per chunk: the index of its chosen option, or NONE
Total = Callable[[Selection], float]


@dataclass(frozen=True)
class Allocation:
    selection: Selection
    gain: float       # sum of the chosen options' gains
    total: float      # the composed predicted error of the selection
    method: str       # "lagrangian" | "greedy"
    lam: float = float("nan")  # the price on error the Lagrangian selection was read at
    greedy_gain: float = float("nan")
    lagrangian_gain: float = float("nan")


def _check(options: Sequence[Sequence[Option]]) -> None:
    for i, opts in enumerate(options):
        for o in opts:
            if not (o.gain == o.gain and o.error == o.error) or o.error < 0:
                raise ValueError(f"chunk {i}: an option needs a finite gain and an error >= 0, got {o}")


def additive(options: Sequence[Sequence[Option]], base: float = 0.0) -> Total:
    """First-order composition: the chosen options' error shares add up (on top of `base`)."""
    return lambda sel: base + sum(options[i][j].error for i, j in enumerate(sel) if j != NONE)


def gain_of(options: Sequence[Sequence[Option]], sel: Selection) -> float:
    return sum(options[i][j].gain for i, j in enumerate(sel) if j != NONE)


class _Memo:
    """`total` is the expensive part (a composition of chunk effects): each selection once."""

    def __init__(self, total: Total):
        self.total, self.seen = total, {}

    def __call__(self, sel: Selection) -> float:
        if sel not in self.seen:
            self.seen[sel] = float(self.total(sel))
        return self.seen[sel]


def allocate_greedy(options: Sequence[Sequence[Option]], budget: float, total: Total | None = None) -> Allocation:
    """Upgrades by gain per unit of error (highest first); one is kept when it gains over the chunk's
    current choice and the whole stays within `budget`."""
    _check(options)
    total = _Memo(total or additive(options))
    sel = [NONE] * len(options)
    steps = sorted(((o.gain / max(o.error, 1e-300), -o.error, i, j) for i, opts in enumerate(options)
                    for j, o in enumerate(opts) if o.gain > 0), key=lambda s: (-s[0], -s[1], s[2], s[3]))
    for _, _, i, j in steps:
        now = options[i][sel[i]].gain if sel[i] != NONE else 0.0
        if options[i][j].gain <= now:
            continue
        trial = tuple(sel[:i] + [j] + sel[i + 1:])
        if total(trial) <= budget:
            sel = list(trial)
    out = tuple(sel)
    return Allocation(out, gain_of(options, out), total(out), "greedy")


def _priced(options: Sequence[Sequence[Option]], lam: float) -> Selection:
    """Each chunk's argmax of gain - lam * error (NONE scores 0; ties go to the smaller error)."""
    sel = []
    for opts in options:
        best, pick = (0.0, 0.0), NONE
        for j, o in enumerate(opts):
            score = (o.gain - lam * o.error, -o.error)
            if score > best:
                best, pick = score, j
        sel.append(pick)
    return tuple(sel)


def dual_bound(options: Sequence[Sequence[Option]], budget: float, lam: float) -> float:
    """The Lagrangian dual at `lam` >= 0: an upper bound on the best gain under the additive model."""
    return lam * budget + sum(max([0.0] + [o.gain - lam * o.error for o in opts]) for opts in options)


def _fill(options, sel: Selection, budget: float, total: _Memo) -> Selection:
    """Take the feasible upgrade that gains most, until none is left."""
    sel = list(sel)
    while True:
        best = None
        for i, opts in enumerate(options):
            now = opts[sel[i]].gain if sel[i] != NONE else 0.0
            for j, o in enumerate(opts):
                if o.gain > now and (best is None or o.gain - now > best[0]):
                    trial = tuple(sel[:i] + [j] + sel[i + 1:])
                    if total(trial) <= budget:
                        best = (o.gain - now, trial)
        if best is None:
            return tuple(sel)
        sel = list(best[1])


def _repair(options, sel: Selection, budget: float, total: _Memo) -> Selection:
    """Downgrade until feasible: a downgrade that restores feasibility losing least gain when there is
    one, else the one losing least gain per unit of error freed."""
    sel = list(sel)
    while total(tuple(sel)) > budget:
        moves = []
        for i, j in enumerate(sel):
            if j == NONE:
                continue
            for k in [NONE] + [k for k, o in enumerate(options[i]) if o.error < options[i][j].error]:
                trial = tuple(sel[:i] + [k] + sel[i + 1:])
                lost = options[i][j].gain - (options[i][k].gain if k != NONE else 0.0)
                freed = options[i][j].error - (options[i][k].error if k != NONE else 0.0)
                moves.append((total(trial) > budget, lost if total(trial) <= budget else lost / max(freed, 1e-300),
                              i, k, trial))
        if not moves:
            break
        sel = list(min(moves, key=lambda m: m[:4])[4])
    return tuple(sel)


def allocate_lagrangian(options: Sequence[Sequence[Option]], budget: float, total: Total | None = None) -> Allocation:
    _check(options)
    total = _Memo(total or additive(options))
    n = len(options)
    hi = max([o.gain / o.error for opts in options for o in opts if o.error > 0 and o.gain > 0] + [1.0]) * 2.0
    lo = 0.0
    if total(_priced(options, lo)) <= budget:  # everything fits: no price needed
        hi = lo
    else:
        for _ in range(BISECTIONS):
            mid = 0.5 * (lo + hi)
            if total(_priced(options, mid)) <= budget:
                hi = mid
            else:
                lo = mid
    feasible = _priced(options, hi)
    if total(feasible) > budget:  # even the highest price selects something infeasible: repair it too
        feasible = _repair(options, feasible, budget, total)
    tries = [_fill(options, feasible, budget, total)]
    if hi > 0:
        tries.append(_fill(options, _repair(options, _priced(options, lo), budget, total), budget, total))
    ok = [s for s in tries if total(s) <= budget] or [(NONE,) * n]
    best = max(ok, key=lambda s: (gain_of(options, s), -total(s)))
    return Allocation(best, gain_of(options, best), total(best), "lagrangian", hi)


def allocate(options: Sequence[Sequence[Option]], budget: float, total: Total | None = None) -> Allocation:
    """Both solvers on the same inputs; the one with the larger gain (the Lagrangian on a tie)."""
    total = _Memo(total or additive(options))
    lag = allocate_lagrangian(options, budget, total)
    greedy = allocate_greedy(options, budget, total)
    win = lag if lag.gain >= greedy.gain else greedy
    return Allocation(win.selection, win.gain, win.total, win.method, lag.lam, greedy.gain, lag.gain)


def apply(selection: Selection, extras: Sequence[Sequence[frozenset]], base: frozenset,
          sites: Callable[[tuple], tuple]) -> frozenset:
    """`base` with each chunk's chosen extra changes replacing what it set on the same sites."""
    chosen = [extras[i][j] for i, j in enumerate(selection) if j != NONE]
    over = {sites(ch) for extra in chosen for ch in extra}
    return frozenset([ch for ch in base if sites(ch) not in over] + [ch for extra in chosen for ch in extra])

