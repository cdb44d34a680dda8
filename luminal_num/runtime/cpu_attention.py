"""CPU emulation of the fused attention kernel: the CUDA kernel's order of operations and roundings,
vectorised over score rows (codegen/attention.py says what it computes).

Per row (one thread of the CUDA kernel per row and split), in FP32 with every op rounded once (no FMA):
  s_j   = fl(fl(sum_d q_d k_d, sequential from 0) * fl32(scale)) + bias_j
  per split, per key tile: m' = max(m, max_j s_j); alpha = e(m - m'); l = l alpha; o = o alpha;
    per key j in order: p = e(s_j - m'); l = l + p; o = o + r_pv(p) * r_pv(v_j)
  combine: M = max_i m_i; w_i = e(m_i - M); L = sum_i l_i w_i; O = sum_i o_i w_i; out = O / L
where e(x) = fl32(exp(x)) (exp in FP64, one rounding; e(-inf) = 0, and x = -inf when the new max is
-inf) and r_pv rounds to the variant's P V operand format (identity for FP32).
"""
from __future__ import annotations

from typing import Mapping

import numpy as np

from ..codegen.attention import ATTENTION_VARIANTS, AttentionSpec, key_ranges
from ..dtypes.formats import F32, Format
from ..dtypes.rounding import Overflow, round_to
from ..hlir.symbolic import evaluate


def _round(x: np.ndarray, fmt: Format) -> np.ndarray:
    """x (float32) rounded to an operand format (overflow to inf, as the CUDA conversions do)."""
    x = np.asarray(x, dtype=np.float32)
    return x if fmt is F32 else np.asarray(round_to(x, fmt, Overflow.INF), dtype=np.float32)


def exp32(x: np.ndarray) -> np.ndarray:
    """fl32(exp(x)) for float32 x: exp in FP64 (exact argument), one rounding to FP32."""
    return np.exp(np.asarray(x, dtype=np.float64)).astype(np.float32)


def _shifted(x: np.ndarray, m: np.ndarray) -> np.ndarray:
    """fl32(x - m), -inf where m is -inf (a row with no finite score yet)."""
    with np.errstate(invalid="ignore"):
        return np.where(m == -np.inf, np.float32(-np.inf), x - m).astype(np.float32)


def scores(q: np.ndarray, k: np.ndarray, bias: np.ndarray, scale: float, fmt: Format) -> np.ndarray:
    """(N, T) FP32 scores from q, k (N, T, D) and bias (N, T): the dot sequential over D."""
    q, k = _round(q, fmt), _round(k, fmt)
    s = np.zeros(q.shape[:-1], dtype=np.float32)
    for d in range(q.shape[-1]):
        s = s + q[..., d] * k[..., d]
    return (s * np.float32(scale) + np.asarray(bias, dtype=np.float32)).astype(np.float32)


def online_softmax_pv(s: np.ndarray, v: np.ndarray, spec: AttentionSpec, fmt: Format) -> np.ndarray:
    """(N, Dv) FP32 output from scores (N, T) and v (N, Dv, T), split by split, tile by tile."""
    n, t = s.shape
    v = _round(v, fmt)
    parts = []
    for tiles in key_ranges(t, spec):
        m = np.full(n, -np.inf, dtype=np.float32)
        l = np.zeros(n, dtype=np.float32)
        o = np.zeros((n, v.shape[1]), dtype=np.float32)
        for a, b in tiles:
            m_new = np.maximum(m, np.max(s[:, a:b], axis=1))
            alpha = exp32(_shifted(m, m_new))
            l, o = l * alpha, o * alpha[:, None]
            for j in range(a, b):
                p = exp32(_shifted(s[:, j], m_new))
                l = l + p
                o = o + _round(p, fmt)[:, None] * v[:, :, j]
            m = m_new
        parts.append((m, l, o))
    big = parts[0][0]
    for m, _, _ in parts[1:]:
        big = np.maximum(big, m)
    total_l = np.zeros(n, dtype=np.float32)
    total_o = np.zeros((n, v.shape[1]), dtype=np.float32)
    for m, l, o in parts:
        w = exp32(_shifted(m, big))
        total_l, total_o = total_l + l * w, total_o + o * w[:, None]
    with np.errstate(invalid="ignore", divide="ignore"):
        return (total_o / total_l[:, None]).astype(np.float32)


def run_attention(k, operands: tuple[np.ndarray, ...], bindings: Mapping[str, int]) -> np.ndarray:
    """The kernel's FP32 result over its output shape; `operands` = (q, k, bias, v) read through
    the kernel's views (any dtype; widened exactly to FP32)."""
    q, kk, bias, v = (np.asarray(x, dtype=np.float32) for x in operands)
    variant = ATTENTION_VARIANTS[k.precision]
    rows = bias.shape[:-1]
    n, t = int(np.prod(rows, dtype=np.int64)), bias.shape[-1]
    spec: AttentionSpec = k.value
    s = scores(q.reshape(n, t, q.shape[-1]), kk.reshape(n, t, kk.shape[-1]), bias.reshape(n, t), spec.scale,
               variant.qk)
    out = online_softmax_pv(s, v.reshape(n, v.shape[-2], t), spec, variant.pv)
    shape = tuple(int(evaluate(d, bindings)) for d in k.shape)
    return out.reshape(shape)
