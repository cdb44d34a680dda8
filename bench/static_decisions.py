"""Why the static stage decides what it decides: for every distinct program a search judged, its static
bound per output against the gate it is judged by and against its measured error, and, for the FP32
program, where along the kernels the bound is lost.

search_efficiency.csv counts `decided_by_static`; this shows the numbers behind the count. A candidate is
certified when its bound uses at most the whole gate (allclose and every metric the bound can speak to,
error/static_metrics.py); a bound never drops below the measured error (checked here on every element:
a violation stops the run). Writes reports/bench/static_decisions.csv (one row per program) and
static_growth.csv (per kernel of the FP32 program: the largest elementwise bound and row-norm bound);
`--smollm2-layers N` instead bounds a SmolLM2 decode step of N layers (static_smollm2.csv).
"""
from __future__ import annotations

import argparse
import time
import warnings

import numpy as np
import pandas as pd

from luminal_num.compiler import compile
from luminal_num.error.budget import Budget
from luminal_num.error.deciders import _bound_ratio, _metric_ratio
from luminal_num.error.interval import Interval
from luminal_num.error.judge import Judge
from luminal_num.error.static import StaticAnalyzer, static_bound
from luminal_num.error.verdict import program_key
from luminal_num.models.registry import minilm_job, transformer_job
from luminal_num.runtime.cpu import CpuRuntime
from luminal_num.search.search import SearchOptions

from .summary import OUT, write_csv

TARGET = "h200"
JOBS = {"transformer": transformer_job, "minilm": lambda: minilm_job(16)}


def _point_ranges(inputs) -> dict[str, Interval]:
    return {k: Interval.point(np.asarray(v, dtype=np.float64)) for k, v in inputs.items()}


def program_row(job: str, e, program, ev, norms: dict) -> dict:
    """One program's static bound vs the gate and vs its measured error, over the calibration batches."""
    t0 = time.perf_counter()
    bound_ratio = metric_ratio = measured_ratio = bound_max = measured_max = 0.0
    overflow = ""
    for inputs, bindings, ref in zip(ev.calibration, ev.bindings, ev.refs):
        rep = static_bound(program, _point_ranges(inputs), bindings, ev.graph.weights, norms)
        if rep.overflow is not None:
            overflow = rep.overflow.message()
            break
        out = CpuRuntime(program, ev.graph.weights).run(inputs).outputs
        for name in ev.gate.outputs or tuple(rep.error_bounds):
            err = rep.error_bounds[name]
            diff = np.abs(np.asarray(out[name], dtype=np.float64) - ref[name])
            if not np.all(diff <= err):
                raise AssertionError(f"{job} candidate {e.id}: static bound below the measured error on {name}")
            bound_ratio = max(bound_ratio, _bound_ratio(err, ref[name], ev.gate))
            metric_ratio = max(metric_ratio, _metric_ratio(err, ref[name], ev.gate) if ev.gate.metrics else 0.0)
            measured_ratio = max(measured_ratio, _bound_ratio(diff, ref[name], ev.gate))
            bound_max, measured_max = max(bound_max, float(np.max(err))), max(measured_max, float(np.max(diff)))
    share = max(bound_ratio, metric_ratio)
    return dict(job=job, id=e.id, label=e.label, verdict_source=str(e.verdict.source), passed=bool(e.verdict.passed),
                bound_max=bound_max, measured_max=measured_max,
                looseness=bound_max / measured_max if measured_max > 0 else np.inf,
                bound_allclose_share=bound_ratio, bound_metric_share=metric_ratio, measured_allclose_share=measured_ratio,
                certifiable=bool(share <= 1.0) and not overflow, overflow=overflow,
                static_s=time.perf_counter() - t0)


def growth_rows(job: str, program, ev) -> list[dict]:
    """Per kernel of `program` on the first calibration batch: the largest elementwise bound and row-norm
    bound (where the bound is lost along the model)."""
    inputs = _point_ranges(ev.calibration[0])
    for name, w in ev.graph.weights.items():
        inputs.setdefault(name, Interval.point(np.asarray(w, dtype=np.float64)))
    an = StaticAnalyzer(program, ev.bindings[0], ev.graph.weights)
    rows = []
    for k in program.kernels:
        v = an.kernel(k, inputs)
        an.vals[k.id] = v
        if k.kind.value == "external":
            continue
        err = np.broadcast_to(v.err, v.iv.lo.shape)
        rows.append(dict(job=job, kernel=k.id, kind=k.kind.value, label=k.label,
                         err_max=float(np.max(err)) if err.size else 0.0,
                         ball_max=float(np.max(v.ball)) if v.ball is not None and np.size(v.ball) else np.nan,
                         value_max=float(np.max(v.iv.magnitude)) if err.size else 0.0))
    return rows


def run(jobs: tuple[str, ...], candidates: int, programs: int | None) -> tuple[pd.DataFrame, pd.DataFrame]:
    warnings.filterwarnings("ignore", category=RuntimeWarning)
    rows, growth = [], []
    for name in jobs:
        job = JOBS[name]()
        budget = Budget.parse(job.default_budget)
        options = SearchOptions(max_candidates=candidates, target=TARGET, progress=False)
        result = compile(job.graph, budget, TARGET, job.calibration, options, use_static=False)
        head = result.search.stats.headroom_share
        ev = Judge(job.graph, budget, list(job.calibration), use_static=True, headroom=head, use_prediction=False).ev
        norms: dict = {}
        seen: set[str] = set()
        for e in result.search.evaluated:
            program = e.program if e.program is not None else result.space.program(e.genome)
            key = program_key(program)
            if key in seen:
                continue
            if not seen:
                growth += growth_rows(name, program, ev)
            seen.add(key)
            rows.append(program_row(name, e, program, ev, norms))
            print(f"[static_decisions] {name} #{e.id} {e.label or '-'}: bound {rows[-1]['bound_max']:.3g} "
                  f"measured {rows[-1]['measured_max']:.3g} share {rows[-1]['bound_allclose_share']:.3g}", flush=True)
            if programs is not None and len(seen) >= programs:
                break
    return pd.DataFrame(rows), pd.DataFrame(growth)


def smollm2_row(layers: int, workload: str, genome: str = "FP32 everywhere") -> dict:
    """A SmolLM2 decode step's static logit bound against its measured error (calibration batch 0), every
    output checked within its bound, with the analysis' time and this process's peak memory."""
    from luminal_num.hlir import evaluate
    from luminal_num.models.registry import llm_job
    from luminal_num.search.recipes import baseline_genomes
    from luminal_num.search.space import SearchSpace
    warnings.filterwarnings("ignore", category=RuntimeWarning)
    job = llm_job("smollm2", workload, layers=layers)
    space = SearchSpace.build(job.graph)
    program, g, inputs = space.program(baseline_genomes(space)[genome]), job.graph, job.calibration[0]
    model_gb = _peak_rss_gb()
    t0 = time.perf_counter()
    rep = static_bound(program, _point_ranges(inputs), g.bind_symbols(inputs), g.weights)
    static_s, static_gb = time.perf_counter() - t0, _peak_rss_gb()
    out = CpuRuntime(program, g.weights).run(inputs).outputs
    ref = evaluate(g, inputs)
    diff = {n: np.abs(np.asarray(out[n], dtype=np.float64) - ref[n]) for n in ref}
    if not all(np.all(diff[n] <= rep.error_bounds[n]) for n in diff):
        raise AssertionError(f"SmolLM2 {layers} layers {genome}: a static bound below the measured error")
    return dict(layers=layers, workload=workload, genome=genome, bound_max=float(np.max(rep.error_bounds["logits"])),
                measured_max=float(np.max(diff["logits"])), outputs_within_bound=len(diff), static_s=static_s,
                peak_rss_model_gb=model_gb, peak_rss_static_gb=static_gb)


def _peak_rss_gb() -> float:
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20


def _merged(df: pd.DataFrame, name: str) -> pd.DataFrame:
    """The jobs run replace their rows; other jobs' rows already in the table are kept."""
    path = OUT / name
    if not path.exists():
        return df
    old = pd.read_csv(path)
    return pd.concat([old[~old.job.isin(df.job)], df], ignore_index=True)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--jobs", default="transformer", help=f"comma-separated subset of {', '.join(JOBS)}")
    ap.add_argument("--candidates", type=int, default=40, help="the search's candidate budget per job")
    ap.add_argument("--programs", type=int, default=None,
                    help="bound at most this many distinct programs per job (MiniLM: ~80 s each at batch 16)")
    ap.add_argument("--smollm2-layers", type=int, default=None,
                    help="instead: the FP32 bound of a SmolLM2 decode:8@64 step of this many layers "
                         "(reports/bench/static_smollm2.csv; 30 layers: ~2 min, ~4 GB)")
    args = ap.parse_args(argv)
    if args.smollm2_layers is not None:
        row = smollm2_row(args.smollm2_layers, "decode:8@64")
        old = pd.read_csv(OUT / "static_smollm2.csv") if (OUT / "static_smollm2.csv").exists() else None
        df = pd.DataFrame([row])
        if old is not None:
            df = pd.concat([old[(old.layers != row["layers"]) | (old.genome != row["genome"])], df], ignore_index=True)
        write_csv(df, "static_smollm2.csv")
        print(row)
        return row
    df, growth = run(tuple(args.jobs.split(",")), args.candidates, args.programs)
    write_csv(_merged(df, "static_decisions.csv"), "static_decisions.csv")
    write_csv(_merged(growth, "static_growth.csv"), "static_growth.csv")
    figures = {}
    for job, g in _merged(df, "static_decisions.csv").groupby("job"):
        figures[f"{job}: programs bounded"] = len(g)
        figures[f"{job}: certifiable by the static bound"] = int(g.certifiable.sum())
        figures[f"{job}: smallest bound share of the gate"] = float(np.min(g.bound_allclose_share))
        figures[f"{job}: median bound / measured error"] = float(np.median(g.looseness))
    for k, v in figures.items():
        print(f"{k}: {v!r}")
    return figures


if __name__ == "__main__":
    main()
