"""The static analysis drops a buffer's bound after its last reader (error/liveness.py): the
bounds must be exactly those of an analysis that keeps every buffer, on fused and unfused programs (the norm
pattern reaches back through elementwise kernels to a SUM and its inputs), and a 30-layer model must not
hold every layer's bounds at once."""
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import luminal_num.error.static as static
from luminal_num.error.interval import Interval
from luminal_num.models.llama import LLAMA_TINY, build_prefill, random_weights
from luminal_num.models.testnets import transformer
from luminal_num.search.choice import random_candidate
from luminal_num.search.lower import lower_program
from luminal_num.search.space import SearchSpace

warnings.filterwarnings("ignore", category=RuntimeWarning)

_SPACES: dict = {}


def _model(kind: str, fusion: bool):
    if (kind, fusion) not in _SPACES:
        if kind == "transformer":
            m = transformer(2)
            inputs = m.make_inputs(1)
        else:
            cfg = LLAMA_TINY.with_layers(2)
            m = build_prefill(cfg, random_weights(cfg, seed=0), seq=2, max_cache=8)
            inputs = m.make_inputs(np.array([3, 5]), np.arange(2))
        _SPACES[kind, fusion] = (m.graph, SearchSpace.build(m.graph, fusion=fusion), inputs)
    return _SPACES[kind, fusion]


def _bounds(program, graph, inputs, keep_all: bool, monkeypatch):
    ranges = {k: Interval.point(np.asarray(v, dtype=np.float64)) for k, v in inputs.items()}
    with monkeypatch.context() as mp:
        if keep_all:
            mp.setattr(static, "last_readers", lambda program: {})
        return static.static_bound(program, ranges, graph.bind_symbols(inputs), graph.weights)


@settings(deadline=None, max_examples=8, derandomize=True)
@given(kind=st.sampled_from(["transformer", "llama"]), fusion=st.booleans(), seed=st.integers(0, 2 ** 32 - 1))
def test_dropping_dead_bounds_changes_no_bound(kind, fusion, seed):
    with pytest.MonkeyPatch.context() as monkeypatch:
        graph, space, inputs = _model(kind, fusion)
        rng = np.random.default_rng(seed)
        genome = {c.index: random_candidate(space.groups[g.key].space, rng) for g in space.part.groups for c in g.chunks}
        program = lower_program(graph, space.part, space.groups, genome)
        dropped = _bounds(program, graph, inputs, False, monkeypatch)
        kept = _bounds(program, graph, inputs, True, monkeypatch)
    assert (dropped.overflow is None) == (kept.overflow is None)
    for name, bound in kept.error_bounds.items():
        assert np.array_equal(dropped.error_bounds[name], bound), name


def test_only_live_bounds_are_held():
    """After the run, only the outputs' bounds remain (a buffer no kernel reads goes as soon as it is made)."""
    graph, space, inputs = _model("llama", True)
    program = space.program(frozenset())
    ranges = {k: Interval.point(np.asarray(v, dtype=np.float64)) for k, v in inputs.items()}
    for name, w in graph.weights.items():
        ranges.setdefault(name, Interval.point(np.asarray(w, dtype=np.float64)))
    an = static.StaticAnalyzer(program, graph.bind_symbols(inputs), graph.weights)
    an.run(ranges)
    assert set(an.vals) == {kid for _, kid in program.outputs}
