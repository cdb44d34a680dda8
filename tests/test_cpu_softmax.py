"""The CPU backend's FP32 softmax (cpu_softmax.softmax_f64_into) against its definition, softmax in float64
rounded once to float32 (hlir.evaluate.softmax, written without the shortcuts), bit for bit: masked
scores (-1e4 as MiniLM's key mask, -inf), scores near float64 exp's underflow (results subnormal or 0),
fully masked rows, NaN, and the softmax axis first, middle or last."""
from __future__ import annotations

import numpy as np
import pytest

from luminal_num.hlir.evaluate import softmax
from luminal_num.runtime.cpu_softmax import EXP_UNDERFLOW, softmax_f64_into


def _definition(x: np.ndarray, axis: int) -> np.ndarray:
    return softmax(x.astype(np.float64), axis).astype(np.float32)


@pytest.mark.parametrize("axis", [0, 1, -1])
@pytest.mark.parametrize("fill", [-1e4, -np.inf, -60.0, -100.0, -700.0, -730.0, -744.0, -746.0, -799.0, -801.0, -1e30])
def test_masked_scores_match_the_definition(axis, fill):
    rng = np.random.default_rng(abs(hash((axis, fill))) % 2 ** 32)
    x = (rng.standard_normal((6, 9, 41)) * 3).astype(np.float32)
    mask = rng.random(x.shape) < 0.7
    x[mask] = np.float32(fill)
    x[0, 0] = np.float32(fill)  # a fully masked row along the last axis
    x[1, 2, 3] = np.nan
    with np.errstate(all="ignore"):
        want = _definition(x, axis)
        got = softmax_f64_into(x, axis, np.empty_like(x))
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def test_exp_is_zero_below_the_underflow_cut():
    """What the shortcut relies on: numpy's float64 exp returns +0 (not the least subnormal) below the cut."""
    y = -np.geomspace(-EXP_UNDERFLOW, 1e300, 100_000)
    assert np.all(np.exp(y) == 0) and not np.signbit(np.exp(y)).any()
