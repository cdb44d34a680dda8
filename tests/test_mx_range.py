"""f8e4m3_mx keeps FP32's range: E8M0 scales are applied to the exact products, not to FP32 operands.

An activation near FP32's max quantizes to q = 256 with scale 2^120: q * 2^120 = 2^128 is inf in FP32
although every product with a small weight, and the result, are finite. Truths: the FP64 evaluation of
the graph (hlir.evaluate), hand-derived values, and the static bound, which must hold and be finite here.
"""
import warnings

import numpy as np
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from luminal_num.dtypes import GEMM_VARIANTS
from luminal_num.dtypes.formats import F32
from luminal_num.error.interval import Interval
from luminal_num.error.static import static_bound
from luminal_num.hlir import Graph, evaluate
from luminal_num.runtime.cpu import CpuRuntime
from luminal_num.runtime.numerics import emulate_gemm
from luminal_num.search.space import SearchSpace

warnings.filterwarnings("ignore", category=RuntimeWarning)
MX = GEMM_VARIANTS["f8e4m3_mx"]


def test_an_operand_beyond_fp32_gives_the_finite_product():
    """Hand-derived: a = 3.3e38 quantizes to 256 * 2^120 (= 2^128), b = 2^-10 to 2^-10 exactly, K = 32:
    the exact result 32 * 2^128 * 2^-10 = 2^123 (the FP32 value of the quantized product)."""
    a = np.full((1, 32), 3.3e38, np.float32)
    b = np.full((32, 1), 2.0 ** -10, np.float32)
    got = emulate_gemm(a, b, MX)
    assert got.dtype == np.float32 and got[0, 0] == np.float32(2.0 ** 123)


def test_in_range_operands_keep_the_fp32_accumulation():
    """Below the limit the FP32 BLAS sum of the dequantized operands is what runs (bits unchanged)."""
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((5, 96)).astype(np.float32), rng.standard_normal((96, 7)).astype(np.float32)
    got = emulate_gemm(a, b, MX)
    from luminal_num.quant import quantize_tensor
    qa, qb = (quantize_tensor(x, MX.a_format, spec) for x, spec in ((a, MX.a_scale), (b, MX.b_scale)))
    from luminal_num.quant import expand_scales
    deq = [q.values * expand_scales(q.scales, q.values.shape, spec) for q, spec in ((qa, MX.a_scale), (qb, MX.b_scale))]
    np.testing.assert_array_equal(got, np.matmul(*deq))


def _mx_graph(w: np.ndarray, rows: int) -> Graph:
    g = Graph()
    g.output(g.input("x", (rows, w.shape[0])) @ g.weight("w", w), "y")
    return g


def _program(g: Graph):
    space = SearchSpace.build(g)
    changes = [c for c in space.all_changes() if c[2] == "gemm:f8e4m3_mx"]
    assert changes, "gemm:f8e4m3_mx not in the space"
    return space.program(frozenset(changes))


@settings(deadline=None, max_examples=40, derandomize=True, phases=(Phase.explicit, Phase.reuse, Phase.generate))
@given(top=st.floats(0.9, 0.99999), k=st.sampled_from([32, 64, 96]), w_exp=st.integers(-60, -6),
       seed=st.integers(0, 2 ** 31))
def test_near_the_fp32_limit_the_result_is_finite_and_within_the_bound(top, k, w_exp, seed):
    """Activations up to `top` x FP32's max, weights of magnitude 2^w_exp / K: every exact result is finite; the
    plan's output is finite and within the static bound (finite too) of the FP64 reference."""
    rng = np.random.default_rng(seed)
    x = (rng.uniform(0.25, 1.0, (3, k)) * rng.choice([-1.0, 1.0], (3, k)) * top * F32.max_finite).astype(np.float32)
    w = (rng.standard_normal((k, 5)) * 2.0 ** w_exp / k).astype(np.float32)
    g = _mx_graph(w, 3)
    ref = evaluate(g, {"x": x})["y"]
    assert np.all(np.abs(ref) < F32.max_finite / 4)
    program = _program(g)
    out = np.asarray(CpuRuntime(program, g.weights).run({"x": x}).outputs["y"], dtype=np.float64)
    assert np.all(np.isfinite(out))
    rep = static_bound(program, {"x": Interval.point(x.astype(np.float64))}, g.bind_symbols({"x": x}), g.weights)
    assert rep.overflow is None
    bound = rep.error_bounds["y"]
    assert np.all(np.isfinite(bound)) and np.all(np.abs(out - ref) <= bound)
    # the quantization error dominates: within a few u(e4m3) of sum |x||w| (the variant's own scale)
    assert np.all(np.abs(out - ref) <= 4 * 2.0 ** -4 * (np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64)))


def test_a_result_beyond_fp32_is_still_inf():
    """Where the exact result itself exceeds FP32's max the Gemm overflows, and the bound says so."""
    a = np.full((1, 32), 3.3e38, np.float32)
    b = np.full((32, 2), 0.5, np.float32)
    assert np.all(np.isinf(emulate_gemm(a, b, MX)))
    g = _mx_graph(b, 1)
    rep = static_bound(_program(g), {"x": Interval.point(a.astype(np.float64))}, g.bind_symbols({"x": a}), g.weights)
    assert rep.overflow is not None or np.all(np.isinf(rep.error_bounds["y"]))
