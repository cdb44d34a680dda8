"""What a CPU runtime keeps between runs (its output buffers, compiled reads and bodies, the ids of the
values bodies share) must not carry one run's values into the next: a runtime run on new inputs
gives, bit for bit, what a fresh runtime gives."""
from __future__ import annotations

import numpy as np
import pytest

from luminal_num.models.testnets import all_test_models
from luminal_num.runtime.cpu import CpuRuntime
from luminal_num.search.extract import BASE
from luminal_num.search.space import SearchSpace


def _genomes(space: SearchSpace):
    """The FP32 plan and the plan with every knob on its last low-precision tag."""
    yield frozenset()
    yield frozenset((gk, k.cls, [t for t in k.tags if t != BASE][-1])
                    for gk, ks in space.knobs.items() for k in ks if any(t != BASE for t in k.tags))


@pytest.mark.parametrize("model", all_test_models(), ids=lambda m: m.name)
def test_a_second_run_equals_a_fresh_runtime(model):
    space = SearchSpace.build(model.graph)
    for genome in _genomes(space):
        program = space.program(genome)
        reused = CpuRuntime(program, model.graph.weights)
        for seed in (1, 2, 1):
            batch = model.make_inputs(seed)
            got = reused.run(batch, keep_exports=True)
            want = CpuRuntime(program, model.graph.weights).run(batch, keep_exports=True)
            for name, value in want.outputs.items():
                assert np.array_equal(got.outputs[name], value, equal_nan=True), (model.name, seed, name)
            for nid, value in (want.exports or {}).items():
                assert np.array_equal(got.exports[nid], value, equal_nan=True), (model.name, seed, nid)


@pytest.mark.parametrize("model", all_test_models(), ids=lambda m: m.name)
def test_batches_run_together_equal_their_own_runs_and_make_an_uncached_weight_form_once(model):
    """run_many goes kernel by kernel over every batch: each batch's outputs and exports are, bit for bit, a
    fresh runtime's run of it alone; and where the weight cache keeps nothing (a scan over a cache with no
    room), each weight form is made once for all the batches instead of once per batch."""
    from luminal_num.hlir.weightcache import WEIGHTS
    space = SearchSpace.build(model.graph)
    batches = [model.make_inputs(seed) for seed in (1, 2, 3)]
    old = WEIGHTS.budget_bytes
    for genome in _genomes(space):
        program = space.program(genome)
        try:
            WEIGHTS.resize(1)
            WEIGHTS.clear()
            with WEIGHTS.scanning():
                m0 = WEIGHTS.misses
                want = [CpuRuntime(program, model.graph.weights).run(b, keep_exports=True) for b in batches]
                m1 = WEIGHTS.misses
                got = CpuRuntime(program, model.graph.weights).run_many(batches, keep_exports=True)
                m2 = WEIGHTS.misses
        finally:
            WEIGHTS.resize(old)
        alone = m1 - m0
        assert alone % 3 == 0 and m2 - m1 == alone // 3, (model.name, alone, m2 - m1)  # once, not once per batch
        for g, w in zip(got, want, strict=True):
            for name, value in w.outputs.items():
                assert np.array_equal(g.outputs[name], value, equal_nan=True), (model.name, name)
            assert (g.exports or {}).keys() == (w.exports or {}).keys()
            for nid, value in (w.exports or {}).items():
                assert np.array_equal(g.exports[nid], value, equal_nan=True), (model.name, nid)
