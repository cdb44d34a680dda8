"""Reports of a compile: reports/<name>/{pareto.csv, pareto.html, pareto.png, plan_ops.csv, plan.json}."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pandas as pd

from ..search.front import Stage, reported_front
from ..search.plan import scales_path, weights_path
from .files import atomic_files
from .layer_map import write_layer_map
from .pareto import (ALLCLOSE_COLUMN, CHOSEN_COLUMN, CSV_NAME, ERROR_COLUMN, FRONT_COLUMN, HTML_NAME, PNG_NAME,
                     write_op_table, write_pareto_report)

PLAN_NAME, OPS_NAME = "plan.json", "plan_ops.csv"
LAYER_CSV, LAYER_PNG = "layer_map.csv", "layer_map.png"
CHUNKS_NAME = "kernels_per_chunk.csv"
COMPILE_FILES = (CSV_NAME, PNG_NAME, HTML_NAME, OPS_NAME, PLAN_NAME, LAYER_CSV, LAYER_PNG, CHUNKS_NAME,
                 scales_path(PLAN_NAME).name, weights_path(PLAN_NAME).name)
INTERRUPTED_KEY = "interrupted"  # plan.json field marking a partial result (the search was stopped)


def metric_columns(budget) -> tuple[str, ...]:
    """One report column per metric the budget limits, named by the metric (its verdict's worst value over the
    calibration batches; blank where the verdict has none: a static bound, a pruned change)."""
    return tuple(m.name for m in budget.metrics)


def candidate_rows(result) -> pd.DataFrame:
    """One row per evaluated candidate (baselines labelled, the chosen plan and the search's front marked)."""
    metrics = metric_columns(result.plan.budget)
    on_front = {e.id for e in reported_front(result.search.evaluated, result.search.stats.interrupted)}
    chosen_id = result.search.chosen.id if result.search.chosen is not None else -1
    sources = result.search.stats.baseline_sources  # what each labelled baseline follows
    headroom = result.search.stats.headroom_share
    rows = []
    for e in result.search.evaluated:
        label = e.label if e.stage == Stage.BASELINE else ""  # a chosen baseline keeps its recipe's name
        tags = sorted(t for _, _, t in e.genome)
        rows.append({"candidate": e.id,
                     ERROR_COLUMN: e.verdict.share.of_budget(headroom),
                     ALLCLOSE_COLUMN: e.verdict.share.user_allclose,  # against the user's budget
                     **{m: e.verdict.metrics.get(m, float("nan")) for m in metrics},  # a limited max_abs: its value
                     "latency_s": e.latency_s, "latency_source": e.latency.source if e.latency else "not profiled",
                     "launch_form": e.latency.form.value if e.latency else "",
                     "verdict_source": e.verdict.source, "passes": bool(e.verdict.passed), "label": label,
                     "stage": e.stage, "changes": len(tags),
                     **({} if "max_abs" in metrics else {"max_abs": e.verdict.max_abs}),
                     "variants": " ".join(sorted(set(tags))) or "fp32", "reason": e.verdict.reason,
                     "source": sources.get(e.label, "") if e.stage == Stage.BASELINE else "",
                     CHOSEN_COLUMN: e.id == chosen_id, FRONT_COLUMN: e.id in on_front})
    return pd.DataFrame(rows)


def kernels_per_chunk(ops: pd.DataFrame, groups: list[list[int]]) -> pd.DataFrame:
    """Launched kernels per chunk (a layer is a chunk of the group of identical layers), total and by kind:
    what decode latency is made of when launches dominate (issue 16)."""
    group_of = {c: g for g, chunks in enumerate(groups) for c in chunks}
    counts = ops.groupby(["chunk", "kind"]).size().unstack(fill_value=0)
    table = counts.assign(kernels=counts.sum(axis=1)).reset_index()
    table.insert(0, "group", [group_of.get(int(c), -1) for c in table["chunk"]])
    return table[["group", "chunk", "kernels", *counts.columns]]


def write_compile_report(result, out_dir: str | Path, title: str, interrupted: str = "",
                         extra_rows: pd.DataFrame | None = None) -> dict[str, Path]:
    """Every file of a compile, staged beside `out_dir` and moved in only when all were written.

    `interrupted`: why the search stopped early; the plan is then marked as a partial result (in
    plan.json and in the page's title), never mistaken for the search's answer. `extra_rows`: peer rows
    (e.g. ONNX Runtime) judged on the same FP64 reference, shown beside the plans.
    """
    out_dir = Path(out_dir)
    rows = candidate_rows(result)
    if extra_rows is not None and not extra_rows.empty:
        # peers: not searched, never chosen
        rows = pd.concat([rows, extra_rows.assign(**{CHOSEN_COLUMN: False, FRONT_COLUMN: False})], ignore_index=True)
    headroom = result.search.stats.headroom_share
    if interrupted:
        result = dataclasses.replace(result, plan=result.plan.with_fields(**{INTERRUPTED_KEY: interrupted}))
        title = f"{title} [PARTIAL: {interrupted}]"
    with atomic_files(out_dir) as staging:
        groups = [[c.index for c in g.chunks] for g in result.space.part.groups]
        layers = write_layer_map(result.program, groups, staging, frozenset(result.space.graph.weights))
        write_pareto_report(staging, rows, budget_error=1.0, title=title, threshold=headroom,
                            error_label="share of the budget vs FP64, allclose and every metric (<= 1 is within it)",
                            figures=[("The chosen plan per layer: what each kernel computes in, and what its weights "
                                      "(w:) and KV-cache rows (kv:) are stored in", layers["layer_map_png"].read_bytes())],
                            notes=() if result.plan.invariance_price is None else (result.plan.invariance_price.describe(),))
        ops = pd.DataFrame(result.plan.kernels)
        write_op_table(staging / OPS_NAME, ops)
        write_op_table(staging / CHUNKS_NAME, kernels_per_chunk(ops, groups))
        result.plan.save(staging / PLAN_NAME)
    files = {"csv": CSV_NAME, "png": PNG_NAME, "html": HTML_NAME, "ops": OPS_NAME, "plan": PLAN_NAME, "chunks": CHUNKS_NAME,
             **{key: path.name for key, path in layers.items()}}
    return {key: out_dir / name for key, name in files.items()}
