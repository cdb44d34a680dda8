"""The precision search: sensitivity of each change alone, greedy seeding by latency gain per unit of
error, then random + mutation generations; every candidate passes the numerics gate before its
latency is taken, and the (error, latency) Pareto front of the survivors is kept.

Deterministic for a seed (no wall-clock decisions unless a time limit is set).
"""
from __future__ import annotations

import dataclasses
import time
from types import MappingProxyType
from dataclasses import dataclass
from typing import Callable, Mapping
import numpy as np
from tqdm import tqdm

from .. import interrupts
from ..codegen.invariance import row_coupled_kernels
from ..codegen.llir import Program
from ..error.verdict import PREDICTED_SOURCES, Verdict
from ..runtime.cost import Latency, UnsupportedOnTarget
from ..runtime.launch_form import program_latency
from ..error.executors import ExecutorSpec
from . import allocate
from .front import Evaluated, Stage, choose, front, share
from .outcome import Gate, SearchResult, SearchStats
from .recipes import BASELINE_SOURCES, baselines, rotated_recipes
from .space import ChunkSite, Genome, Offers, SearchSpace, group_of
from .tags import Tag, TagKind, is_kind, priority
from .variants import variant_classes


@dataclass(frozen=True)
class SearchOptions:
    seed: int = 0
    max_candidates: int = 300      # evaluated candidates (numerics-gated), excluding the baselines
    time_limit_s: float | None = None
    mutation_changes: int = 2
    target: str = "h200"
    progress: bool = True
    workers: int = 2               # local processes running chunk verdict tasks (error/tasks.py); 1: none
    executor: ExecutorSpec = ExecutorSpec()  # where those tasks run: this machine (default) or a Ray cluster
    headroom: float | None = None  # share of the budget a plan may use on the calibration set (the rest
                                   # is kept for unseen inputs: audit judges against the full budget);
                                   # None: from data (error/headroom.py), a number overrides it
    offers: Offers = Offers()      # alternatives beyond formats and fusions: GPTQ fills, rotations, smoothings
    batch_invariant: bool = False  # every candidate a batch-invariant program (issue 37): fixed reduction
                                   # orders, fixed attention split sizes, no scale computed across rows
    megakernel: bool = False       # price each candidate also as one persistent megakernel, keep the cheaper
                                   # form (runtime/launch_form.py; a model not yet confirmed on a device)


@dataclass(frozen=True)
class Exploration:
    """The search's candidates before confirmation: the searcher holding them, its baselines, whether
    Ctrl-C stopped it, and the baselines the space could not offer (label -> why: recipes.baselines)."""
    searcher: "Searcher"
    baselines: dict[str, Evaluated]
    interrupted: bool
    refused_baselines: Mapping[str, str] = MappingProxyType({})


class Searcher:
    def __init__(self, space: SearchSpace, judge: Gate, options: SearchOptions, latency_inputs=None,
                 target: str | None = None):
        self.space, self.judge, self.opt = space, judge, options
        self.target = options.target if target is None else target
        self.rng = np.random.default_rng(options.seed)
        self.evaluated: list[Evaluated] = []
        self.seen: dict[Genome, Evaluated] = {}
        self.latency_inputs = latency_inputs
        self.allocation: dict = {}  # per_layer: the Lagrangian vs greedy allocation, which won
        self.deferred_latency: dict[int, Latency | None] = {}  # tentative reject id -> its latency (None: target cannot run it)
        self.t0 = time.perf_counter()
        self.bar = tqdm(total=options.max_candidates, desc="search", unit="cand", disable=not options.progress,
                        leave=False)

    # -- evaluation ---------------------------------------------------------------------------
    def budget_left(self) -> bool:
        n = sum(1 for e in self.evaluated if e.stage != Stage.BASELINE)
        if n >= self.opt.max_candidates:
            return False
        return self.opt.time_limit_s is None or time.perf_counter() - self.t0 < self.opt.time_limit_s

    def latency(self, program) -> Latency | None:
        g = self.space.graph
        try:
            return program_latency(program, self.target, self.judge.latency_bindings, g.weights, self.latency_inputs,
                                   self.opt.megakernel)
        except UnsupportedOnTarget:
            return None

    def evaluate(self, genome: Genome, stage: Stage, label: str = "", force_latency: bool = False) -> Evaluated:
        interrupts.check()  # a Ctrl-C a finalizer swallowed since the last candidate (interrupts.py)
        if genome in self.seen:
            return self.seen[genome]
        lowered: list[Program] = []

        def program() -> Program:  # lowered on demand: a candidate its chunks reject never is
            if not lowered:
                lowered.append(self.space.program(genome))
            return lowered[0]
        # the FP32 baseline (every single change's reference point) and a baseline already run end to end
        # (a headroom probe: its outputs are kept) are measured; the other baselines are judged like any
        # candidate (the front and the chosen plan are confirmed end to end anyway)
        measured = stage == Stage.BASELINE and (not genome or self.judge.has_outputs(program()))
        screen = None if measured else self.space.candidates(genome)
        runs_before = self.judge.measured
        # a baseline is timed whatever its verdict (lowered now), and reported next to the plan: one inside
        # the band is measured, never decided tentatively
        verdict = self.judge.judge(program() if stage == Stage.BASELINE else program, genome, screen,
                                   predict=not measured, tentative=stage != Stage.BASELINE)
        if verdict.passed and self.space.batch_invariant:  # no scale taken over other rows (codegen/invariance.py)
            coupled = row_coupled_kernels(program())
            if coupled:
                verdict = dataclasses.replace(verdict, passed=False, reason=f"not batch-invariant: {coupled[0]}"
                                              + (f" (+{len(coupled) - 1} more)" if len(coupled) > 1 else ""))
        lat = self.latency(program()) if (verdict.passed or force_latency) else None
        if verdict.passed and lat is None:  # the target cannot run this variant (FP8 on an A100)
            verdict = dataclasses.replace(verdict, passed=False, reason=f"not supported on target {self.target}")
        e = Evaluated(len(self.evaluated), genome, verdict, lat, label, stage, lowered[0] if lowered else None,
                      self.judge.measured - runs_before)
        self.evaluated.append(e)
        self.seen[genome] = e
        if stage != Stage.BASELINE:
            self.bar.update(1)
        return e

    # -- phases -------------------------------------------------------------------------------
    def run(self) -> SearchResult:
        return self.confirm(self.explore())

    def explore(self) -> "Exploration":
        """The search's phases, from the baselines to the mutations (Ctrl-C stops it: the candidates so far)."""
        interrupted, refused = False, {}
        try:
            offered, refused = baselines(self.space)
            evaluated = {name: self.evaluate(g, Stage.BASELINE, name, force_latency=True) for name, g in offered.items()}
            base = evaluated["FP32 everywhere"]
            self.uniform()
            singles = self.sensitivity(base)
            self.greedy(base, singles)
            self.crossover()
            self.per_layer()
            self.mutate(singles)
            interrupts.check()  # dropped during the last candidate: the search was interrupted all the same
        except KeyboardInterrupt:  # Ctrl-C: stop cleanly and return what was evaluated, marked interrupted
            interrupts.handled()
            self.bar.close()
            if not self.evaluated:
                raise
            interrupted = True
            evaluated = {e.label: e for e in self.evaluated if e.stage == Stage.BASELINE}
        self.bar.close()
        return Exploration(self, evaluated, interrupted, MappingProxyType(dict(refused)))

    def confirm(self, explored: "Exploration") -> SearchResult:
        """The chosen plan: the front's and the chosen plan's predicted verdicts measured end to end; with
        the statistics of the whole search."""
        interrupted, peers = explored.interrupted, explored.baselines
        # an interrupted search confirms nothing more: its partial plan stands on measurements only
        chosen = choose([e for e in self.passing() if e.verdict.source not in PREDICTED_SOURCES]) if interrupted \
            else self.confirm_finalists()
        stats = SearchStats(len(self.evaluated), time.perf_counter() - self.t0, self.judge.summary(),
                            MappingProxyType(dict(BASELINE_SOURCES)), MappingProxyType(dict(self.allocation)),
                            interrupted, refused_baselines=explored.refused_baselines)
        return SearchResult(self.evaluated, peers, chosen, stats)

    def uniform(self, per_class: int = 2) -> None:
        """Each Gemm variant class on every Gemm that has it (its `per_class` most accurate variants),
        before any single change: the uniform recipes ("BF16 on every Gemm") are always candidates, so
        they are on the front whenever they pass, whatever the later phases find."""
        tags = sorted({t for ks in self.space.knobs.values() for k in ks for t in k.tags if is_kind(t, TagKind.GEMM)})
        for cls_tags in variant_classes(tags, self.target):
            for tag in cls_tags[:per_class]:
                genome = frozenset((gk, k.cls, tag) for gk, ks in self.space.knobs.items() for k in ks
                                   if tag in k.tags)
                if not self.budget_left():
                    return
                self.evaluate(genome, Stage.UNIFORM, f"{Tag.parse(tag).variant} on every Gemm")
        for name, genome in rotated_recipes(self.space).items():  # a rotation (smoothing) pays only with a format
            if self.budget_left():
                self.evaluate(genome, Stage.UNIFORM, name)

    def confirm_finalists(self) -> Evaluated | None:
        """Measure end to end every predicted member of the front and the chosen plan, until the front
        and the choice stand on measurements alone; then each tentative reject that would be chosen were
        it to pass (faster than the chosen plan), fastest first, and confirm again if one passes: a
        rejection without margin never costs the returned plan. Returns the chosen plan."""
        while True:
            chosen = choose(self.passing())
            todo = [e for e in self.front() + ([chosen] if chosen else []) if e.verdict.source in PREDICTED_SOURCES]
            if not todo:
                todo = self._deferred_faster_than(chosen)[:1]
                if not todo:
                    return chosen
            for e in {e.id: e for e in todo}.values():
                self._remeasure(e)
                self.follow_bias()

    def judged_again(self, judge: Callable[[Evaluated], tuple[Verdict, bool]], limit: int) -> tuple[Evaluated | None, int]:
        """The chosen plan judged once more by `judge` (the pooled teacher-forced positions, whose verdict
        replaces the calibration batches'); a rejection fails that candidate and the next choice is confirmed
        and judged, at most `limit` judgements in all (then nothing is chosen). `judge` says whether it ran:
        a verdict it already had (another genome lowering to the same program) is free and not counted.
        Returns the chosen plan and how many judgements ran."""
        chosen, judged = choose(self.passing()), 0
        while chosen is not None:
            if judged == limit:
                return None, judged
            v, ran = judge(chosen)
            judged += ran
            new = dataclasses.replace(chosen, verdict=v, latency=chosen.latency if v.passed else None)
            self.evaluated[chosen.id] = self.seen[chosen.genome] = new
            if v.passed:
                return new, judged
            chosen = self.confirm_finalists()
        return None, judged

    def _remeasure(self, e: Evaluated) -> None:
        """An end-to-end run replaces a candidate's predicted verdict (a tentative reject is timed now:
        its latency was never taken)."""
        runs_before = self.judge.measured
        program = e.program if e.program is not None else self.space.program(e.genome)
        v = self.judge.confirm(program, e.genome, self.space.candidates(e.genome))
        if e.latency is None and e.id not in self.deferred_latency:
            self.deferred_latency[e.id] = self.latency(program)
        latency = (e.latency or self.deferred_latency[e.id]) if v.passed else None
        new = dataclasses.replace(e, verdict=v, latency=latency, program=program,
                                  end_to_end_runs=e.end_to_end_runs + self.judge.measured - runs_before)
        self.evaluated[e.id] = new
        self.seen[e.genome] = new

    def follow_bias(self) -> None:
        """The one place a recorded verdict changes after it was made: an end-to-end run moved the
        composition's bias, so every composed share is re-corrected by it (judge.rebiased), in candidate
        order; a composed pass whose share now exceeds the gate becomes a tentative reject (no latency)."""
        for old in self.evaluated:
            v = self.judge.rebiased(old.verdict)
            if v is not old.verdict:
                self.evaluated[old.id] = self.seen[old.genome] = dataclasses.replace(
                    old, verdict=v, latency=old.latency if v.passed else None)

    def _deferred_faster_than(self, chosen: Evaluated | None) -> list[Evaluated]:
        """Tentative rejects modelled faster than `chosen` (all of them when nothing passed), fastest first;
        each is lowered and timed once (the latency model only: its error verdict stands until measured)."""
        out = []
        for e in self.evaluated:
            if e.verdict.passed or not e.verdict.tentative or e.verdict.source not in PREDICTED_SOURCES:
                continue
            if e.id not in self.deferred_latency:
                program = e.program if e.program is not None else self.space.program(e.genome)
                self.evaluated[e.id] = e = dataclasses.replace(e, program=program)
                self.seen[e.genome] = e
                self.deferred_latency[e.id] = self.latency(program)
            if chosen is None or self._deferred_s(e) < chosen.latency_s:
                out.append(e)
        return sorted(out, key=lambda e: (self._deferred_s(e), e.id))

    def _deferred_s(self, e: Evaluated) -> float:
        lat = self.deferred_latency[e.id]
        return lat.total_s if lat is not None else np.inf

    def passing(self) -> list[Evaluated]:
        return [e for e in self.evaluated if e.verdict.passed and e.latency is not None]

    def sensitivity(self, base: Evaluated) -> list[Evaluated]:
        """Each change alone against the FP32 baseline; a failure prunes every candidate containing it.

        Per knob, the variants are grouped into speed classes (the target's peak for their math, the
        bytes they store) and walked fastest class first, breadth-first over knobs; within a class only
        the a-priori most accurate variant is tried (the others cost the same and are less accurate),
        and a knob stops after two classes pass (a fast choice and a safer one for the greedy step).
        """
        cap = int(self.opt.max_candidates * 0.6)
        plans = []
        for gk, ks in self.space.knobs.items():
            for k in ks:
                plans.append([(gk, k.cls, tags[0]) for tags in variant_classes(k.tags, self.target)])
        plans.sort(key=lambda p: priority(p[0][2]) if p else 9)
        out, passed = [], [0] * len(plans)
        for round_ in range(max((len(p) for p in plans), default=0)):
            for i, p in enumerate(plans):
                if round_ >= len(p) or passed[i] >= 2:
                    continue
                if not self.budget_left() or self._count(Stage.SENSITIVITY) >= cap:
                    return out
                e = self.evaluate(frozenset([p[round_]]), Stage.SENSITIVITY)
                self.judge.note_isolated(p[round_], e.verdict)
                out.append(e)
                passed[i] += e.verdict.passed
        return out

    def _count(self, stage: Stage) -> int:
        return sum(1 for e in self.evaluated if e.stage == stage)

    def greedy(self, base: Evaluated, singles: list[Evaluated]) -> None:
        """Add passing changes in order of latency gain per unit of error while the whole stays in budget."""
        if base.latency is None:
            return
        base_err = share(base) if np.isfinite(share(base)) else 0.0

        def score(e: Evaluated) -> float:
            gain = base.latency_s - e.latency_s
            return gain / max(share(e) - base_err, 1e-12)
        useful = [e for e in singles if e.verdict.passed and e.latency is not None and e.latency_s < base.latency_s]
        useful.sort(key=lambda e: (-score(e), e.id))
        # start from the fastest passing uniform recipe or single change (or FP32): singles then refine it
        # knob by knob (a single can beat every uniform recipe: a fused kernel on a knob the recipe sets)
        starts = [e for e in self.evaluated if e.stage == Stage.UNIFORM and e.verdict.passed and e.latency is not None]
        start = min(starts + useful, key=lambda e: (e.latency_s, e.id), default=base)
        current, current_lat = start.genome, start.latency_s
        for e in useful:
            (change,) = tuple(e.genome)
            if not self.budget_left() or self._count(Stage.GREEDY) >= max(int(self.opt.max_candidates * 0.25), 1):
                break
            if any((g, c) == change[:2] for g, c, _ in current):
                continue
            trial = self.evaluate(current | {change}, Stage.GREEDY)
            if trial.verdict.passed and trial.latency is not None and trial.latency_s < current_lat:
                current, current_lat = trial.genome, trial.latency_s

    def crossover(self) -> None:
        """Each passing peer recipe with the fastest passing plan's changes on the knobs the recipe leaves FP32:
        a recipe sets a whole model at once (every weight in its GGUF blocks) where the other phases change one
        knob at a time, so a recipe's gain and a change it lacks (fused attention) are otherwise never combined."""
        fastest = choose(self.passing())
        if fastest is None:
            return
        for e in list(self.evaluated):
            if e.stage != Stage.BASELINE or not e.genome or not e.verdict.passed or e.latency is None:
                continue
            taken = {(group_of(site), cls) for site, cls, _ in e.genome}
            extra = {(site, cls, tag) for site, cls, tag in fastest.genome if (group_of(site), cls) not in taken}
            if extra and self.budget_left():
                self.evaluate(e.genome | extra, Stage.CROSSOVER, f"{e.label} + the fastest plan's other changes")

    def per_layer(self, share: float = 0.25) -> None:
        """Precision per chunk: from the fastest passing genome, give one chunk of a multi-chunk group the
        choices a faster genome makes for that group (a uniform recipe, passing or not), each chunk alone;
        then allocate the budget across chunks (search/allocate.py) by latency gain and the composed
        predicted error of the chunks' effects, with the Lagrangian and the greedy allocation on the same
        options, each judged; `self.allocation` says which won. Layers differ in sensitivity: the budget
        goes where it buys the most latency."""
        current = choose(self.passing())
        if current is None or not self.judge.per_chunk:  # per-chunk genomes need per-chunk verdicts
            return
        cap = self._count(Stage.LAYER) + max(int(self.opt.max_candidates * share), 1)
        multi = [g for g in self.space.part.groups if len(g.chunks) > 1]
        # uniform recipes in the order tried (fastest class first; a failing one has no latency: it is
        # never timed) and passing greedy genomes, each only if not known to be slower than `current`
        donors = [e for e in self.evaluated if e.stage in (Stage.UNIFORM, Stage.GREEDY) and e.genome != current.genome
                  and (e.latency is None or e.latency_s < current.latency_s)]
        trials: dict[int, list[Evaluated]] = {}  # chunk -> its single-chunk trials that passed and gained
        for donor in donors:
            for g in multi:
                over = {(c, t) for site, c, t in donor.genome if site == g.key}
                if not over or over <= {(c, t) for site, c, t in current.genome if site == g.key}:
                    continue
                for chunk in g.chunks:
                    if not self.budget_left() or self._count(Stage.LAYER) >= cap:
                        break
                    trial = self.evaluate(self.space.per_chunk(current.genome, chunk.index, over), Stage.LAYER,
                                          f"chunk {chunk.index} as {donor.label or f'candidate {donor.id}'}")
                    if trial.verdict.passed and trial.latency is not None and trial.latency_s < current.latency_s:
                        trials.setdefault(chunk.index, []).append(trial)
        if trials:
            self._allocate(current, trials)

    def _allocate(self, current: Evaluated, trials: dict[int, list[Evaluated]], tries: int = 3) -> None:
        """Combine the single-chunk trials by allocate_lagrangian and allocate_greedy (gain: the trial's
        latency saving; error: its composed predicted share over `current`'s); judge both. A combination
        the judge rejects (the composition is first order) is retried with the budget tightened."""
        chunks = sorted(trials)
        extras = [[t.genome - current.genome for t in trials[c]] for c in chunks]
        def genome(sel):
            return allocate.apply(sel, extras, current.genome, lambda ch: (ch[0], ch[1]))
        composed = {}
        def total(sel):
            g = genome(sel)
            if g not in composed:
                composed[g] = self._composed(g)
            return composed[g]
        base = total((allocate.NONE,) * len(chunks))
        options = [[allocate.Option(current.latency_s - t.latency_s, max(total(tuple(
            j if k == i else allocate.NONE for k in range(len(chunks)))) - base, 0.0))
            for j, t in enumerate(trials[c])] for i, c in enumerate(chunks)]
        limit, won = 1.0, {}
        for attempt in range(tries):
            for solve in (allocate.allocate_lagrangian, allocate.allocate_greedy):
                a = solve(options, limit, total)
                if all(j == allocate.NONE for j in a.selection) or not self.budget_left():
                    continue
                e = self.evaluate(genome(a.selection), Stage.LAYER, f"per-layer {a.method} allocation")
                self.allocation.setdefault(f"allocation_{a.method}_predicted", a.total)
                if e.verdict.passed and e.latency is not None:
                    won.setdefault(a.method, e)
                    if a.method == "lagrangian":
                        self.allocation["allocation_lambda"] = a.lam
            if won:
                break
            limit *= 0.5
        for method, e in won.items():
            self.allocation[f"allocation_{method}_s"] = e.latency_s
        self.allocation["allocation_options"] = sum(len(o) for o in options)
        self.allocation["allocation_winner"] = (min(won, key=lambda m: (won[m].latency_s, m != "lagrangian"))
                                                if won else "none")

    def _composed(self, genome: Genome) -> float:
        """The share of the gate a genome uses, predicted from its chunks' effects composed."""
        return self.judge.composed_share(self.space.candidates(genome))

    def mutate(self, singles: list[Evaluated]) -> None:
        """Luminal-style generations: mutate members of the current front, dedupe, gate, keep the front.
        The pool holds every passing change both group-wide and for each chunk of its group alone."""
        pool = sorted({c for e in singles if e.verdict.passed for c in e.genome}
                      | ({(ChunkSite(g.key, ch.index), c, t) for e in singles if e.verdict.passed
                          for site, c, t in e.genome for g in self.space.part.groups
                          if g.key == site and len(g.chunks) > 1 for ch in g.chunks}
                         if self.judge.per_chunk else set()))
        if not pool:
            return
        stale = 0
        while self.budget_left() and stale < 50:
            front = self.front()
            parent = front[int(self.rng.integers(len(front)))].genome if front else frozenset()
            child = dict(((g, c), t) for g, c, t in parent)
            for _ in range(int(self.rng.integers(1, self.opt.mutation_changes + 1))):
                g, c, t = pool[int(self.rng.integers(len(pool)))]
                if child.get((g, c)) == t:
                    del child[(g, c)]
                else:
                    child[(g, c)] = t
            genome = frozenset((g, c, t) for (g, c), t in child.items())
            if genome in self.seen:
                stale += 1
                continue
            stale = 0
            self.evaluate(genome, Stage.MUTATION)

    def front(self) -> list[Evaluated]:
        return front(self.evaluated)


def search(space: SearchSpace, judge: Gate, options: SearchOptions, latency_inputs=None,
           target: str | None = None) -> SearchResult:
    """`target` (default `options.target`): where latencies are modelled or measured."""
    return Searcher(space, judge, options, latency_inputs, target).run()


def explore(space: SearchSpace, judge: Gate, options: SearchOptions, latency_inputs=None,
            target: str | None = None) -> Exploration:
    """The search without its confirmation (compile's `search` stage; `confirm` is the next)."""
    return Searcher(space, judge, options, latency_inputs, target).explore()


def confirm(explored: Exploration) -> SearchResult:
    return explored.searcher.confirm(explored)
