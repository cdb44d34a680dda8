"""The numerics gate: a chain of deciders, cheapest first (error/deciders.py), and one calibrator that owns
the bands predictions are decided by (error/calibrate.py).

A candidate is identified by its lowered program's key and by the precision changes it makes relative to
the FP32 baseline. A change whose isolated error already breaks the budget prunes every candidate that
contains it (monotone pruning), without running anything. The search talks to the judge through the few
methods below (search.search.Gate), never to its deciders.
"""
from __future__ import annotations

from collections import Counter
from types import MappingProxyType
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import numpy as np

from ..codegen.llir import Program
from ..hlir.graph import Graph
from ..hlir.weightcache import WEIGHTS
from ..runtime.cpu import CpuRuntime
from .budget import Budget
from .calibrate import BandKind, Calibrator
from .chunks import ChunkEffects
from .deciders import (Candidate, Change, Composed, Count, Evidence, FirstOrder, KnownPrograms, Lowering,
                       Measurement, PrunedChanges, StaticBound)
from .metric_values import MetricValues
from .metrics import METRICS, Compared
from .predict import FirstOrderDeltas, budget_ratio
from .reference import Fp64Reference, references
from .share import Share
from .executors import Executor
from .pooled import PooledJudge
from .tasks import RunTask, TaskPool
from .verdict import PREDICTED_SOURCES, Verdict, VerdictSource, program_key
from .verdict_store import VerdictStore

__all__ = ["Judge", "GateStats", "InsideBand", "JudgeSummary", "Verdict", "VerdictSource", "PREDICTED_SOURCES",
           "program_key", "Change"]


@dataclass(frozen=True)
class InsideBand:
    """Chunk verdicts decided inside their band (among the `chunks` verdicts)."""
    tentative: int = 0          # passed on the bias-corrected estimate
    deferred: int = 0           # failed on it: tentative rejects
    exact: int = 0              # from the exact composition (SCALED inside its band)
    deferred_measured: int = 0  # tentative rejects measured end to end because they would have been chosen


@dataclass(frozen=True)
class GateStats:
    """What decided the verdicts so far, by decider."""
    cache: int = 0
    static: int = 0
    measured: int = 0    # end-to-end measurements
    pruned: int = 0
    chunks: int = 0      # decided by the composed per-chunk effects
    predicted: int = 0   # decided by the first-order composition of measured single changes
    confirmed: int = 0   # predicted verdicts re-measured end to end (front and chosen plan)
    mismatches: int = 0  # measurements outside the prediction's band (each widened the margin)
    stored: int = 0      # verdicts read from the on-disk cache (counted among the cache's verdicts)
    inside_band: InsideBand = field(default_factory=InsideBand)

    @staticmethod
    def of(counts: Counter, mismatches: int) -> "GateStats":
        return GateStats(counts[Count.CACHE], counts[Count.STATIC], counts[Count.MEASURED], counts[Count.PRUNED],
                         counts[Count.CHUNKS], counts[Count.PREDICTED], counts[Count.CONFIRMED], mismatches,
                         counts[Count.STORED], InsideBand(counts[Count.TENTATIVE], counts[Count.DEFERRED],
                                                          counts[Count.EXACT], counts[Count.DEFERRED_MEASURED]))

    def as_dict(self) -> dict[str, int]:
        return dict(cache=self.cache, static=self.static, chunks=self.chunks, predicted=self.predicted,
                    measured=self.measured, pruned=self.pruned, confirmed=self.confirmed,
                    mismatches=self.mismatches, stored=self.stored, tentative=self.inside_band.tentative,
                    deferred=self.inside_band.deferred, deferred_measured=self.inside_band.deferred_measured,
                    exact=self.inside_band.exact)


@dataclass(frozen=True)
class JudgeSummary:
    """The gate's statistics at the end of a search: verdict counts, and the calibration and chunk-work
    figures a plan records (margins and biases of the bands, chunk programs run, ...)."""
    gate: GateStats
    figures: Mapping[str, float | int | str]

    def record(self) -> dict:
        return {**self.gate.as_dict(), **self.figures}


class EndToEnd:
    """Runs whole programs on the calibration batches against FP64 (on the chunks' pool when there is one).
    `outputs_cache`: program key -> its outputs per batch, run once and read once (the headroom's probes
    are also baselines of the search). `positions`: an LLM decode job's teacher-forced positions; a
    measurement's verdict is then the program's on every position pooled (thousands of rows where the
    calibration batches hold a few dozen), so every measured verdict, and every band a prediction is decided
    by, rests on them."""

    def __init__(self, counts: Counter, ev: Evidence, pool: Executor | None, outputs_cache: dict | None,
                 positions: PooledJudge | None = None):
        self.counts, self.ev, self.pool, self.outputs_cache = counts, ev, pool, outputs_cache
        self.positions = positions

    def has_outputs(self, program: Program) -> bool:
        return self.outputs_cache is not None and program_key(program) in self.outputs_cache

    def batch_ratios(self, programs: Sequence[Program], pool: Executor | None = None) -> list[list[float]]:
        """For each program, the share of the user's budget it uses on each calibration batch (all
        metrics). With a pool every (program, batch) is a task, so the programs and batches run in
        parallel (the headroom's probes: four end-to-end runs of the model each)."""
        ev = self.ev
        tasks = [RunTask(p, (inp,), (bind,)) for p in programs for inp, bind in zip(ev.calibration, ev.bindings)]
        results = (pool or TaskPool(ev.graph.weights, workers=1)).map(tasks)
        nb, out = len(ev.calibration), []
        for i, program in enumerate(programs):
            runs = results[i * nb:(i + 1) * nb]
            for r in runs:
                if isinstance(r, Exception):
                    raise r
            outs = [r[0] for r in runs]
            if self.outputs_cache is not None:
                self.outputs_cache[program_key(program)] = outs
            out.append([budget_ratio(ev.budget, ev.budget.check(o, ref)) for o, ref in zip(outs, ev.refs)])
        return out

    def measure(self, program: Program, keep_outputs: bool = False,
                genome: frozenset = frozenset()) -> tuple[Verdict, list | None]:
        """End to end: on the positions when the job has them (the calibration batches run too only to keep
        their outputs, which the first-order prediction composes; a run failing there is the verdict), else
        on every calibration batch. The outputs of all batches come back when kept and complete."""
        self.counts[Count.MEASURED] += 1
        if self.positions is None:
            return self.on_batches(program, keep_outputs)
        outs = None
        if keep_outputs:
            failed, outs = self.on_batches(program, True)
            if outs is None:
                return failed, None
        elif self.outputs_cache is not None:
            self.outputs_cache.pop(program_key(program), None)  # read once: the headroom's outputs are not judged
        return self.positions.verdict(program, genome), outs

    def on_batches(self, program: Program, keep_outputs: bool = False) -> tuple[Verdict, list | None]:
        """End to end on every batch (stopping at the first failing one unless `keep_outputs`; with the
        chunks' pool, all batches run at once, in parallel); the outputs of all batches come back when
        kept and complete."""
        ev = self.ev
        worst, user, worst_abs, reason, passed, ratio = 0.0, 0.0, 0.0, "", True, 0.0
        values = MetricValues()  # the worst of each budget metric over the batches run
        outs: list | None = [] if keep_outputs else None
        ran = self.outputs_cache.pop(program_key(program), None) if self.outputs_cache is not None else None
        if ran is None and self.pool is not None and len(ev.calibration) > 1:
            ran = [r if isinstance(r, Exception) else r[0] for r in self.pool.map(
                [RunTask(program, (inp,), (bind,)) for inp, bind in zip(ev.calibration, ev.bindings)])]
        rt = CpuRuntime(program, ev.graph.weights) if ran is None else None  # runs here
        if rt is not None and len(ev.calibration) > 1:
            try:  # every batch at once: a weight form the cache cannot keep is made once, not once per batch
                with WEIGHTS.scanning():
                    ran = [r.outputs for r in rt.run_many(ev.calibration)]
            except (ValueError, FloatingPointError):
                ran = None  # batch by batch below: the first failing batch's reason, as run alone
        for b, (inp, ref) in enumerate(zip(ev.calibration, ev.refs)):
            try:
                with WEIGHTS.scanning():  # a whole-model run (hlir/weightcache.py)
                    out = ran[b] if ran is not None else rt.run(inp).outputs
                if isinstance(out, Exception):
                    raise out
            except (ValueError, FloatingPointError) as exc:  # e.g. a REJECT overflow policy
                return Verdict(False, VerdictSource.MEASURED, Share(np.inf, np.inf, np.inf), np.inf, None,
                               f"run failed: {exc}"), None
            if outs is not None:
                outs.append(out)
            names = ev.gate.outputs or tuple(ref)
            compared = {n: Compared(out[n], ref[n]) for n in names}  # one pair per output for both budgets
            verdict = ev.gate.check(compared, ref)
            ratio = max(ratio, budget_ratio(ev.gate, verdict))
            values = values.worse(MetricValues.worst_of([verdict]))
            user = max(user, ev.budget.check(compared, ref).worst_allclose)
            worst_abs = max([worst_abs] + [float(METRICS["max_abs"].of(c)) for c in compared.values()])
            if verdict.worst_allclose >= worst:
                worst, reason = verdict.worst_allclose, verdict.reason
            if not verdict.passed:
                passed, reason = False, verdict.reason
                if outs is None:
                    break
        if passed and not ev.gate.allclose_applies:  # summed up by the worst values over the batches, as recorded
            reason = ev.gate.within(values, worst)
        return Verdict(passed, VerdictSource.MEASURED, Share(ratio, worst, user), worst_abs, None, reason,
                       metrics=values), outs


class Judge:
    """Judges against `budget.gate(headroom)` (the share of the user's budget a plan may use on the
    calibration set); every verdict also carries its share of the user's `budget`.

    `use_static`: "auto" keeps the static stage only if it certifies the first candidate; `use_prediction`:
    decide multi-change candidates from their measured single changes; `chunks` / `exact_chunks`: per-chunk
    verdicts (SCALED, and EXACT where SCALED falls inside its band), tried before any measurement; `store`:
    measured verdicts on disk, reused across compiles; `outputs_cache`: outputs batch_ratios() ran, read
    once by the measurement of the same program; `positions`: an LLM's teacher-forced positions every
    measurement judges on (EndToEnd), so the bands calibrate the calibration batches' predictions to them."""

    def __init__(self, graph: Graph, budget: Budget, calibration: Sequence[Mapping[str, np.ndarray]],
                 use_static: bool | str = "auto", headroom: float = 1.0, gate: Budget | None = None,
                 references: Sequence[Fp64Reference] | None = None, use_prediction: bool = True,
                 chunks: ChunkEffects | None = None, exact_chunks: ChunkEffects | None = None,
                 store: VerdictStore | None = None, outputs_cache: dict[str, list] | None = None,
                 positions: PooledJudge | None = None):
        if not calibration:
            raise ValueError("the numerics gate needs at least one calibration batch")
        gate = budget.gate(headroom) if gate is None else gate  # budget.gate(headroom) unless compile computed it
        refs_ = _references(graph, calibration, references)
        refs = tuple(r.outputs(graph) for r in refs_)
        self.ev = Evidence(graph, budget, gate, tuple(calibration), refs,
                           tuple({k: r[k] for k in gate.outputs or r} for r in refs), tuple(r.bindings for r in refs_),
                           pooled=positions is not None)
        self.counts: Counter = Counter()
        self.calibrator = Calibrator(tuple(k for k, on in ((BandKind.FIRST_ORDER, use_prediction),
                                                           (BandKind.SCALED, chunks is not None),
                                                           (BandKind.EXACT, chunks is not None and exact_chunks is not None))
                                           if on))
        deltas = FirstOrderDeltas(self.ev.checker) if use_prediction else None
        self.known = KnownPrograms(self.counts, deltas)
        self.pruned = PrunedChanges(self.counts)
        self.static = StaticBound(self.counts, self.ev, self.known, use_static)
        self.composed = Composed(self.counts, self.ev, self.known, self.calibrator, chunks, exact_chunks) \
            if chunks is not None else None
        self.first_order = FirstOrder(self.counts, deltas, self.calibrator) if deltas is not None else None
        self.runner = EndToEnd(self.counts, self.ev, chunks.pool if chunks is not None else None, outputs_cache,
                               positions)
        self.measurement = Measurement(self.counts, self.ev, self.known, self.calibrator, self.runner, deltas, store)
        self.chain = tuple(d for d in (self.known, self.pruned, self.static, self.composed, Lowering(self.known),
                                       self.first_order, self.measurement) if d is not None)

    # -- what the search uses ------------------------------------------------------------------
    def judge(self, program: Program | Callable[[], Program], changes: frozenset[Change] = frozenset(),
              candidates=None, predict: bool = True, tentative: bool = True) -> Verdict:
        """The first verdict of the chain. `program` may be a callable that lowers it: then a candidate
        the chunks reject is never lowered (the composition needs only its chunk choices `candidates`).
        `predict=False`: no prediction decides; `tentative=False`: a composition inside its band does not."""
        c = Candidate(program, changes, candidates, predict, tentative)
        for decider in self.chain:
            v = decider.decide(c)
            if v is not None:
                break
        if c.lowered:
            self.known.verdicts[c.key] = v
        return v

    def confirm(self, program: Program, changes: frozenset[Change] = frozenset(), candidates=None) -> Verdict:
        """Measure a predicted candidate end to end (finalists, and tentative rejects that would be
        chosen: `changes` names those); the result replaces the prediction. With `candidates` (its chunk
        choices) the EXACT composition is checked against the run too, wherever SCALED decided: the
        exact band is calibrated by every confirmation, not only by those it decided."""
        key = program_key(program)
        deferred = self.composed.deferred.pop(changes, None) if self.composed is not None else None
        known = self.known.verdicts.get(key)
        if known is not None and known.source == VerdictSource.MEASURED:  # another genome's finalist, same program:
            self.counts[Count.CACHE] += 1                                  # measured already (one run, not two)
            return known
        if deferred is not None:
            self.calibrator.expect(BandKind.SCALED, key, deferred[0])
            self.calibrator.expect(BandKind.EXACT, key, deferred[1])
            self.counts[Count.DEFERRED_MEASURED] += 1
        if candidates is not None and self.composed is not None and self.composed.exact is not None \
                and not self.calibrator.expects(BandKind.EXACT, key):
            self.calibrator.expect(BandKind.EXACT, key, self.composed.exact_prediction(candidates))
        v = self.measurement.confirm(key, program, changes)
        if deferred is None:
            self.counts[Count.CONFIRMED] += 1
        self.known.verdicts[key] = v
        return v

    def note_isolated(self, change: Change, verdict: Verdict) -> None:
        """Record a single change's verdict: a failure prunes every later candidate containing it."""
        self.pruned.note_isolated(change, verdict)

    def rebiased(self, verdict: Verdict) -> Verdict:
        """A composed verdict re-corrected by its band's current bias (calibrate.Calibrator.rebiased)."""
        return self.calibrator.rebiased(verdict)

    @property
    def per_chunk(self) -> bool:
        """Whether per-chunk verdicts exist (per-chunk genomes need them)."""
        return self.composed is not None

    def composed_share(self, choices) -> float:
        """The gate share a genome uses, predicted from its chunks' effects composed."""
        return self.composed.share(choices)

    def has_outputs(self, program: Program) -> bool:
        """Whether this program's outputs on every calibration batch were kept (batch_ratios ran it)."""
        return self.runner.has_outputs(program)

    @property
    def measured(self) -> int:
        """End-to-end measurements so far."""
        return self.counts[Count.MEASURED]

    @property
    def latency_bindings(self):
        """The first calibration batch's dynamic dimensions (what latencies are modelled on)."""
        return self.ev.bindings[0]

    @property
    def stats(self) -> GateStats:
        return GateStats.of(self.counts, self.calibrator.mismatches)

    def summary(self) -> JudgeSummary:
        figures: dict = {}
        bands = self.calibrator.bands
        if BandKind.FIRST_ORDER in bands:
            figures["prediction_margin"] = bands[BandKind.FIRST_ORDER].margin
        if self.composed is not None:
            ce, band = self.composed.scaled, bands[BandKind.SCALED]
            figures.update(chunk_margin=band.margin, chunk_bias=band.bias, chunk_runs=ce.runs,
                           chunk_composed=ce.composed, chunk_shared=ce.shared,
                           chunk_local_checks=len(ce.local_checks), chunk_injections=ce.injections)
            if ce.compose_off:
                figures["chunk_compose_off"] = ce.compose_off
        if BandKind.EXACT in bands:
            xe, band = self.composed.exact, bands[BandKind.EXACT]
            figures.update(exact_margin=band.margin, exact_bias=band.bias, exact_checks=len(band.observed),
                           exact_runs=xe.runs, exact_injections=xe.injections)
        return JudgeSummary(self.stats, MappingProxyType(figures))

    # -- the headroom's probes ----------------------------------------------------------------
    def batch_ratios(self, programs: Sequence[Program], pool: Executor | None = None) -> list[list[float]]:
        return self.runner.batch_ratios(programs, pool)

    @property
    def static_note(self) -> str:
        return self.static.note


def _references(graph: Graph, calibration, given) -> Sequence[Fp64Reference]:
    refs = references(graph, calibration) if given is None else given
    if len(refs) != len(calibration):
        raise ValueError(f"{len(refs)} FP64 references for {len(calibration)} calibration batches")
    return refs
