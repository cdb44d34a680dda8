"""The CPU emulator against an independent slow reference (exact rational arithmetic, Python loops),
its errors against FP64 and the a-priori bounds, and reductions / elementwise kernels."""
from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from luminal_num.dtypes import (BF16, E8M0, F8E4M3, F16, F32, GEMM_VARIANTS, INT8, INT32, Kind,
                                ELEMENTWISE_VARIANTS, GemmPrecision, Granularity, ScaleSpec, round_to)
from luminal_num.quant import QuantOverflow, QuantOverflowError, compute_scales
from luminal_num.runtime import jit_gemm
from luminal_num.runtime.numerics import emulate_elementwise, emulate_gemm, emulate_reduce_sum
from test_dtypes import exact_round, same_bits

EXTRA_VARIANTS = [  # structure the catalogue does not exercise: ragged N blocks, FP32 chunks, int chunks
    GemmPrecision("e4m3_small_blocks", F8E4M3, F8E4M3, F32, ScaleSpec(Granularity.BLOCK, (1, 32), F32, False),
                  ScaleSpec(Granularity.BLOCK, (32, 2), F32, True), promote_every=32, acc_mantissa_bits=13),
    GemmPrecision("e4m3_block_fp32acc", F8E4M3, F8E4M3, F32, ScaleSpec(Granularity.BLOCK, (1, 64), F32, False),
                  ScaleSpec(Granularity.BLOCK, (64, 64), F32, True), promote_every=64),
    GemmPrecision("bf16_limited_promoted", BF16, BF16, F32, promote_every=64, acc_mantissa_bits=10),
    GemmPrecision("int8_blocks", INT8, INT8, INT32, ScaleSpec(Granularity.BLOCK, (1, 64), F32, False),
                  ScaleSpec(Granularity.BLOCK, (64, 2), F32, True), promote_every=64),
]
ALL_VARIANTS = [*GEMM_VARIANTS.values(), *EXTRA_VARIANTS]


@pytest.fixture(params=["jit", "numpy"])
def grouped_path(request, monkeypatch):
    """Narrow-accumulator Gemms on the numba kernel (where numba is installed) and on numpy alone."""
    if request.param == "numpy":
        monkeypatch.setattr(jit_gemm, "ENABLED", False)
    elif jit_gemm.kernel() is None:
        pytest.skip("the kernel is off (numba missing or LUMINAL_NUM_JIT=0): the numpy path runs here")


# ---------------------------------------------------------------- the independent reference

def to_format(x: Fraction, fmt) -> Fraction:
    """RN to fmt with saturation, in exact arithmetic (the operands' conversion)."""
    if fmt.kind is Kind.INT:
        return Fraction(min(max(round(x), -fmt.max_finite - 1), fmt.max_finite))
    r = exact_round(x, fmt.p, fmt.min_normal)
    return max(min(r, Fraction(fmt.max_finite)), -Fraction(fmt.max_finite))


def f32(x: Fraction) -> Fraction:
    return exact_round(x, 24, F32.min_normal)


def ref_scale(amax: Fraction, fmt, spec: ScaleSpec) -> Fraction:
    if amax == 0:
        return Fraction(1)
    ratio = amax * Fraction(spec.margin) / Fraction(fmt.max_finite)
    if spec.scale_format is E8M0:
        e = -127
        while Fraction(2) ** e < ratio and e < 127:
            e += 1
        return Fraction(2) ** e
    return max(f32(ratio), Fraction(2) ** -126)


def ref_operand(x: np.ndarray, fmt, spec: ScaleSpec | None) -> tuple[np.ndarray, np.ndarray]:
    """(quantized values, the scale of every element) as object arrays of Fractions, by loops."""
    rows, cols = x.shape
    values = np.empty(x.shape, object)
    scales = np.full(x.shape, Fraction(1), object)
    if spec is None:
        for idx in np.ndindex(x.shape):
            values[idx] = Fraction(float(x[idx])) if fmt is F32 else to_format(Fraction(float(x[idx])), fmt)
        return values, scales
    block_rows, block_cols = spec.block[0] or rows, spec.block[1] or cols
    amax: dict[tuple[int, int], Fraction] = {}
    for i, j in np.ndindex(x.shape):
        key = (i // block_rows, j // block_cols)
        amax[key] = max(amax.get(key, Fraction(0)), abs(Fraction(float(x[i, j]))))
    for i, j in np.ndindex(x.shape):
        scales[i, j] = ref_scale(amax[(i // block_rows, j // block_cols)], fmt, spec)
        values[i, j] = to_format(f32(Fraction(float(x[i, j])) / scales[i, j]), fmt)
    return values, scales


def as_f32(values: np.ndarray) -> np.ndarray:
    return np.array([[float(v) for v in row] for row in values], np.float32)


def ref_gemm(a: np.ndarray, b: np.ndarray, v: GemmPrecision) -> np.ndarray:
    """C = A @ B per the semantics in luminal_num.runtime.numerics, one output at a time."""
    qa, sa = ref_operand(a, v.a_format, v.a_scale)
    qb, sb = ref_operand(b, v.b_format, v.b_scale)
    (m, k), n = a.shape, b.shape[1]
    acc = v.accumulator

    def narrow(x: Fraction) -> Fraction:
        return exact_round(x, acc.p, acc.min_normal)

    def group_sum(i, j, start):
        return sum((qa[i, t] * qb[t, j] for t in range(start, min(start + v.mma_k, k))), Fraction(0))

    if v.scales_per_product and not v.grouped:  # MX: power-of-two scales folded into the operands
        return np.matmul(as_f32(qa * sa), as_f32(qb * sb))
    out = np.zeros((m, n), np.float32)
    if v.scales_per_product:  # one narrow accumulator, fed fl32(fl32(group) * fl32(sa sb))
        for i, j in np.ndindex(m, n):
            total = Fraction(0)
            for start in range(0, k, v.mma_k):
                term = f32(f32(group_sum(i, j, start)) * f32(sa[i, start] * sb[start, j]))
                total = narrow(total + term)
            out[i, j] = float(total)
        return out
    chunk = min(v.promote_every or v.scale_k_block or k, k)
    for start in range(0, k, chunk):
        stop = min(start + chunk, k)
        fp32_blas = not (v.grouped or v.acc_format is INT32)
        blas = np.matmul(as_f32(qa[:, start:stop]), as_f32(qb[start:stop])) if fp32_blas else None
        for i, j in np.ndindex(m, n):
            if v.acc_format is INT32:
                partial = f32(sum((qa[i, t] * qb[t, j] for t in range(start, stop)), Fraction(0)))
            elif v.grouped:
                partial = Fraction(0)
                for g in range(start, stop, v.mma_k):
                    partial = narrow(partial + group_sum(i, j, g))
            else:
                partial = Fraction(float(blas[i, j]))  # the one BLAS-defined step: same call, same bits
            scaled = v.a_scale is not None or v.b_scale is not None
            term = f32(partial * f32(sa[i, start] * sb[start, j])) if scaled else partial
            out[i, j] = float(term if start == 0 else f32(Fraction(float(out[i, j])) + term))
    return out


@pytest.fixture(scope="module")
def small_operands():
    """3x257 @ 257x5: K ragged for every block and group size; magnitudes spread over 2^+-4 so that
    FP8 subnormals, zeros and ties occur."""
    rng = np.random.default_rng(11)
    a = (rng.standard_normal((3, 257)) * 2.0 ** rng.integers(-4, 5, (3, 257))).astype(np.float32)
    b = (rng.standard_normal((257, 5)) * 2.0 ** rng.integers(-4, 5, (257, 5))).astype(np.float32)
    return a, b


@pytest.mark.usefixtures("grouped_path")
@pytest.mark.parametrize("variant", ALL_VARIANTS, ids=lambda v: v.name)
def test_emulation_matches_the_slow_reference_bit_for_bit(variant, small_operands):
    a, b = small_operands
    assert same_bits(emulate_gemm(a, b, variant), ref_gemm(a, b, variant))


# ---------------------------------------------------------------- errors vs FP64 and the bounds

# Expected magnitude. Round-to-nearest of a value with log-uniform significand (Benford-like, as for
# Gaussian data) has relative error delta uniform in +-ulp/2 with ulp = 2u * 2^e, so
# E[delta^2] = E[(2u 2^e)^2 / 12 / x^2] = (u^2 / 3) E[1/m^2] over m in [1, 2) with density 1/(m ln 2),
# = (u^2 / 3) * (3 / 8) / ln 2 = u^2 / (8 ln 2). A product a_k b_k with rounded operands errs by
# a_k b_k (delta_a + delta_b); k independent such errors add in variance:
#   var_operands = k E[(ab)^2] (c_a + c_b),   c = u^2 / (8 ln 2)   (int8: absolute, c = E[s^2] / 12 / E[x^2]).
# Accumulating zero-mean terms, the partial sum after j terms has E[s_j^2] = j E[(ab)^2]; each rounding
# of it adds variance u_acc^2 / (8 ln 2) * E[s_j^2]. FP32 BLAS rounds after every term (sum_j j ~ k^2/2);
# a narrow accumulator rounds once per MMA group of g terms, n = chunk / g times per chunk, at
# s_j with j g terms (sum ~ g n^2 / 2 per chunk). Independent sources add in variance; the check
# allows a factor 10 either way (BLAS blocking, distribution tails, the model's approximations).
DELTA2 = 1.0 / (8.0 * math.log(2.0))


def _operand_variance(x: np.ndarray, fmt, spec) -> float:
    if fmt is F32:
        return 0.0
    if fmt.kind is Kind.INT:
        s = compute_scales(x, fmt, spec).astype(np.float64)
        return float(np.mean(s ** 2)) / 12.0 / float(np.mean(x.astype(np.float64) ** 2))
    return fmt.unit_roundoff ** 2 * DELTA2


def expected_rms_error(v: GemmPrecision, a: np.ndarray, b: np.ndarray) -> float:
    k = a.shape[-1]
    product_ms = float(np.mean(a.astype(np.float64) ** 2) * np.mean(b.astype(np.float64) ** 2))
    var = k * product_ms * (_operand_variance(a, v.a_format, v.a_scale) + _operand_variance(b, v.b_format, v.b_scale))
    if v.acc_format is not INT32:
        u = v.accumulator.unit_roundoff
        if v.grouped:
            chunk = min(v.promote_every or k, k)
            n = chunk / v.mma_k
            roundings = (k / chunk) * v.mma_k * n * n / 2
        else:
            roundings = k * k / 2
        var += u * u * DELTA2 * product_ms * roundings
    return math.sqrt(var)


def check_claim(claimed: GemmPrecision, result: np.ndarray, a: np.ndarray, b: np.ndarray) -> float:
    """Raise AssertionError unless `result` is consistent with being computed as `claimed`:
    every error within the a-priori bound and the rms error within 10x of the expected magnitude."""
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    err = np.abs(result.astype(np.float64) - a64 @ b64)
    bound = claimed.a_priori_bound(a.shape[-1], np.abs(a64) @ np.abs(b64), np.abs(a64).max(), np.abs(b64).max())
    assert np.all(err <= bound), f"{claimed.name}: error {err.max()!r} exceeds its bound"
    rms, expected = float(np.sqrt(np.mean(err ** 2))), expected_rms_error(claimed, a, b)
    assert expected / 10 <= rms <= expected * 10, f"{claimed.name}: rms {rms!r} vs expected {expected!r}"
    return rms


def check_ordering(rms: dict[str, float], chain: list[str]):
    for finer, coarser in zip(chain, chain[1:]):
        assert rms[finer] < rms[coarser], f"{finer} ({rms[finer]!r}) not below {coarser} ({rms[coarser]!r})"


ORDER = ["f32", "tf32", "bf16", "f8e4m3_tensor", "f8e5m2_tensor"]


@pytest.fixture(scope="module")
def gaussian_results():
    rng = np.random.default_rng(12)
    a = rng.standard_normal((64, 1024)).astype(np.float32)
    b = rng.standard_normal((1024, 64)).astype(np.float32)
    return a, b, {name: emulate_gemm(a, b, v) for name, v in GEMM_VARIANTS.items()}


def test_every_variant_is_within_its_bound_and_expected_magnitude(gaussian_results):
    a, b, results = gaussian_results
    rms = {name: check_claim(GEMM_VARIANTS[name], y, a, b) for name, y in results.items()}
    check_ordering(rms, ORDER)
    for granularity in ("channel", "block"):
        check_ordering(rms, [f"f8e4m3_{granularity}", f"f8e5m2_{granularity}"])


def test_the_checks_catch_a_mislabelled_variant(gaussian_results):
    a, b, results = gaussian_results
    with pytest.raises(AssertionError):
        check_claim(GEMM_VARIANTS["f32"], results["bf16"], a, b)  # bf16 arithmetic sold as f32
    rms = {name: float(np.sqrt(np.mean((y.astype(np.float64) - a.astype(np.float64) @ b) ** 2)))
           for name, y in results.items()}
    swapped = {**rms, "f8e4m3_tensor": rms["f8e5m2_tensor"], "f8e5m2_tensor": rms["f8e4m3_tensor"]}
    with pytest.raises(AssertionError):
        check_ordering(swapped, ORDER)


# ---------------------------------------------------------------- structure: batches, static scales, policy

@pytest.mark.usefixtures("grouped_path")
@pytest.mark.parametrize("name", ["bf16", "f8e4m3_channel", "f8e4m3_block", "f8e4m3_mx", "int8_channel"])
def test_batched_equals_per_matrix(name):
    rng = np.random.default_rng(13)
    a = rng.standard_normal((2, 5, 160)).astype(np.float32)
    b = rng.standard_normal((2, 160, 7)).astype(np.float32)
    v = GEMM_VARIANTS[name]
    batched = emulate_gemm(a, b, v)
    assert batched.shape == (2, 5, 7)
    for i in range(2):
        assert same_bits(batched[i], emulate_gemm(a[i], b[i], v))
    assert same_bits(emulate_gemm(a, b[0], v)[1], emulate_gemm(a[1], b[0], v))  # broadcast weights


@pytest.mark.usefixtures("grouped_path")
def test_static_weight_scales_and_overflow_policy():
    rng = np.random.default_rng(14)
    a = rng.standard_normal((4, 256)).astype(np.float32)
    b = rng.standard_normal((256, 3)).astype(np.float32)
    v = GEMM_VARIANTS["f8e4m3_block"]
    static = compute_scales(b, v.b_format, v.b_scale)
    assert same_bits(emulate_gemm(a, b, v, b_scales=static), emulate_gemm(a, b, v))
    with pytest.raises(QuantOverflowError):
        emulate_gemm(a, b, v, b_scales=static / 4, overflow=QuantOverflow.REJECT)
    clipped = emulate_gemm(a, b, v, b_scales=static / 4)  # SATURATE: finite, just wrong where clipped
    assert np.all(np.isfinite(clipped))
    with pytest.raises(QuantOverflowError):
        emulate_gemm(a * 1e5, b, GEMM_VARIANTS["f16"], overflow=QuantOverflow.REJECT)


@pytest.mark.usefixtures("grouped_path")
def test_f16_accumulator_overflows_to_inf():
    a = np.full((1, 64), 200.0, np.float32)
    b = np.full((64, 1), 200.0, np.float32)  # 64 * 40000 > 65504
    assert np.isinf(emulate_gemm(a, b, GEMM_VARIANTS["f16acc16"])).all()
    assert emulate_gemm(a, b, GEMM_VARIANTS["f16"]).item() == 64 * 40000.0


# ---------------------------------------------------------------- reductions and elementwise

def sequential_reference(x: np.ndarray, fmt) -> float:
    total = Fraction(0)
    for value in x:
        total = exact_round(total + Fraction(float(value)), fmt.p, fmt.min_normal)
    return float(total)


@pytest.mark.parametrize("acc", [F32, BF16, F16])
@pytest.mark.parametrize("prerounded", [True, False])
def test_reduce_sum_is_sequential(acc, prerounded):
    x = np.random.default_rng(15).standard_normal((4, 300)).astype(np.float32) * 8
    if prerounded:  # stored in the accumulator format: the cumsum fast path
        x = round_to(x, acc)
    got = emulate_reduce_sum(x, axis=1, acc=acc)
    assert same_bits(got, [sequential_reference(row, acc) for row in x])
    assert same_bits(emulate_reduce_sum(x.T, axis=0, acc=acc), got)


def test_reduce_sum_edges():
    assert np.isinf(emulate_reduce_sum(np.array([60000.0, 60000.0, -60000.0], np.float32), 0, F16))  # overflow sticks
    assert emulate_reduce_sum(np.zeros((3, 0), np.float32), 1, F32).tolist() == [0.0, 0.0, 0.0]
    assert emulate_reduce_sum(np.array([1.0, 2.0 ** -24, 2.0 ** -24], np.float32), 0, F32) == 1.0  # not pairwise


def test_elementwise_precisions():
    rng = np.random.default_rng(16)
    x, y = (rng.standard_normal(500).astype(np.float32) for _ in range(2))

    def fma_like(p, q):
        return p * q + p

    f32_f16 = ELEMENTWISE_VARIANTS["f16_computef32"]
    assert same_bits(emulate_elementwise(fma_like, [x, y], f32_f16), round_to(x * y + x, F16))
    bf16 = ELEMENTWISE_VARIANTS["bf16"]
    xb, yb = round_to(x, BF16), round_to(y, BF16)
    exact = [float(exact_round(Fraction(float(p)) * Fraction(float(q)) + Fraction(float(p)), 8, BF16.min_normal))
             for p, q in zip(xb, yb)]  # computed exactly, rounded once to bf16
    assert same_bits(emulate_elementwise(fma_like, [x, y], bf16), exact)
    with pytest.raises(TypeError):
        emulate_elementwise(lambda p: p.astype(np.float64), [x], ELEMENTWISE_VARIANTS["f32"])


# ---------------------------------------------------------------- hand-derived accumulator semantics

@pytest.mark.usefixtures("grouped_path")
def test_narrow_accumulator_rounds_each_group_once():
    """acc_m13 keeps 14 significant bits: at 8194 the quantum is 1. Group 1 sums to 8194; group 2 to
    0.5 + 2^-20, so the exact 8194.5 + 2^-20 rounds up to 8195. Adding in FP32 first would drop the
    2^-20 and round the tie 8194.5 to even (8194): the sum must be formed exactly."""
    v = GemmPrecision("bf16_acc14", BF16, BF16, F32, acc_mantissa_bits=13)
    a, b = np.zeros((1, 32), np.float32), np.zeros((32, 1), np.float32)
    a[0, [0, 1, 16, 17]] = [128.0, 2.0, 0.5, 2.0 ** -10]
    b[[0, 1, 16, 17], 0] = [64.0, 1.0, 1.0, 2.0 ** -10]
    assert emulate_gemm(a, b, v).item() == 8195.0
    a[0, 17] = 0.0  # now an exact tie: to even
    assert emulate_gemm(a, b, v).item() == 8194.0


@pytest.mark.usefixtures("grouped_path")
def test_promotion_versus_per_product_scaling_hand_derived():
    """One block of K=128 with scale 1 (amax 448 in A and in B): the group sum is 2^17 + 8 + 2^-18.
    With promotion the narrow accumulator rounds the exact sum: 2^17 + 8 is a tie at 14 bits (quantum
    16), the 2^-18 breaks it upward: 131088. Without promotion the group enters as fl32(fl32(g) * s):
    FP32 drops the 2^-18 and the tie goes to even: 131072. FP32 BLAS keeps 131080 (its ulp is 2^-6)."""
    a, b = np.zeros((1, 128), np.float32), np.zeros((128, 1), np.float32)
    a[0, :6] = [256.0, 256.0, 2.0 ** -9, 448.0, 0.0, 2.0]
    b[:6, 0] = [256.0, 256.0, 2.0 ** -9, 0.0, 448.0, 4.0]
    expected = {"f8e4m3_block": 131088.0, "f8e4m3_block_nopromote": 131072.0, "f8e4m3_tensor": 131080.0,
                "f8e4m3_mx": 131080.0}
    assert {name: emulate_gemm(a, b, GEMM_VARIANTS[name]).item() for name in expected} == expected


@settings(deadline=None, max_examples=25)
@given(st.integers(1, 300), st.integers(0, 2 ** 32 - 1), st.integers(0, 40), st.floats(-60, 60))
def test_bounds_hold_on_wide_dynamic_range(k, seed, spread, center):
    """Soundness under stress: magnitudes spread over 2^+-spread around 2^center make values flush to
    zero or go subnormal in the narrow formats, which the absolute terms of the bound must cover.
    The FP64 reference itself errs by at most gamma_k(2^-53) * sum|a||b|, allowed on top."""
    rng = np.random.default_rng(seed)
    a, b = ((rng.standard_normal(shape) * 2.0 ** (center / 2 + rng.uniform(-spread, spread, shape)))
            .astype(np.float32) for shape in ((4, k), (k, 3)))
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    abs_dot = np.abs(a64) @ np.abs(b64)
    slack = k * 2.0 ** -53 / (1 - k * 2.0 ** -53) * abs_dot
    for v in ALL_VARIANTS:
        bound = v.a_priori_bound(k, abs_dot, np.abs(a64).max(), np.abs(b64).max())
        err = np.abs(emulate_gemm(a, b, v).astype(np.float64) - a64 @ b64)
        finite = np.isfinite(bound)
        assert np.all(err[finite] <= bound[finite] + slack[finite]), v.name


@pytest.mark.usefixtures("grouped_path")
def test_non_finite_operands_of_a_narrow_accumulator():
    """inf / NaN operands (raw, as _grouped_gemm takes them) give inf / NaN outputs: the range proofs of the
    in-place rounding refuse them (math.log2 of an inf magnitude used to raise) and round_to handles them."""
    from luminal_num.dtypes import limited_accumulator
    from luminal_num.runtime import numerics
    a, b = np.ones((2, 64), np.float32), np.ones((64, 3), np.float32)
    a[0, 5], b[7, 1] = np.inf, np.nan
    qa, qb = numerics._Operand(a, None, None), numerics._Operand(b, None, None)
    with np.errstate(invalid="ignore"):
        got = numerics._grouped_gemm(qa, qb, limited_accumulator(13), 32, 64, 64, False)
    assert np.isinf(got[0, [0, 2]]).all() and np.isnan(got[:, 1]).all() and (got[1, [0, 2]] == 64).all()


def test_an_exact_integer_sum_by_column_blocks_is_the_int32_accumulator(monkeypatch):
    """int8 codes summed past FP32's exact range go through FP64 a block of B's columns at a time (a 1B
    head's B widened whole was a 2 GB temporary): against int64 sums wrapped to int32 computed here, bit
    for bit, including sums that wrap around."""
    import importlib
    nm = importlib.import_module("luminal_num.runtime.numerics")
    rng = np.random.default_rng(3)
    for k in (2048, 140_000):  # 140k * 127^2 passes 2^31: some sums wrap
        qa = rng.integers(-127, 128, (2, 3, k)).astype(np.float32)
        qb = rng.integers(-127, 128, (k, 11)).astype(np.float32)
        qa[0, 0] = 127.0
        qb[:, 0] = 127.0
        want = (qa.astype(np.int64) @ qb.astype(np.int64) + 2 ** 31) % 2 ** 32 - 2 ** 31
        monkeypatch.setattr(nm, "EXACT_BLOCK_BYTES", 8 * k * 4)  # 4 columns a block: 3 blocks, the last ragged
        got = nm._exact_integer_sum(qa, qb)
        assert got.dtype == np.float32 and got.shape == (2, 3, 11)
        assert np.array_equal(got, want.astype(np.float32))
    assert want[0, 0, 0] < 0  # the all-127 row and column wrapped around
