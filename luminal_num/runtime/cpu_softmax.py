"""The CPU backend's FP32 softmax: float64 throughout, rounded once into float32, with masked scores'
exp taken as the exact +0 it is (MiniLM's attention masks made numpy's slow path half the softmax)."""
from __future__ import annotations

import numpy as np


# exp(y) below this is +0 in float64: e^-800 < 2^-1154, far under half the least subnormal (2^-1075), so
# any faithful exp rounds it to 0 (numpy's does: tests/test_cpu_softmax.py). MiniLM's masked keys give
# y ~ -1e4 for 70% of the attention scores, where numpy's float64 exp takes a slow path (1.25 vs 0.25 ms).
EXP_UNDERFLOW = -800.0


def softmax_f64_into(x: np.ndarray, axis: int, out: np.ndarray) -> np.ndarray:
    """hlir.evaluate.softmax of float32 x computed in float64 and rounded once into float32 `out`, as
    softmax(x.astype(float64)).astype(float32) does it, less a pass: the division's float64 quotients
    are cast into out. The row max is exact in any order, so it is taken with the softmax axis
    outermost (numpy reduces a short contiguous axis one row per call: half the time of a 41-key
    attention softmax went there)."""
    rows_outer = np.ascontiguousarray(np.moveaxis(x, axis, 0))
    m = np.expand_dims(np.max(rows_outer, axis=0), axis)
    m = np.where(np.isfinite(m), m, np.float32(0.0)).astype(np.float64)
    e = x.astype(np.float64)
    np.subtract(e, m, out=e)
    under = e < EXP_UNDERFLOW
    if under.any():  # masked scores: exp's exact +0 set directly (numpy's exp is ~5x slower on them)
        np.copyto(e, 0.0, where=under)
        np.exp(e, out=e)
        np.copyto(e, 0.0, where=under)
    else:
        np.exp(e, out=e)
    return np.divide(e, np.sum(e, axis=axis, keepdims=True), out=out, casting="unsafe")
