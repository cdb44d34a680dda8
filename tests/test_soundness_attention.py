"""The attention bound from the softmax's sum-to-one (error/static.py, Gemm with softmax rows as A):
tighter than the interval bound and never below the measured error, for random candidates of the
whole choice space, masked (causal) and unmasked, at drawn points and over the declared range."""
import warnings

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from luminal_num.search.lower import lower_program
from luminal_num.error.interval import Interval
from luminal_num.error.static import static_bound
from luminal_num.hlir import Graph, evaluate
from luminal_num.runtime.cpu import CpuRuntime
from luminal_num.search.choice import random_candidate
from luminal_num.search.space import SearchSpace

warnings.filterwarnings("ignore", category=RuntimeWarning)
S, D = 8, 16


def attention_graph(causal: bool, scale: float) -> Graph:
    rng = np.random.default_rng(3)
    g = Graph()
    x = g.input("x", (S, D), value_range=(-1.0, 1.0))
    q, k, v = (x @ g.weight(f"w_{n}", scale * rng.standard_normal((D, D)) / np.sqrt(D)) for n in "qkv")
    scores = (q @ k.transpose()) * (1.0 / np.sqrt(D))
    if causal:
        scores = scores + g.weight("mask", np.triu(np.full((S, S), -1e9), 1))
    g.output(scores.softmax(-1) @ v, "y")
    return g


DECLARED = {"x": Interval(np.full((S, D), -1.0), np.full((S, D), 1.0))}


def test_fp32_attention_bound_uses_the_sum_to_one():
    """Over the declared range the FP32 bound was 0.068 (the interval P @ V charges every key); the
    convex-combination form gives about 8x less, still above the worst error measured."""
    g = attention_graph(False, 1.0)
    program = SearchSpace.build(g).program(frozenset())
    bound = static_bound(program, DECLARED, {}, g.weights).max_bound("y")
    rng = np.random.default_rng(0)
    worst = max(float(np.max(np.abs(CpuRuntime(program, g.weights).run({"x": x}).outputs["y"] - evaluate(g, {"x": x})["y"])))
                for x in (rng.uniform(-1, 1, (S, D)) for _ in range(4)))
    assert worst <= bound < 0.02


@settings(deadline=None, max_examples=30, derandomize=True)
@given(causal=st.booleans(), scale=st.sampled_from([0.5, 1.0, 4.0]), seed=st.integers(0, 2 ** 32 - 1),
       edges=st.booleans())
def test_attention_bounds_are_sound_for_random_candidates(causal, scale, seed, edges):
    g = attention_graph(causal, scale)
    space = SearchSpace.build(g)
    rng = np.random.default_rng(seed)
    choices = {c.index: random_candidate(space.groups[gr.key].space, rng) for gr in space.part.groups for c in gr.chunks}
    program = lower_program(g, space.part, space.groups, choices)
    x = rng.choice([-1.0, 1.0], (S, D)) if edges else rng.uniform(-1, 1, (S, D))
    try:
        out = CpuRuntime(program, g.weights).run({"x": x}).outputs["y"]
    except ValueError:  # a weight its chosen storage cannot hold (the -1e9 mask in int4): refused, not run
        for ranges in (DECLARED, {"x": Interval.point(x)}):
            assert static_bound(program, ranges, {}, g.weights).overflow is not None  # an overflow verdict
        return
    err = np.abs(out - evaluate(g, {"x": x})["y"])
    for ranges in (DECLARED, {"x": Interval.point(x)}):
        rep = static_bound(program, ranges, {}, g.weights)
        if rep.overflow is None:
            bound = rep.error_bounds["y"]
            assert np.all((err <= bound) | np.isinf(bound)), float(np.max(err - bound))


def test_causal_mask_does_not_blow_the_bound():
    """A -1e9 causal mask key carries FP32's 60-unit rounding of -1e9 into the scores; weighed by its
    softmax weight (e^-1e9) it no longer matters: the FP32 bound was 32.4 over the declared range and
    1.15 at drawn points (the row's largest score error taken for every key); now it is the unmasked
    graph's, and still above the measured error."""
    g = attention_graph(True, 1.0)
    program = SearchSpace.build(g).program(frozenset())
    rng = np.random.default_rng(0)
    xs = [rng.uniform(-1, 1, (S, D)) for _ in range(4)]
    worst = max(float(np.max(np.abs(CpuRuntime(program, g.weights).run({"x": x}).outputs["y"] - evaluate(g, {"x": x})["y"])))
                for x in xs)
    at_points = max(static_bound(program, {"x": Interval.point(x)}, {}, g.weights).max_bound("y") for x in xs)
    assert worst <= at_points < 1e-4
    assert static_bound(program, DECLARED, {}, g.weights).max_bound("y") < 5e-3
