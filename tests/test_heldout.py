"""The held-out check (bench/heldout.py; issue 15, Must show: 0 returned plans that break their budget on
held-out inputs) and the per-layer precision map's "layers differ" test.

Truths: the FP64 evaluation of the graph on the held-out batches (numpy, independent of the plan's
runtime), the user's budget checked on it directly, and per-chunk genomes built by hand.
"""
from __future__ import annotations

import numpy as np
import pytest

from bench import heldout
from bench.strict_budget import blocking, with_changes
from luminal_num.error.budget import Budget
from luminal_num.error.predict import budget_ratio
from luminal_num.hlir.evaluate import evaluate_nodes
from luminal_num.models.registry import transformer_job
from luminal_num.report.layer_map import differing_groups, layer_table
from luminal_num.runtime.cpu import CpuRuntime
from luminal_num.search.space import ChunkSite, SearchSpace


@pytest.fixture(scope="module")
def compiled():
    spec = heldout.HeldoutJob("transformer", transformer_job, 40)
    job, budget, result, _ = heldout.compile_job(spec)
    return job, budget, result


@pytest.fixture(scope="module")
def rows(compiled):
    job, budget, result = compiled
    return heldout.audit_returned("transformer", job, result, budget)


def test_no_returned_plan_breaks_the_users_budget_on_heldout_inputs(compiled, rows):
    _, _, result = compiled
    assert rows[0]["role"] == "chosen" and rows[0]["candidate"] == result.search.chosen.id
    assert len(rows) >= 2, "the front holds more than the chosen plan"
    assert sum(r["broken"] for r in rows) == 0, [r["audit_reason"] for r in rows if r["broken"]]
    assert all(r["heldout_share"] <= 1.0 and r["calibration_share"] <= r["headroom"] * 1.0001 for r in rows)


def test_the_heldout_share_is_the_budget_checked_on_fp64_directly(compiled, rows):
    """Each plan's held-out share recomputed here: its program run on the CPU backend, against the
    FP64 evaluation of the graph, with the user's budget (every metric)."""
    job, budget, result = compiled
    by_id = {e.id: e for e in result.search.evaluated}
    for r in rows[:4]:
        rt = CpuRuntime(by_id[r["candidate"]].program, job.graph.weights)
        share = 0.0
        for inp in job.heldout:
            ref_nodes = evaluate_nodes(job.graph, inp)
            refs = {name: ref_nodes[nid] for name, nid in job.graph.outputs.items()}
            share = max(share, budget_ratio(budget, budget.check(rt.run(inp).outputs, refs)))
        assert r["heldout_share"] == pytest.approx(share, rel=1e-12)


def test_a_budget_the_plans_do_not_meet_counts_them_broken(compiled):
    """The check can fail: the same plans audited against a budget 1000x tighter than the one they
    were compiled for are broken, and the share says by how much."""
    job, budget, result = compiled
    tight = Budget(budget.atol * 1e-3, budget.rtol * 1e-3, budget.outputs, budget.metrics)
    got = heldout.audit_returned("transformer", job, result, tight)
    assert all(r["broken"] == (r["heldout_share"] > 1.0) for r in got)
    assert any(r["broken"] for r in got)


def test_headlines_count_broken_plans(rows):
    import pandas as pd
    df = pd.DataFrame(rows).assign(layers_differ=False, layer_map="")
    h = heldout.headlines(df)
    assert h["broken plans (held-out audit, user's budget)"] == 0 and h["plans audited"] == len(rows)
    ratio = h["transformer: worst held-out / calibration share"]
    assert np.isfinite(ratio) and ratio > 0


def test_layers_differ_only_when_one_chunk_takes_its_own_choice():
    job = transformer_job(3)
    space = SearchSpace.build(job.graph)
    g = next(gr for gr in space.part.groups if len(gr.chunks) > 1)
    groups = [[c.index for c in gr.chunks] for gr in space.part.groups]
    bf16 = {(k.cls, "gemm:bf16") for k in space.knobs[g.key] if "gemm:bf16" in k.tags}
    uniform = frozenset((g.key, c, t) for c, t in bf16)
    one = space.per_chunk(frozenset(), g.chunks[1].index, bf16)
    assert differing_groups(layer_table(space.program(frozenset()), groups)) == []
    assert differing_groups(layer_table(space.program(uniform), groups)) == []
    assert differing_groups(layer_table(space.program(one), groups)) == [space.part.groups.index(g)]


def test_adding_group_changes_replaces_the_chunks_own_choices():
    job = transformer_job(3)
    space = SearchSpace.build(job.graph)
    g = next(gr for gr in space.part.groups if len(gr.chunks) > 1)
    k = next(k for k in space.knobs[g.key] if "gemm:bf16" in k.tags and "gemm:f16" in k.tags)
    mixed = space.per_chunk(frozenset(), g.chunks[0].index, {(k.cls, "gemm:f16")})
    got = with_changes(mixed, [(g.key, k.cls, "gemm:bf16")])
    assert got == frozenset({(g.key, k.cls, "gemm:bf16")})
    assert not any(isinstance(s, ChunkSite) for s, _, _ in got)


def test_the_layer_map_row_names_its_picture_and_the_allocation(compiled, tmp_path, monkeypatch):
    monkeypatch.setattr(heldout, "OUT", tmp_path)
    _, _, result = compiled
    row = heldout.layer_map_row("transformer", result)
    assert (tmp_path / "layer_maps" / "transformer" / "layer_map.png").is_file()
    groups = [[c.index for c in g.chunks] for g in result.space.part.groups]
    assert row["layers_differ"] == bool(differing_groups(layer_table(result.program, groups)))
    assert row["layer_candidates"] == sum(e.stage == "layer" for e in result.search.evaluated)
    assert row["allocation_winner"] == result.search.stats.allocation.get("allocation_winner", "not run")


def test_strict_budget_names_what_blocks_a_plan_below_autocast():
    """bench.strict_budget's one-line answer, on hand-made rows: a tie, a blocker by the budget (the most
    accurate faster plan and its share), or a search that missed a passing faster plan."""
    assert "within the latency tie" in blocking([], 1e-4)
    rows = [{"passes_gate": False, "gate_share": 70.0, "label": "FP8", "latency_s": 0.98e-4},
            {"passes_gate": False, "gate_share": 11.5, "label": "W8A16", "latency_s": 0.95e-4}]
    line = blocking(rows, 1e-4)
    assert "W8A16 (0.95x its latency), uses 11.5x the gate" in line and line.startswith("only 2 plans")
    assert "missing choice is a variant as fast as those (FP8; W8A16) with under 1/11.5 of" in line
    rows[1]["passes_gate"] = True
    assert "the search's choice is the blocker" in blocking(rows, 1e-4)
