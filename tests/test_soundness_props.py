"""Property: a static bound is never finite and below the measured error (FP64 reference vs the CPU
backend), at magnitudes near every format's limits, for running sums that cross the accumulator's
max and for mat-vec / vector-matrix / matrix Gemms in every precision variant. These draws find the
four holes of issue 17 on the code before it (tests/test_soundness.py pins each one)."""
import warnings

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from luminal_num.error.interval import Interval
from luminal_num.error.static import static_bound
from luminal_num.hlir import Graph, evaluate
from luminal_num.runtime.cpu import CpuRuntime
from luminal_num.search.space import SearchSpace

warnings.filterwarnings("ignore", category=RuntimeWarning)

# every format's largest finite value: f16, e4m3, e5m2, bf16 / f32
LIMITS = (65504.0, 448.0, 57344.0, 3.3895313892515355e38, 3.4028234663852886e38)


def _assert_sound(g: Graph, tag: str | None, x: np.ndarray) -> None:
    space = SearchSpace.build(g)
    changes = [c for c in space.all_changes() if c[2] == tag] if tag else []
    program = space.program(frozenset(changes[:1]))
    rep = static_bound(program, {"x": Interval.point(x)}, g.bind_symbols({"x": x}), g.weights)
    if rep.overflow is not None:
        return  # a verdict, not a bound
    out = np.asarray(CpuRuntime(program, g.weights).run({"x": x}).outputs["y"], dtype=np.float64)
    ref = evaluate(g, {"x": x})["y"]
    bound = rep.error_bounds["y"]
    with np.errstate(invalid="ignore"):
        err = np.abs(out - ref)
        ok = (err <= bound) | np.isinf(bound)  # NaN/inf outputs need an infinite bound
    assert ok.all(), (tag, float(np.nanmax(np.where(ok, 0, err))), float(np.max(np.where(ok, 0, bound))))


def _magnitudes(draw, shape, limit: float) -> np.ndarray:
    """Values from 1e-3 x to 1.1 x a format limit (often within 10% of it), random signs; sometimes
    sorted so the running total climbs before it falls, sometimes mirrored (the last half is minus the
    first: an exact result near 0 whose partial sums cross the accumulator's max), sometimes constant."""
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 32 - 1)))
    exponent = draw(st.one_of(st.floats(-3.0, 0.04), st.floats(-0.05, 0.0)))
    scale = limit * 10.0 ** exponent
    layout = draw(st.sampled_from(["random", "sorted", "mirrored", "constant"]))
    if layout == "constant":
        return np.full(shape, scale)
    values = scale * rng.uniform(0.2, 1.0, shape) * rng.choice([-1.0, 1.0], shape)
    if layout == "mirrored" and shape[-1] % 2 == 0:
        half = np.abs(values[..., : shape[-1] // 2])
        values = np.concatenate([half, -half], axis=-1)
    elif layout != "random":
        values = -np.sort(-values, axis=-1)
    return values


@settings(deadline=None, max_examples=60, derandomize=True)
@given(st.data())
def test_running_sums_near_format_limits_are_soundly_bounded(data):
    tag = data.draw(st.sampled_from([None, "sum:f16", "sum:f16_accf32", "sum:bf16", "sum:bf16_accf32",
                                     "ew:f16_computef32", "ew:bf16"]))
    limit = {None: LIMITS[4], "sum:bf16": LIMITS[3], "sum:bf16_accf32": LIMITS[3], "ew:bf16": LIMITS[3]}.get(tag, LIMITS[0])
    n = data.draw(st.integers(2, 24))
    w = _magnitudes(data.draw, (n,), limit / data.draw(st.sampled_from([1.0, 2.0, n])))
    g = Graph()
    g.output((g.input("x", (2, n)) + g.weight("w", w)).sum(-1), "y")
    x = _magnitudes(data.draw, (2, n), limit / n)
    _assert_sound(g, tag, x)


GEMM_TAGS = [None, "gemm:tf32", "gemm:bf16", "gemm:f16", "gemm:f16acc16", "gemm:f8e4m3_tensor",
             "gemm:f8e4m3_channel", "gemm:f8e4m3_block", "gemm:f8e4m3_block_nopromote", "gemm:f8e4m3_mx",
             "gemm:f8e5m2_tensor", "gemm:f8e5m2_channel", "gemm:f8e5m2_block", "gemm:int8_channel"]


@settings(deadline=None, max_examples=80, derandomize=True)
@given(st.data())
def test_gemm_shapes_and_variants_near_format_limits_are_soundly_bounded(data):
    shape = data.draw(st.sampled_from(["matvec", "vecmat", "matmul"]))
    tag = data.draw(st.sampled_from(GEMM_TAGS))
    k = data.draw(st.sampled_from([8, 32, 64, 160, 256]))
    lim_x, lim_w = data.draw(st.sampled_from(LIMITS + (1.0,))), data.draw(st.sampled_from(LIMITS + (1.0,)))
    # keep the exact result in FP32's range most of the time, so the bound (not only the verdict) is tested
    if data.draw(st.booleans()):
        lim_w = min(lim_w, 1e38 / (lim_x * k))
    g = Graph()
    if shape == "matvec":
        w = _magnitudes(data.draw, (k,), lim_w)
        g.output((g.input("x", (3, k)) * g.weight("w", w)).sum(-1), "y")
        x = _magnitudes(data.draw, (3, k), lim_x)
    elif shape == "vecmat":
        w = _magnitudes(data.draw, (4, k), lim_w).T  # drawn along K, so mirrored/sorted means along K
        g.output((g.input("x", (k,)).expand_dim(1, 4) * g.weight("w", w)).sum(0), "y")
        x = _magnitudes(data.draw, (k,), lim_x)
    else:
        w = _magnitudes(data.draw, (4, k), lim_w).T
        g.output(g.input("x", (3, k)) @ g.weight("w", w), "y")
        x = _magnitudes(data.draw, (3, k), lim_x)
    space_tags = {c[2] for c in SearchSpace.build(g).all_changes()}
    _assert_sound(g, tag if tag in space_tags else None, x)


SCALED_TAGS = [t for t in GEMM_TAGS if t and ("f8" in t or "int8" in t)]


@settings(deadline=None, max_examples=80, derandomize=True)
@given(tag=st.sampled_from(SCALED_TAGS), k=st.sampled_from([64, 256, 384]), seed=st.integers(0, 2 ** 32 - 1),
       tenths=st.integers(355, 386), edge=st.booleans(), layout=st.sampled_from(["mirrored", "signs", "lone"]))
def test_scaled_gemm_totals_crossing_fp32_max_are_soundly_bounded(tag, k, seed, tenths, edge, layout):
    """Scaled FP8/INT8 Gemms with products of 10^35.5..10^38.6 each: chunk sums, the FP32 total across
    scale blocks, the scale product and operands dequantized as q * 2^e may pass FP32's max while the
    exact result stays small (mirrored rows: exactly 0; lone: one operand at FP32's edge, the rest 0)."""
    rng = np.random.default_rng(seed)
    term = tenths / 10  # log10 of one product's magnitude
    x_mag = 3.3e38 if edge or layout == "lone" else 10.0 ** (term / 2)
    w = np.full((k, 3), 10.0 ** term / x_mag) * rng.uniform(0.9, 1.0, (1, 3))
    x = x_mag * rng.uniform(0.5, 1.0, (2, k))
    x[:, 0] = x_mag
    if layout == "mirrored":
        x[:, k // 2:] = -x[:, : k // 2]
    elif layout == "signs":
        x *= rng.choice([-1.0, 1.0], x.shape)
    else:
        x[:, 1:] = 0.0
    g = Graph()
    g.output(g.input("x", (2, k)) @ g.weight("w", w), "y")
    _assert_sound(g, tag, x)


def _sigmoid_graph(kind: str, bound: float) -> Graph:
    rng = np.random.default_rng(5)
    g = Graph()
    x = g.input("x", (4, 16), value_range=(-bound, bound))
    if kind == "silu":
        y = x.silu()
    elif kind == "sigmoid_sum":  # 1 + exp(-x) summed: floors through a SUM and a reciprocal
        y = (x.sigmoid() + 1.0).sum(-1).recip()
    else:
        up = x @ g.weight("w_up", rng.standard_normal((16, 16)) / 4)
        y = ((x @ g.weight("w_gate", rng.standard_normal((16, 16)) / 4)).silu() * up) @ g.weight(
            "w_down", rng.standard_normal((16, 16)) / 4)
    g.output(y, "y")
    return g


@settings(deadline=None, max_examples=40, derandomize=True)
@given(kind=st.sampled_from(["silu", "sigmoid_sum", "swiglu"]), bound=st.sampled_from([1.0, 8.0, 30.0]),
       seed=st.integers(0, 2 ** 32 - 1), edges=st.booleans())
def test_executed_value_floors_keep_sigmoid_bounds_sound(kind, bound, seed, edges):
    """exp2(t) >= 0 after any rounding, so 1 + exp2(t) >= 1 and the reciprocal's slope stays <= 1: the
    floor that made SwiGLU bounds finite must never cut below a measured error (random candidates,
    inputs at the range's edges where exp2 is largest)."""
    from luminal_num.search.lower import lower_program
    from luminal_num.search.choice import random_candidate
    g = _sigmoid_graph(kind, bound)
    space = SearchSpace.build(g)
    rng = np.random.default_rng(seed)
    choices = {c.index: random_candidate(space.groups[gr.key].space, rng) for gr in space.part.groups for c in gr.chunks}
    program = lower_program(g, space.part, space.groups, choices)
    x = rng.choice([-bound, bound], (4, 16)) if edges else rng.uniform(-bound, bound, (4, 16))
    out = np.asarray(CpuRuntime(program, g.weights).run({"x": x}).outputs["y"], dtype=np.float64)
    err = np.abs(out - evaluate(g, {"x": x})["y"])
    for ranges in ({"x": Interval(np.full((4, 16), -bound), np.full((4, 16), bound))}, {"x": Interval.point(x)}):
        rep = static_bound(program, ranges, {}, g.weights)
        if rep.overflow is None:
            bound_y = rep.error_bounds["y"]
            with np.errstate(invalid="ignore"):
                assert np.all((err <= bound_y) | np.isinf(bound_y)), float(np.nanmax(err - bound_y))
