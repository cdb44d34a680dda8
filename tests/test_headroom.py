"""Headroom from data: the margin is a stated quantile (with a floor) of how much worse the peer
baselines do on the calibration batches they were not judged on; an explicit headroom overrides it."""
import argparse

import numpy as np
import pytest

from luminal_num.cli_parser import _headroom_arg
from luminal_num.compiler import PROBES, compile as compile_plan
from luminal_num.error.budget import Budget
from luminal_num.error.headroom import FALLBACK, FLOOR, estimate_headroom, split_ratios
from luminal_num.hlir.evaluate import evaluate
from luminal_num.models.testnets import transformer
from luminal_num.runtime.cpu import CpuRuntime
from luminal_num.search.recipes import baseline_genomes
from luminal_num.search.search import SearchOptions
from luminal_num.search.space import SearchSpace

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")


def test_quantile_of_split_ratios_hand_computed():
    # probe 1: even batches 1, odd 2 -> samples 2 and 0.5; probe 2: 1 and 1.5 -> 1.5 and 1/1.5
    est = estimate_headroom([[1.0, 2.0], [1.0, 1.5]], quantile=0.9)
    assert sorted(est.samples) == pytest.approx([0.5, 2 / 3, 1.5, 2.0])
    # linear interpolation at 0.9 * 3 = 2.7 between 1.5 and 2.0
    assert est.margin == pytest.approx(1.85) and est.headroom == pytest.approx(1 / 1.85) and est.source == "data"


def test_floor_and_fallback():
    assert estimate_headroom([[1.0, 1.0, 1.01]]).headroom == pytest.approx(1 / FLOOR)
    one = estimate_headroom([[0.3]])
    assert one.headroom == FALLBACK and one.source.startswith("fallback")
    assert split_ratios([0.0, 1.0]) == []  # an exact split says nothing


def test_compile_measures_its_headroom_on_split_batches_and_records_it():
    model = transformer(2)
    batches = [model.make_inputs(i) for i in range(4)]
    space = SearchSpace.build(model.graph)
    budget = Budget.parse("atol=1e-2,rtol=1e-2")
    res = compile_plan(model.graph, budget, "h200", batches, SearchOptions(seed=0, max_candidates=8, progress=False),
                       space=space)
    head = res.search.stats.headroom
    assert head.source == "data" and res.plan.headroom == head.headroom
    # independent truth: each probe's allclose share per batch, written with numpy
    genomes = baseline_genomes(space)
    samples = []
    for name in PROBES:
        rt = CpuRuntime(space.program(genomes[name]), model.graph.weights)
        per = []
        for inp in batches:
            out, ref = rt.run(inp).outputs["y"], evaluate(model.graph, inp)["y"]
            per.append(float(np.max(np.abs(out - ref) / (budget.atol + budget.rtol * np.abs(ref)))))
        a, b = max(per[0::2]), max(per[1::2])
        samples += [b / a, a / b]
    assert sorted(head.samples) == pytest.approx(sorted(samples), rel=1e-9)
    assert head.headroom == pytest.approx(1 / max(FLOOR, float(np.quantile(samples, 0.9))))
    override = compile_plan(model.graph, budget, "h200", batches,
                            SearchOptions(seed=0, max_candidates=8, progress=False, headroom=0.7), space=space)
    assert override.plan.headroom == 0.7 and override.search.stats.headroom.source == "override"


def test_cli_headroom_must_be_a_share():
    assert _headroom_arg("0.6") == 0.6
    with pytest.raises(argparse.ArgumentTypeError):
        _headroom_arg("1.5")
