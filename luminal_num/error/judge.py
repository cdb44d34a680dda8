"""The numerics gate: cached verdicts, then static bounds, then measured error vs FP64, cheapest first.

A candidate is identified by its lowered program's key and by the precision changes it makes
relative to the FP32 baseline. A change whose isolated error already breaks the budget prunes every
candidate that contains it (monotone pruning), without running anything.
"""
from __future__ import annotations

import dataclasses
import enum
import hashlib
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import numpy as np

from ..codegen.llir import Program
from ..hlir.graph import Graph
from ..runtime.cpu import CpuRuntime
from .budget import Budget
from .chunks import ChunkEffects
from .interval import Interval
from .metrics import METRICS, Compared
from .predict import DeltaPredictor, Prediction, budget_ratio
from .reference import Fp64Reference, references
from .tasks import RunTask, TaskPool
from .static import static_bound
from .verdict_store import VerdictStore

Change = tuple  # (group key or one chunk of a group, e-class, tag)

# verdicts decided from a prediction, not an end-to-end run: the front and the chosen plan re-measure them
class VerdictSource(enum.StrEnum):
    """What decided a verdict (its text is what plans and reports write)."""
    CACHE = "cache"          # a known program, or a genome containing a change that failed alone
    STATIC = "static"        # the static error bound certifies it (or finds an overflow)
    CHUNKS = "chunks"        # composed per-chunk effects, each chunk judged alone on FP64 inputs
    PREDICTED = "predicted"  # the calibrated error predictor
    MEASURED = "measured"    # an end-to-end run against FP64


PREDICTED_SOURCES = frozenset({VerdictSource.PREDICTED, VerdictSource.CHUNKS})


@dataclass(frozen=True)
class Verdict:
    passed: bool
    source: VerdictSource
    error: float         # worst allclose ratio against the gate's (tightened) budget: <= 1 passes
    max_abs: float       # worst |y - ref| measured (nan when not measured)
    bound: float | None  # largest static error bound (None when not computed)
    reason: str
    budget_error: float = float("nan")  # the same ratio against the user's budget (what plans report)
    ratio: float = float("nan")  # share of the gate used over allclose and every metric (predict.budget_ratio)
    # decided from a composition inside its band (no margin): a tentative pass is confirmed if it reaches the
    # front or is chosen, a tentative reject is measured if it would be chosen (search.confirm_finalists)
    tentative: bool = False
    bias: float | None = None  # a composed verdict: the bias its errors were multiplied by (None: not composed)
    exact: bool = False        # composed with EXACT propagation (its band is the judge's exact_band)

    def __post_init__(self):
        object.__setattr__(self, "source", VerdictSource(self.source))  # one read back from a verdict store


@dataclass
class GateStats:
    cache: int = 0
    static: int = 0
    measured: int = 0    # end-to-end measurements
    pruned: int = 0
    chunks: int = 0      # decided by the composed per-chunk effects (each chunk judged alone on FP64 inputs)
    predicted: int = 0   # decided by the first-order composition of measured single changes
    confirmed: int = 0   # predicted verdicts re-measured end to end (front and chosen plan)
    mismatches: int = 0  # measurements outside the prediction's band (each widened the margin)
    stored: int = 0      # verdicts read from the on-disk cache (counted among the cache's verdicts)
    tentative: int = 0   # chunk verdicts inside the band that pass on the bias-corrected estimate (among chunks)
    deferred: int = 0    # chunk verdicts inside the band that fail on it: tentative rejects (among chunks)
    exact: int = 0       # chunk verdicts from the exact composition (SCALED inside its band; among chunks)
    deferred_measured: int = 0  # tentative rejects measured end to end because they would have been chosen

    def as_dict(self) -> dict[str, int]:
        return dict(cache=self.cache, static=self.static, chunks=self.chunks,
                    predicted=self.predicted,
                    measured=self.measured, pruned=self.pruned, confirmed=self.confirmed,
                    mismatches=self.mismatches, stored=self.stored, tentative=self.tentative,
                    deferred=self.deferred, deferred_measured=self.deferred_measured, exact=self.exact)


def program_key(program: Program) -> str:
    """Identity of what runs: kernel kinds, dtypes, precisions, weight storage formats, views, bodies (not
    names). Storage is part of it: two plans that differ only in how a weight is held compute different values."""
    items = [(k.kind.value, k.dtype.name, k.precision, k.acc.name if k.acc else None, k.axis, repr(k.body),
              tuple((i.buffer, i.view.encode()) for i in k.inputs), k.aliases, k.storage) for k in program.kernels]
    return hashlib.sha256(repr((items, program.outputs)).encode()).hexdigest()[:20]


@dataclass
class Judge:
    """Judges against `budget.tightened(headroom)` (the share of the user's budget a plan may use on
    the calibration set); every verdict also carries its ratio against the user's `budget`."""

    graph: Graph
    budget: Budget
    calibration: Sequence[Mapping[str, np.ndarray]]
    use_static: bool | str = "auto"  # "auto": keep the static stage only if it certifies the first candidate
    headroom: float = 1.0
    gate: Budget | None = None  # budget.gate(headroom) unless the caller computed it (compile's context)
    references: Sequence[Fp64Reference] | None = None  # FP64 of each batch (computed here when not given)
    stats: GateStats = field(default_factory=GateStats)
    cache: dict[str, Verdict] = field(default_factory=dict)
    bad_changes: dict[Change, str] = field(default_factory=dict)
    use_prediction: bool = True  # decide multi-change candidates from their measured single changes
    chunks: ChunkEffects | None = None  # per-chunk verdicts (error/chunks.py), tried before any measurement
    # the same, EXACT propagation: decides where `chunks` (SCALED, cheaper) falls inside its band
    exact_chunks: ChunkEffects | None = None
    bad_chunks: dict[tuple, str] = field(default_factory=dict)  # (structure, chunk, choice key) -> why
    chunks_alone_ok: set = field(default_factory=set)  # chunk choices whose effect alone did not break it
    store: VerdictStore | None = None  # measured verdicts on disk (error/verdict_store.py), reused across compiles
    # program key -> its outputs per calibration batch, run once and read once: batch_ratios() fills it, a
    # later _measure() of the same program reads it (the headroom's probes are also baselines)
    outputs_cache: dict[str, list] | None = None

    def __post_init__(self):
        if not self.calibration:
            raise ValueError("the numerics gate needs at least one calibration batch")
        if self.gate is None:
            self.gate = self.budget.gate(self.headroom)
        if self.use_static == "auto" and self.budget.metrics:
            # bounds certify allclose only: with cosine/KL/top-1 limits every verdict needs a measurement
            self.use_static = False
        if self.references is None:
            self.references = references(self.graph, self.calibration)
        if len(self.references) != len(self.calibration):
            raise ValueError(f"{len(self.references)} FP64 references for {len(self.calibration)} calibration batches")
        self.refs = [r.outputs(self.graph) for r in self.references]
        # the outputs the budget gates (the per-chunk composition predicts only those)
        self.gated_refs = [{k: r[k] for k in self.gate.outputs or r} for r in self.refs]
        self.ranges = [{k: Interval.point(np.asarray(v, dtype=np.float64)) for k, v in inp.items()}
                       for inp in self.calibration]
        self.bindings = [r.bindings for r in self.references]
        self.static_note = ""
        self.predictor = DeltaPredictor(self.gate, self.budget, self.refs) if self.use_prediction else None
        self.pending: dict[str, Prediction] = {}  # program key -> the prediction a measurement checks
        self.key_change: dict[str, Change] = {}   # program key -> the single change whose errors it holds
        # the per-chunk composition's own band (its margin, calibrated by the end-to-end runs it predicted)
        self.chunk_band = DeltaPredictor(self.gate, self.budget, self.refs, centred=True) \
            if self.chunks is not None else None
        self.chunk_pending: dict[str, Prediction] = {}
        self.exact_band = DeltaPredictor(self.gate, self.budget, self.refs, centred=True) \
            if self.exact_chunks is not None else None
        self.exact_pending: dict[str, Prediction] = {}
        # tentative rejects (never lowered) -> their compositions (SCALED, EXACT or None)
        self.deferred: dict[frozenset, tuple[Prediction, Prediction | None]] = {}

    def judge(self, program: Program | Callable[[], Program], changes: frozenset[Change] = frozenset(),
              candidates=None, predict: bool = True, tentative: bool = True) -> Verdict:
        """`program` may be a callable that lowers it: then a candidate the chunks reject is never
        lowered (the composition needs only its chunk choices); the program is lowered otherwise.
        `tentative=False`: a composition inside its band does not decide (the candidate is measured)."""
        lazy = not isinstance(program, Program)
        key = None if lazy else program_key(program)
        if key is not None and key in self.cache:
            return self._cached(key, changes)
        bad = sorted(c for c in changes if c in self.bad_changes)
        if bad:
            self.stats.cache += 1
            self.stats.pruned += 1
            v = Verdict(False, VerdictSource.CACHE, np.inf, np.nan, None,
                        f"contains a change that alone breaks the budget: {bad[0][2]} ({self.bad_changes[bad[0]]})", np.inf)
            if key is not None:
                self.cache[key] = v
            return v
        if lazy and self.use_static:
            program, lazy = program(), False
            key = program_key(program)
            if key in self.cache:
                return self._cached(key, changes)
        v = self._static(program) if self.use_static else None
        if self.use_static == "auto":
            # The first candidate (the FP32 baseline) decides: a static stage that cannot certify FP32
            # will not certify lower precisions either, and costs more than measuring them.
            certified = v is not None and v.passed
            self.use_static = certified
            self.static_note = ("static bounds certify the FP32 baseline: static stage on" if certified else
                                "static bounds do not certify the FP32 baseline: measurement decides")
        pending = None  # (SCALED, EXACT or None) compositions a later measurement checks
        if v is None and predict and self.chunks is not None and candidates is not None:
            v, *pending = self._chunk_verdict(candidates)
            if v is not None and v.tentative and not tentative:
                v = None
            if v is not None and v.source == VerdictSource.CHUNKS:
                self.stats.chunks += 1
                self.stats.exact += pending[1] is not None
                self._count_tentative(v, 1)
            if v is not None and v.tentative and not v.passed:
                self.deferred[changes] = tuple(pending)  # checked if it is ever measured (confirm)
            if lazy and v is not None and not v.passed:
                return v  # rejected from its chunks: never lowered
        if lazy:
            program = program()
            key = program_key(program)
            if key in self.cache:
                if v is not None and v.source == VerdictSource.CHUNKS:  # a known program: the cache decides
                    self.stats.chunks -= 1
                    self.stats.exact -= pending[1] is not None
                    self._count_tentative(v, -1)
                return self._cached(key, changes)
        if pending is not None:
            self._expect(key, *pending)  # a later measurement of this program checks the compositions
        if v is None and predict and self.predictor is not None and len(changes) >= 2:
            v = self._predict(key, changes)
        if v is None:
            single = self.predictor is not None and len(changes) == 1
            # a single change is measured again: the prediction needs its outputs, which are not stored
            v = None if single else self._stored(key)
            if v is None:
                v, outs = self._measure(program, keep_outputs=single)
                if outs is not None:
                    self.predictor.record(next(iter(changes)), outs)
                    self.key_change[key] = next(iter(changes))
                self._persist(key, v)
            self._observe(key, v)
        self.cache[key] = v
        return v

    def _count_tentative(self, v: Verdict, n: int) -> None:
        if v.tentative:
            if v.passed:
                self.stats.tentative += n
            else:
                self.stats.deferred += n

    def _cached(self, key: str, changes) -> Verdict:
        self.stats.cache += 1
        src = self.key_change.get(key)
        if len(changes) == 1 and src is not None:  # the same program as a measured single change
            self.predictor.deltas.setdefault(next(iter(changes)), self.predictor.deltas[src])
        return self.cache[key]

    def _persist(self, key: str, v: Verdict) -> None:
        if self.store is not None:
            self.store.put(key, v)

    def _stored(self, key: str) -> Verdict | None:
        """A measurement an earlier compile of the same graph, inputs and budget made (or None). It
        stands where the measurement would: predictions made before it are checked against it."""
        v = self.store.get(key, Verdict) if self.store is not None else None
        if v is not None:
            self.stats.cache += 1
            self.stats.stored += 1
        return v

    def _expect(self, key: str, scaled: Prediction | None, exact: Prediction | None) -> None:
        for pending, p in ((self.chunk_pending, scaled), (self.exact_pending, exact)):
            if p is not None:
                pending.setdefault(key, p)

    def _observe(self, key: str, measured: Verdict) -> None:
        for pending, band in ((self.pending, self.predictor), (self.chunk_pending, self.chunk_band),
                              (self.exact_pending, self.exact_band)):
            if key in pending:
                before = band.mismatches
                band.observe(pending[key].ratio, measured.ratio)
                self.stats.mismatches += band.mismatches - before

    def _chunk_verdict(self, candidates) -> tuple[Verdict | None, Prediction | None, Prediction | None]:
        """Decide from the chunks' effects composed (error/chunks.py) when outside the band; a chunk
        choice whose effect alone (the other chunks FP32) breaks it prunes every genome containing it.
        Inside the band the bias-corrected estimate decides tentatively (Verdict.tentative): measurement is
        spent only where it can change the answer (search.confirm_finalists); with `exact_chunks`, the EXACT
        composition (each chunk's own deviation injected into the FP64 rest: validated within 2x on SmolLM2
        where SCALED is not, bench/prediction.py) decides instead, with its own band. Also returns the
        SCALED and EXACT compositions (a later measurement of the program checks them). The caller counts
        the "chunks" verdicts it keeps."""
        ce, band = self.chunks, self.chunk_band
        changed = [i for i in sorted(candidates) if candidates[i].key != ce.base[i].key]
        ids = {i: (ce.structure[i], i, candidates[i].key) for i in changed}
        for i in changed:
            if ids[i] in self.bad_chunks:
                self.stats.cache += 1
                self.stats.pruned += 1
                return Verdict(False, VerdictSource.CACHE, np.inf, np.nan, None,
                               f"chunk {i}'s choice alone breaks the budget ({self.bad_chunks[ids[i]]})", np.inf), None, None
        ce.prefetch(candidates)
        p = scaled = band.check(ce.compose(candidates, self.gated_refs))
        if band.decides(p) is not True:
            # not a clear pass: does one chunk's choice alone break it? (then it prunes every genome with
            # it). With one chunk changed the composition is that chunk alone.
            for i in changed:
                if ids[i] in self.chunks_alone_ok:
                    continue
                alone = p if len(changed) == 1 else band.check(ce.alone(i, candidates[i], self.gated_refs))
                if band.decides(alone) is not False:
                    self.chunks_alone_ok.add(ids[i])  # checked once: the metrics of a 49152-wide row cost
                    continue
                self.bad_chunks[ids[i]] = f"predicted {alone.ratio:.3g}x the budget: {alone.reason}"
                return Verdict(False, VerdictSource.CHUNKS, alone.allclose, np.nan, None,
                               f"chunk {i}'s choice alone is predicted {alone.ratio:.3g}x the budget "
                               f"(margin {band.margin:.3g}): {alone.reason}", alone.user, alone.ratio), p, None
        decided, exact, how = band.decides(p), None, "composed from"
        if decided is None and self.exact_chunks is not None:  # inside SCALED's band: the exact composition
            self.exact_chunks.prefetch(candidates)
            p = exact = self.exact_band.check(self.exact_chunks.compose(candidates, self.gated_refs))
            band, how = self.exact_band, "composed exactly (each chunk's deviation injected into the FP64 rest) from"
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
        return Verdict(decided, VerdictSource.CHUNKS, p.allclose * b, np.nan, None, f"{how}): {p.reason}",
                       p.user * b, p.ratio * b, tentative, b, exact is not None), scaled, exact

    def rebias(self, v: Verdict) -> Verdict:
        """A composed verdict re-corrected by its band's current bias (learnt from end-to-end runs made
        since): ranked against measured plans on the front, a stale estimate would look better than they
        do and cost a confirmation each. A pass whose estimate now exceeds the gate becomes a tentative
        reject."""
        if v.bias is None:
            return v
        band = self.exact_band if v.exact else self.chunk_band
        f = band.bias / v.bias
        if f == 1.0:
            return v
        passed = v.passed and v.ratio * f <= 1.0
        return dataclasses.replace(v, passed=passed, error=v.error * f, budget_error=v.budget_error * f,
                                   ratio=v.ratio * f, bias=band.bias, tentative=v.tentative or passed != v.passed)

    def _predict(self, key: str, changes) -> Verdict | None:
        p = self.predictor.predict(changes)
        if p is None:
            return None
        decided = self.predictor.decides(p)
        if decided is None:
            self.pending[key] = p  # too close to call: measured, and the measurement checks the composition
            return None
        self.pending[key] = p
        self.stats.predicted += 1
        return Verdict(decided, VerdictSource.PREDICTED, p.allclose, np.nan, None,
                       f"predicted from the changes' measured errors (margin {self.predictor.margin:.3g}): {p.reason}",
                       p.user, p.ratio)

    def confirm(self, program: Program, changes: frozenset[Change] = frozenset(), candidates=None) -> Verdict:
        """Measure a predicted candidate end to end (finalists, and tentative rejects that would be
        chosen: `changes` names those); the result replaces the prediction. With `candidates` (its chunk
        choices) the EXACT composition is checked against the run too, wherever SCALED decided: the
        exact band is calibrated by every confirmation, not only by those it decided."""
        key = program_key(program)
        deferred = self.deferred.pop(changes, None)
        if deferred is not None:
            self._expect(key, *deferred)
            self.stats.deferred_measured += 1
        if self.exact_chunks is not None and candidates is not None and key not in self.exact_pending:
            self.exact_chunks.prefetch(candidates)
            self._expect(key, None, self.exact_band.check(self.exact_chunks.compose(candidates, self.gated_refs)))
        v = self._stored(key)
        if v is None:
            v, _ = self._measure(program)
            self._persist(key, v)
        if deferred is None:
            self.stats.confirmed += 1
        self._observe(key, v)
        self.cache[key] = v
        return v

    def note_isolated(self, change: Change, verdict: Verdict) -> None:
        """Record a single change's verdict: a failure prunes every later candidate containing it (a
        tentative reject does not: it failed on an estimate inside the band, not by the margin)."""
        if not verdict.passed and not verdict.tentative:
            self.bad_changes[change] = verdict.reason

    def _static(self, program: Program) -> Verdict | None:
        worst, user, bound = 0.0, 0.0, 0.0
        for ranges, bindings, ref in zip(self.ranges, self.bindings, self.refs):
            rep = static_bound(program, ranges, bindings, self.graph.weights)
            if rep.overflow is not None:
                self.stats.static += 1
                return Verdict(False, VerdictSource.STATIC, np.inf, np.nan, np.inf, rep.overflow.message(), np.inf)
            names = self.gate.outputs or tuple(rep.error_bounds)
            for name in names:
                err = rep.error_bounds[name]
                worst = max(worst, _bound_ratio(err, ref[name], self.gate))
                user = max(user, _bound_ratio(err, ref[name], self.budget))
                bound = max(bound, float(np.max(err)) if err.size else 0.0)
            if self.gate.metrics or not worst <= 1.0:
                return None  # other metrics need measurement; a bound above budget proves nothing
        self.stats.static += 1
        return Verdict(True, VerdictSource.STATIC, worst, np.nan, bound, f"certified: static bound ratio {worst!r} <= 1", user)

    def has_outputs(self, program: Program) -> bool:
        """Whether this program's outputs on every calibration batch were kept (batch_ratios ran it)."""
        return self.outputs_cache is not None and program_key(program) in self.outputs_cache

    def batch_ratios(self, programs: Sequence[Program], pool: TaskPool | None = None) -> list[list[float]]:
        """For each program, the share of the user's budget it uses on each calibration batch (all
        metrics). With a pool every (program, batch) is a task, so the programs and batches run in
        parallel (the headroom's probes: four end-to-end runs of the model each)."""
        tasks = [RunTask(p, (inp,), (bind,)) for p in programs for inp, bind in zip(self.calibration, self.bindings)]
        results = (pool or TaskPool(self.graph.weights, workers=1)).map(tasks)
        nb, out = len(self.calibration), []
        for i, program in enumerate(programs):
            runs = results[i * nb:(i + 1) * nb]
            for r in runs:
                if isinstance(r, Exception):
                    raise r
            outs = [r[0] for r in runs]
            if self.outputs_cache is not None:
                self.outputs_cache[program_key(program)] = outs
            out.append([budget_ratio(self.budget, self.budget.check(o, ref)) for o, ref in zip(outs, self.refs)])
        return out

    def _measure(self, program: Program, keep_outputs: bool = False) -> tuple[Verdict, list | None]:
        """End to end on every batch (stopping at the first failing one unless `keep_outputs`; with the
        chunks' pool, all batches run at once, in parallel); the outputs of all batches come back when
        kept and complete."""
        self.stats.measured += 1
        worst, user, worst_abs, reason, passed, ratio = 0.0, 0.0, 0.0, "", True, 0.0
        outs: list | None = [] if keep_outputs else None
        ran = self.outputs_cache.pop(program_key(program), None) if self.outputs_cache is not None else None
        pool = self.chunks.pool if self.chunks is not None else None
        if ran is None and pool is not None and len(self.calibration) > 1:
            ran = [r if isinstance(r, Exception) else r[0] for r in pool.map(
                [RunTask(program, (inp,), (bind,)) for inp, bind in zip(self.calibration, self.bindings)])]
        rt = CpuRuntime(program, self.graph.weights) if ran is None else None  # runs here, batch by batch
        for b, (inp, ref) in enumerate(zip(self.calibration, self.refs)):
            try:
                out = ran[b] if ran is not None else rt.run(inp).outputs
                if isinstance(out, Exception):
                    raise out
            except (ValueError, FloatingPointError) as exc:  # e.g. a REJECT overflow policy
                return Verdict(False, VerdictSource.MEASURED, np.inf, np.inf, None, f"run failed: {exc}", np.inf, np.inf), None
            if outs is not None:
                outs.append(out)
            names = self.gate.outputs or tuple(ref)
            compared = {n: Compared(out[n], ref[n]) for n in names}  # one pair per output for both budgets
            verdict = self.gate.check(compared, ref)
            ratio = max(ratio, budget_ratio(self.gate, verdict))
            user = max(user, self.budget.check(compared, ref).worst_allclose)
            worst_abs = max([worst_abs] + [float(METRICS["max_abs"].of(c)) for c in compared.values()])
            if verdict.worst_allclose >= worst:
                worst, reason = verdict.worst_allclose, verdict.reason
            if not verdict.passed:
                passed, reason = False, verdict.reason
                if outs is None:
                    break
        return Verdict(passed, VerdictSource.MEASURED, worst, worst_abs, None, reason, user, ratio), outs


def _bound_ratio(err: np.ndarray, ref, budget: Budget) -> float:
    """Worst bound / allowance over the elements (an exact element needs no allowance)."""
    tol = budget.atol + budget.rtol * np.abs(np.asarray(ref))
    with np.errstate(divide="ignore", invalid="ignore"):
        return float(np.max(np.where(err == 0, 0.0, err / tol))) if err.size else 0.0
