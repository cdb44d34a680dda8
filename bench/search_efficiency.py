"""Search efficiency: how many candidates the search generates, which stage of the numerics gate decided
them (verdict cache, static bound, measurement), how many were pruned or profiled, and how soon the
chosen plan and the final Pareto front appeared.

The gate's point is that latency is never spent on a candidate the contract rejects and measurement
is never spent on one a cheaper stage already decided; these counts show how far that holds.
The compiles are shared with bench/numerics.py (the plan vs baselines table), so they run once.
"""
from __future__ import annotations

import argparse
import os
import resource
import time
import warnings
from dataclasses import dataclass, fields
from typing import Callable

import pandas as pd

from luminal_num.compiler import CompileResult, compile
from luminal_num.error.budget import Budget
from luminal_num.error.judge import GateStats
from luminal_num.models.registry import ModelJob, llm_job, minilm_job, transformer_job

from luminal_num.search.search import Evaluated, SearchOptions, front as search_front

from .summary import OUT, write_csv

TARGET = "h200"
# the gate's stages, in the order it tries them; `pruned` and `stored` (read from the on-disk cache) are
# subsets of the cache's verdicts
# the counters of deciding stages (inside_band groups the in-band counters, read from the stats dict by name)
VERDICT_STAGES = tuple(f.name for f in fields(GateStats) if f.type in (int, "int")
                       and f.name not in ("pruned", "stored", "tentative", "deferred", "deferred_measured", "exact"))


@dataclass(frozen=True)
class JobSpec:
    """A job the benchmark compiles and its candidate budget (full run, --quick run; None: not in --quick,
    MiniLM's candidates each run a real encoder on the CPU emulator, minutes for even a few)."""

    name: str
    load: Callable[[], ModelJob]
    max_candidates: int
    quick_candidates: int | None


SPECS = (JobSpec("transformer", transformer_job, SearchOptions().max_candidates, 40),
         JobSpec("minilm", lambda: minilm_job(16), 100, None))
# on request (--jobs smollm2): SmolLM2-135M decode:8@64 (30 layers) on the shipped prompts; bench/numerics.py
# shares SPECS and does not compile it
ON_REQUEST = (JobSpec("smollm2", llm_job, 200, None),)


@dataclass(frozen=True)
class CompiledJob:
    name: str
    job: ModelJob
    budget: Budget
    options: SearchOptions
    result: CompileResult
    compile_s: float  # wall time of compile(), including the FP64 references and saturation
    load: tuple[float, float]  # the machine's 1-minute load average before and after the compile
    peak_rss_gb: tuple[float, float] = (float("nan"), float("nan"))  # this process, its largest child (so far)

    def budget_ratio(self, e: Evaluated) -> float:
        """A candidate's error as an allclose ratio of the user's budget (<= 1 fits it): the search
        judges against the budget tightened by its headroom, and a ratio scales with the tolerance."""
        return float(e.verdict.share.allclose) * self.result.search.stats.headroom_share


def compile_jobs(quick: bool = False, only: tuple[str, ...] | None = None) -> dict[str, CompiledJob]:
    """Compile every job of SPECS (or those named in `only`) with its default budget on TARGET (seed 0)."""
    warnings.filterwarnings("ignore", category=RuntimeWarning)  # intervals overflowing to inf are verdicts
    out = {}
    for spec in SPECS if only is None else SPECS + ON_REQUEST:
        if (quick and spec.quick_candidates is None) or (only is not None and spec.name not in only):
            continue
        job = spec.load()
        budget = Budget.parse(job.default_budget)
        options = SearchOptions(max_candidates=spec.quick_candidates if quick else spec.max_candidates,
                                target=TARGET, progress=False)
        t0, load0 = time.perf_counter(), os.getloadavg()[0]
        result = compile(job.graph, budget, TARGET, job.calibration, options)
        out[spec.name] = CompiledJob(spec.name, job, budget, options, result, time.perf_counter() - t0,
                                     (load0, os.getloadavg()[0]), peak_rss())
        print(f"[search_efficiency] {spec.name}: {len(result.search.evaluated)} candidates in "
              f"{out[spec.name].compile_s!r} s: {efficiency_row(out[spec.name])}", flush=True)
    return out


def peak_rss() -> tuple[float, float]:
    """Peak resident memory so far (GB) of this process and of its largest finished child (the verdict
    pool's workers share the weights with this process by fork: their sum over-counts those pages)."""
    return tuple(resource.getrusage(who).ru_maxrss / 2 ** 20 for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))


def final_front(evaluated: list[Evaluated]) -> list[Evaluated]:
    """The passing, profiled candidates on the (budget share, latency) Pareto front at the end of the
    search: the front the search confirms (search.front; allclose alone is 0 for every LLM plan)."""
    return search_front(evaluated)


def layers_differ(c: CompiledJob) -> int:
    """How many chunks of multi-chunk groups run other choices than their group's first chunk."""
    cands = c.result.space.candidates(c.result.search.chosen.genome)
    return sum(cands[ch.index] != cands[g.chunks[0].index] for g in c.result.space.part.groups for ch in g.chunks)


def efficiency_row(c: CompiledJob) -> dict:
    search = c.result.search
    stats = search.stats.record()
    evaluated = search.evaluated
    gate = {f"decided_by_{k}": stats[k] for k in VERDICT_STAGES}
    front = final_front(evaluated)
    chosen = search.chosen
    searched = [e for e in evaluated if e.stage != "baseline"]
    # a candidate decided without an end-to-end run cost none (a cache hit on a program measured for an
    # earlier genome carries that genome's "measured" verdict, so the verdict's source cannot tell)
    no_e2e = sum(e.end_to_end_runs == 0 for e in searched)
    return dict(job=c.name, budget=str(c.budget), candidates=len(evaluated),
                decided_without_e2e=no_e2e / max(len(searched), 1), confirmed=stats["confirmed"],
                mismatches=stats["mismatches"], prediction_margin=stats.get("prediction_margin"),
                baselines=sum(e.stage == "baseline" for e in evaluated), **gate,
                pruned=stats["pruned"],  # monotone pruning: counted among the cache's verdicts
                passed=sum(bool(e.verdict.passed) for e in evaluated),
                profiled=sum(e.latency is not None for e in evaluated),
                profiled_rejected=sum(e.latency is not None and not e.verdict.passed for e in evaluated),
                search_s=stats["seconds"], compile_s=c.compile_s,
                search_s_per_candidate=stats["seconds"] / len(evaluated),
                chosen_index=chosen.id, chosen_stage=chosen.stage, chosen_source=chosen.verdict.source,
                front_size=len(front), front_complete_index=max(e.id for e in front),
                headroom=stats["headroom"], chosen_error=c.budget_ratio(chosen),
                chosen_share=float(chosen.verdict.share.gate) * stats["headroom"], chosen_latency_s=chosen.latency_s,
                chunk_margin=stats.get("chunk_margin"), chosen_chunks_differing=layers_differ(c),
                chunk_runs=stats.get("chunk_runs"), chunk_composed=stats.get("chunk_composed"),
                chunk_shared=stats.get("chunk_shared"), chunk_local_checks=stats.get("chunk_local_checks"),
                chunk_compose_off=stats.get("chunk_compose_off", ""), chunk_bias=stats.get("chunk_bias"),
                tentative=stats.get("tentative"), deferred=stats.get("deferred"),
                deferred_measured=stats.get("deferred_measured"),
                decided_exactly=stats.get("exact"), exact_margin=stats.get("exact_margin"),
                exact_bias=stats.get("exact_bias"), exact_checks=stats.get("exact_checks"),
                exact_runs=stats.get("exact_runs"), exact_injections=stats.get("exact_injections"),
                peak_rss_gb=c.peak_rss_gb[0], peak_rss_worker_gb=c.peak_rss_gb[1],
                load_before=c.load[0], load_after=c.load[1])


def candidate_row(c: CompiledJob, e: Evaluated) -> dict:
    """One evaluated candidate: its phase, what decided it (after confirmation), the end-to-end runs it cost
    (0 for a cache hit, whose source is the cached verdict's: a program equal to FP32's says "measured"),
    error and latency."""
    return dict(job=c.name, id=e.id, stage=e.stage, label=e.label, changes=len(e.genome), source=e.verdict.source,
                end_to_end_runs=e.end_to_end_runs,
                passed=bool(e.verdict.passed), error=float(e.verdict.share.allclose), ratio=float(e.verdict.share.gate),
                latency_s=e.latency_s, reason=e.verdict.reason[:160])


def _merged(df: pd.DataFrame, name: str, only: tuple[str, ...] | None) -> pd.DataFrame:
    """`--jobs` re-measures those jobs: the other jobs' rows already in the table are kept."""
    path = OUT / name
    if only is None or not path.exists():
        return df
    old = pd.read_csv(path)
    return pd.concat([old[~old.job.isin(df.job)], df], ignore_index=True) if "job" in old else df


def run(compiled: dict[str, CompiledJob] | None = None, quick: bool = False,
        only: tuple[str, ...] | None = None) -> dict:
    compiled = compiled if compiled is not None else compile_jobs(quick, only)
    df = pd.DataFrame([efficiency_row(c) for c in compiled.values()])
    write_csv(_merged(df, "search_efficiency.csv", only), "search_efficiency.csv")
    cands = pd.DataFrame([candidate_row(c, e) for c in compiled.values() for e in c.result.search.evaluated])
    write_csv(_merged(cands, "search_candidates.csv", only), "search_candidates.csv")
    return figures(df)


def figures(df: pd.DataFrame) -> dict:
    """The headline figures of search_efficiency.csv rows (one job per row)."""
    figures = {}
    for r in df.itertuples():
        gate = ", ".join(f"{c.removeprefix('decided_by_')} {getattr(r, c)}" for c in df.columns
                         if c.startswith("decided_by_"))
        figures[f"{r.job}: candidates"] = int(r.candidates)
        figures[f"{r.job}: decided by"] = gate
        figures[f"{r.job}: decided without an end-to-end run"] = float(r.decided_without_e2e)
        figures[f"{r.job}: pruned (a change that alone breaks the budget)"] = int(r.pruned)
        figures[f"{r.job}: profiled (latency taken)"] = int(r.profiled)
        figures[f"{r.job}: search wall seconds"] = float(r.search_s)
        figures[f"{r.job}: compile wall seconds (load {r.load_before:.1f} -> {r.load_after:.1f})"] = float(r.compile_s)
        figures[f"{r.job}: peak RSS GB (compiler, largest worker)"] = f"{r.peak_rss_gb:.2f}, {r.peak_rss_worker_gb:.2f}"
        figures[f"{r.job}: chunks whose choices differ from their group's first"] = int(r.chosen_chunks_differing)
        figures[f"{r.job}: chosen plan found at evaluation"] = f"{r.chosen_index} of {r.candidates} ({r.chosen_stage})"
        figures[f"{r.job}: final front complete at evaluation"] = int(r.front_complete_index)
    return figures


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="few candidates, transformer only (smoke run)")
    ap.add_argument("--jobs", default=None, help=f"comma-separated subset of {', '.join(s.name for s in SPECS + ON_REQUEST)}")
    args = ap.parse_args(argv)
    figures = run(quick=args.quick, only=tuple(args.jobs.split(",")) if args.jobs else None)
    for k, v in figures.items():
        print(f"{k}: {v!r}")
    return figures


if __name__ == "__main__":
    main()
