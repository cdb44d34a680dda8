"""The precision search: sensitivity of each change alone, greedy seeding by latency gain per unit of
error, then random + mutation generations; every candidate passes the numerics gate before its
latency is taken, and the (error, latency) Pareto front of the survivors is kept.

Deterministic for a seed (no wall-clock decisions unless a time limit is set).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
from tqdm import tqdm

from ..error.judge import Judge, Verdict
from ..runtime.cost import Latency, UnsupportedOnTarget
from ..runtime.latency import program_latency
from .space import Change, Genome, SearchSpace


@dataclass(frozen=True)
class SearchOptions:
    seed: int = 0
    max_candidates: int = 300      # evaluated candidates (numerics-gated), excluding the baselines
    time_limit_s: float | None = None
    mutation_changes: int = 2
    target: str = "h200"
    progress: bool = True


@dataclass(frozen=True)
class Evaluated:
    id: int
    genome: Genome
    verdict: Verdict
    latency: Latency | None   # None when the gate rejected it (latency is never spent on those)
    label: str = ""
    stage: str = ""           # baseline | sensitivity | greedy | mutation

    @property
    def latency_s(self) -> float:
        return self.latency.total_s if self.latency is not None else float("nan")


@dataclass
class SearchResult:
    evaluated: list[Evaluated]
    baselines: dict[str, Evaluated]
    chosen: Evaluated | None
    stats: dict = field(default_factory=dict)

    def passing(self) -> list[Evaluated]:
        return [e for e in self.evaluated if e.verdict.passed and e.latency is not None]


def _baseline_genomes(space: SearchSpace) -> dict[str, Genome]:
    """What users pick today: FP32 everywhere, the global TF32 flag, BF16 by an autocast-style op list
    (matmuls and pointwise ops in BF16, reductions/norms and softmax in FP32), FP8 everywhere."""
    def pick(pred) -> Genome:
        out = {}
        for gk, ks in space.knobs.items():
            for k in ks:
                tag = next((t for t in k.tags if pred(t)), None)
                if tag is not None:
                    out[(gk, k.cls)] = tag
        return frozenset((g, c, t) for (g, c), t in out.items())
    return {"FP32 everywhere": frozenset(),
            "TF32 flag": pick(lambda t: t == "gemm:tf32"),
            "BF16 autocast": pick(lambda t: t in ("gemm:bf16", "ew:bf16")),
            "FP8 everywhere": pick(lambda t: t == "gemm:f8e4m3_tensor")}


class Searcher:
    def __init__(self, space: SearchSpace, judge: Judge, options: SearchOptions, latency_inputs=None):
        self.space, self.judge, self.opt = space, judge, options
        self.rng = np.random.default_rng(options.seed)
        self.evaluated: list[Evaluated] = []
        self.seen: dict[Genome, Evaluated] = {}
        self.latency_inputs = latency_inputs
        self.t0 = time.perf_counter()
        self.bar = tqdm(total=options.max_candidates, desc="search", unit="cand", disable=not options.progress,
                        leave=False)

    # -- evaluation ---------------------------------------------------------------------------
    def budget_left(self) -> bool:
        n = sum(1 for e in self.evaluated if e.stage != "baseline")
        if n >= self.opt.max_candidates:
            return False
        return self.opt.time_limit_s is None or time.perf_counter() - self.t0 < self.opt.time_limit_s

    def latency(self, program) -> Latency | None:
        g = self.space.graph
        try:
            return program_latency(program, self.opt.target, self.judge.bindings[0], g.weights, self.latency_inputs)
        except UnsupportedOnTarget:
            return None

    def evaluate(self, genome: Genome, stage: str, label: str = "", force_latency: bool = False) -> Evaluated:
        if genome in self.seen:
            return self.seen[genome]
        program = self.space.program(genome)
        verdict = self.judge.judge(program, genome)
        lat = self.latency(program) if (verdict.passed or force_latency) else None
        if verdict.passed and lat is None:  # the target cannot run this variant (FP8 on an A100)
            verdict = Verdict(False, verdict.source, verdict.error, verdict.max_abs, verdict.bound,
                              f"not supported on target {self.opt.target}")
        e = Evaluated(len(self.evaluated), genome, verdict, lat, label, stage)
        self.evaluated.append(e)
        self.seen[genome] = e
        if stage != "baseline":
            self.bar.update(1)
        return e

    # -- phases -------------------------------------------------------------------------------
    def run(self) -> SearchResult:
        baselines = {name: self.evaluate(g, "baseline", name, force_latency=True)
                     for name, g in _baseline_genomes(self.space).items()}
        base = baselines["FP32 everywhere"]
        singles = self.sensitivity(base)
        self.greedy(base, singles)
        self.mutate(singles)
        self.bar.close()
        passing = [e for e in self.evaluated if e.verdict.passed and e.latency is not None]
        chosen = min(passing, key=lambda e: (e.latency_s, e.verdict.error, e.id)) if passing else None
        stats = {"candidates": len(self.evaluated), "seconds": time.perf_counter() - self.t0,
                 **self.judge.stats.as_dict()}
        return SearchResult(self.evaluated, baselines, chosen, stats)

    def sensitivity(self, base: Evaluated) -> list[Evaluated]:
        """Each change alone against the FP32 baseline; failures prune every candidate containing them."""
        out = []
        for change in self.space.all_changes():
            if not self.budget_left():
                break
            e = self.evaluate(frozenset([change]), "sensitivity")
            self.judge.note_isolated(change, e.verdict)
            out.append(e)
        return out

    def greedy(self, base: Evaluated, singles: list[Evaluated]) -> None:
        """Add passing changes in order of latency gain per unit of error while the whole stays in budget."""
        if base.latency is None:
            return
        base_err = base.verdict.error if np.isfinite(base.verdict.error) else 0.0

        def score(e: Evaluated) -> float:
            gain = base.latency_s - e.latency_s
            return gain / max(e.verdict.error - base_err, 1e-12)
        useful = [e for e in singles if e.verdict.passed and e.latency is not None and e.latency_s < base.latency_s]
        useful.sort(key=lambda e: (-score(e), e.id))
        current, current_lat = frozenset(), base.latency_s
        for e in useful:
            (change,) = tuple(e.genome)
            if any((g, c) == change[:2] for g, c, _ in current) or not self.budget_left():
                continue
            trial = self.evaluate(current | {change}, "greedy")
            if trial.verdict.passed and trial.latency is not None and trial.latency_s < current_lat:
                current, current_lat = trial.genome, trial.latency_s

    def mutate(self, singles: list[Evaluated]) -> None:
        """Luminal-style generations: mutate members of the current front, dedupe, gate, keep the front."""
        pool = sorted({c for e in singles if e.verdict.passed for c in e.genome})
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
            self.evaluate(genome, "mutation")

    def front(self) -> list[Evaluated]:
        passing = [e for e in self.evaluated if e.verdict.passed and e.latency is not None]
        passing.sort(key=lambda e: (e.latency_s, e.verdict.error, e.id))
        out, best_err = [], np.inf
        for e in passing:
            if e.verdict.error < best_err:
                out.append(e)
                best_err = e.verdict.error
        return out


def search(space: SearchSpace, judge: Judge, options: SearchOptions, latency_inputs=None) -> SearchResult:
    return Searcher(space, judge, options, latency_inputs).run()
