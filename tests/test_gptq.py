"""GPTQ (quant/gptq.py) against an independent reference written from the paper's derivation, and as a
way to fill storage formats: the codes a kernel reads, the format's own dequantize, lower output error
than round-to-nearest on correlated calibration inputs, the same bytes for the same inputs.

The reference is the Optimal Brain Quantization step the GPTQ paper starts from (Frantar & Alistarh 2022,
eq. 2-3): quantize column j, spread its error over the columns not yet quantized with the row j of the
current inverse Hessian, then remove j from that inverse by one Gaussian elimination step. No Cholesky,
no lazy batches: if the production code's blocked Cholesky form is right, both pick the same codes.
"""
from __future__ import annotations

import numpy as np
import pytest

from luminal_num.quant.gptq import DAMPING, gptq, group_width, hessian
from luminal_num.quant.layout import Part
from luminal_num.quant.storage import CODECS, storage_format

FORMATS = ["int4_g32", "int4_g32_asym", "int4_g128", "int8_channel", "f8e4m3_channel", "f8e4m3_g32", "mxfp4", "bf16",
           "f8e4m3_block128"]


def reference_gptq(weight: np.ndarray, h: np.ndarray, name: str) -> np.ndarray:
    """Dequantized GPTQ weight by the OBQ recursion (FP64, one column at a time, explicit inverse)."""
    fmt = storage_format(name)
    w = np.array(weight, dtype=np.float64)
    rows, k = w.shape
    h = np.array(h, dtype=np.float64)
    dead = np.diag(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    h += DAMPING * np.mean(np.diag(h)) * np.eye(k)
    hinv = np.linalg.inv(h)
    width = group_width(fmt, k)
    out = np.zeros_like(w)
    for j in range(k):
        if j % width == 0:  # the group's parameters from its current columns, as the format's codec sets them
            group = CODECS[fmt.scheme].quantize(fmt, w[:, j:j + width].astype(np.float32))
        q = _quantize_column(fmt, w[:, j], group)
        out[:, j] = q
        err = (w[:, j] - q) / hinv[j, j]
        w[:, j + 1:] -= np.outer(err, hinv[j, j + 1:])
        hinv = hinv - np.outer(hinv[:, j], hinv[j, :]) / hinv[j, j]
    return out


def _quantize_column(fmt, column: np.ndarray, group: dict) -> np.ndarray:
    """Round one column with the group's parameters by the format's definition: x ~ s * code (+ zero)."""
    x = column.astype(np.float32)
    if fmt.name == "bf16":
        return CODECS[fmt.scheme].quantize(fmt, x[:, None])[Part.Q][:, 0].astype(np.float64)
    scale = group[Part.SCALE][:, 0]
    if fmt.name.startswith("f8e4m3_block"):
        scale = np.repeat(scale, fmt.block)[:len(x)]
    if fmt.name.startswith("int4") and fmt.name.endswith("asym"):
        zero = group[Part.ZERO][:, 0]
        return ((np.clip(np.rint(x / scale) + zero, 0, 15) - zero) * scale).astype(np.float32).astype(np.float64)
    if fmt.name.startswith("int4"):
        return (np.clip(np.rint(x / scale), -8, 7) * scale).astype(np.float32).astype(np.float64)
    import ml_dtypes
    element = {"int8_channel": None, "mxfp4": ml_dtypes.float4_e2m1fn}.get(fmt.name, ml_dtypes.float8_e4m3fn)
    scaled = (x / scale).astype(np.float32)
    if element is None:
        codes = np.clip(np.rint(scaled), -128, 127)  # int8's range (saturating)
    else:
        limit = float(ml_dtypes.finfo(element).max)
        codes = np.clip(scaled, -limit, limit).astype(element).astype(np.float32)
    return (codes.astype(np.float32) * scale).astype(np.float32).astype(np.float64)


def correlated_inputs(rng, n: int, k: int) -> np.ndarray:
    """Activations with a few dominant directions and outlier channels, as LLM layers see."""
    basis = rng.standard_normal((8, k))
    x = rng.standard_normal((n, 8)) @ basis + 0.1 * rng.standard_normal((n, k))
    x[:, rng.choice(k, 3, replace=False)] *= 20.0
    return x


@pytest.mark.parametrize("name", FORMATS)
def test_gptq_picks_the_codes_of_the_obq_reference(name):
    rng = np.random.default_rng(3)
    k = 256 if "block128" in name or "g128" in name else 96
    w = rng.standard_normal((24 if "block128" not in name else 130, k)).astype(np.float32)
    h = hessian(correlated_inputs(rng, 512, k))
    got = gptq(w, h, name)
    assert got.fmt.name == name and got.values[Part.Q].shape == w.shape
    np.testing.assert_allclose(got.dequantize(), reference_gptq(w, h, name), rtol=0, atol=0)


@pytest.mark.parametrize("name", ["int4_g32", "int4_g128", "int8_channel", "f8e4m3_channel", "mxfp4"])
def test_gptq_has_less_output_error_than_round_to_nearest_on_correlated_inputs(name):
    rng = np.random.default_rng(5)
    k = 256
    w = rng.standard_normal((64, k)).astype(np.float32) / np.sqrt(k)
    x = correlated_inputs(rng, 1024, k)
    fmt = storage_format(name)
    rtn = fmt.dequantize(fmt.quantize(w))
    filled = gptq(w, hessian(x), fmt).dequantize()
    exact = x @ w.T.astype(np.float64)
    err_rtn = np.linalg.norm(x @ rtn.T - exact)
    err_gptq = np.linalg.norm(x @ filled.T - exact)
    assert err_gptq < 0.8 * err_rtn, (err_gptq, err_rtn)


def test_gptq_is_a_quantized_of_the_format_and_reproducible():
    rng = np.random.default_rng(7)
    w = rng.standard_normal((16, 64)).astype(np.float32)
    h = hessian(correlated_inputs(rng, 200, 64))
    a, b = gptq(w, h, "int4_g32_asym"), gptq(w, h, "int4_g32_asym")
    fmt = storage_format("int4_g32_asym")
    assert all(np.array_equal(a.values[p], b.values[p]) for p in fmt.parts)
    stored = fmt.pack(a)
    assert all(np.array_equal(fmt.unpack(stored).values[p], a.values[p]) for p in fmt.parts)
    assert set(np.unique(a.values[Part.Q])) <= set(range(16))


def test_gptq_refuses_what_it_does_not_fill_and_bad_hessians():
    w = np.ones((4, 64), np.float32)
    with pytest.raises(ValueError, match="not built for nvfp4"):
        gptq(w, np.eye(64), "nvfp4")
    with pytest.raises(ValueError, match="Hessian"):
        gptq(w, np.eye(32), "int4_g32")


def test_an_input_that_is_always_zero_rounds_its_weights_to_zero():
    rng = np.random.default_rng(9)
    w = rng.standard_normal((8, 64)).astype(np.float32)
    x = rng.standard_normal((100, 64))
    x[:, 5] = 0.0
    got = gptq(w, hessian(x), "int8_channel").dequantize()
    assert np.all(got[:, 5] == 0.0)
