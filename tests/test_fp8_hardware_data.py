"""FP8 E4M3 per-tensor Gemms as an H200 ran them through cuBLASLt (recorded by `scripts/gpu_stages.py fp8acc`
on 2026-12-04; tests/data/h200_fp8_cublaslt.npz: inputs and device outputs, K = 32, 64, 256, three magnitude
spreads each) checked on any machine:
* the variant's a-priori bound (the static analysis' bound) covers the device's error against FP64;
* the device does not accumulate the E4M3 products in FP32, as the CPU emulation does: it differs from the
  emulation by far more than FP32 summation order allows, and by no more than a Hopper tensor-core
  accumulator of HOPPER_FP8_ACC_BITS stored mantissa bits that aligns each MMA group's products to the
  largest and truncates (DeepSeek-V3's ~14 significant bits) can: the emulation is within an envelope of
  the hardware, not its bits. (No bit-exact model was found: fitting group sizes 4-32, 10-29 kept bits,
  RN/RZ and operand- or product-exponent alignment matched at most 69% of K = 32 outputs.)
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from luminal_num.dtypes.variants import GEMM_VARIANTS, HOPPER_FP8_ACC_BITS
from luminal_num.runtime.numerics import emulate_gemm

DATA = Path(__file__).parent / "data" / "h200_fp8_cublaslt.npz"
MMA_K = 32  # E4M3 products one Hopper MMA instruction adds (32 bytes of K)
CASES = [(k, t) for k in (32, 64, 256) for t in range(3)]


def hopper_fp8_envelope(k: int, largest_product: np.ndarray) -> np.ndarray:
    """|hardware - FP32 accumulation| for a truncating accumulator of HOPPER_FP8_ACC_BITS bits that aligns each
    MMA group's products to its largest: each of the k products loses under 2^-bits of the largest product
    (both sides' roundings: twice); `largest_product` is max_j |a_ij b_jk| of the unscaled operands and
    (1 + 2^-3)^2 covers E4M3 rounding of each operand."""
    return 2 * k * 2.0 ** -HOPPER_FP8_ACC_BITS * (1 + 2.0 ** -3) ** 2 * largest_product


@pytest.fixture(scope="module")
def recorded():
    return np.load(DATA)


@pytest.mark.parametrize("k,trial", CASES)
def test_the_static_bound_covers_the_h200s_fp8_gemm(recorded, k, trial):
    a, b = (recorded[f"k{k}_t{trial}_{n}"].astype(np.float64) for n in "ab")
    gpu = recorded[f"k{k}_t{trial}_gpu"].astype(np.float64)
    variant = GEMM_VARIANTS["f8e4m3_tensor"]
    bound = variant.a_priori_bound(k, np.abs(a) @ np.abs(b), np.abs(a).max(), np.abs(b).max())
    assert np.all(np.abs(gpu - a @ b) <= bound), float(np.max(np.abs(gpu - a @ b) / bound))


@pytest.mark.parametrize("k,trial", CASES)
def test_the_h200_accumulates_fp8_products_narrower_than_fp32_within_the_hopper_envelope(recorded, k, trial):
    a, b = (recorded[f"k{k}_t{trial}_{n}"] for n in "ab")
    gpu = recorded[f"k{k}_t{trial}_gpu"].astype(np.float64)
    emulated = np.asarray(emulate_gemm(a, b, GEMM_VARIANTS["f8e4m3_tensor"]), dtype=np.float64)
    wide_a, wide_b = np.abs(a.astype(np.float64)), np.abs(b.astype(np.float64))
    largest = np.max(wide_a[:, :, None] * wide_b[None, :, :], axis=1)
    magnitude = wide_a @ wide_b
    gap = np.abs(gpu - emulated)
    envelope = hopper_fp8_envelope(k, largest)
    assert np.all(gap <= envelope), float(np.max(gap / envelope))
    if trial < 2:  # moderate spreads; at spread 2^N(0, 12) one product dominates each sum and both agree
        fp32_order = k * 2.0 ** -23 * magnitude  # what another FP32 summation order could change
        assert np.any(gap > fp32_order)
