"""Numerics: how tight the static error bound is against the measured error, per op family, and how the
compiled plan compares with the plans a user would pick by hand.

Bounds: small graphs of one op family each, random candidates drawn from the full choice space
(structure and precision), inputs drawn uniformly from each input's declared range. Each candidate is
bounded twice: over the whole declared range (Interval(lo, hi): what a compile-time certificate
sees) and at the drawn input itself (point intervals: what the judge's static stage sees). The
tightness of a candidate is max(bound) / max(measured |y - y_fp64|) over the output; a violation is
any element whose measured error exceeds its bound, and must never happen.

Plans: the compiled plan against the search's baselines (FP32 everywhere, the TF32 flag, BF16
autocast, FP8 everywhere) on error vs FP64 and modelled latency, from the compiles that
bench/search_efficiency.py runs.
"""
from __future__ import annotations

import argparse
import warnings
from dataclasses import dataclass
from typing import Callable

import numpy as np
import pandas as pd

from luminal_num.search.lower import lower_program
from luminal_num.error.interval import Interval
from luminal_num.error.judge import program_key
from luminal_num.error.static import static_bound
from luminal_num.hlir import Graph, GraphTensor, evaluate
from luminal_num.runtime.cpu import CpuRuntime
from luminal_num.search.choice import random_candidate
from luminal_num.search.space import SearchSpace

from .search_efficiency import CompiledJob, compile_jobs
from .summary import OUT, write_csv

INPUT, OUTPUT = "x", "y"


@dataclass(frozen=True)
class Family:
    """One op family: y = body(x) for x of `shape` declared in `value_range`; weights come from `rng`."""

    name: str
    shape: tuple[int, ...]
    value_range: tuple[float, float]
    body: Callable[[Graph, GraphTensor, np.random.Generator], GraphTensor]


def _matmul_chain(g: Graph, x: GraphTensor, rng: np.random.Generator) -> GraphTensor:
    dims = (x.shape[-1], 48, 24)
    for i, (k, n) in enumerate(zip(dims, dims[1:])):
        x = x @ g.weight(f"w{i}", rng.standard_normal((k, n)) / np.sqrt(k))
    return x


def _layer_norm(g: Graph, x: GraphTensor, rng: np.random.Generator) -> GraphTensor:
    d = x.shape[-1]
    gamma, beta = 1 + 0.1 * rng.standard_normal(d), 0.1 * rng.standard_normal(d)
    return x.layer_norm(g.weight("gamma", gamma), g.weight("beta", beta))


def _rms_norm(g: Graph, x: GraphTensor, rng: np.random.Generator) -> GraphTensor:
    return x.rms_norm(g.weight("gamma", 1 + 0.1 * rng.standard_normal(x.shape[-1])))


def _residual_layer_norm(g: Graph, x: GraphTensor, rng: np.random.Generator) -> GraphTensor:
    d = x.shape[-1]
    return _layer_norm(g, x + x @ g.weight("w", rng.standard_normal((d, d)) / np.sqrt(d)), rng)


def _swiglu(g: Graph, x: GraphTensor, rng: np.random.Generator) -> GraphTensor:
    d, h = x.shape[-1], 2 * x.shape[-1]
    gate = x @ g.weight("w_gate", rng.standard_normal((d, h)) / np.sqrt(d))
    up = x @ g.weight("w_up", rng.standard_normal((d, h)) / np.sqrt(d))
    return (gate.silu() * up) @ g.weight("w_down", rng.standard_normal((h, d)) / np.sqrt(h))


def _attention(g: Graph, x: GraphTensor, rng: np.random.Generator) -> GraphTensor:
    d = x.shape[-1]
    q, k, v = (x @ g.weight(f"w_{n}", rng.standard_normal((d, d)) / np.sqrt(d)) for n in "qkv")
    return ((q @ k.transpose()) * (1.0 / np.sqrt(d))).softmax(-1) @ v


FAMILIES = (
    Family("matmul_chain", (16, 32), (-1.0, 1.0), _matmul_chain),
    Family("softmax", (8, 64), (-4.0, 4.0), lambda g, x, rng: x.softmax(-1)),
    Family("layer_norm", (16, 64), (-2.0, 2.0), _layer_norm),
    Family("rms_norm", (16, 64), (-2.0, 2.0), _rms_norm),
    Family("residual_layer_norm", (16, 32), (-2.0, 2.0), _residual_layer_norm),
    Family("swiglu", (16, 32), (-1.0, 1.0), _swiglu),
    Family("attention", (8, 32), (-1.0, 1.0), _attention),
    Family("gelu_erf", (16, 64), (-4.0, 4.0), lambda g, x, rng: x.gelu("none")),
    Family("gelu_tanh", (16, 64), (-4.0, 4.0), lambda g, x, rng: x.gelu("tanh")),
    Family("exp", (16, 64), (-4.0, 4.0), lambda g, x, rng: x.exp()),
    Family("log", (16, 64), (0.125, 8.0), lambda g, x, rng: x.log()),
)

# how the input's range is handed to static_bound: the declared interval, or the drawn values themselves
RANGE_KINDS: dict[str, Callable[[Family, np.ndarray], Interval]] = {
    "declared interval": lambda f, x: Interval(f.value_range[0], f.value_range[1]),
    "point": lambda f, x: Interval.point(x),
}


def family_graph(family: Family, seed: int) -> Graph:
    g = Graph()
    x = g.input(INPUT, family.shape, value_range=family.value_range)
    g.output(family.body(g, x, np.random.default_rng(seed)), OUTPUT)
    return g


def random_programs(graph: Graph, count: int, rng: np.random.Generator) -> list:
    """Up to `count` distinct programs (by program key) from random candidates over the whole space."""
    space = SearchSpace.build(graph)
    programs = {}
    for _ in range(count):
        choices = {c.index: random_candidate(space.groups[g.key].space, rng)
                   for g in space.part.groups for c in g.chunks}
        program = lower_program(graph, space.part, space.groups, choices)
        programs.setdefault(program_key(program), program)
    return list(programs.values())


def candidate_rows(family: Family, candidates: int, draws: int, seed: int) -> list[dict]:
    """One row per (distinct candidate, range kind): worst bound, worst measured error over `draws` inputs."""
    graph = family_graph(family, seed)
    rng = np.random.default_rng(seed)
    rows = []
    for index, program in enumerate(random_programs(graph, candidates, rng)):
        runtime = CpuRuntime(program, graph.weights)
        worst = {kind: dict(bound=0.0, measured=0.0, violations=0, overflow=False) for kind in RANGE_KINDS}
        for _ in range(draws):
            x = rng.uniform(*family.value_range, size=family.shape)
            inputs = {INPUT: x}
            error = np.abs(runtime.run(inputs).outputs[OUTPUT] - evaluate(graph, inputs)[OUTPUT])
            for kind, ranges in RANGE_KINDS.items():
                report = static_bound(program, {INPUT: ranges(family, x)}, graph.bind_symbols(inputs), graph.weights)
                w = worst[kind]
                if report.overflow is not None:
                    w["overflow"] = True  # a certain-overflow verdict: a rejection, not a number to compare
                    continue
                bound = report.error_bounds[OUTPUT]
                w["bound"] = max(w["bound"], float(np.max(bound)))
                w["measured"] = max(w["measured"], float(np.max(error)))
                w["violations"] += int(np.count_nonzero(error > bound))
        for kind, w in worst.items():
            informative = not w["overflow"] and np.isfinite(w["bound"]) and w["measured"] > 0
            rows.append(dict(family=family.name, ranges=kind, candidate=index, overflow=w["overflow"],
                             bound=w["bound"], measured=w["measured"], violations=w["violations"],
                             tightness=w["bound"] / w["measured"] if informative else np.nan))
    return rows


def summarize_bounds(rows: pd.DataFrame) -> pd.DataFrame:
    def one(df: pd.DataFrame) -> pd.Series:
        finite = df[~df.overflow & np.isfinite(df.bound)]
        return pd.Series(dict(candidates=len(df), overflow_verdicts=int(df.overflow.sum()),
                              infinite_bounds=int((~df.overflow & ~np.isfinite(df.bound)).sum()),
                              exact=int((finite.measured == 0).sum()),
                              median_tightness=float(df.tightness.median()), max_tightness=float(df.tightness.max()),
                              min_tightness=float(df.tightness.min()), violations=int(df.violations.sum())))
    counts = ("candidates", "overflow_verdicts", "infinite_bounds", "exact", "violations")
    table = rows.groupby(["family", "ranges"], sort=False).apply(one, include_groups=False).reset_index()
    return table.astype({c: int for c in counts})


TIGHTNESS = "numerics_tightness.csv"


def tightness(label: str, candidates: int, draws: int, families: tuple[str, ...] = ()) -> pd.DataFrame:
    """The bound table alone (no compiles), labelled: run it on two versions of the package (PYTHONPATH)
    and the before/after table is written when both labels exist (`numerics_tightness.csv`). A subset of
    families writes its own files (`numerics_tightness_<families>_<label>.csv`), leaving the full table."""
    warnings.filterwarnings("ignore", category=RuntimeWarning)
    unknown = sorted(set(families) - {f.name for f in FAMILIES})
    if unknown:
        raise SystemExit(f"unknown families {unknown}; known: {[f.name for f in FAMILIES]}")
    chosen = [f for f in FAMILIES if not families or f.name in families]
    rows = pd.DataFrame([r for f in chosen for r in candidate_rows(f, candidates, draws, seed=0)])
    table = summarize_bounds(rows).assign(version=label)
    stem = "numerics_tightness" + "".join(f"_{f.name}" for f in chosen if families)
    write_csv(table, f"{stem}_{label}.csv")
    parts = [OUT / f"{stem}_{v}.csv" for v in ("before", "after")]
    if all(p.exists() for p in parts):
        both = pd.concat([pd.read_csv(p) for p in parts])
        keys = ["family", "ranges"]
        wide = both.pivot_table(index=keys, columns="version", sort=False,
                                values=["infinite_bounds", "median_tightness", "max_tightness", "violations"])
        wide.columns = [f"{metric}_{version}" for metric, version in wide.columns]
        write_csv(wide.reset_index(), f"{stem}.csv" if families else TIGHTNESS)
    return table


def plan_rows(c: CompiledJob) -> list[dict]:
    """The chosen plan and every baseline: error vs FP64 (allclose ratio of the user's budget; `passes_gate`
    is the search's verdict, taken with its headroom), modelled latency, speedup over FP32."""
    search = c.result.search
    fp32 = search.baselines["FP32 everywhere"].latency_s
    plans = {"compiled plan": search.chosen, **search.baselines}
    return [dict(job=c.name, plan=name, passes_gate=bool(e.verdict.passed), verdict_source=e.verdict.source,
                 error=c.budget_ratio(e), max_abs=float(e.verdict.max_abs), latency_s=e.latency_s,
                 latency_source=e.latency.source if e.latency is not None else "not profiled",
                 speedup_vs_fp32=fp32 / e.latency_s, changes=len(e.genome), evaluation=e.id)
            for name, e in plans.items()]


def run(compiled: dict[str, CompiledJob] | None = None, quick: bool = False, candidates: int = 40,
        draws: int = 3) -> dict:
    warnings.filterwarnings("ignore", category=RuntimeWarning)  # intervals overflowing to inf are verdicts
    candidates = min(candidates, 10) if quick else candidates
    rows = pd.DataFrame([r for f in FAMILIES for r in candidate_rows(f, candidates, draws, seed=0)])
    write_csv(rows, "numerics_candidates.csv")
    bounds = summarize_bounds(rows)
    write_csv(bounds, "numerics_bounds.csv")
    compiled = compiled if compiled is not None else compile_jobs(quick)
    plans = pd.DataFrame([r for c in compiled.values() for r in plan_rows(c)])
    write_csv(plans, "numerics_plans.csv")
    declared = bounds[bounds.ranges == "declared interval"].set_index("family")
    figures = {"bound violations (all families, both range kinds; must be 0)": int(bounds.violations.sum())}
    for f, r in declared.iterrows():
        if np.isfinite(r.median_tightness):
            figures[f"{f}: median tightness (declared interval)"] = float(r.median_tightness)
            figures[f"{f}: max tightness (declared interval)"] = float(r.max_tightness)
        if r.infinite_bounds:
            figures[f"{f}: infinite bounds (declared interval)"] = f"{int(r.infinite_bounds)} of {int(r.candidates)}"
    for job, df in plans.groupby("job", sort=False):
        chosen = df[df.plan == "compiled plan"].iloc[0]
        passing = df[(df.plan != "compiled plan") & df.passes_gate]
        best = passing.loc[passing.latency_s.idxmin()]
        figures[f"{job}: compiled plan speedup vs FP32 (modelled)"] = float(chosen.speedup_vs_fp32)
        figures[f"{job}: compiled plan vs fastest passing baseline ({best.plan})"] = \
            float(best.latency_s / chosen.latency_s)
        figures[f"{job}: compiled plan error (allclose ratio of the budget)"] = float(chosen.error)
    return figures


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="10 candidates per family, quick compiles")
    ap.add_argument("--candidates", type=int, default=40, help="random candidates per family")
    ap.add_argument("--draws", type=int, default=3, help="input draws per candidate")
    ap.add_argument("--tightness", metavar="LABEL", choices=("before", "after"),
                    help="only the bound table, labelled (run on the old and the new package for before/after)")
    ap.add_argument("--families", default="", help="with --tightness: comma-separated families (default all)")
    args = ap.parse_args(argv)
    if args.tightness:
        table = tightness(args.tightness, args.candidates, args.draws,
                          tuple(f for f in args.families.split(",") if f))
        print(table.to_string(index=False))
        return {}
    figures = run(quick=args.quick, candidates=args.candidates, draws=args.draws)
    for k, v in figures.items():
        print(f"{k}: {v!r}")
    return figures


if __name__ == "__main__":
    main()
