"""The normalisation's Lipschitz bound (error/normalize.py): f(z) = z / sqrt(c ||z||^2 + eps) moves by at most
||a - x|| / sigma_min, sigma_min = max(sqrt(eps), sqrt(c ||x||^2 + eps) - sqrt(c) ||a - x||), over the row
and in every element. Checked in 60-digit arithmetic on the rows that stress it: constant rows, rows near
0 (the eps-dominated regime), an error as large as the row (the segment passes 0), errors tangent to the
row (where f moves the most), magnitudes from 1e-30 to 1e30; and the analyzer's norm bound on a layer
norm fed a lossy value, and on random genomes of 4-6 layer Llama steps (slow), against the measured error."""
import warnings

import mpmath
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from luminal_num.error.interval import Interval
from luminal_num.error.static import static_bound
from luminal_num.hlir import Graph, evaluate
from luminal_num.runtime.cpu import CpuRuntime
from luminal_num.search.space import SearchSpace

warnings.filterwarnings("ignore", category=RuntimeWarning)
mpmath.mp.dps = 60


def _f(z, c, eps):
    s = mpmath.sqrt(c * mpmath.fsum(v * v for v in z) + eps)
    return [v / s for v in z]


@settings(deadline=None, max_examples=300, derandomize=True)
@given(seed=st.integers(0, 2 ** 32 - 1), n=st.integers(1, 12), scale=st.sampled_from([1e-30, 1e-6, 1e-3, 1.0, 1e3, 1e30]),
       kind=st.sampled_from(["random", "constant", "tangent", "through_zero", "small"]),
       rel=st.sampled_from([1e-12, 1e-6, 1e-2, 0.5, 1.0, 3.0]), eps_exp=st.integers(-12, 0))
def test_normalisation_moves_by_at_most_the_error_over_sigma_min(seed, n, scale, kind, rel, eps_exp):
    rng = np.random.default_rng(seed)
    c, eps = 1.0 / rng.integers(1, 2 * n + 1), 10.0 ** eps_exp
    x = rng.standard_normal(n) * scale
    if kind == "constant":
        x = np.full(n, x[0])
    if kind == "small":
        x = x * 1e-9
    e = rng.standard_normal(n)
    if kind == "tangent" and n > 1:  # orthogonal to x: the direction f stretches by 1/s
        e = e - x * (e @ x) / max(x @ x, 1e-300)
    if kind == "through_zero":
        e = -x
    norm_x = float(np.sqrt(x @ x))
    size = rel * max(norm_x, 1e-300)
    e = e / max(float(np.sqrt(e @ e)), 1e-300) * size if np.any(e) else e
    a = x + e
    moved_by = [mpmath.mpf(float(p)) - mpmath.mpf(float(q)) for p, q in zip(a, x)]  # a - x exactly (a is rounded)
    ball = float(mpmath.sqrt(mpmath.fsum(d * d for d in moved_by))) * (1 + 2.0 ** -50)
    sigma_min = max(np.sqrt(eps), np.sqrt(c * norm_x ** 2 + eps) - np.sqrt(c) * ball)
    bound = ball / sigma_min * (1 + 2.0 ** -50)
    fx = _f([mpmath.mpf(float(v)) for v in x], mpmath.mpf(c), mpmath.mpf(eps))
    fa = _f([mpmath.mpf(float(v)) for v in a], mpmath.mpf(c), mpmath.mpf(eps))
    moved = [abs(p - q) for p, q in zip(fa, fx)]
    assert mpmath.sqrt(mpmath.fsum(m * m for m in moved)) <= bound * (1 + 1e-12)
    assert max(moved) <= bound * (1 + 1e-12)


def _lossy_norm(kind: str) -> Graph:
    """A norm fed by a Gemm: its low-precision variants give the numerator and its squares an error."""
    rng = np.random.default_rng(3)
    g = Graph()
    x = g.input("x", (4, 48), value_range=(-4.0, 4.0))
    h = x @ g.weight("w", rng.standard_normal((48, 48)) / 7)
    y = h.layer_norm() if kind == "layer_norm" else h.rms_norm(g.weight("g", 1 + 0.1 * rng.standard_normal(48)))
    g.output(y, "y")
    return g


@settings(deadline=None, max_examples=30, derandomize=True)
@given(kind=st.sampled_from(["layer_norm", "rms_norm"]), tag_index=st.integers(0, 100),
       seed=st.integers(0, 2 ** 32 - 1), rows=st.sampled_from(["normal", "constant", "tiny", "edges"]))
def test_norm_of_a_lossy_value_is_soundly_bounded(kind, tag_index, seed, rows):
    g = _lossy_norm(kind)
    space = SearchSpace.build(g)
    tags = [None] + sorted({c[2] for c in space.all_changes()})
    tag = tags[tag_index % len(tags)]
    program = space.program(frozenset([c for c in space.all_changes() if c[2] == tag]))
    rng = np.random.default_rng(seed)
    x = rng.uniform(-4, 4, (4, 48))
    if rows == "constant":  # h's rows are then W's column sums times one value each
        x = np.repeat(x[:, :1], 48, axis=1)
    elif rows == "tiny":  # the eps-dominated regime
        x = x * 1e-4
    elif rows == "edges":
        x = rng.choice([-4.0, 4.0], (4, 48))
    err = np.abs(CpuRuntime(program, g.weights).run({"x": x}).outputs["y"] - evaluate(g, {"x": x})["y"])
    for ranges in ({"x": Interval.point(x)}, {"x": Interval(np.full((4, 48), -4.0), np.full((4, 48), 4.0))}):
        rep = static_bound(program, ranges, {}, g.weights)
        if rep.overflow is None:
            bound = rep.error_bounds["y"]
            assert np.all((err <= bound) | np.isinf(bound)), (tag, float(np.max(err - bound)))


@pytest.mark.slow
@settings(deadline=None, max_examples=20, derandomize=True)
@given(layers=st.sampled_from([4, 6]), seed=st.integers(0, 2 ** 32 - 1), scale=st.sampled_from([1.0, 300.0, 1e4]))
def test_random_genomes_of_deep_llama_steps_are_soundly_bounded(layers, seed, scale):
    """Deep stacks: every norm of a 4-6 layer Llama step takes the Lipschitz bound; random genomes (storage,
    Gemm and attention variants per layer), embeddings scaled towards the formats' limits."""
    from luminal_num.models.llama import EMBED, LLAMA_TINY, build_prefill, random_weights
    from luminal_num.search.choice import random_candidate
    from luminal_num.search.lower import lower_program
    cfg = LLAMA_TINY.with_layers(layers)
    w = random_weights(cfg, seed=0)
    w[EMBED] = w[EMBED] * scale
    m = build_prefill(cfg, w, seq=1, max_cache=8)
    space = SearchSpace.build(m.graph)
    rng = np.random.default_rng(seed)
    genome = {c.index: random_candidate(space.groups[g.key].space, rng) for g in space.part.groups for c in g.chunks}
    program = lower_program(m.graph, space.part, space.groups, genome)
    inputs = m.make_inputs(rng.integers(0, cfg.vocab_size, 1), np.arange(1))
    rep = static_bound(program, {k: Interval.point(np.asarray(v, dtype=np.float64)) for k, v in inputs.items()},
                       m.graph.bind_symbols(inputs), m.graph.weights)
    try:
        out = CpuRuntime(program, m.graph.weights).run(inputs).outputs
    except ValueError:  # a run the plan's policy refuses
        return
    ref = evaluate(m.graph, inputs)
    if rep.overflow is None:
        for name, bound in rep.error_bounds.items():
            err = np.abs(np.asarray(out[name], dtype=np.float64) - ref[name])
            assert np.all((err <= bound) | np.isinf(bound)), (name, float(np.max(err - bound)))
