"""Regression tests for the soundness holes of issue 17, each with the issue's own values.

A static bound below the measured error is a bug: where a running sum, a cross-block total or a
dequantized operand can overflow, the bound must be infinite (measure instead) or an overflow verdict.
"""
import warnings

import numpy as np
import pytest

from luminal_num.dtypes.formats import F8E4M3
from luminal_num.dtypes.rounding import Overflow, round_to, to_storage
from luminal_num.error.budget import Budget
from luminal_num.error.interval import Interval
from luminal_num.error.judge import Judge
from luminal_num.error.rounding_bounds import nan_as_unbounded
from luminal_num.error.static import static_bound
from luminal_num.hlir import Graph, evaluate
from luminal_num.runtime.cpu import CpuRuntime
from luminal_num.search.space import SearchSpace

warnings.filterwarnings("ignore", category=RuntimeWarning)


def _program(g: Graph, tag: str | None):
    space = SearchSpace.build(g)
    changes = [c for c in space.all_changes() if c[2] == tag] if tag else []
    assert tag is None or changes, f"{tag} not in the space"
    return space.program(frozenset(changes[:1]))


def _bound_and_run(g: Graph, x: np.ndarray, tag: str | None):
    program = _program(g, tag)
    rep = static_bound(program, {"x": Interval.point(x)}, g.bind_symbols({"x": x}), g.weights)
    out = CpuRuntime(program, g.weights).run({"x": x}).outputs["y"]
    return rep, out, evaluate(g, {"x": x})["y"]


def _sum_graph(w: np.ndarray, rows: int = 2) -> Graph:
    g = Graph()
    g.output((g.input("x", (rows, w.size)) + g.weight("w", w)).sum(-1), "y")
    return g


def test_f16_running_sum_overflow_is_not_certified():
    """(x + w).sum(-1), w = +-4e4 in pairs, sum:f16: the running total hits 8e4 > 65504 (inf)."""
    w = np.array([4e4, 4e4, -4e4, -4e4] * 4)
    g = _sum_graph(w)
    x = np.zeros((2, 16))
    rep, out, ref = _bound_and_run(g, x, "sum:f16")
    assert np.all(np.isinf(out)) and np.all(ref == 0)
    assert rep.overflow is not None or np.all(np.isinf(rep.error_bounds["y"]))  # was a finite 5042
    program = _program(g, "sum:f16")
    judge = Judge(g, Budget.parse("atol=1000,rtol=0"), [{"x": x}], use_static=True)
    v = judge.judge(program)
    assert not v.passed and v.source == "measured"  # not certified without running it


def test_fp32_baseline_running_sum_near_1e38_is_not_certified():
    w = np.array([1e38] * 4 + [-1e38] * 4)
    rep, out, ref = _bound_and_run(_sum_graph(w), np.zeros((2, 8)), None)
    assert np.all(~np.isfinite(out)) and np.all(ref == 0)
    assert np.all(np.isinf(rep.error_bounds["y"]))  # was 4.8e32


def test_sum_below_the_accumulator_max_keeps_a_finite_bound():
    """The fix is not 'always infinite': with sum|terms| = 4.8e4 < 65504 no order can overflow (the
    kernel may sum in any order, e.g. CUDA's warp tree, so the criterion is sum|terms|, not the prefixes)."""
    w = np.array([3e3, 3e3, -3e3, -3e3] * 4)
    rep, out, ref = _bound_and_run(_sum_graph(w), np.zeros((2, 16)), "sum:f16")
    bound = rep.error_bounds["y"]
    assert np.all(np.isfinite(bound)) and np.all(np.abs(out - ref) <= bound)


def _gemm_graph(k: int, w: np.ndarray) -> Graph:
    g = Graph()
    g.output(g.input("x", (1, k)) @ g.weight("w", w), "y")
    return g


@pytest.mark.parametrize("tag", ["gemm:f8e4m3_block", "gemm:f8e5m2_block"])
def test_fp8_block_cross_block_total_overflow_is_infinite(tag):
    """Two 128-blocks of +-3e36 times ones: each block's quantized sum fits, the FP32 total does not."""
    x = np.concatenate([np.full(128, 3e36), np.full(128, -3e36)])[None]
    rep, out, ref = _bound_and_run(_gemm_graph(256, np.ones((256, 2))), x, tag)
    # the exact result is 0; the FP64 reference is 0 up to its own summation error, which depends on the
    # order the BLAS kernel sums in (0 with OpenBLAS's Haswell dgemm, -3.8e22 with its Sandybridge one)
    assert np.all(np.abs(ref) <= 256 * 2.0 ** -53 * np.sum(np.abs(x))) and not np.all(np.isfinite(out))
    assert rep.overflow is not None or np.all(np.isinf(rep.error_bounds["y"]))  # was ~1e38


def test_mx_operand_beyond_fp32_gives_the_exact_product_and_a_bound_that_holds():
    """3.3e38 with an E8M0 scale 2^120 quantizes to 256 (e4m3); 256 * 2^120 = 2^128 is beyond FP32, so the
    products are summed in FP64 (issue 36; it was inf): 2^128 * 0.5 = 2^127 exactly; the bound holds."""
    x = np.zeros((1, 32))
    x[0, 0] = 3.3e38
    rep, out, ref = _bound_and_run(_gemm_graph(32, np.full((32, 2), 0.5)), x, "gemm:f8e4m3_mx")
    np.testing.assert_allclose(ref, 1.65e38)
    np.testing.assert_array_equal(out, np.float32(2.0 ** 127))
    assert rep.overflow is None
    assert np.all(np.abs(out - ref) <= rep.error_bounds["y"])  # was 2.1e37 below the error while out was inf


def test_mat_vec_and_vector_matrix_run_in_reference_backend_and_bounds():
    """(x * w).sum(-1) with a 1-D weight is a Gemm with no N axis: it crashed with 'cannot reshape'."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal(8)
    g = Graph()
    g.output((g.input("x", (3, 8)) * g.weight("w", w)).sum(-1), "y")
    x = rng.standard_normal((3, 8))
    rep, out, ref = _bound_and_run(g, x, None)
    np.testing.assert_allclose(ref, x @ w, rtol=1e-12)
    assert np.all(np.abs(out - ref) <= rep.error_bounds["y"])
    g2 = Graph()
    m = rng.standard_normal((8, 3))
    g2.output((g2.input("x", (8,)).expand_dim(1, 3) * g2.weight("w", m)).sum(0), "y")
    x2 = rng.standard_normal(8)
    rep2, out2, ref2 = _bound_and_run(g2, x2, None)
    np.testing.assert_allclose(ref2, x2 @ m, rtol=1e-12)
    assert np.all(np.abs(out2 - ref2) <= rep2.error_bounds["y"])


@pytest.mark.parametrize("bad", ["saturate", "SATURATE", None, 0])
def test_round_to_refuses_an_overflow_policy_that_is_not_the_enum(bad):
    """The policy's string value was misread: round_to(465, e4m3, overflow="saturate") returned NaN."""
    with pytest.raises(TypeError, match="Overflow"):
        round_to(np.array([465.0]), F8E4M3, overflow=bad)
    with pytest.raises(TypeError, match="Overflow"):
        to_storage(np.array([465.0]), F8E4M3, overflow=bad)
    assert round_to(np.array([465.0]), F8E4M3, overflow=Overflow.SATURATE)[0] == 448.0


def test_a_nan_or_infinite_error_term_is_an_unbounded_bound():
    """0 * inf and inf - inf in a bound's terms are NaN: unbounded. +inf stays inf; numpy's nan_to_num,
    used here before, turns +inf into the largest double, a finite (unsound) bound."""
    got = nan_as_unbounded(np.array([np.nan, np.inf, 2.5, 0.0]))
    assert np.isinf(got[0]) and np.isinf(got[1]) and got[2] == 2.5 and got[3] == 0.0
    assert np.isfinite(np.nan_to_num(np.array([np.inf]), nan=np.inf)).all()  # why the helper exists
