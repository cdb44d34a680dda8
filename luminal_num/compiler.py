"""compile(graph, budget, target, calibration) -> Plan: the whole pipeline in one call.

partition + group -> saturate (lower, precision, dtype_prop, inplace) -> search genomes (numerics gate:
cache -> static bound -> measured vs FP64; then latency) -> the fastest plan within budget.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from .codegen.llir import Program
from .error.budget import Budget
from .error.chunks import ChunkEffects, Propagation
from .error.headroom import HeadroomEstimate, estimate_headroom
from .error.judge import Judge
from .error.reference import Fp64Reference, references
from .error.tasks import TaskPool
from .error.verdict_store import VerdictStore, context_key
from .hlir.graph import Graph
from .hlir.partition import Partition
from .memory import MemoryPlan, plan_memory
from .search.plan import Plan
from .search.search import SearchOptions, SearchResult, _baseline_genomes, search
from .search.space import SearchSpace
from .runtime.targets import get_target


class BudgetUnreachable(RuntimeError):
    """No candidate meets the budget; carries the best error reachable."""

    def __init__(self, budget: Budget, best_error: float, best_label: str, result: SearchResult,
                 headroom: float = 1.0):
        super().__init__(f"no plan meets the budget {budget}: the best error reachable is an allclose ratio of "
                         f"{best_error!r} ({best_label}); a plan may use {headroom!r} of the budget on the "
                         f"calibration set (ratio <= {headroom!r}). Loosen the budget or check the model's "
                         f"FP32 error.")
        self.best_error, self.result = best_error, result


@dataclass(frozen=True)
class CompileResult:
    plan: Plan
    program: Program
    space: SearchSpace
    search: SearchResult


def calibration_ranges(graph: Graph, part: Partition, refs: Sequence[Fp64Reference]) -> dict:
    """FP64 value ranges of every output and chunk export on the calibration set (audit compares)."""
    out: dict[str, tuple[float, float]] = {}
    names = {nid: name for name, nid in graph.outputs.items()}
    for ref in refs:
        vals = ref.values
        for chunk in part.chunks:
            for nid in chunk.exported:
                key = names.get(nid, f"chunk{chunk.index}:%{nid}")
                v = vals[nid]
                lo, hi = (float(np.min(v)), float(np.max(v))) if v.size else (0.0, 0.0)
                old = out.get(key, (lo, hi))
                out[key] = (min(old[0], lo), max(old[1], hi))
    return out


def compile(graph: Graph, budget: Budget, target: str = "h200",
            calibration: Sequence[Mapping[str, np.ndarray]] = (), options: SearchOptions | None = None,
            space: SearchSpace | None = None, use_static: bool | str = "auto",
            cache_dir: str | Path | None = None, memory: MemoryPlan | None = None) -> CompileResult:
    """The fastest plan found whose error vs FP64 on `calibration` is within `budget` on `target`
    (`target` wins over `options.target`). `cache_dir`: measured verdicts persist there (keyed by graph,
    weights, inputs and budget), so a second or interrupted compile of the same job reuses them.
    `memory`: the worker count and cache sizes (memory.py; default: planned for 80% of the available
    memory and `options.workers`)."""
    options = options or SearchOptions(target=target)
    memory = memory or plan_memory(graph.weights, workers=options.workers)
    with memory.applied():
        return _compile(graph, budget, target, calibration, options, space, use_static, cache_dir, memory)


def _compile(graph: Graph, budget: Budget, target: str, calibration, options: SearchOptions,
             space: SearchSpace | None, use_static, cache_dir, memory: MemoryPlan) -> CompileResult:
    if not calibration:
        raise ValueError("compile needs calibration inputs (a list of input dicts)")
    get_target(target)  # an unknown target fails now, not after the first candidate
    unknown = [o for o in budget.outputs or () if o not in graph.outputs]
    if unknown:
        raise ValueError(f"the budget names outputs {unknown} that the graph does not have "
                         f"(outputs: {', '.join(graph.outputs)})")
    if options.max_candidates < 1:
        raise ValueError(f"max_candidates must be >= 1, got {options.max_candidates}")
    _check_inputs(graph, calibration)
    space = space or SearchSpace.build(graph)
    refs = references(graph, calibration, space.part)  # the one FP64 pass per batch, chunk boundaries kept
    if len(space.part.chunks) > 1:
        with TaskPool(graph.weights, memory.workers, memory.worker_cache) as pool:
            chunks, exact = (ChunkEffects(graph, space.part, refs, space.lower_chunk, space.candidates(frozenset()),
                                          mode, pool=pool, changes_of=space.knobs_of, outputs=budget.outputs)
                             for mode in (Propagation.SCALED, Propagation.EXACT))
            return _search(graph, budget, target, calibration, options, space, use_static, cache_dir, refs, chunks,
                           exact)
    return _search(graph, budget, target, calibration, options, space, use_static, cache_dir, refs, None, None)


def _search(graph: Graph, budget: Budget, target: str, calibration, options: SearchOptions, space: SearchSpace,
            use_static, cache_dir, refs, chunks: ChunkEffects | None, exact: ChunkEffects | None) -> CompileResult:
    ran: dict[str, list] = {}  # the headroom probes' outputs: the same programs are baselines of the search
    head = choose_headroom(graph, budget, calibration, refs, space, options.headroom, ran,
                           chunks.pool if chunks is not None else None)
    # candidates are judged against the budget scaled by the headroom; every verdict also carries its
    # ratio against the user's budget, which is what plans and errors report
    gate = budget if head.headroom == 1.0 else budget.tightened(head.headroom)
    store = VerdictStore.open(cache_dir, context_key(graph, calibration, gate, budget)) if cache_dir else None
    judge = Judge(graph, budget, list(calibration), use_static=use_static, headroom=head.headroom, references=refs, chunks=chunks,
                  exact_chunks=exact, store=store,
                  outputs_cache=ran)
    result = search(space, judge, options, latency_inputs=calibration[0], target=target)
    result.stats.update(head.as_dict())
    options = dataclasses.replace(options, headroom=head.headroom)
    if result.chosen is None:
        tried = [e for e in result.evaluated if np.isfinite(e.verdict.error)]
        best = min(tried, key=lambda e: e.verdict.error) if tried else result.evaluated[0]
        raise BudgetUnreachable(budget, best.verdict.budget_error, best.label or f"candidate {best.id}",
                                result, options.headroom)
    chosen = result.chosen
    plan = Plan.create(space, chosen.genome, chosen.program, budget, target, options.seed, chosen.verdict,
                       chosen.latency, judge.bindings[0], _stable_stats(result.stats),
                       calibration_ranges(graph, space.part, refs), graph.weights, headroom=options.headroom)
    return CompileResult(plan, chosen.program, space, result)


PROBES = ("FP32 everywhere", "TF32 flag", "BF16 autocast", "FP16 autocast")  # the headroom's probe programs


def choose_headroom(graph: Graph, budget: Budget, calibration, refs, space: SearchSpace,
                    override: float | None, ran: dict[str, list] | None = None,
                    pool: TaskPool | None = None) -> HeadroomEstimate:
    """The override when given, else the margin measured on split calibration batches (error/headroom.py)
    with the peer baselines as probes (their outputs are kept in `ran`, by program key; run on `pool`)."""
    if override is not None:
        return HeadroomEstimate(override, "override")
    if len(calibration) < 2:
        return estimate_headroom([])
    probe = Judge(graph, budget, list(calibration), use_static=False, references=refs, use_prediction=False,
                  outputs_cache=ran)
    genomes = _baseline_genomes(space)
    return estimate_headroom(probe.batch_ratios([space.program(genomes[n]) for n in PROBES if n in genomes], pool))


def _stable_stats(stats: dict) -> dict:
    """Search statistics that are the same on every run (wall-clock seconds are reported, not stored)."""
    return {k: v for k, v in stats.items() if k != "seconds"}


def _check_inputs(graph: Graph, batches) -> None:
    for i, inp in enumerate(batches):
        missing = [n for n, info in graph.inputs.items() if not info.is_weight and n not in inp]
        if missing:
            raise ValueError(f"calibration batch {i} is missing inputs {missing}")
        for name, arr in inp.items():
            a = np.asarray(arr)
            if a.dtype.kind == "f" and not np.all(np.isfinite(a)):
                raise ValueError(f"calibration batch {i}: input {name!r} contains NaN or Inf")
