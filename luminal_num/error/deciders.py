"""The judge's deciders, cheapest first: each `decide(candidate)` returns a Verdict or None (pass it on).

known program -> pruned change -> static bound -> per-chunk composition (SCALED, then EXACT inside SCALED's
band) -> lowering (a known program again) -> first-order sum of single changes -> measurement (a stored
one, else end to end). Deciders count what they decide in one shared Counter; the bands they decide by
and the predictions measurements check belong to the calibrator (error/calibrate.py).
"""
from __future__ import annotations

import functools

import enum
from collections import Counter
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..codegen.llir import Program
from ..hlir.graph import Graph
from .budget import Budget
from .calibrate import BandKind, Calibrator, Observation
from .chunks import ChunkEffects
from .interval import Interval
from .predict import Change, FirstOrderDeltas, Prediction, ShareCheck
from .share import Share
from .metrics import METRICS
from .static import static_bound
from .static_metrics import metric_bound
from .verdict import Verdict, VerdictSource, program_key


class Count(enum.StrEnum):
    """What the gate counts (the names plan.json's `search` statistics use)."""
    CACHE = "cache"          # decided by a known program, a stored measurement or a pruned change
    STATIC = "static"
    MEASURED = "measured"    # end-to-end measurements
    PRUNED = "pruned"
    CHUNKS = "chunks"        # decided by the composed per-chunk effects (each chunk judged alone on FP64 inputs)
    PREDICTED = "predicted"  # decided by the first-order composition of measured single changes
    CONFIRMED = "confirmed"  # predicted verdicts re-measured end to end (front and chosen plan)
    STORED = "stored"        # verdicts read from the on-disk cache (counted among the cache's verdicts)
    TENTATIVE = "tentative"  # chunk verdicts inside the band that pass on the bias-corrected estimate
    DEFERRED = "deferred"    # chunk verdicts inside the band that fail on it: tentative rejects
    EXACT = "exact"          # chunk verdicts from the exact composition (SCALED inside its band)
    DEFERRED_MEASURED = "deferred_measured"  # tentative rejects measured end to end because they would be chosen


@dataclass(frozen=True)
class Evidence:
    """What every decider judges against: the FP64 truth of the calibration batches and both budgets."""
    graph: Graph
    budget: Budget                 # the user's
    gate: Budget                   # the user's with the headroom's share of every allowance
    calibration: tuple             # input batches
    refs: tuple                    # FP64 outputs per batch
    gated_refs: tuple              # the outputs the gate names, per batch (what compositions predict)
    bindings: tuple                # dynamic dimension bindings per batch
    pooled: bool = False           # measurements pool rows (teacher-forced positions): so do predictions

    @functools.cached_property
    def checker(self) -> ShareCheck:
        return ShareCheck(self.gate, self.budget, self.refs, self.pooled)


class Candidate:
    """One candidate as the judge sees it: its program (lowered on demand, once: a candidate its chunks
    reject never is), the changes it makes to the FP32 baseline, its chunk choices (None: none given)."""

    def __init__(self, program: Program | Callable[[], Program], changes: frozenset, choices=None,
                 predict: bool = True, tentative: bool = True):
        self._program = program if isinstance(program, Program) else None
        self._lower = None if isinstance(program, Program) else program
        self._key = None
        self.changes, self.choices = changes, choices
        self.predict, self.tentative = predict, tentative  # whether predictions / tentative verdicts may decide

    @property
    def lowered(self) -> bool:
        return self._program is not None

    @property
    def program(self) -> Program:
        if self._program is None:
            self._program = self._lower()
        return self._program

    @property
    def key(self) -> str:
        if self._key is None:
            self._key = program_key(self.program)
        return self._key


class KnownPrograms:
    """A program judged before keeps its verdict (decides only for a lowered candidate)."""

    def __init__(self, counts: Counter, deltas: FirstOrderDeltas | None):
        self.counts, self.deltas = counts, deltas
        self.verdicts: dict[str, Verdict] = {}
        self.single_of: dict[str, Change] = {}  # program key -> the single change whose deviations it holds

    def decide(self, c: Candidate) -> Verdict | None:
        if not c.lowered or c.key not in self.verdicts:
            return None
        self.counts[Count.CACHE] += 1
        src = self.single_of.get(c.key)
        if len(c.changes) == 1 and src is not None:  # the same program as a measured single change
            self.deltas.alias(next(iter(c.changes)), src)
        return self.verdicts[c.key]

    def lowered(self, c: Candidate) -> Verdict | None:
        """Lower the candidate now; a known program's verdict then decides."""
        c.program
        return self.decide(c)


class Lowering:
    """Lower the candidate (nothing cheaper decided it): a known program's verdict then decides."""

    def __init__(self, known: KnownPrograms):
        self.known = known

    def decide(self, c: Candidate) -> Verdict | None:
        return self.known.lowered(c)


class PrunedChanges:
    """A change whose isolated error breaks the budget rules out every candidate containing it."""

    def __init__(self, counts: Counter):
        self.counts = counts
        self.bad: dict[Change, str] = {}

    def note_isolated(self, change: Change, verdict: Verdict) -> None:
        """A tentative reject does not prune: it failed on an estimate inside the band, not by the margin."""
        if not verdict.passed and not verdict.tentative:
            self.bad[change] = verdict.reason

    def decide(self, c: Candidate) -> Verdict | None:
        bad = sorted(ch for ch in c.changes if ch in self.bad)
        if not bad:
            return None
        self.counts[Count.CACHE] += 1
        self.counts[Count.PRUNED] += 1
        return Verdict(False, VerdictSource.CACHE, Share.unreachable(), np.nan, None,
                       f"contains a change that alone breaks the budget: {bad[0][2]} ({self.bad[bad[0]]})")


class StaticBound:
    """The static error bound certifies a candidate (allclose and the metric limits error/static_metrics.py
    derives from it) or finds an overflow. "auto": the first candidate (the FP32 baseline) decides whether
    the stage stays on."""

    def __init__(self, counts: Counter, ev: Evidence, known: KnownPrograms, mode: bool | str):
        self.counts, self.ev, self.known = counts, ev, known
        # "auto" leaves metric budgets (LLMs, embeddings) to measurement: their models' bounds certify nothing
        # yet (MiniLM's FP32 bound is infinite, SmolLM2's 1e8x its error at 1-3 layers) and the analysis of the
        # FP32 baseline would cost 40 s (MiniLM) to minutes and > 6 GB (SmolLM2, 30 layers); use_static=True
        # certifies them (error/static_metrics.py), except metrics with no bound derived (ULP distances)
        self.mode = False if mode == "auto" and ev.budget.metrics else mode
        self.ranges = None  # value intervals of every input, per batch (built on first use)
        self.norms: dict = {}  # spectral norms of the graph's weights, computed once (error/static_ball.py)
        self.note = ""

    def decide(self, c: Candidate) -> Verdict | None:
        if not self.mode:
            return None
        known = self.known.lowered(c)  # the bound needs the program: lowered now, so a known one decides
        if known is not None:
            return known
        v = self.bound(c.program)
        if self.mode == "auto":
            # The first candidate (the FP32 baseline) decides: a static stage that cannot certify FP32
            # will not certify lower precisions either, and costs more than measuring them.
            self.mode = v is not None and v.passed
            self.note = ("static bounds certify the FP32 baseline: static stage on" if self.mode else
                         "static bounds do not certify the FP32 baseline: measurement decides")
        return v

    def bound(self, program: Program) -> Verdict | None:
        if self.ranges is None:
            self.ranges = [{k: Interval.point(np.asarray(v, dtype=np.float64)) for k, v in inp.items()}
                           for inp in self.ev.calibration]
        worst, user, bound, metric, gate = 0.0, 0.0, 0.0, 0.0, self.ev.gate
        for ranges, bindings, ref in zip(self.ranges, self.ev.bindings, self.ev.refs):
            rep = static_bound(program, ranges, bindings, self.ev.graph.weights, self.norms)
            if rep.overflow is not None:
                self.counts[Count.STATIC] += 1
                return Verdict(False, VerdictSource.STATIC, Share.unreachable(), np.nan, np.inf, rep.overflow.message())
            for name in gate.outputs or tuple(rep.error_bounds):
                err = rep.error_bounds[name]
                worst = max(worst, _bound_ratio(err, ref[name], gate))
                user = max(user, _bound_ratio(err, ref[name], self.ev.budget))
                bound = max(bound, float(np.max(err)) if err.size else 0.0)
                metric = max(metric, _metric_ratio(err, ref[name], gate))
            if not max(worst, metric) <= 1.0:
                return None  # a bound above budget proves nothing
        self.counts[Count.STATIC] += 1
        share = Share(max(worst, metric), worst, user) if gate.metrics else Share(np.nan, worst, user)
        return Verdict(True, VerdictSource.STATIC, share, np.nan, bound,
                       f"certified: static bound ratio {max(worst, metric)!r} <= 1")


def _bound_ratio(err: np.ndarray, ref, budget: Budget) -> float:
    """Worst bound / allowance over the elements (an exact element needs no allowance)."""
    if not budget.allclose_applies:
        return 0.0
    ref = np.abs(np.asarray(ref))
    with np.errstate(invalid="ignore"):
        tol = budget.atol + np.where(ref == 0, 0.0, budget.rtol * ref)  # rtol=inf at ref=0 is 0, not NaN
    with np.errstate(divide="ignore", invalid="ignore"):  # an unbounded element breaks any allowance (inf / inf)
        return float(np.max(np.where(err == 0, 0.0, np.where(np.isinf(err), np.inf, err / tol)))) if err.size else 0.0


def _metric_ratio(err: np.ndarray, ref, budget: Budget) -> float:
    """The worst share of a metric limit the bound allows (error/predict.budget_ratio's, of the metric's
    bound); inf where a metric has no bound derived from the error bound."""
    worst = 0.0
    for m in budget.metrics:
        value = metric_bound(m.name, err, ref)
        if value is None:
            return np.inf
        worst = max(worst, METRICS[m.name].share(value, m.limit))
    return worst


class Composed:
    """A genome's outputs composed from its chunks' effects, each chunk judged alone on its exact FP64
    inputs (error/chunks.py): decides outside its band; inside it, tentatively on the bias-corrected
    estimate (Verdict.tentative: measurement is spent only where it can change the answer,
    search.confirm_finalists). With `exact`, the EXACT composition (each chunk's own deviation injected
    into the FP64 rest: validated within 2x on SmolLM2 where SCALED is not, bench/prediction.py) decides
    where SCALED falls inside its band, with its own band. A chunk choice whose effect alone (the other
    chunks FP32) breaks the budget prunes every genome containing it."""

    def __init__(self, counts: Counter, ev: Evidence, known: KnownPrograms, cal: Calibrator,
                 scaled: ChunkEffects, exact: ChunkEffects | None):
        self.counts, self.ev, self.known, self.cal = counts, ev, known, cal
        self.scaled, self.exact = scaled, exact
        self.bad: dict[tuple, str] = {}  # (structure, chunk, choice key) -> why it alone breaks the budget
        self.alone_ok: set = set()       # chunk choices whose effect alone did not break it
        # tentative rejects (never lowered) -> their compositions (SCALED, EXACT or None), checked if measured
        self.deferred: dict[frozenset, tuple[Prediction | None, Prediction | None]] = {}

    def decide(self, c: Candidate) -> Verdict | None:
        if not c.predict or c.choices is None:
            return None
        v, scaled, exact = self._verdict(c.choices)
        if v is not None and v.tentative and not c.tentative:
            v = None  # a composition inside its band may not decide this candidate: it is measured
        if v is not None and v.tentative and not v.passed:
            self.deferred[c.changes] = (scaled, exact)
        if v is not None and not v.passed and not c.lowered:
            self._count(v, exact)
            return v  # rejected from its chunks: never lowered
        known = self.known.lowered(c)  # kept (or undecided): lowered now, and a known program decides
        if known is not None:
            return known
        self._count(v, exact)
        self.cal.expect(BandKind.SCALED, c.key, scaled)  # a later measurement of it checks the compositions
        self.cal.expect(BandKind.EXACT, c.key, exact)
        return v

    def _count(self, v: Verdict | None, exact: Prediction | None) -> None:
        if v is None or v.source != VerdictSource.CHUNKS:
            return
        self.counts[Count.CHUNKS] += 1
        self.counts[Count.EXACT] += exact is not None
        if v.tentative:
            self.counts[Count.TENTATIVE if v.passed else Count.DEFERRED] += 1

    def exact_prediction(self, choices) -> Prediction | None:
        """The EXACT composition of a genome's chunk choices (None without EXACT effects)."""
        if self.exact is None:
            return None
        self.exact.prefetch(choices)
        return self.ev.checker.check(self.exact.compose(choices, self.ev.gated_refs))

    def share(self, choices) -> float:
        """The gate share a genome uses, predicted from its chunks' SCALED effects composed."""
        self.scaled.prefetch(choices)
        return self.ev.checker.check(self.scaled.compose(choices, self.ev.gated_refs)).ratio

    def _verdict(self, candidates) -> tuple[Verdict | None, Prediction | None, Prediction | None]:
        """The composed verdict (or None), with the SCALED and EXACT compositions a later measurement checks."""
        ce, band, check = self.scaled, self.cal.band(BandKind.SCALED), self.ev.checker.check
        changed = [i for i in sorted(candidates) if candidates[i].key != ce.base[i].key]
        ids = {i: (ce.structure[i], i, candidates[i].key) for i in changed}
        for i in changed:
            if ids[i] in self.bad:
                self.counts[Count.CACHE] += 1
                self.counts[Count.PRUNED] += 1
                return Verdict(False, VerdictSource.CACHE, Share.unreachable(), np.nan, None,
                               f"chunk {i}'s choice alone breaks the budget ({self.bad[ids[i]]})"), None, None
        ce.prefetch(candidates)
        p = scaled = check(ce.compose(candidates, self.ev.gated_refs))
        if band.decides(p) is not True:
            # not a clear pass: does one chunk's choice alone break it? (then it prunes every genome with
            # it). With one chunk changed the composition is that chunk alone.
            for i in changed:
                if ids[i] in self.alone_ok:
                    continue
                alone = p if len(changed) == 1 else check(ce.alone(i, candidates[i], self.ev.gated_refs))
                if band.decides(alone) is not False:
                    self.alone_ok.add(ids[i])  # checked once: the metrics of a 49152-wide row cost
                    continue
                self.bad[ids[i]] = f"predicted {alone.ratio:.3g}x the budget: {alone.reason}"
                return Verdict(False, VerdictSource.CHUNKS, alone.share, np.nan, None,
                               f"chunk {i}'s choice alone is predicted {alone.ratio:.3g}x the budget "
                               f"(margin {band.margin:.3g}): {alone.reason}", metrics=alone.metrics), p, None
        decided, exact, how = band.decides(p), None, "composed from"
        if decided is None and self.exact is not None:  # inside SCALED's band: the exact composition
            p = exact = self.exact_prediction(candidates)
            band, how = self.cal.band(BandKind.EXACT), \
                "composed exactly (each chunk's deviation injected into the FP64 rest) from"
            decided = band.decides(p)
        how, tentative = f"{how} {len(candidates)} chunks judged alone on FP64 inputs (margin {band.margin:.3g}, " \
                         f"bias {band.bias:.3g}", decided is None
        if decided is None:
            # likely to pass: re-measured end to end if it reaches the front or is chosen; likely to fail:
            # measured only if it would be chosen were it to pass (the front omits it otherwise)
            decided = band.expected(p) <= 1.0
            how += (f", inside the band: expected {band.expected(p):.3g} of the budget, "
                    f"tentative {'pass' if decided else 'reject'}")
        # its errors corrected by the observed bias: comparable with measured ones on the front (an
        # under-predicted point would look better than the measured ones and take their place)
        b = band.bias
        return Verdict(decided, VerdictSource.CHUNKS, p.share.times(b), np.nan, None, f"{how}): {p.reason}",
                       tentative, b, exact is not None, metrics=p.metrics), scaled, exact


class FirstOrder:
    """A genome of several changes, each measured alone: its outputs are FP64 plus the sum of their
    deviations (first order); decides outside its band, else the measurement that follows checks it."""

    def __init__(self, counts: Counter, deltas: FirstOrderDeltas, cal: Calibrator):
        self.counts, self.deltas, self.cal = counts, deltas, cal

    def decide(self, c: Candidate) -> Verdict | None:
        if not c.predict or len(c.changes) < 2:
            return None
        p = self.deltas.predict(c.changes)
        if p is None:
            return None
        band = self.cal.band(BandKind.FIRST_ORDER)
        decided = band.decides(p)
        self.cal.expect(BandKind.FIRST_ORDER, c.key, p, replace=True)  # checked by a measurement, if one follows
        if decided is None:
            return None  # too close to call: measured
        self.counts[Count.PREDICTED] += 1
        return Verdict(decided, VerdictSource.PREDICTED, p.share, np.nan, None,
                       f"predicted from the changes' measured errors (margin {band.margin:.3g}): {p.reason}",
                       metrics=p.metrics)


class Measurement:
    """End to end vs FP64, on the positions or every calibration batch (judge.EndToEnd), or a measurement an
    earlier compile stored: the last decider, which always decides. Its result is reported to the calibrator
    in candidate order."""

    def __init__(self, counts: Counter, ev: Evidence, known: KnownPrograms, cal: Calibrator, runner,
                 deltas: FirstOrderDeltas | None, store):
        self.counts, self.ev, self.known, self.cal, self.runner = counts, ev, known, cal, runner
        self.deltas, self.store = deltas, store

    def decide(self, c: Candidate) -> Verdict:
        # a single change is measured again: the first-order prediction needs its outputs, which are not stored
        single = self.deltas is not None and len(c.changes) == 1
        ticket = self.cal.ticket()
        reported = False
        try:
            v = None if single else self.stored(c.key)
            if v is None:
                v, outs = self.runner.measure(c.program, keep_outputs=single, genome=c.changes)
                if outs is not None:
                    change = next(iter(c.changes))
                    self.deltas.record(change, outs)
                    self.known.single_of[c.key] = change
                self.persist(c.key, v)
            self.cal.report(ticket, Observation(c.key, v.share.gate))
            reported = True
        finally:
            if not reported:
                self.cal.report(ticket, None)
        return v

    def confirm(self, key: str, program: Program, changes: frozenset = frozenset()) -> Verdict:
        """A predicted candidate measured end to end (stored or run now), reported to the calibrator."""
        ticket = self.cal.ticket()
        reported = False
        try:
            v = self.stored(key)
            if v is None:
                v, _ = self.runner.measure(program, genome=changes)
                self.persist(key, v)
            self.cal.report(ticket, Observation(key, v.share.gate))
            reported = True
        finally:
            if not reported:
                self.cal.report(ticket, None)
        return v

    def stored(self, key: str) -> Verdict | None:
        """A measurement an earlier compile of the same graph, inputs and budget made (or None). It
        stands where the measurement would: predictions made before it are checked against it."""
        v = self.store.get(key) if self.store is not None else None
        if v is not None:
            self.counts[Count.CACHE] += 1
            self.counts[Count.STORED] += 1
        return v

    def persist(self, key: str, v: Verdict) -> None:
        if self.store is not None:
            self.store.put(key, v)
