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
