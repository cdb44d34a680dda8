"""Predicted shares and the bands that say when a prediction may decide.

A prediction is the budget checked on predicted outputs (`ShareCheck`): the first-order sum of measured
single changes (`FirstOrderDeltas`: each precision change measured alone end to end leaves its output error
vector d_c = y_c - y_FP64 per calibration batch; rounding errors of different ops enter the outputs
linearly to first order, so a genome's outputs are y_FP64 + sum_c d_c) or a per-chunk composition
(error/chunks.py). A prediction decides only outside its `Band` [1/margin, margin] around the budget;
inside it the candidate is measured, and every measurement of a predicted candidate checks the band: a
ratio outside it widens the margin (reported). The bands are owned by the calibrator (error/calibrate.py).
"""
from __future__ import annotations

import functools

from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

import numpy as np

from ..hlir.store import keyed

from .budget import Budget, BudgetVerdict
from .metric_values import MetricValues
from .metrics import METRICS, Compared, allclose_of
from .share import RESOLVED, Share

Change = tuple  # one precision change: (group key or one chunk of a group (search.space.ChunkSite), e-class, tag)
Outputs = Mapping[str, np.ndarray]

WIDEN = 1.25  # a mismatch sets the margin to the observed ratio times this
MIN_MARGIN = 1.3  # the band never gets narrower than this
SETTLE = 5        # observations before the band is set from the observed accuracy


def budget_ratio(budget: Budget, verdict: BudgetVerdict) -> float:
    """How much of the budget a result uses, over allclose and every metric (<= 1 passes; the ratio a
    budget tightened by h would need to be <= h): metric distance from perfect / the limit's distance."""
    worst = verdict.worst_allclose
    limits = {m.name: m.limit for m in budget.metrics}
    for out in verdict.outputs:
        for name, value in out.metric_values:
            worst = max(worst, METRICS[name].share(value, limits[name]))
    return float(worst)


@dataclass(frozen=True)
class Prediction:
    share: Share  # of the predicted outputs (max over batches)
    reason: str
    metrics: MetricValues = field(default=MetricValues(), kw_only=True)  # of the predicted outputs (worst over batches)

    @property
    def ratio(self) -> float:
        """The gate share over every metric: what a band compares with a measurement."""
        return self.share.gate


@dataclass(frozen=True)
class ShareCheck:
    """The gate (and the user's budget, for its allclose share) checked on predicted outputs. `pooled`: the
    batches' rows are judged together, as one batch (an LLM whose measurements pool thousands of teacher-forced
    positions: a prediction then estimates the same pooled statistic, where the worst batch of 8 rows would
    count one flipped token as top-1 0.875, 3x the share it is over 24 rows)."""
    gate: Budget
    budget: Budget
    refs: Sequence[Outputs]
    pooled: bool = False

    @functools.cached_property
    def _pooled_refs(self) -> tuple[Outputs, ...]:
        """Keyed as the batches' references are: what metrics derive from a reference alone (its log-softmax
        rows) is then made once, not at every prediction checked against it."""
        return ({n: keyed(v) for n, v in _rows_together(self.refs, self.compared).items()},)

    @property
    def compared(self) -> tuple[str, ...]:
        """The outputs the budget compares (a predicted batch needs only these)."""
        return tuple(self.budget.outputs or (self.refs[0] if self.refs else ()))

    def check(self, predicted: Sequence[Outputs]) -> Prediction:
        """The budget checked on predicted outputs (one dict per calibration batch), every metric."""
        ratio = allclose = user = 0.0
        reason, values = "", MetricValues()
        refs = self.refs
        if self.pooled and len(predicted) > 1:
            predicted, refs = (_rows_together(predicted, self.compared),), self._pooled_refs
        for pred, ref in zip(predicted, refs):
            compared = {n: Compared(pred[n], ref[n]) for n in self.budget.outputs or ref}
            v = self.gate.check(compared, ref)
            r = budget_ratio(self.gate, v)
            if r >= ratio:
                ratio, reason = r, v.reason
            allclose = max(allclose, v.worst_allclose)
            values = values.worse(MetricValues.worst_of([v]))
            # the user's allclose only (its metrics are the gate's, loosened: not needed for the ratio)
            user = max([user] + [allclose_of(c, self.budget.atol, self.budget.rtol) for c in compared.values()])
        if ratio <= 1.0 and not self.gate.allclose_applies:  # a pass: the worst values over the batches
            reason = self.gate.within(values, allclose)
        return Prediction(Share(ratio, allclose, user), reason, metrics=values)


def _rows_together(batches: Sequence[Outputs], names: Sequence[str]) -> Outputs:
    """Every batch's rows of the outputs `names`, stacked into one batch (outputs are (rows, ...) per batch)."""
    return {name: np.concatenate([np.asarray(b[name]) for b in batches]) for name in names}


@dataclass
class FirstOrderDeltas:
    """Measured single changes' output deviations, summed to predict a genome of several changes."""
    checker: ShareCheck
    deltas: dict[Change, tuple[dict[str, np.ndarray], ...]] = field(default_factory=dict)

    def record(self, change: Change, outputs: Sequence[Outputs]) -> None:
        """A single change's measured outputs on every calibration batch: the deviations of the outputs the
        budget compares, no others (an LLM step's KV caches are 16x its logits, and one set is kept per
        single change: 150 MB each on SmolLM2, GBs over a search)."""
        refs, names = self.checker.refs, self.checker.compared
        if len(outputs) != len(refs):
            raise ValueError(f"{len(outputs)} batches of outputs for {len(refs)} references")
        self.deltas[change] = tuple({k: np.asarray(o[k], np.float64) - np.asarray(r[k], np.float64) for k in names}
                                    for o, r in zip(outputs, refs))

    def alias(self, change: Change, measured: Change) -> None:
        """`change` lowers to the same program as `measured`: it has the same deviations."""
        self.deltas.setdefault(change, self.deltas[measured])

    def predict(self, changes: Iterable[Change]) -> Prediction | None:
        """None unless every change has been measured alone."""
        changes = sorted(changes)
        if not changes or any(c not in self.deltas for c in changes):
            return None
        names = self.checker.compared
        return self.checker.check([{k: np.asarray(ref[k], np.float64) + sum(self.deltas[c][b][k] for c in changes)
                                    for k in names} for b, ref in enumerate(self.checker.refs)])


@dataclass
class Band:
    """When a prediction may decide: outside [1/margin, margin] around the budget, after the bias
    correction (centred bands only). Calibrated by the measurements of predicted candidates."""
    margin: float = 2.0
    observed: list[tuple[float, float]] = field(default_factory=list)  # (predicted, measured) ratios
    mismatches: int = 0
    # centred: after SETTLE checks a prediction is first multiplied by the observed bias (the geometric
    # mean of measured / predicted) and the band is WIDEN x the worst ratio around that bias
    centred: bool = False
    bias: float = 1.0

    def decides(self, p: Prediction) -> bool | None:
        """True: passes with margin; False: fails with margin; None: too close to call (measure it)."""
        r = p.ratio * self.bias
        if r > self.margin:
            return False
        if r * self.margin < 1.0:
            return True
        return None

    def expected(self, p: Prediction) -> float:
        """The prediction corrected by the observed bias: the best single guess of the measurement."""
        return p.ratio * self.bias

    def observe(self, predicted: float, measured: float) -> None:
        """Check the composition against a measurement: a ratio outside the band is a mismatch and widens
        it; after SETTLE checks the band is WIDEN x the worst observed ratio (at least MIN_MARGIN). Only
        candidates that are returned or on the front must be right, and those are all measured."""
        if not (predicted >= RESOLVED and measured >= RESOLVED):
            return  # a zero or subnormal share has no ratio to check (its value is rounding noise)
        self.observed.append((predicted, measured))
        if np.isfinite(predicted) and np.isfinite(measured):
            e = predicted * self.bias  # what the band expected
            q = max(measured / e, e / measured)
            if q > self.margin:
                self.mismatches += 1
                self.margin = q * WIDEN
        logs = np.array([np.log(m / p) for p, m in self.observed
                         if p > 0 and m > 0 and np.isfinite(p) and np.isfinite(m)])
        if len(logs) >= SETTLE:
            centre = float(np.mean(logs)) if self.centred else 0.0
            self.bias = float(np.exp(centre))
            self.margin = max(MIN_MARGIN, WIDEN * float(np.exp(np.max(np.abs(logs - centre)))))
