"""The row-norm channel of the static analysis (error/static_ball.py): its pieces against brute force and
numpy's own norms, and whole LLM decode steps beyond one layer: the FP32 bound of a two-layer Llama step,
finite where it used to be infinite, and every random genome's bound above its measured error (magnitudes
near the formats' limits included). The causal mask of an iota comparison is exact (no flipped entries)."""
import functools
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from luminal_num.error.interval import Interval
from luminal_num.error.static import static_bound
from luminal_num.error.static_ball import row_norm, spectral_norm, weighted
from luminal_num.hlir import evaluate
from luminal_num.models.llama import EMBED, LLAMA_TINY, build_prefill, random_weights
from luminal_num.models.testnets import transformer
from luminal_num.runtime.cpu import CpuRuntime
from luminal_num.search.choice import random_candidate
from luminal_num.search.lower import lower_program
from luminal_num.search.space import SearchSpace
from bound_checks import assert_within_bounds

warnings.filterwarnings("ignore", category=RuntimeWarning)


# -- pieces ---------------------------------------------------------------------------------------------

@settings(deadline=None, max_examples=60, derandomize=True)
@given(seed=st.integers(0, 2 ** 32 - 1), n=st.integers(1, 12), ball_scale=st.sampled_from([0.0, 0.1, 0.5, 1.0, 3.0, np.inf]))
def test_weighted_norm_is_the_supremum_over_box_and_ball(seed, n, ball_scale):
    """sup ||s * e|| over |e_i| <= err_i, ||e|| <= ball: above every feasible e, and attained by the
    knapsack's own choice (so it is not looser than it must be)."""
    rng = np.random.default_rng(seed)
    s, err = rng.standard_normal((3, n)) * rng.integers(0, 2, (3, n)), rng.uniform(0, 1, (3, n))
    ball = row_norm(err, err.shape) * ball_scale
    bound = weighted(s, err, ball, s.shape)
    unbounded = err.copy()
    unbounded[0, rng.integers(0, n)] = np.inf  # an unbounded element: that row's norm is the ball's, or inf
    got = weighted(s, unbounded, ball, s.shape)
    assert np.allclose(got[1:], bound[1:], rtol=1e-12, atol=0) and got[0] >= bound[0] * (1 - 1e-12)
    assert weighted(np.ones((1, n)), np.full((1, n), np.inf), np.array([np.inf]), (1, n))[0] == np.inf
    for _ in range(50):
        e = rng.uniform(-1, 1, s.shape) * err
        norms = np.sqrt(np.sum(e * e, -1))
        e = e * np.minimum(1.0, np.where(norms > 0, ball / np.maximum(norms, 1e-300), 1.0))[:, None]
        assert np.all(np.sqrt(np.sum((s * e) ** 2, -1)) <= bound)
    order = np.argsort(-s * s, axis=-1, kind="stable")  # the maximiser: largest |s| first
    e2 = np.take_along_axis(err * err, order, -1)
    fill = np.clip(ball[:, None] ** 2 - (np.cumsum(e2, -1) - e2), 0, e2)
    best = np.sqrt(np.sum(np.take_along_axis(s * s, order, -1) * fill, -1))
    assert np.allclose(bound, best, rtol=1e-9, atol=0)


def test_spectral_norm_bounds_numpy_and_stays_close():
    rng = np.random.default_rng(0)
    for shape in ((1, 5, 7), (3, 40, 9), (1, 64, 300)):
        b = rng.standard_normal(shape) * 10.0 ** rng.integers(-3, 4)
        got = spectral_norm(b)[:, 0, 0]
        want = np.array([np.linalg.norm(m, 2) for m in b])
        assert np.all(got >= want) and np.all(got <= want * (1 + 1e-6))


def test_row_norm_of_infinite_and_huge_rows():
    x = np.array([[3.0, 4.0], [1e300, 1e300], [np.inf, 0.0]])
    got = row_norm(x, x.shape)
    assert got[0] >= 5.0 and got[0] <= 5.0 * (1 + 1e-12)
    assert np.isfinite(got[1]) and got[1] >= 1e300 * np.sqrt(2)
    assert got[2] == np.inf


# -- decode steps beyond one layer ----------------------------------------------------------------------

MAX_CACHE = 8


def _weights(cfg, scale: float) -> dict:
    w = random_weights(cfg, seed=0)
    w[EMBED] = w[EMBED] * scale
    for name in w:
        if name.endswith("layernorm.weight"):
            w[name] = w[name] * np.sqrt(scale)
    return w


@functools.lru_cache(maxsize=None)
def _space(layers: int, seq: int) -> SearchSpace:
    cfg = LLAMA_TINY.with_layers(layers)
    return SearchSpace.build(build_prefill(cfg, _weights(cfg, 1.0), seq=seq, max_cache=MAX_CACHE).graph)


@functools.lru_cache(maxsize=None)
def _model(layers: int, seq: int, scale: float):
    cfg = LLAMA_TINY.with_layers(layers)
    return build_prefill(cfg, _weights(cfg, scale), seq=seq, max_cache=MAX_CACHE), _space(layers, seq)


def _inputs(layers: int, seq: int, scale: float, seed: int, cached: int) -> dict:
    cfg = LLAMA_TINY.with_layers(layers)
    rng = np.random.default_rng(seed)
    inputs = None
    if cached:
        pre = build_prefill(cfg, _weights(cfg, scale), seq=cached, max_cache=MAX_CACHE)
        inputs = evaluate(pre.graph, pre.make_inputs(rng.integers(0, cfg.vocab_size, cached), np.arange(cached)))
    m, _ = _model(layers, seq, scale)
    return m.make_inputs(rng.integers(0, cfg.vocab_size, seq), np.arange(cached, cached + seq), inputs)


def _bound_and_error(program, graph, inputs):
    ranges = {k: Interval.point(np.asarray(v, dtype=np.float64)) for k, v in inputs.items()}
    rep = static_bound(program, ranges, graph.bind_symbols(inputs), graph.weights)
    try:
        out = CpuRuntime(program, graph.weights).run(inputs).outputs
    except ValueError:  # a run the plan's policy refuses: a verdict
        return rep, None
    ref = evaluate(graph, inputs)
    return rep, {n: np.abs(np.asarray(out[n], dtype=np.float64) - ref[n]) for n in ref}


def _assert_sound(rep, err) -> None:
    if rep.overflow is not None or err is None:
        return
    assert_within_bounds(rep.error_bounds, err)


def test_two_layer_fp32_decode_bound_is_finite_and_sound():
    """Was infinite from the second layer on (elementwise |e| |W| compounding through the Gemms)."""
    m, space = _model(2, 1, 1.0)
    rep, err = _bound_and_error(space.program(frozenset()), m.graph, _inputs(2, 1, 1.0, seed=1, cached=4))
    assert rep.overflow is None
    _assert_sound(rep, err)
    assert np.all(np.isfinite(rep.error_bounds["logits"]))


def test_causal_mask_of_iota_comparisons_is_exact():
    """The test transformer's mask (Iota < Iota + 1, times 1e4) is exact: an iota's integers and i + 1 are
    points FP32 holds, so no comparison may flip (a 1e4 bound on the mask made the FP32 bound infinite)."""
    m = transformer(2)
    program = SearchSpace.build(m.graph).program(frozenset())
    inputs = m.make_inputs(1)
    rep, err = _bound_and_error(program, m.graph, inputs)
    _assert_sound(rep, err)
    assert np.all(np.isfinite(rep.error_bounds["y"]))


def _check_genome(layers, seq, scale, seed, cached):
    m, space = _model(layers, seq, scale)
    rng = np.random.default_rng(seed)
    genome = {c.index: random_candidate(space.groups[gr.key].space, rng) for gr in space.part.groups for c in gr.chunks}
    program = lower_program(m.graph, space.part, space.groups, genome)
    _assert_sound(*_bound_and_error(program, m.graph, _inputs(layers, seq, scale, seed, cached)))


GENOMES = dict(seq=st.sampled_from([1, 1, 2]), scale=st.sampled_from([1.0, 300.0, 1e4]),
               seed=st.integers(0, 2 ** 32 - 1), cached=st.integers(0, 4))


@settings(deadline=None, max_examples=6, derandomize=True)
@given(**GENOMES)
def test_random_genomes_of_two_layer_steps_are_soundly_bounded(seq, scale, seed, cached):
    _check_genome(2, seq, scale, seed, cached)


@pytest.mark.slow
@settings(deadline=None, max_examples=120, derandomize=True)
@given(layers=st.sampled_from([2, 3]), **GENOMES)
def test_many_random_genomes_of_multi_layer_steps_are_soundly_bounded(layers, seq, scale, seed, cached):
    _check_genome(layers, seq, scale, seed, cached)


# -- SmolLM2 (real GGUF weights) --------------------------------------------------------------------------

def _smollm2_bounds(layers: int, workload: str, prompts, names):
    """(bound, measured) of the logits for baseline genomes of a SmolLM2 decode step, every output sound."""
    from luminal_num.models.llm import Prompt
    from luminal_num.models.registry import llm_job
    from luminal_num.search.recipes import baseline_genomes
    job = llm_job("smollm2", workload, calibration=[Prompt(p, False) for p in prompts],
                  heldout=[Prompt(p, False) for p in prompts], layers=layers)
    space = SearchSpace.build(job.graph)
    genomes = baseline_genomes(space)
    out = {}
    for name in names:
        rep, err = _bound_and_error(space.program(genomes[name]), job.graph, job.calibration[0])
        _assert_sound(rep, err)
        out[name] = (rep.max_bound("logits"), float(np.max(err["logits"])))
    return out


@pytest.mark.slow
def test_smollm2_two_layer_fp32_decode_bound_is_finite_and_sound():
    """Two real layers (30 s): the FP32 bound was infinite (every per-element |W| |e| compounding); now finite."""
    got = _smollm2_bounds(2, "decode:2@48", ["The capital of France is", "def add(a, b):"], ["FP32 everywhere"])
    bound, measured = got["FP32 everywhere"]
    assert np.isfinite(bound) and measured <= bound


@pytest.mark.slow
def test_smollm2_decode_bounds_are_sound_for_baselines_up_to_three_layers():
    prompts = ["The capital of France is", "def add(a, b):", "Once upon a time", "What is 2 + 2?"]
    for layers in (1, 2, 3):
        got = _smollm2_bounds(layers, "decode:4@64", prompts, ["FP32 everywhere", "BF16 autocast", "W8A16 INT8 per-channel"])
        assert np.isfinite(got["FP32 everywhere"][0]), (layers, got)
