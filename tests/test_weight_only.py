"""Weight-only Gemms: the CPU emulation bit-exact against a rational (Fraction) reference written from
the definition, within its a-priori bound against the exact product with the original weights, and
the static transfer sound on sampled points of its input intervals; fuzzed near the format limits."""
from __future__ import annotations

import zlib
from fractions import Fraction

import gguf
import numpy as np
from kept_blocks import kept_k, kept_sample
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from luminal_num.dtypes import BF16, F16, F32, Format
from luminal_num.quant import STORAGE_FORMATS, Layout, Part, Scheme, from_gguf
from luminal_num.quant.gguf_blocks import block_type
from luminal_num.runtime.weight_only import (WEIGHT_ONLY_GEMMS, SumOrder, WeightOnlyGemm, emulate_weight_only_gemm,
                                             weight_only_transfer)



# ---------------------------------------------------------------- the rational reference


def round_fraction(x: Fraction, fmt: Format) -> Fraction:
    """RNE of a rational to fmt's significand, fixed quantum below min_normal; overflow -> inf (a float)."""
    if x == 0:
        return Fraction(0)
    magnitude = abs(x)
    e = magnitude.numerator.bit_length() - magnitude.denominator.bit_length()
    if Fraction(2) ** e > magnitude:
        e -= 1
    min_exponent = Fraction(fmt.min_normal).numerator.bit_length() - Fraction(fmt.min_normal).denominator.bit_length()
    quantum = Fraction(2) ** (max(e, min_exponent) - fmt.p + 1)
    rounded = round(magnitude / quantum) * quantum  # round() of a Fraction is half to even
    if rounded > Fraction(fmt.max_finite):
        raise OverflowError
    return rounded if x > 0 else -rounded


def f32(x: Fraction) -> Fraction:
    return round_fraction(x, F32)


def dequantize_fraction(fmt, values, shape):
    """Each scheme's dequantize from the part values, as exact rationals (written from the definitions)."""
    rows, k = shape
    if fmt.scheme is Scheme.GGUF_BLOCKS:  # the gguf package's decoding of the kept bytes (llama.cpp's own)
        blocks = values[Part.BLOCKS].astype(np.uint8)
        decoded = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[block_type(fmt.name).ggml])
        return [[Fraction(float(v)) for v in row] for row in decoded.astype(np.float32)]
    q = values[Part.Q]

    def per_group(part, r, c):
        return Fraction(float(values[part][r, c // fmt.block]))

    out = []
    for r in range(rows):
        row = []
        for c in range(k):
            v = Fraction(float(q[r, c]))
            if fmt.scheme is Scheme.IEEE:
                row.append(v)
            elif fmt.scheme is Scheme.AMAX:
                b = max(fmt.block, 1)
                index = {Layout.CHANNEL: (r, 0), Layout.TILE: (r // b, c // b), Layout.GROUP: (r, c // b)}[fmt.layout]
                row.append(f32(v * Fraction(float(values[Part.SCALE][index]))))
            elif fmt.scheme is Scheme.INT4_SYMMETRIC or fmt.scheme is Scheme.GGUF_Q8_0:
                row.append(v * per_group(Part.SCALE, r, c))
            elif fmt.scheme is Scheme.INT4_ASYMMETRIC:
                row.append((v - per_group(Part.ZERO, r, c)) * per_group(Part.SCALE, r, c))
            elif fmt.scheme is Scheme.NVFP4:
                row.append(f32(f32(v * per_group(Part.SCALE, r, c)) * Fraction(float(values[Part.TENSOR_SCALE]))))
            elif fmt.scheme is Scheme.GGUF_Q4_1:
                row.append(f32(v * per_group(Part.SCALE, r, c) + per_group(Part.MIN, r, c)))
        out.append(row)
    return out


def reference_gemm(a: np.ndarray, quantized, variant: WeightOnlyGemm) -> np.ndarray:
    """Steps 1-4 of the definition in rationals, sequential K order; float32 result."""
    w = dequantize_fraction(variant.weight, quantized.values, quantized.shape)
    act = variant.activation
    widen = (lambda v: v) if act is F32 else (lambda v: round_fraction(v, act))
    w_hat = [[widen(v) for v in row] for row in w]
    out = np.zeros((a.shape[0], len(w_hat)), np.float32)
    for m in range(a.shape[0]):
        a_hat = [widen(Fraction(float(v))) for v in a[m]]
        for n, row in enumerate(w_hat):
            acc = Fraction(0)
            for x, y in zip(a_hat, row):
                acc = f32(acc + f32(x * y))
            out[m, n] = float(acc)
    return out


def exact_gemm(a: np.ndarray, w: np.ndarray) -> np.ndarray:
    """sum_k a_k w_k: products exact in float64, np.float64 dot error <= K 2^-53 sum|a w| (tests add it)."""
    return a.astype(np.float64) @ w.astype(np.float64).T


def case(variant: WeightOnlyGemm, m: int, n: int, k: int, seed: int, scale: float = 1.0):
    rng = np.random.default_rng(seed)
    kept = variant.weight.keeps_only  # random blocks, K whole blocks: the weight is what they decode to
    k = kept_k(variant.weight, k) if kept else k
    w = (rng.standard_normal((n, k)) * 0.05 * 10.0 ** rng.uniform(-2, 0, (n, 1))).astype(np.float32)
    a = (rng.standard_normal((m, k)) * scale).astype(np.float32)
    if variant.activation is not F32:
        a = a.astype(variant.activation.storage).astype(np.float32)  # activations arrive in their format
    quantized = kept_sample(variant.weight, n, k, seed) if kept else variant.weight.quantize(w)
    return a, quantized.dequantize() if kept else w, quantized


# ---------------------------------------------------------------- catalogue


def test_catalogue_covers_every_storage_format_and_activation():
    expected = {f"{s}_a{a}" for s in STORAGE_FORMATS if s != "f32" for a in ("f32", "bf16", "f16")}
    assert set(WEIGHT_ONLY_GEMMS) == expected
    assert WEIGHT_ONLY_GEMMS["int8_channel_abf16"].label == "W8A16"
    assert WEIGHT_ONLY_GEMMS["int4_g128_af16"].label == "W4A16"
    assert WEIGHT_ONLY_GEMMS["nvfp4_af32"].label == "W4A32"
    with pytest.raises(ValueError, match="activations are f32/bf16/f16"):
        WeightOnlyGemm("bad", STORAGE_FORMATS["int4_g32"], STORAGE_FORMATS["f8e4m3_channel"].element)


# ---------------------------------------------------------------- bit-exact against the rational reference


@pytest.mark.parametrize("name", sorted(WEIGHT_ONLY_GEMMS))
def test_emulation_is_bit_exact_against_fractions(name):
    variant = WEIGHT_ONLY_GEMMS[name]
    k = 64 if variant.weight.scheme in (Scheme.GGUF_Q4_1, Scheme.GGUF_Q8_0) else 37  # 37: ragged groups
    a, w, quantized = case(variant, m=2, n=3, k=k, seed=zlib.crc32(name.encode()))
    got = emulate_weight_only_gemm(a, quantized, variant)
    assert got.tobytes() == reference_gemm(a, quantized, variant).tobytes()
    stored = variant.weight.pack(quantized)  # the packed form computes the same
    assert emulate_weight_only_gemm(a, stored, variant).tobytes() == got.tobytes()


@settings(max_examples=30, deadline=None)
@given(name=st.sampled_from(sorted(n for n, v in WEIGHT_ONLY_GEMMS.items() if not v.weight.keeps_only)),
       seed=st.integers(0, 2 ** 31),
       a_exp=st.floats(-140, 100), w_exp=st.floats(-60, 15))
def test_emulation_is_bit_exact_near_the_limits(name, seed, a_exp, w_exp):
    """Subnormal products, activations near the format maxima: still the rational definition, bit for bit."""
    variant = WEIGHT_ONLY_GEMMS[name]
    rng = np.random.default_rng(seed)
    w = (np.exp2(w_exp - rng.uniform(0, 30, (2, 32))) * rng.choice([-1, 1], (2, 32))).astype(np.float32)
    a = (np.exp2(a_exp - rng.uniform(0, 30, (1, 32))) * rng.choice([-1, 1], (1, 32))).astype(np.float32)
    try:
        quantized = variant.weight.quantize(w)
    except ValueError:
        return  # refused (f16 range): covered by the storage tests
    got = emulate_weight_only_gemm(a, quantized, variant)
    try:
        expected = reference_gemm(a, quantized, variant)
    except OverflowError:  # the definition overflows somewhere: the emulation must not hide it
        assert not np.all(np.isfinite(got))
        return
    assert got.tobytes() == expected.tobytes()


def test_tiled_accumulation_is_the_same_sequential_sum(monkeypatch):
    import luminal_num.runtime.weight_only as wo
    variant = WEIGHT_ONLY_GEMMS["int4_g32_abf16"]
    a, w, quantized = case(variant, m=3, n=17, k=96, seed=4)
    whole = emulate_weight_only_gemm(a, quantized, variant)
    monkeypatch.setattr(wo, "_TILE_ELEMENTS", 3 * 96 * 2)  # two outputs per tile
    assert emulate_weight_only_gemm(a, quantized, variant).tobytes() == whole.tobytes()
    assert emulate_weight_only_gemm(a[None], quantized, variant).shape == (1, 3, 17)


# ---------------------------------------------------------------- bounds


def _check_within_a_priori(variant, a, w, quantized, order):
    got = emulate_weight_only_gemm(a, quantized, variant, order).astype(np.float64)
    exact = exact_gemm(a, w)
    abs_dot = np.abs(a.astype(np.float64)) @ np.abs(w.astype(np.float64)).T
    bound = variant.a_priori_bound(a.shape[1], abs_dot, float(np.abs(a).max()), float(np.abs(w).max()))
    slack = a.shape[1] * 2.0 ** -52 * abs_dot  # the float64 reference's own error
    assert np.all(np.abs(got - exact) <= bound + slack), variant.name
    return np.abs(got - exact), bound


@pytest.mark.parametrize("name", sorted(WEIGHT_ONLY_GEMMS))
def test_emulation_within_its_a_priori_bound(name):
    variant = WEIGHT_ONLY_GEMMS[name]
    a, w, quantized = case(variant, m=4, n=24, k=256, seed=7, scale=3.0)
    for order in SumOrder:
        err, bound = _check_within_a_priori(variant, a, w, quantized, order)
    assert np.all(np.isfinite(bound))


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(sorted(n for n, v in WEIGHT_ONLY_GEMMS.items() if not v.weight.keeps_only)),
       seed=st.integers(0, 2 ** 31),
       a_exp=st.floats(-120, 15), w_exp=st.floats(-60, 15), k=st.sampled_from([32, 64, 160]))
def test_a_priori_bound_is_sound_near_the_limits(name, seed, a_exp, w_exp, k):
    variant = WEIGHT_ONLY_GEMMS[name]
    rng = np.random.default_rng(seed)
    w = (np.exp2(w_exp - rng.uniform(0, 20, (5, k))) * rng.choice([-1, 1], (5, k))).astype(np.float32)
    a = (np.exp2(a_exp - rng.uniform(0, 30, (3, k))) * rng.choice([-1, 1], (3, k))).astype(np.float32)
    try:
        quantized = variant.weight.quantize(w)
    except ValueError:
        assert np.abs(w).max() > 6e4  # only an f16 value / scale range refuses
        return
    _check_within_a_priori(variant, a, w, quantized, SumOrder.SEQUENTIAL)


@pytest.mark.parametrize("name", ["int4_g128_abf16", "int8_channel_af16", "nvfp4_af32", "mxfp4_abf16",
                                  "gguf_q4_1_af16", "f8e4m3_block128_af32", "bf16_af32"])
def test_static_transfer_is_sound_and_tighter_than_a_priori(name):
    variant = WEIGHT_ONLY_GEMMS[name]
    rng = np.random.default_rng(11)
    k, n = 128, 16
    w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
    quantized = variant.weight.quantize(w)
    lo = rng.uniform(-2, 1, (2, k))
    hi = lo + rng.uniform(0, 1, (2, k))
    a_err = 1e-3 * np.abs(lo).max()
    result = weight_only_transfer(variant, lo, hi, a_err, quantized, w)
    for _ in range(20):
        exact_a = rng.uniform(lo, hi)
        executed = (exact_a + rng.uniform(-a_err, a_err, exact_a.shape)).astype(np.float32)
        exact = exact_gemm(exact_a, w)
        assert np.all((result.lo <= exact) & (exact <= result.hi))
        got = emulate_weight_only_gemm(executed, quantized, variant, SumOrder.BLAS).astype(np.float64)
        assert np.all(np.abs(got - exact) <= result.err), name
    # on point intervals with exact activations the transfer knows the storage error: tighter than a priori
    point = weight_only_transfer(variant, lo, lo, 0.0, quantized, w)
    a_priori = variant.a_priori_bound(k, np.abs(lo) @ np.abs(w.astype(np.float64)).T, float(np.abs(lo).max()),
                                      float(np.abs(w).max()))
    assert np.all(point.err <= a_priori)


def test_a_kept_gguf_weight_costs_no_storage_error(smollm2_gguf):
    reader = smollm2_gguf
    tensor = next(t for t in reader.tensors if t.tensor_type.name == "Q4_1")
    kept = from_gguf(np.asarray(tensor.data), "Q4_1")
    model_weight = gguf.quants.dequantize(tensor.data, tensor.tensor_type)[:8]  # the model's own values
    rows = from_gguf(np.asarray(tensor.data)[:8], "Q4_1")
    variant = WEIGHT_ONLY_GEMMS["gguf_q4_1_af32"]
    assert np.array_equal(variant.widen(rows), model_weight)
    a = np.random.default_rng(0).standard_normal((1, kept.shape[1])).astype(np.float32)
    point = weight_only_transfer(variant, a, a, 0.0, rows, model_weight)
    arithmetic = variant.arithmetic_bound(kept.shape[1], (np.abs(a) @ np.abs(model_weight).T) * (1 + 2.0 ** -30),
                                          float(np.abs(a).max()), float(np.abs(model_weight).max()))
    assert np.allclose(point.err, arithmetic * (1 + 2.0 ** -20), rtol=1e-12)  # no storage term at all
    got = emulate_weight_only_gemm(a, rows, variant).astype(np.float64)
    assert np.all(np.abs(got - exact_gemm(a, model_weight)) <= point.err)


def test_refusals():
    variant = WEIGHT_ONLY_GEMMS["int4_g32_af16"]
    w = np.ones((2, 64), np.float32)
    with pytest.raises(ValueError, match="reads int4_g32 weights, got int4_g64"):
        emulate_weight_only_gemm(np.ones((1, 64)), STORAGE_FORMATS["int4_g64"].quantize(w), variant)
    with pytest.raises(ValueError, match="do not have K = 64"):
        emulate_weight_only_gemm(np.ones((1, 63)), variant.weight.quantize(w), variant)
    with pytest.raises(ValueError, match="the original weight is"):
        weight_only_transfer(variant, np.zeros((1, 64)), np.zeros((1, 64)), 0.0, variant.weight.quantize(w), w[:1])
    big = WEIGHT_ONLY_GEMMS["bf16_af16"]  # bf16 weights beyond f16's range cannot be widened to f16
    assert big.a_priori_bound(4, 1.0, 1.0, 1e6) == float("inf")
    assert WEIGHT_ONLY_GEMMS["int8_channel_af16"].a_priori_bound(4, 1.0, 1e6, 1.0) == float("inf")
    assert BF16.bits == F16.bits == 16
