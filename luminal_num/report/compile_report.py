"""Reports of a compile: reports/<name>/{pareto.csv, pareto.html, pareto.png, plan_ops.csv, plan.json}."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from .layer_map import write_layer_map
from .pareto import ReportFiles, write_op_table, write_pareto_report


def candidate_rows(result) -> pd.DataFrame:
    """One row per evaluated candidate (baselines labelled, the chosen plan marked)."""
    chosen_id = result.search.chosen.id if result.search.chosen is not None else -1
    scale = result.search.stats.get("headroom", 1.0)  # judged on the tightened budget: rescale to the user's
    sources = result.search.stats.get("baseline_sources", {})  # what each labelled baseline follows
    rows = []
    for e in result.search.evaluated:
        label = e.label if e.stage == "baseline" else ""
        if e.id == chosen_id:
            label = "chosen"
        tags = sorted(t for _, _, t in e.genome)
        rows.append({"candidate": e.id,
                     "error": float(e.verdict.error) * scale if np.isfinite(e.verdict.error) else np.inf,
                     "latency_s": e.latency_s, "latency_source": e.latency.source if e.latency else "not profiled",
                     "verdict_source": e.verdict.source, "passes": bool(e.verdict.passed), "label": label,
                     "stage": e.stage, "changes": len(tags), "max_abs": e.verdict.max_abs,
                     "variants": " ".join(sorted(set(tags))) or "fp32", "reason": e.verdict.reason,
                     "source": sources.get(e.label, "") if e.stage == "baseline" else ""})
    return pd.DataFrame(rows)


def write_compile_report(result, out_dir: str | Path, title: str) -> dict[str, Path]:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = candidate_rows(result)
    files: ReportFiles = write_pareto_report(out_dir, rows, budget_error=1.0, title=title,
                                             error_label="error vs FP64 (allclose ratio; <= 1 is within budget)")
    ops = write_op_table(out_dir / "plan_ops.csv", pd.DataFrame(result.plan.data["kernels"]))
    plan = result.plan.save(out_dir / "plan.json")
    layers = write_layer_map(result.program, [[c.index for c in g.chunks] for g in result.space.part.groups], out_dir)
    return {"csv": files.csv, "png": files.png, "html": files.html, "ops": ops, "plan": plan, **layers}
