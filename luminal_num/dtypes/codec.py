"""Bit-exact codes of the 8-bit float storage formats (float8 e4m3fn / e5m2) for values already in them.

Why: a QUANTIZE kernel's values are exactly representable in its format, so storing them is pure bit
manipulation, yet ml_dtypes' float32 <-> float8 casts cost ~10 ns per element here (a third of a
dynamically quantized MiniLM Gemm's time went to them); the numba loops of jit_loops take ~1.5 ns.

Same bits as ml_dtypes by construction: decoding is a 256-entry table built from ml_dtypes' own
decode of every code; encoding computes each code from the float32 bits, checking that the value
is one of the format's finite values (tests/test_codec.py: every one of them gives ml_dtypes' code,
and values between them are refused), else the whole array goes through ml_dtypes' cast (NaN,
infinities and inexact values take that path: a quantizer never writes the latter). Without numba,
or with LUMINAL_NUM_JIT=0 (dtypes.jit), the ml_dtypes casts run.
"""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np

from .jit import loops

CODED = (np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2))


def _layout(dtype: np.dtype) -> tuple[int, int, float, int, np.ndarray]:
    """(stored mantissa bits, exponent bias, 1 / min subnormal, the largest finite value's code, the
    float32 bits of every code)."""
    info = ml_dtypes.finfo(dtype)
    table = np.arange(256, dtype=np.uint8).view(dtype).astype(np.float32).view(np.uint32)
    max_code = int(np.array(info.max, dtype).view(np.uint8))
    return int(info.nmant), 1 - int(info.minexp), 2.0 ** -math.log2(float(info.smallest_subnormal)), max_code, table


_LAYOUTS = {dt: _layout(dt) for dt in CODED}


def code_layout(dtype: np.dtype) -> tuple[int, int, float, int] | None:
    """(stored mantissa bits, exponent bias, 1 / min subnormal, largest finite code) of a coded float8
    dtype, as jit_loops' encoders take them; None for any other dtype."""
    layout = _LAYOUTS.get(np.dtype(dtype))
    return None if layout is None else layout[:4]


def encode_into(values: np.ndarray, out: np.ndarray) -> bool:
    """out[...] = values (float32, exactly representable in out's float8 format), by codes; False
    (out untouched or partly written) where the fast path does not apply: the caller then casts."""
    jit = loops()
    if jit is None or out.dtype not in _LAYOUTS or values.dtype != np.float32 or values.size != out.size \
            or not out.flags.c_contiguous or not same_order(values.shape, out.shape):
        return False
    mant, bias, inv_sub, max_code = code_layout(out.dtype)
    flat = np.ascontiguousarray(values).reshape(-1)
    return jit.encode(flat, flat.view(np.uint32), out.reshape(-1).view(np.uint8), mant, bias, inv_sub, max_code)


def same_order(shape: tuple, target: tuple) -> bool:
    """Whether np.copyto(target, shape) pairs the elements in C order (equal sizes: only 1s differ), so
    that writing codes in C order stores what the run loop's cast would (quant.codes asks the same)."""
    try:
        return np.broadcast_shapes(shape, target) == target
    except ValueError:
        return False


def to_float32(x: np.ndarray) -> np.ndarray:
    """x as float32 (exact): float8 arrays by their codes, others by numpy's cast."""
    x = np.asarray(x)
    jit = loops()
    if jit is None or x.dtype not in _LAYOUTS:
        return np.asarray(x, dtype=np.float32)
    codes = np.ascontiguousarray(x.view(np.uint8)).reshape(-1)
    return jit.decode(codes, _LAYOUTS[x.dtype][4]).view(np.float32).reshape(x.shape)
