"""Rounding to every format, differentially: against ml_dtypes casts, an independent float64
frexp/ldexp reference, and exact rational arithmetic; the format constants against finfo; the
variant catalogue's structure."""
from __future__ import annotations

import math
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from luminal_num.dtypes import (BF16, E8M0, Kind, F4E2M1, F8E4M3, F8E5M2, F16, F32, F64, GEMM_VARIANTS, INT8, INT32,
                                MX_BLOCK, TF32, WHOLE, ELEMENTWISE_VARIANTS, REDUCE_VARIANTS, ElementwisePrecision,
                                GemmPrecision, Granularity, Overflow, ReducePrecision, ScaleSpec, from_storage,
                                round_to, to_storage)

ROUNDED = (TF32, F16, BF16, F8E4M3, F8E5M2, F4E2M1)


def exact_round(x: Fraction, p: int, min_normal: float) -> Fraction:
    """RNE of a rational to p significant bits, fixed quantum below min_normal; unbounded above.
    Python's round() of a Fraction is half-to-even: the whole reference is integer arithmetic."""
    if x == 0:
        return Fraction(0)
    magnitude = abs(x)
    e = magnitude.numerator.bit_length() - magnitude.denominator.bit_length()
    if Fraction(2) ** e > magnitude:
        e -= 1  # now 2^e <= |x| < 2^(e+1)
    quantum = Fraction(2) ** (max(e, int(math.log2(min_normal))) - p + 1)
    rounded = round(magnitude / quantum) * quantum
    return rounded if x > 0 else -rounded


def frexp_round(x: np.ndarray, p: int, min_normal: float) -> np.ndarray:
    """Independent float64 reference: the quantum from np.frexp, RNE by np.rint, rescaled by np.ldexp
    (x / quantum is a power-of-two scaling, exact)."""
    _, exponent = np.frexp(x)
    lead = np.maximum(exponent - 1, int(math.log2(min_normal)))
    quantum = np.ldexp(1.0, lead - (p - 1))
    with np.errstate(invalid="ignore"):
        return np.where(np.isfinite(x), np.rint(x / quantum) * quantum, x)


def bit_patterns(n: int, seed: int) -> np.ndarray:
    """Uniformly random float32 bit patterns: every binade, subnormals, infinities and NaNs."""
    return np.random.default_rng(seed).integers(0, 2 ** 32, n, dtype=np.uint64).astype(np.uint32).view(np.float32)


def same_bits(actual: np.ndarray, expected: np.ndarray) -> bool:
    """Equal as values, with -0 != +0 and NaN == NaN."""
    with np.errstate(invalid="ignore"):  # signalling NaN patterns warn when widened
        actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    nan = np.isnan(actual)
    return bool(np.array_equal(nan, np.isnan(expected))
                and np.array_equal(actual[~nan], expected[~nan])
                and np.array_equal(np.signbit(actual[~nan]), np.signbit(expected[~nan])))


# ---------------------------------------------------------------- format constants

@pytest.mark.parametrize("fmt", [F64, F32, F16, BF16, F8E4M3, F8E5M2, F4E2M1])
def test_format_constants_match_finfo(fmt):
    info = ml_dtypes.finfo(fmt.storage)
    assert fmt.max_finite == float(info.max)
    assert fmt.min_normal == float(info.smallest_normal)
    assert fmt.min_subnormal == float(info.smallest_subnormal)
    assert 2 * fmt.unit_roundoff == float(info.eps)  # eps is the gap above 1 = 2u


def test_tf32_constants_are_fp32_with_13_bits_dropped():
    f32 = np.finfo(np.float32)
    largest = np.array(f32.max, np.float32).view(np.uint32) & np.uint32(~0x1FFF & 0xFFFFFFFF)
    assert TF32.max_finite == float(largest.view(np.float32))
    assert TF32.min_normal == float(f32.smallest_normal)
    assert TF32.min_subnormal == float(f32.smallest_normal) * 2.0 ** -10
    assert 2 * TF32.unit_roundoff == float(f32.eps) * 2.0 ** 13


def test_integer_and_scale_constants():
    assert INT8.max_finite == np.iinfo(np.int8).max and INT32.max_finite == np.iinfo(np.int32).max
    e8m0 = ml_dtypes.finfo(E8M0.storage)
    assert E8M0.max_finite == float(e8m0.max) and E8M0.min_normal == float(e8m0.smallest_normal)


# ---------------------------------------------------------------- hand-derived edges

EDGES = [  # (format, input, policy, expected)
    (F8E4M3, 1.0625, Overflow.SATURATE, 1.0),  # tie between 1 and 1.125: to even (1.000)
    (F8E4M3, 1.1875, Overflow.SATURATE, 1.25),  # tie between 1.125 and 1.25: to even (1.010)
    (F8E4M3, 464.0, Overflow.NAN, 448.0),  # tie between 448 and 480: down to even 448, no overflow
    (F8E4M3, 465.0, Overflow.NAN, math.nan),
    (F8E4M3, 465.0, Overflow.SATURATE, 448.0),
    (F8E4M3, -465.0, Overflow.SATURATE, -448.0),
    (F8E4M3, 465.0, Overflow.INF, math.nan),  # no infinities in e4m3
    (F8E4M3, math.inf, Overflow.SATURATE, 448.0),  # .satfinite clamps infinities too
    (F8E4M3, 2.0 ** -10, Overflow.SATURATE, 0.0),  # half the smallest subnormal: tie to even zero
    (F8E4M3, 3 * 2.0 ** -10, Overflow.SATURATE, 2.0 ** -8),  # 1.5 subnormal quanta: tie to even (2)
    (F16, 65519.0, Overflow.INF, 65504.0),  # below the tie at 65520: rounds down, finite
    (F16, 65520.0, Overflow.INF, math.inf),  # the tie rounds to 65536 (even): overflow
    (F16, 65520.0, Overflow.SATURATE, 65504.0),
    (F16, 65520.0, Overflow.NAN, math.nan),
    (F16, -math.inf, Overflow.INF, -math.inf),
    (F16, -math.inf, Overflow.NAN, -math.inf),  # a representable infinity is not an overflow
    (F16, 2.0 ** -25, Overflow.SATURATE, 0.0),
    (F8E5M2, 61439.0, Overflow.INF, 57344.0),
    (F8E5M2, 61440.0, Overflow.INF, math.inf),
    (F8E5M2, 61440.0, Overflow.SATURATE, 57344.0),
    (BF16, 1.0 + 2.0 ** -8, Overflow.SATURATE, 1.0),
    (BF16, 1.0 + 2.0 ** -8 + 2.0 ** -40, Overflow.SATURATE, 1.0 + 2.0 ** -7),  # one rounding, not two
    (TF32, 1.0 + 2.0 ** -11, Overflow.SATURATE, 1.0),
    (TF32, 1.0 + 3 * 2.0 ** -11, Overflow.SATURATE, 1.0 + 2.0 ** -9),
    (F4E2M1, 7.0, Overflow.SATURATE, 6.0),
    (F4E2M1, 7.0, Overflow.NAN, math.nan),  # 7 is the tie between 6 and 8: rounds to 8, overflow
    (F4E2M1, 6.9, Overflow.INF, 6.0),
    (INT8, 2.5, Overflow.SATURATE, 2.0),
    (INT8, -2.5, Overflow.SATURATE, -2.0),
    (INT8, 3.5, Overflow.SATURATE, 4.0),
    (INT8, 127.5, Overflow.SATURATE, 127.0),  # rounds to 128 (even), clamps to 127
    (INT8, 127.5, Overflow.NAN, math.nan),
    (INT8, -128.5, Overflow.SATURATE, -128.0),  # two's complement range, as cvt + clamp on the GPU
    (INT8, -128.5, Overflow.NAN, -128.0),  # rounds to -128 (even): in range
]


@pytest.mark.parametrize("fmt,value,policy,expected", EDGES)
def test_hand_derived_edges(fmt, value, policy, expected):
    for dtype in (np.float32, np.float64):
        if float(dtype(value)) != value:
            continue  # not an input of that width
        assert same_bits(round_to(np.array([value], dtype), fmt, policy), [expected])


def test_scalar_and_narrow_inputs():
    assert round_to(1.0625, F8E4M3).shape == ()
    assert float(round_to(np.float16(1.0625), F8E4M3)) == 1.0
    assert float(round_to(np.array(3, np.int8), F8E4M3)) == 3.0


# ---------------------------------------------------------------- TF32 vs an independent reference

def test_tf32_matches_frexp_reference_on_1e5_values():
    x = np.concatenate([bit_patterns(100_000, seed=1),
                        np.array([np.inf, -np.inf, np.nan, 0.0, -0.0, 2.0 ** -149, -(2.0 ** -140)], np.float32)])
    subnormal = (np.abs(x) < 2.0 ** -126) & (x != 0)
    assert subnormal.sum() > 100 and np.isnan(x).sum() > 100 and np.isinf(x).sum() >= 2
    with np.errstate(invalid="ignore"):
        expected = frexp_round(x.astype(np.float64), TF32.p, TF32.min_normal)
    expected = np.where(np.abs(expected) > TF32.max_finite, np.copysign(np.inf, x), expected)  # IEEE overflow
    assert same_bits(round_to(x, TF32, Overflow.INF), expected)


def ties_of(fmt, n: int, seed: int) -> np.ndarray:
    """Exact midpoints between neighbouring values of fmt (float64), over the format's whole range."""
    rng = np.random.default_rng(seed)
    exponent = rng.integers(int(math.log2(fmt.min_subnormal)), int(math.log2(fmt.max_finite)) + 1, n)
    ulp = np.ldexp(1.0, np.maximum(exponent - (fmt.p - 1), int(math.log2(fmt.min_subnormal))))
    mantissa = rng.integers(0, 2 ** (fmt.p - 1), n)
    base = np.ldexp(1.0, exponent) + mantissa * ulp
    return np.where(rng.random(n) < 0.5, -1, 1) * (base + ulp / 2)


@pytest.mark.parametrize("fmt", [F16, BF16, F8E4M3, F8E5M2, F4E2M1])
def test_float32_inputs_match_ml_dtypes_casts(fmt):
    """ml_dtypes rounds float32 once, to nearest even: the oracle for in-range values and ties.
    Its overflow behaviour is format-specific, so each is compared with the matching policy."""
    x = np.concatenate([bit_patterns(50_000, seed=2), ties_of(fmt, 5_000, seed=3).astype(np.float32),
                        np.random.default_rng(4).standard_normal(5_000).astype(np.float32) * min(fmt.max_finite, 1e30)])
    policy = Overflow.SATURATE if fmt is F4E2M1 else Overflow.INF  # e2m1 clamps; the rest follow IEEE/NaN
    if fmt is F4E2M1:
        x = x[~np.isnan(x)]  # e2m1 has no NaN
    with np.errstate(over="ignore", invalid="ignore"):
        expected = x.astype(fmt.storage).astype(np.float32)
    assert same_bits(round_to(x, fmt, policy), expected)


@pytest.mark.parametrize("fmt", [F32, *ROUNDED])
def test_float64_inputs_round_once(fmt):
    """float64 inputs against exact rational rounding, including values a step through float32
    would round twice: a tie at the target precision nudged by 2^-30 relative."""
    rng = np.random.default_rng(5)
    ties = ties_of(fmt, 300, seed=6)
    nudged = ties * (1 + rng.choice([-1.0, 1.0], ties.size) * 2.0 ** -30)
    wide = rng.standard_normal(300) * 2.0 ** rng.integers(-30, 30, 300)
    x = np.concatenate([ties, nudged, wide])
    x = x[np.abs(x) <= fmt.max_finite]
    expected = [math.copysign(float(exact_round(Fraction(v), fmt.p, fmt.min_normal)), v) for v in x]  # signed 0
    expected = np.clip(expected, -fmt.max_finite, fmt.max_finite)  # saturation of the rounded value
    assert same_bits(round_to(x, fmt), expected)


@settings(deadline=None, max_examples=200)
@given(st.sampled_from(ROUNDED), st.floats(allow_nan=False, allow_infinity=False, width=32),
       st.floats(allow_nan=False, allow_infinity=False, width=32))
def test_rounding_properties(fmt, x, y):
    """Within half a quantum, idempotent, monotone: what any correct rounding must satisfy."""
    x, y = sorted((x, y))
    rx, ry = (float(round_to(np.float32(v), fmt)) for v in (x, y))
    if abs(x) <= fmt.max_finite:
        assert abs(rx - x) <= fmt.unit_roundoff * abs(x) + fmt.min_subnormal / 2
    assert float(round_to(np.float32(rx), fmt)) == rx
    assert rx <= ry


# ---------------------------------------------------------------- integers and storage

def test_int_rounding_is_half_even_with_policy():
    x = np.array([0.5, 1.5, -0.5, 126.5, 1e9, -np.inf, np.nan])
    assert same_bits(round_to(x, INT8), [0.0, 2.0, -0.0, 126.0, 127.0, -128.0, np.nan])
    assert same_bits(round_to(x, INT8, Overflow.NAN), [0.0, 2.0, -0.0, 126.0, np.nan, np.nan, np.nan])
    big = round_to(np.array([2.0 ** 31 - 0.5, 3e9]), INT32)  # the first rounds to 2^31 (even): clamped
    assert big.dtype == np.float64 and big.tolist() == [2.0 ** 31 - 1, 2.0 ** 31 - 1]


@pytest.mark.parametrize("fmt", [F32, F16, BF16, F8E4M3, F8E5M2, F4E2M1, INT8, INT32, TF32])
def test_storage_round_trip(fmt):
    x = np.random.default_rng(7).standard_normal(1000) * min(fmt.max_finite, 1e4) / 8
    stored = to_storage(x, fmt)
    assert stored.dtype == fmt.storage
    values, expected = from_storage(stored, fmt), round_to(x, fmt)
    assert np.array_equal(values, expected) if fmt.kind is Kind.INT else same_bits(values, expected)  # ints: no -0


def test_storage_errors():
    with pytest.raises(ValueError):
        to_storage([200.0], INT8, Overflow.NAN)  # int8 cannot hold the NaN marking overflow
    with pytest.raises(TypeError):
        from_storage(np.zeros(3, np.float32), F16)
    powers = [2.0 ** -127, 1.0, 2.0 ** 127]
    assert from_storage(to_storage(powers, E8M0), E8M0).tolist() == powers
    with pytest.raises(ValueError):
        to_storage([3.0], E8M0)
    with pytest.raises(ValueError):
        round_to([1.0], E8M0)


# ---------------------------------------------------------------- the variant catalogue

def test_catalogue_names_and_structure():
    expected = {"f32", "tf32", "bf16", "f16", "f16acc16", "f8e4m3_tensor", "f8e4m3_channel", "f8e4m3_block",
                "f8e5m2_tensor", "f8e5m2_channel", "f8e5m2_block", "f8e4m3_mx", "f8e4m3_block_nopromote",
                "int8_channel", "f8e4m3_channel_prologue",
                "f8e4m3_tensor_dynamic", "f8e4m3_channel_dynamic"}  # both operands scaled at run time
    assert set(GEMM_VARIANTS) == expected
    assert not any(GEMM_VARIANTS[n].b_scale.static for n in ("f8e4m3_tensor_dynamic", "f8e4m3_channel_dynamic"))
    assert all(name == v.name for name, v in GEMM_VARIANTS.items())
    block, nopromote, mx = (GEMM_VARIANTS[n] for n in ("f8e4m3_block", "f8e4m3_block_nopromote", "f8e4m3_mx"))
    assert (block.a_scale.block, block.b_scale.block, block.promote_every) == ((1, 128), (128, 128), 128)
    assert not block.a_scale.static and block.b_scale.static
    assert block.accumulator.p == 14 and nopromote.promote_every is None and nopromote.scales_per_product
    assert mx.a_scale.scale_format is E8M0 and mx.scale_k_block == MX_BLOCK and mx.scales_per_product
    assert [GEMM_VARIANTS[n].mma_k for n in ("tf32", "bf16", "f8e4m3_block", "int8_channel")] == [8, 16, 32, 32]
    assert GEMM_VARIANTS["int8_channel"].accumulator is INT32 and GEMM_VARIANTS["f16acc16"].grouped
    assert set(ELEMENTWISE_VARIANTS) == {"f32", "bf16", "bf16_computef32", "f16_computef32"}
    assert set(REDUCE_VARIANTS) == {"f32", "bf16", "f16", "bf16_accf32", "f16_accf32"}


INVALID = [
    lambda: ScaleSpec(Granularity.TENSOR, (1, WHOLE), F32, False),
    lambda: ScaleSpec(Granularity.MX, (1, 32), F32, False),
    lambda: ScaleSpec(Granularity.BLOCK, (1, 128), F16, False),
    lambda: ScaleSpec(Granularity.BLOCK, (1, 128), F32, False, margin=0.0),
    lambda: GemmPrecision("x", F8E4M3, F8E4M3, F32),  # 8-bit operands without scales
    lambda: GemmPrecision("x", INT8, INT8, F32, GEMM_VARIANTS["int8_channel"].a_scale,
                          GEMM_VARIANTS["int8_channel"].b_scale),
    lambda: GemmPrecision("x", BF16, BF16, F16, acc_mantissa_bits=10),
    lambda: GemmPrecision("x", F8E4M3, F8E4M3, F32, ScaleSpec(Granularity.BLOCK, (1, 128), F32, False),
                          ScaleSpec(Granularity.BLOCK, (64, 128), F32, True), promote_every=64),  # K blocks differ
    lambda: GemmPrecision("x", F8E4M3, F8E4M3, F32, ScaleSpec(Granularity.BLOCK, (1, 128), F32, False),
                          ScaleSpec(Granularity.BLOCK, (128, 128), F32, True)),  # FP32 K-scales, no promotion
    lambda: GemmPrecision("x", F8E4M3, F8E4M3, F32, ScaleSpec(Granularity.BLOCK, (1, 128), F32, False),
                          ScaleSpec(Granularity.BLOCK, (128, 128), F32, True), promote_every=256),
    lambda: ElementwisePrecision(F16, F16),
    lambda: ReducePrecision(BF16, F32),
]


@pytest.mark.parametrize("build", INVALID)
def test_invalid_precisions_are_rejected(build):
    with pytest.raises(ValueError):
        build()
