"""dtypes.codec against ml_dtypes, its oracle: every code of each 8-bit float format, and random values
exactly representable in it (signed zeros, subnormals, the extremes), bit for bit; values a code
cannot hold (NaN, inf, inexact) make encode_into refuse, so the caller's cast runs."""
from __future__ import annotations

import numpy as np
import pytest

from luminal_num.dtypes import codec, jit

needs_numba = pytest.mark.skipif(jit.loops() is None, reason="numba missing or LUMINAL_NUM_JIT=0: casts run")
FORMATS = [pytest.param(dt, id=dt.name) for dt in codec.CODED]


def _all_codes(dtype) -> np.ndarray:
    return np.arange(256, dtype=np.uint8).view(dtype)


def _cast(values: np.ndarray, dtype) -> np.ndarray:
    out = np.empty(values.shape, dtype)
    np.copyto(out, values, casting="unsafe")
    return out


@needs_numba
@pytest.mark.parametrize("dtype", FORMATS)
def test_decode_every_code(dtype):
    codes = _all_codes(dtype)
    assert np.array_equal(codec.to_float32(codes).view(np.uint32), codes.astype(np.float32).view(np.uint32))


@needs_numba
@pytest.mark.parametrize("dtype", FORMATS)
def test_encode_every_finite_code(dtype):
    values = _all_codes(dtype).astype(np.float32)
    finite = values[np.isfinite(values)]
    out = np.empty(finite.shape, dtype)
    assert codec.encode_into(finite, out)
    assert np.array_equal(out.view(np.uint8), _cast(finite, dtype).view(np.uint8))


@needs_numba
@pytest.mark.parametrize("dtype", FORMATS)
def test_encode_random_representable_values(dtype):
    rng = np.random.default_rng(7)
    values = _all_codes(dtype).astype(np.float32)
    values = values[np.isfinite(values)]
    x = rng.choice(values, size=(3, 41, 129)).astype(np.float32)  # odd shape: no vector-width luck
    x[0, 0, :4] = [0.0, -0.0, values.max(), values.min()]
    out = np.empty((1,) + x.shape, dtype)  # a leading 1, as a kernel's buffer may have it
    assert codec.encode_into(x, out)
    assert np.array_equal(out.view(np.uint8)[0], _cast(x, dtype).view(np.uint8))
    view = out[0, :, 3:, ::2]  # a strided read decodes too
    assert np.array_equal(codec.to_float32(view).view(np.uint32), view.astype(np.float32).view(np.uint32))


@needs_numba
@pytest.mark.parametrize("dtype", FORMATS)
@pytest.mark.parametrize("bad", [np.nan, -np.nan, np.inf, -np.inf, 1e30, 1.0 + 2.0 ** -20, 2.0 ** -30, -3e-8])
def test_encode_refuses_what_no_code_holds(dtype, bad):
    x = np.ones(100, np.float32)
    x[57] = bad
    assert not codec.encode_into(x, np.empty(100, dtype))


@needs_numba
def test_encode_refuses_other_buffers():
    x = np.ones((4, 6), np.float32)
    assert not codec.encode_into(x, np.empty((4, 6), np.float16))  # not a coded format
    assert not codec.encode_into(x, np.empty((6, 4), codec.CODED[0]))  # copyto would not pair them in order
    assert not codec.encode_into(x, np.empty((4, 12), codec.CODED[0])[:, ::2])  # not contiguous


def test_without_the_kernels_the_casts_run(monkeypatch):
    monkeypatch.setattr(jit, "ENABLED", False)
    codes = _all_codes(codec.CODED[0])
    assert not codec.encode_into(np.zeros(256, np.float32), np.empty(256, codec.CODED[0]))
    assert np.array_equal(codec.to_float32(codes), codes.astype(np.float32), equal_nan=True)


@needs_numba
@pytest.mark.parametrize("dtype", FORMATS)
def test_encode_accepts_exactly_the_formats_values(dtype):
    """Over a sweep of float32 bit patterns (every sign and binade) and each finite code's value with its
    neighbours (one float32 ulp off, and each of the next bits above the kept mantissa): a value is
    encoded iff ml_dtypes' cast gives it back exactly, and then to ml_dtypes' code."""
    finite = _all_codes(dtype).astype(np.float32)
    finite = finite[np.isfinite(finite)]
    near = finite.view(np.uint32)[:, None].astype(np.int64) + np.array([-1, 1, 1 << 18, 1 << 19, 1 << 20])
    candidates = np.concatenate([np.arange(0, 2 ** 32, 40009, dtype=np.int64), near.ravel() % 2 ** 32])
    for x in candidates.astype(np.uint32).view(np.float32):
        one = np.array([x], np.float32)
        out = np.empty(1, dtype)
        cast = _cast(one, dtype)
        exact = bool(np.isfinite(x)) and cast.astype(np.float32).view(np.uint32)[0] == one.view(np.uint32)[0]
        assert codec.encode_into(one, out) == exact, x
        if exact:
            assert out.view(np.uint8)[0] == cast.view(np.uint8)[0], x
