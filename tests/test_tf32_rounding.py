"""The TF32 Gemm variant's a-priori bound covers every operand rounding a device may apply: the
project's own (round to nearest even: the CPU emulator and the generated CUDA kernels), ties away
(cvt.rna) and truncation (tensor cores dropping the 13 low bits), against FP64 of the FP32 operands."""
from __future__ import annotations

import numpy as np
import pytest

from luminal_num.dtypes import variants
from luminal_num.dtypes.formats import TF32
from luminal_num.dtypes.rounding import round_to
from luminal_num.dtypes.variants import GEMM_VARIANTS

LOW_BITS = np.uint32(0x1FFF)


def truncated(x: np.ndarray) -> np.ndarray:
    bits = x.astype(np.float32).view(np.uint32)
    return np.where(np.isfinite(x), bits & ~LOW_BITS, bits).astype(np.uint32).view(np.float32)


def ties_away(x: np.ndarray) -> np.ndarray:
    bits = x.astype(np.float32).view(np.uint32)
    return np.where(np.isfinite(x), (bits + np.uint32(0x1000)) & ~LOW_BITS, bits).astype(np.uint32).view(np.float32)


ROUNDINGS = {"rne": lambda x: round_to(x, TF32), "rna": ties_away, "trunc": truncated}


def worst_case_operands(rng, m: int, k: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Positive FP32 values whose 13 bits below TF32 are all ones (truncation loses almost a whole step,
    and every error has the same sign), times powers of two."""
    def draw(shape):
        mantissa = rng.integers(0, 2 ** 10, size=shape, dtype=np.uint32) << np.uint32(13) | LOW_BITS
        exponent = rng.integers(120, 131, size=shape, dtype=np.uint32) << np.uint32(23)
        return (mantissa | exponent).view(np.float32)
    return draw((m, k)), draw((k, n))


def gemm_error(a: np.ndarray, b: np.ndarray, rounding) -> tuple[np.ndarray, np.ndarray]:
    """(|computed - exact|, bound): operands rounded to TF32 by `rounding`, FP32 accumulation (any order)."""
    computed = (rounding(a) @ rounding(b)).astype(np.float64)  # products of 11-bit significands are exact in FP32
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    bound = GEMM_VARIANTS["tf32"].a_priori_bound(a.shape[1], np.abs(a64) @ np.abs(b64), np.abs(a64).max(),
                                                  np.abs(b64).max())
    return np.abs(computed - a64 @ b64), bound


@pytest.mark.parametrize("rounding", sorted(ROUNDINGS))
@pytest.mark.parametrize("data", ["worst", "normal", "tiny"])
def test_the_tf32_bound_covers_every_operand_rounding(rounding, data):
    rng = np.random.default_rng(11)
    m, k, n = 8, 512, 8
    if data == "worst":
        a, b = worst_case_operands(rng, m, k, n)
    else:
        scale = 2.0 ** -130 if data == "tiny" else 1.0  # FP32 subnormals: the absolute term
        a = (rng.standard_normal((m, k)) * scale).astype(np.float32)
        b = rng.standard_normal((k, n)).astype(np.float32)
    error, bound = gemm_error(a, b, ROUNDINGS[rounding])
    assert np.all(error <= bound), float(np.max(error / bound))


def test_charging_truncation_half_a_step_would_be_unsound(monkeypatch):
    """The test above has teeth: with the round-to-nearest charge (u, as for any other format) the
    truncated worst case exceeds the bound, while nearest even stays within it."""
    a, b = worst_case_operands(np.random.default_rng(11), 8, 512, 8)
    monkeypatch.setattr(variants, "OPERAND_STEP_FRACTION", {})
    error, bound = gemm_error(a, b, truncated)
    assert np.any(error > bound)
    error, bound = gemm_error(a, b, ROUNDINGS["rne"])
    assert np.all(error <= bound)


def test_the_three_roundings_differ_where_the_gpu_probe_looks():
    """A = 1 + j 2^-13: j = 4 is a tie (RNE keeps 1, RNA goes up), j = 5 is above it (truncation keeps 1)."""
    x = (1.0 + np.arange(8) * 2.0 ** -13).astype(np.float32)
    got = {name: fn(x) for name, fn in ROUNDINGS.items()}
    step = np.float32(1.0 + 2.0 ** -10)
    assert list(got["rne"]) == [1, 1, 1, 1, 1, step, step, step]
    assert list(got["rna"]) == [1, 1, 1, 1, step, step, step, step]
    assert list(got["trunc"]) == [1] * 8
