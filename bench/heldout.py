"""Held-out check: every returned plan (the chosen one and every plan on the reported front) re-checked on
inputs the search never saw, against the USER's budget, through the audit path (report/audit.py).

A plan is broken when its audit on the held-out batches fails (target: 0). Per plan the CSV gives the
share of the budget used (allclose and every metric; <= 1 passes) on the calibration batches and on the
held-out ones, their ratio (what the headroom must cover), and the headroom the compile judged with.
It also says whether the chosen plan's per-layer precision map differs between layers, and writes
that picture (reports/bench/layer_maps/<job>/layer_map.png).

`python -m bench.heldout [--jobs transformer minilm smollm2]` writes reports/bench/heldout.csv.
"""
from __future__ import annotations

import argparse
import time
import warnings
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import pandas as pd

from luminal_num.compiler import CompileResult, calibration_ranges, compile
from luminal_num.error.budget import Budget
from luminal_num.error.reference import references
from luminal_num.models.registry import ModelJob, llm_job, minilm_job, transformer_job
from luminal_num.report.audit import audit
from luminal_num.report.layer_map import differing_groups, layer_table, write_layer_map
from luminal_num.search.plan import Plan
from luminal_num.search.search import Evaluated, SearchOptions
from luminal_num.search.space import Offers

from .search_efficiency import final_front
from .summary import OUT, write_csv

TARGET = "h200"
CSV = "heldout.csv"


@dataclass(frozen=True)
class HeldoutJob:
    """A job, its candidate budget and how to load it (the budget: the job's default unless given)."""

    name: str
    load: Callable[[], ModelJob]
    candidates: int
    budget: str | None = None
    offers: Offers = Offers()  # the space's alternatives beyond formats (compile --gptq/--rotate/--smooth)


def jobs(minilm_batch: int = 4, minilm_candidates: int = 60, smollm2_layers: int | None = 2,
         smollm2_candidates: int = 40) -> dict[str, HeldoutJob]:
    return {"transformer": HeldoutJob("transformer", transformer_job, SearchOptions().max_candidates),
            "minilm": HeldoutJob("minilm", lambda: minilm_job(minilm_batch), minilm_candidates),
            "smollm2": HeldoutJob("smollm2", lambda: llm_job(layers=smollm2_layers), smollm2_candidates)}


def plan_of(result: CompileResult, e: Evaluated, budget: Budget, bindings, ranges: dict) -> Plan:
    """The plan file the compiler would have written had `e` been chosen (same fields, same scales)."""
    return Plan.create(result.space, e.genome, e.program, budget, TARGET, 0, e.verdict, e.latency, bindings, {},
                       ranges, result.space.graph.weights, headroom=result.search.stats.headroom_share)


def returned(result: CompileResult) -> list[tuple[str, Evaluated]]:
    """The chosen plan, then every other plan on the reported front (fastest first)."""
    chosen = result.search.chosen
    out = [("chosen", chosen)]
    out += [("front", e) for e in sorted(final_front(result.search.evaluated), key=lambda e: e.latency_s)
            if e.id != chosen.id]
    return out


def audit_returned(name: str, job: ModelJob, result: CompileResult, budget: Budget) -> list[dict]:
    """One row per returned plan: its audit on the calibration and on the held-out batches."""
    graph = job.graph
    refs = references(graph, job.calibration)
    ranges = calibration_ranges(graph, result.space.part, refs)
    stats = result.search.stats.record()
    rows = []
    for role, e in returned(result):
        plan = plan_of(result, e, budget, refs[0].bindings, ranges)
        cal, held = audit(plan, graph, job.calibration), audit(plan, graph, job.heldout)
        rows.append({"job": name, "role": role, "candidate": e.id, "stage": e.stage, "label": e.label,
                     "verdict_source": e.verdict.source, "latency_s": e.latency_s,
                     "headroom": float(stats["headroom"]), "headroom_source": stats.get("headroom_source", ""),
                     "calibration_share": cal.budget_share, "heldout_share": held.budget_share,
                     "heldout_over_calibration": held.budget_share / cal.budget_share if cal.budget_share > 0
                     else float("nan"),
                     "calibration_allclose": cal.audit_error, "heldout_allclose": held.audit_error,
                     "broken": not held.passed, "audit_reason": held.reason})
    return rows


def layer_map_row(name: str, result: CompileResult) -> dict:
    """Whether the chosen plan's precision differs between the layers of a group; writes the picture."""
    groups = [[c.index for c in g.chunks] for g in result.space.part.groups]
    table = layer_table(result.program, groups)
    files = write_layer_map(result.program, groups, OUT / "layer_maps" / name)
    stats = result.search.stats.record()
    return {"job": name, "layers_differ": bool(differing_groups(table)), "layer_map": str(files["layer_map_png"]),
            "layer_candidates": sum(e.stage == "layer" for e in result.search.evaluated),
            "allocation_winner": stats.get("allocation_winner", "not run")}


def compile_job(spec: HeldoutJob) -> tuple[ModelJob, Budget, CompileResult, float]:
    job = spec.load()
    budget = Budget.parse(spec.budget or job.default_budget)
    t0 = time.perf_counter()
    result = compile(job.graph, budget, TARGET, job.calibration,
                     SearchOptions(max_candidates=spec.candidates, target=TARGET, progress=False, offers=spec.offers))
    return job, budget, result, time.perf_counter() - t0


def run(names: Sequence[str] = ("transformer", "minilm", "smollm2"), **kw) -> dict:
    """Compile each job, audit what it returned; heldout.csv (plus the layer-map columns) and headlines."""
    warnings.filterwarnings("ignore", category=RuntimeWarning)
    specs = jobs(**kw)
    rows, maps = [], {}
    for name in names:
        job, budget, result, seconds = compile_job(specs[name])
        print(f"[heldout] {name}: compiled in {seconds:.0f} s, {result.search.stats.candidates} candidates")
        rows += [{**r, "compile_s": seconds} for r in audit_returned(name, job, result, budget)]
        maps[name] = layer_map_row(name, result)
    df = pd.DataFrame(rows)
    for column in ("layers_differ", "layer_map", "layer_candidates", "allocation_winner"):
        df[column] = df.job.map(lambda j: maps[j][column])
    path = write_csv(df, CSV)
    print(df[["job", "role", "candidate", "latency_s", "calibration_share", "heldout_share", "broken"]].to_string())
    print(f"wrote {path}")
    return headlines(df)


def headlines(df: pd.DataFrame) -> dict:
    out = {"broken plans (held-out audit, user's budget)": int(df.broken.sum()), "plans audited": len(df)}
    for job, g in df.groupby("job", sort=False):
        ratio = g.heldout_over_calibration[np.isfinite(g.heldout_over_calibration)]
        out[f"{job}: worst held-out / calibration share"] = float(ratio.max()) if len(ratio) else float("nan")
        out[f"{job}: headroom"] = float(g.headroom.iloc[0])
        out[f"{job}: chosen plan's layers differ"] = bool(g.layers_differ.iloc[0])
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", nargs="+", default=["transformer", "minilm", "smollm2"],
                    choices=["transformer", "minilm", "smollm2"])
    ap.add_argument("--minilm-batch", type=int, default=4)
    ap.add_argument("--minilm-candidates", type=int, default=60)
    ap.add_argument("--smollm2-layers", type=int, default=2, help="0: all 30 layers")
    ap.add_argument("--smollm2-candidates", type=int, default=40)
    a = ap.parse_args(argv)
    return run(a.jobs, minilm_batch=a.minilm_batch, minilm_candidates=a.minilm_candidates,
               smollm2_layers=a.smollm2_layers or None, smollm2_candidates=a.smollm2_candidates)


if __name__ == "__main__":
    main()
