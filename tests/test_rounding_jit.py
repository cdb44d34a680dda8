"""dtypes.rounding.round_to's numba pass (jit_loops.round_f32) against its numpy steps, bit for bit (NaN
included), for every float format narrower than FP32 and every overflow policy: a sweep over the float32
bit patterns (every sign, binade and NaN payload class) and the neighbourhood of each format's limits
(max_finite and the overflow tie above it, min_normal, the subnormal quantum, ties)."""
from __future__ import annotations

import numpy as np
import pytest

from luminal_num.dtypes import FLOAT_FORMATS, jit, rounding
from luminal_num.dtypes.rounding import Overflow, round_to

NARROW = [pytest.param(f, id=f.name) for f in FLOAT_FORMATS if f.p < 24 and f.kind.name == "FLOAT"]
needs_numba = pytest.mark.skipif(jit.loops() is None, reason="numba missing or LUMINAL_NUM_JIT=0: numpy runs")


def _numpy(x, fmt, policy, monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(rounding, "_JIT_MIN_SIZE", 1 << 62)
        return round_to(x, fmt, policy)


def _inputs(fmt) -> np.ndarray:
    sweep = np.arange(0, 2 ** 32, 1021, dtype=np.uint64).astype(np.uint32).view(np.float32)
    edges = np.array([fmt.max_finite, fmt.min_normal, fmt.min_subnormal, 1.0], np.float64)
    ulp = 2.0 ** (np.floor(np.log2(edges)) - (fmt.p - 1))
    steps = np.arange(-8, 9)[:, None] * ulp / 2  # multiples of half a format ulp: every tie around each limit
    near = (edges + steps).astype(np.float32)
    near = near.view(np.uint32)[..., None].astype(np.int64) + np.array([-1, 0, 1])  # and one float32 ulp off
    near = (near.ravel() % 2 ** 32).astype(np.uint32).view(np.float32)
    return np.concatenate([sweep, near, -near, [np.inf, -np.inf, np.nan, -np.nan, 0.0, -0.0]]).astype(np.float32)


@needs_numba
@pytest.mark.parametrize("policy", list(Overflow), ids=lambda p: p.name)
@pytest.mark.parametrize("fmt", NARROW)
def test_jit_rounding_is_numpys(fmt, policy, monkeypatch):
    x = _inputs(fmt)
    got, want = round_to(x, fmt, policy), _numpy(x, fmt, policy, monkeypatch)
    assert got.dtype == want.dtype == np.float32
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


@needs_numba
def test_jit_rounding_of_views_and_shapes(monkeypatch):
    """A strided 3-D view rounds element for element as its copy; the shape is kept."""
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((6, 50, 80)) * 300).astype(np.float32)[:, ::2, 1::3]
    fmt = FLOAT_FORMATS[[f.name for f in FLOAT_FORMATS].index("f16")]
    got = round_to(x, fmt, Overflow.INF)
    assert got.shape == x.shape
    want = _numpy(np.ascontiguousarray(x), fmt, Overflow.INF, monkeypatch)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
