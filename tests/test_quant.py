"""Scales and quantize/dequantize against hand-computed cases and error properties."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from luminal_num.dtypes import E8M0, F8E4M3, F8E5M2, F32, INT8, WHOLE, Granularity, ScaleSpec
from luminal_num.quant import (QuantOverflow, QuantOverflowError, block_amax, compute_scales, expand_scales,
                               quantize, quantize_tensor, scales_from_amax)

TENSOR = ScaleSpec(Granularity.TENSOR, (WHOLE, WHOLE), F32, static=False)
ROWS = ScaleSpec(Granularity.CHANNEL, (1, WHOLE), F32, static=False)
COLS = ScaleSpec(Granularity.CHANNEL, (WHOLE, 1), F32, static=True)
BLOCK_1x128 = ScaleSpec(Granularity.BLOCK, (1, 128), F32, static=False)
BLOCK_128x128 = ScaleSpec(Granularity.BLOCK, (128, 128), F32, static=True)
MX_ROWS = ScaleSpec(Granularity.MX, (1, 32), E8M0, static=False)


def test_amax_at_the_format_max_gives_scale_one():
    x = np.array([[448.0, -3.0, 1.5]], np.float32)
    q = quantize_tensor(x, F8E4M3, TENSOR)
    assert q.scales.tolist() == [[1.0]]
    assert q.values.tolist() == x.tolist() and q.dequantize().tolist() == x.tolist()


def test_scaled_ties_round_to_even():
    x = np.array([[896.0, 2.125, 2.375, -2.125]], np.float32)  # scale 2: 1.0625 / 1.1875 are e4m3 ties
    q = quantize_tensor(x, F8E4M3, TENSOR)
    assert q.scales.tolist() == [[2.0]]
    assert q.values.tolist() == [[448.0, 1.0, 1.25, -1.0]]
    assert q.dequantize().tolist() == [[896.0, 2.0, 2.5, -2.0]]
    # scale 7 (not a power of two): 10.9375 / 7 = 1.5625 exactly, a tie -> 1.5 (even); multiplying by
    # a rounded reciprocal instead (10.9375 * fl32(1/7) = 1.5625001...) would round up to 1.625
    q7 = quantize_tensor(np.array([[3136.0, 10.9375]], np.float32), F8E4M3, TENSOR)
    assert q7.scales.tolist() == [[7.0]] and q7.values.tolist() == [[448.0, 1.5]]


def test_all_zero_blocks_get_a_finite_scale():
    x = np.zeros((2, 256), np.float32)
    x[0, :128] = np.linspace(-3, 3, 128)  # row 0: one live block, one all-zero block; row 1: all zero
    for spec, fmt in ((BLOCK_1x128, F8E4M3), (MX_ROWS, F8E4M3), (ROWS, INT8)):
        q = quantize_tensor(x, fmt, spec)
        assert np.all(np.isfinite(q.scales)) and np.all(q.scales > 0)
        assert np.all(q.scales[1] == 1.0) and (spec is ROWS or q.scales[0, -1] == 1.0)
        assert not np.isnan(q.values).any() and not q.values[1].any()
    zero = quantize_tensor(np.zeros((3, 3), np.float32), F8E5M2, TENSOR)
    assert zero.scales.item() == 1.0 and not zero.dequantize().any()


def test_saturate_versus_reject():
    x = np.array([[500.0, -600.0, 464.0, 1.0]], np.float32)
    static = np.ones((1, 1), np.float32)  # a compile-time scale too small for these values
    assert quantize(x, F8E4M3, static, TENSOR, QuantOverflow.SATURATE).tolist() == [[448.0, -448.0, 448.0, 1.0]]
    with pytest.raises(QuantOverflowError) as caught:
        quantize(x, F8E4M3, static, TENSOR, QuantOverflow.REJECT)
    assert caught.value.count == 2 and caught.value.worst == 600.0  # 464 rounds to 448: no overflow
    assert "2 of 4" in str(caught.value) and "600.0" in str(caught.value)
    ok = np.array([[464.0, -448.0]], np.float32)
    assert quantize(ok, F8E4M3, static, TENSOR, QuantOverflow.REJECT).tolist() == [[448.0, -448.0]]


@pytest.mark.parametrize("amax,expected", [
    (448.0, 1.0), (449.0, 2.0), (448.0 * 8, 8.0), (448.0 * 8 + 1, 16.0), (1.0, 2.0 ** -8),
    (3.5, 2.0 ** -7), (1e-45, 2.0 ** -127), (0.0, 1.0),
])
def test_e8m0_scales_are_the_next_power_of_two(amax, expected):
    """2^ceil(log2(amax / 448)): the smallest power of two that keeps amax / s <= 448."""
    assert scales_from_amax(np.array([amax]), F8E4M3, MX_ROWS).tolist() == [expected]


def test_e8m0_scales_are_minimal_and_never_overflow():
    amax = np.float32(2.0) ** np.random.default_rng(0).uniform(-100, 100, 2000).astype(np.float32)
    scale = scales_from_amax(amax, F8E4M3, MX_ROWS).astype(np.float64)
    assert np.all(np.frexp(scale)[0] == 0.5)  # powers of two
    assert np.all(amax / scale <= 448.0) and np.all(amax / (scale / 2) > 448.0)


def test_ragged_blocks():
    x = np.arange(3 * 300, dtype=np.float32).reshape(3, 300) - 450.0
    scales = compute_scales(x, F8E4M3, BLOCK_1x128)
    assert scales.shape == (3, 3)
    assert scales[2, 2] == np.float32(449.0 / 448.0)  # row 2, columns 256..299: 600+256-450 .. 600+299-450
    assert scales[0, 0] == np.float32(450.0 / 448.0)
    assert expand_scales(scales, x.shape, BLOCK_1x128).shape == x.shape

    w = np.random.default_rng(1).standard_normal((200, 130)).astype(np.float32)
    ws = compute_scales(w, F8E5M2, BLOCK_128x128)
    assert ws.shape == (2, 2)
    assert ws[1, 1] == np.float32(np.abs(w[128:, 128:]).max() / F8E5M2.max_finite)
    q = quantize(w, F8E5M2, ws, BLOCK_128x128)
    assert np.abs(q[128:, 128:]).max() == F8E5M2.max_finite  # each block's amax maps onto max_finite


def test_channel_orientation_and_batches():
    x = np.random.default_rng(2).standard_normal((2, 4, 8)).astype(np.float32)
    assert compute_scales(x, F8E4M3, ROWS).shape == (2, 4, 1)
    cols = compute_scales(x, F8E4M3, COLS)
    assert cols.shape == (2, 1, 8)
    assert np.array_equal(cols[1, 0], (np.abs(x[1]).max(axis=0) / 448.0).astype(np.float32))
    tensor = compute_scales(x, F8E4M3, TENSOR)
    assert tensor.shape == (1, 1, 1) and tensor.item() == np.float32(np.abs(x).max() / 448.0)


def test_int8_symmetric():
    x = np.array([[127.0, 2.5, -3.5, 0.5], [254.0, 5.0, -1.0, 3.0]], np.float32)
    q = quantize_tensor(x, INT8, ROWS)
    assert q.scales.ravel().tolist() == [1.0, 2.0]  # amax / 127
    assert q.values.tolist() == [[127.0, 2.0, -4.0, 0.0], [127.0, 2.0, -0.0, 2.0]]  # 2.5 / 0.5 / 1.5 ties: even


def test_margin_leaves_headroom_and_inf_is_left_out_of_amax():
    x = np.array([[100.0, -50.0, np.inf]], np.float32)
    spec = ScaleSpec(Granularity.TENSOR, (WHOLE, WHOLE), F32, static=False, margin=2.0)
    assert block_amax(x, spec).item() == 100.0
    q = quantize_tensor(x, F8E4M3, spec)
    assert q.values.tolist() == [[224.0, -112.0, 448.0]]  # inf saturates under the default policy


@settings(deadline=None, max_examples=60)
@given(st.sampled_from([(TENSOR, F8E4M3), (ROWS, F8E5M2), (BLOCK_1x128, F8E4M3), (MX_ROWS, F8E4M3),
                        (COLS, INT8), (BLOCK_128x128, F8E5M2)]),
       st.integers(1, 140), st.integers(1, 300), st.integers(0, 2 ** 32 - 1), st.floats(-20, 20))
def test_quantization_error_bound(spec_fmt, rows, cols, seed, log_scale):
    """|dequantize(quantize(x)) - x| <= u|x| + s * half a subnormal (float formats) or s / 2 (int8),
    plus the FP32 roundings of x / s and q * s: the per-element terms the Gemm bounds rely on."""
    spec, fmt = spec_fmt
    x = (np.random.default_rng(seed).standard_normal((rows, cols)) * 2.0 ** log_scale).astype(np.float32)
    q = quantize_tensor(x, fmt, spec)
    s = expand_scales(q.scales, x.shape, spec).astype(np.float64)
    err = np.abs(q.dequantize().astype(np.float64) - x)
    u32 = 2.0 ** -24
    if fmt is INT8:
        allowed = s * 0.5 + 2 * u32 * np.abs(x)
    else:  # x / s may also underflow FP32: half an FP32 subnormal in the scaled domain
        allowed = (fmt.unit_roundoff + 3 * u32) * np.abs(x) + s * (fmt.min_subnormal / 2 + 2.0 ** -150)
    assert np.all(err <= allowed * (1 + 2.0 ** -20))
    assert np.all(np.abs(q.values) <= fmt.max_finite)


@pytest.mark.parametrize("spec", [TENSOR, ROWS, COLS, BLOCK_1x128, BLOCK_128x128, MX_ROWS], ids=lambda s: str(s.block))
@pytest.mark.parametrize("fmt", ["f8e4m3", "int8"])
def test_a_large_tensor_quantized_a_block_of_rows_at_a_time_is_bit_identical(spec, fmt, monkeypatch):
    """Scales, quantize and dequantize of a tensor past ROW_BLOCK_BYTES go a block of rows at a time (a 1B head's
    full-size temporaries were the compile's memory peaks): every code and every widened value is the
    whole-tensor computation's (x / expanded scales, rounded; codes * expanded scales), ragged rows and a
    batch axis included, with magnitudes up to the format's max."""
    import importlib
    from luminal_num.dtypes.formats import get as get_format
    qz = importlib.import_module("luminal_num.quant.quantize")  # the module (the package exports a function of that name)
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((2, 301, 256)) * np.exp(rng.uniform(-8, 8, (2, 301, 1)))).astype(np.float32)
    x[0, 5, :7] = [0.0, -0.0, 448.0, -448.0, 1e-30, 3e38, -3e38]
    scales = compute_scales(x, get_format(fmt), spec)
    with np.errstate(over="ignore"):
        want = qz.convert(x / expand_scales(scales, x.shape, spec), get_format(fmt))
    want_back = want * expand_scales(scales, x.shape, spec)
    monkeypatch.setattr(qz, "ROW_BLOCK_BYTES", 37 * 256 * 4)  # 37 rows (128-row blocks: one scale block) at a time
    import luminal_num.quant.scales as sc
    monkeypatch.setattr(sc, "AMAX_BLOCK_BYTES", 2 * 37 * 256 * 4)  # the block maxima too (rows of both batches)
    assert np.array_equal(compute_scales(x, get_format(fmt), spec), scales)
    blocks = list(sc.row_blocks(x.shape, spec, qz.ROW_BLOCK_BYTES))
    assert len(blocks) > 2
    got = qz.quantize(x, fmt, scales, spec)
    assert got.dtype == want.dtype and np.array_equal(got, want, equal_nan=True)
    back = qz.dequantize(got, scales, spec)
    assert np.array_equal(back, want_back, equal_nan=True)
