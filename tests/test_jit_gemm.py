"""Differential fuzz: the numba kernel (runtime.jit_gemm) against numerics' numpy path on the narrow-accumulator
Gemms, bit for bit (NaN where NaN: its payload and sign are not part of the contract, as across BLAS builds).

Operands are drawn so that every MMA group sum is exact in FP64 (the exponents of a test's operands
span a window narrow enough for the products' significands), because that is where numerics' bits
are defined independently of the BLAS summation order; within that: random shapes (mat-vec, K not a
multiple of the group, batched and broadcast operands, transposed and strided views), magnitudes at
each accumulator's limits (F16 sums overflowing to inf and in the subnormals; FP32-range accumulators
crossing 2^128 and below 2^-126), signed zeros, and NaN / inf operands.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from luminal_num.dtypes import BF16, F8E4M3, F16, F32, GEMM_VARIANTS, GemmPrecision, Granularity, ScaleSpec
from luminal_num.dtypes.variants import limited_accumulator
from luminal_num.runtime import jit_gemm, numerics
from luminal_num.runtime.numerics import emulate_gemm

needs_numba = pytest.mark.skipif(jit_gemm.kernel() is None,
                                 reason="the kernel is off (numba missing or LUMINAL_NUM_JIT=0): nothing to compare")

VARIANTS = [GEMM_VARIANTS[name] for name in ("f16acc16", "f8e4m3_block", "f8e4m3_block_nopromote", "f8e5m2_block")] + [
    GemmPrecision("e4m3_small_blocks", F8E4M3, F8E4M3, F32, ScaleSpec(Granularity.BLOCK, (1, 32), F32, False),
                  ScaleSpec(Granularity.BLOCK, (32, 2), F32, True), promote_every=32,
                  acc_mantissa_bits=13),  # ragged column blocks of B, promotion per block
    GemmPrecision("bf16_limited_promoted", BF16, BF16, F32, promote_every=64, acc_mantissa_bits=10),
]
# exponent window of the operands keeping every group sum exact in FP64: 2 * window + product bits + log2(group) <= 53
WINDOW = {"f16": 12, "bf16": 16, "f8e5m2": 20, "f8e4m3": 24}


def both_paths(fn):
    """(kernel's result, numpy path's result) of fn(); NaN / inf operands warn in numpy, as they may."""
    with np.errstate(all="ignore"):
        jit = fn()
        saved, jit_gemm.ENABLED = jit_gemm.ENABLED, False
        try:
            return jit, fn()
        finally:
            jit_gemm.ENABLED = saved


def assert_same(got: np.ndarray, want: np.ndarray) -> None:
    assert got.dtype == want.dtype == np.float32 and got.shape == want.shape
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))


def values(rng, shape, low: int, window: int, sig_bits: int, zeros: float) -> np.ndarray:
    """Signed float32 values with `sig_bits`-bit significands and binades in [low, low + window)."""
    sig = np.floor(rng.uniform(1, 2, shape) * 2.0 ** (sig_bits - 1)) / 2.0 ** (sig_bits - 1)
    x = sig * 2.0 ** rng.integers(low, low + max(window, 1), shape) * rng.choice([-1.0, 1.0], shape)
    x[rng.random(shape) < zeros] = 0.0
    x[rng.random(shape) < zeros / 4] = -0.0
    return x.astype(np.float32)


def layout(rng, x: np.ndarray) -> np.ndarray:
    """x as a C copy, a Fortran copy, a transposed view or a strided view (same values)."""
    kind = rng.integers(4)
    if kind == 1:
        return np.asfortranarray(x)
    if kind == 2:
        return np.ascontiguousarray(np.swapaxes(x, -1, -2)).swapaxes(-1, -2)
    if kind == 3:
        wide = np.zeros(x.shape[:-1] + (2 * x.shape[-1],), np.float32)
        wide[..., ::2] = x
        return wide[..., ::2]
    return x


@needs_numba
@settings(deadline=None, max_examples=80)
@given(st.integers(0, 2 ** 32 - 1), st.sampled_from(VARIANTS), st.integers(1, 9), st.integers(1, 300),
       st.integers(1, 40), st.sampled_from(["2d", "batched", "broadcast_b"]), st.integers(-20, 12))
def test_emulate_gemm_matches_the_numpy_path(seed, variant, m, k, n, lead, low):
    """Through emulate_gemm (quantization, scales, promotion or per-product scaling, lead dimensions)."""
    rng = np.random.default_rng(seed)
    window = WINDOW[variant.a_format.name] // 2
    a_shape, b_shape = {"2d": ((m, k), (k, n)), "batched": ((2, m, k), (2, k, n)),
                        "broadcast_b": ((3, m, k), (k, n))}[lead]
    a = layout(rng, values(rng, a_shape, low, window, 11, 0.2))
    b = layout(rng, values(rng, b_shape, low // 2, window, 11, 0.2))
    got, want = both_paths(lambda: emulate_gemm(a, b, variant))
    assert_same(got, want)


ACCUMULATORS = [(F16, 16, 11), (limited_accumulator(13), 32, 4), (limited_accumulator(10), 16, 8)]  # acc, group, bits


@needs_numba
@settings(deadline=None, max_examples=120)
@given(st.integers(0, 2 ** 32 - 1), st.sampled_from(ACCUMULATORS), st.integers(1, 9), st.integers(1, 200),
       st.integers(1, 40), st.sampled_from(["top", "bottom", "middle"]), st.booleans(), st.booleans(),
       st.booleans())
def test_the_accumulator_at_its_limits(seed, accumulator, m, k, n, where, promote, batched, specials):
    """numerics._grouped_gemm on raw operands: running sums crossing the accumulator's max (inf) and in
    its subnormals, with promotion every 2 groups or none, signed zeros, and NaN / +-inf operands."""
    acc, group, bits = accumulator
    rng = np.random.default_rng(seed)
    window = 12 if acc is F16 else 20
    top = (8 if acc is F16 else 61) - window // 2  # products and sums past max_finite
    bottom = (-8 if acc is F16 else -69) - window // 2  # products in the subnormals, and below
    low = {"top": top, "bottom": bottom, "middle": -window // 2}[where]
    lead = (2,) if batched else ()
    a = layout(rng, values(rng, lead + (m, k), low, window, bits, 0.25))
    b = layout(rng, values(rng, (k, n), low, window, bits, 0.25))
    if specials:
        for x in (a, b):
            flat = x.reshape(-1) if x.flags.c_contiguous else None
            if flat is not None:
                picks = rng.integers(0, flat.size, 3)
                flat[picks] = rng.choice([np.nan, np.inf, -np.inf, -0.0], 3)
    chunk = min(k, 2 * group) if promote else k
    qa, qb = numerics._Operand(a, None, None), numerics._Operand(b, None, None)
    got, want = both_paths(lambda: numerics._grouped_gemm(qa, qb, acc, group, chunk, k, False))
    assert_same(got, want)


@needs_numba
@pytest.mark.parametrize("acc", [F16, limited_accumulator(13)], ids=lambda f: f.name)
def test_the_limits_are_reached(acc):
    """The fuzz's "top" and "bottom" operands do reach inf and the accumulator's subnormals (both paths agree)."""
    rng = np.random.default_rng(7)
    top, bottom = (3, -16) if acc is F16 else (60, -72)
    for low, reached in ((top, lambda x: np.isinf(x).any()),
                         (bottom, lambda x: ((x != 0) & (np.abs(x) < acc.min_normal)).any())):
        a, b = (np.abs(values(rng, shape, low, 4, 4, 0.0)) for shape in ((8, 96), (96, 24)))
        qa, qb = numerics._Operand(a, None, None), numerics._Operand(b, None, None)
        got, want = both_paths(lambda: numerics._grouped_gemm(qa, qb, acc, 16, 96, 96, False))
        assert_same(got, want)
        assert reached(want)


@needs_numba
def test_a_tiny_negative_sum_rounds_to_negative_zero():
    """A product below half acc_m13's smallest subnormal (2^-139) rounds to -0 when negative, and keeps
    that sign to the output; a sum of zero products is +0."""
    a, b = np.zeros((2, 32), np.float32), np.zeros((32, 2), np.float32)
    a[1, 0], b[0, 1] = 2.0 ** -80, -2.0 ** -80
    qa, qb = numerics._Operand(a, None, None), numerics._Operand(b, None, None)
    got, want = both_paths(lambda: numerics._grouped_gemm(qa, qb, limited_accumulator(13), 32, 32, 32, False))
    assert_same(got, want)
    assert (want == 0).all() and np.signbit(want).tolist() == [[False, False], [False, True]]


def test_without_numba_the_numpy_path_runs():
    """A process where numba cannot be imported computes the grouped Gemms on numerics' numpy path, with
    the bits this process gets on it."""
    code = ("import sys; sys.modules['numba'] = None\n"
            "import numpy as np\n"
            "from luminal_num.dtypes import GEMM_VARIANTS\n"
            "from luminal_num.runtime import jit_gemm\n"
            "from luminal_num.runtime.numerics import emulate_gemm\n"
            "assert jit_gemm.kernel() is None\n"
            "rng = np.random.default_rng(3)\n"
            "a, b = rng.standard_normal((5, 70)).astype(np.float32), rng.standard_normal((70, 9)).astype(np.float32)\n"
            "sys.stdout.write(emulate_gemm(a, b, GEMM_VARIANTS['f8e4m3_block']).tobytes().hex())\n")
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    rng = np.random.default_rng(3)
    a, b = rng.standard_normal((5, 70)).astype(np.float32), rng.standard_normal((70, 9)).astype(np.float32)
    saved, jit_gemm.ENABLED = jit_gemm.ENABLED, False
    try:
        want = emulate_gemm(a, b, GEMM_VARIANTS["f8e4m3_block"])
    finally:
        jit_gemm.ENABLED = saved
    assert done.stdout == want.tobytes().hex()


@needs_numba
@pytest.mark.parametrize("name", ["f8e4m3_block_nopromote", "f8e4m3_block"])
def test_scales_that_overflow_the_accumulator(name):
    """Per-product and per-chunk scaling with scales near FP32's top (one K-block's 2^62 * 2^62 overflows
    acc_m13 to inf mid-way, per product; or only at the FP32 promotion) and a NaN scale: the unproved paths."""
    v = GEMM_VARIANTS[name]
    rng = np.random.default_rng(9)
    m, k, n = 9, 384, 30
    a = values(rng, (m, k), -3, 6, 4, 0.1)
    b = values(rng, (k, n), -3, 6, 4, 0.1)
    sa = np.ones((m, k // 128), np.float32)
    sb = np.ones((k // 128, 1), np.float32)
    sa[2:5, 1], sb[1, 0] = 2.0 ** 62, 2.0 ** 62
    sa[7, 2] = np.nan
    qa, qb = numerics._Operand(a, sa, v.a_scale), numerics._Operand(b, sb, v.b_scale)
    chunk = k if v.scales_per_product else v.promote_every
    got, want = both_paths(lambda: numerics._grouped_gemm(qa, qb, v.accumulator, v.mma_k, chunk, 128,
                                                          v.scales_per_product))
    assert_same(got, want)
    assert np.isinf(want).any() and np.isnan(want[7]).all()


@needs_numba
@pytest.mark.parametrize("shapes", [((9, 40), (3, 40, 30)), ((2, 1, 9, 40), (1, 3, 40, 30)), ((1, 9, 40), (4, 40, 30))])
def test_a_broadcast_over_the_batch(shapes):
    """A shared by every matrix of a batched B (one matrix of A read by each task, or broadcast copies)."""
    rng = np.random.default_rng(11)
    a = values(rng, shapes[0], -6, 6, 11, 0.1)
    b = values(rng, shapes[1], -6, 6, 11, 0.1)
    for name in ("f16acc16", "f8e4m3_block"):
        got, want = both_paths(lambda: emulate_gemm(a, b, GEMM_VARIANTS[name]))
        assert_same(got, want)


@needs_numba
@pytest.mark.parametrize("special", [None, np.nan, -np.nan, np.inf, -np.inf, -0.0, 2.0 ** -149, -3.4e38])
@pytest.mark.parametrize("size", [0, 1, 7, 1000])
def test_abs_max_is_numpys(special, size):
    """abs_max (an integer max over the bits) gives float(np.max(np.abs(x), initial=0.0)), NaN where x has one."""
    x = (np.random.default_rng(size).standard_normal(size) * 1e3).astype(np.float32)
    if special is not None and size:
        x[size // 2] = special
    got, want = jit_gemm.abs_max(x.view(np.uint32)), float(np.max(np.abs(x), initial=0.0))
    assert got == want or (np.isnan(got) and np.isnan(want))


@needs_numba
@pytest.mark.parametrize("name", ["f8e4m3_channel", "f8e4m3_channel_dynamic", "f8e4m3_tensor", "f8e5m2_tensor",
                                  "int8_channel", "f8e4m3_channel_prologue"])
@pytest.mark.parametrize("shapes", [((7, 50), (50, 33)), ((3, 7, 50), (50, 33)), ((2, 7, 50), (2, 50, 33))])
def test_vector_scales_in_one_pass(name, shapes):
    """numerics._outer_scaled (partial * fl32(sa * sb) in one numba pass) gives the bits of the numpy
    product of the (M, N) scale matrix, per-tensor and per-channel scales, batched and broadcast."""
    rng = np.random.default_rng(len(name))
    a = (rng.standard_normal(shapes[0]) * 2.0 ** rng.integers(-10, 10, shapes[0])).astype(np.float32)
    b = (rng.standard_normal(shapes[1]) * 2.0 ** rng.integers(-10, 10, shapes[1])).astype(np.float32)
    got, want = both_paths(lambda: emulate_gemm(a, b, GEMM_VARIANTS[name]))
    assert_same(got, want)
