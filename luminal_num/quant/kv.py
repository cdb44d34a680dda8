"""KV-cache storage formats: a cache buffer held in BF16, FP16 or FP8 E4M3 with per-token / per-head scales.

A KV cache is a (rows, width) buffer, one row per cached token (all KV heads side by side), that a
step's in-place Scatter extends by the new tokens' rows. Held in a format, the Scatter writes each new
row converted (its codes and, for FP8, its scale beside it) and attention reads the row widened. Each
format here quantizes one row independently of every other (per-token: one FP32 scale per row; per-head:
one per `head` consecutive elements of a row, a head's slice), so the value a reader sees is
`cache_values(rows)` row by row, whichever step wrote the row: the emulation applies it to the rows a
step writes and, on entry, to the rows a cache input brings (a cache handed over as values is taken to
have been written in the plan's format: the conversion the CPU backend applies is this same function).

The formats are `luminal_num.quant.storage` declarations (the cost model reads their stored bytes):
  bf16, f16           round to nearest even (no scale); an overflow is inf (the store's policy);
  f8e4m3_channel      per token: s = amax(row) / 448 in FP32, q = RN_e4m3,sat(fl32(x / s)), x^ = fl32(q s);
  f8e4m3_g<head>      per head: the same per `head` elements of a row (FP8 KV caches of vLLM / TensorRT-LLM).
A run-time row may overflow or carry NaN: its amax skips non-finite values, NaN stays NaN, +-inf saturates
(what the CUDA scatter writes), so a run never raises on the values a step computes.
"""
from __future__ import annotations

import math

import numpy as np

from ..dtypes.rounding import store
from .layout import Layout
from .storage import FP8_GROUPS, StorageFormat, storage_format

KV_TOKEN_FORMATS: tuple[str, ...] = ("bf16", "f16", "f8e4m3_channel")
KV_HEAD_FORMAT = "f8e4m3_g{head}"  # per head, for a cache of `head`-wide heads (FP8_GROUPS only)
KV_HEAD_DIMS: tuple[int, ...] = FP8_GROUPS


def kv_formats(head_dim: int) -> tuple[str, ...]:
    """The formats offered for a cache whose heads are `head_dim` wide (0: unknown; per-token only)."""
    per_head = (KV_HEAD_FORMAT.format(head=head_dim),) if head_dim in KV_HEAD_DIMS else ()
    return KV_TOKEN_FORMATS + per_head


def is_kv_format(name: str) -> bool:
    return name in KV_TOKEN_FORMATS or any(name == KV_HEAD_FORMAT.format(head=h) for h in KV_HEAD_DIMS)


def _kv_format(fmt: str | StorageFormat) -> StorageFormat:
    fmt = storage_format(fmt)
    if not is_kv_format(fmt.name):
        raise ValueError(f"{fmt.name} is not a KV-cache format (they are {', '.join(kv_formats(64))} and per head "
                         f"f8e4m3_g<{'/'.join(map(str, KV_HEAD_DIMS))}>)")
    return fmt


def cache_values(rows, fmt: str | StorageFormat) -> np.ndarray:
    """float32 (..., width): every row as the cache holds it in `fmt` (quantized, then widened on read)."""
    fmt = _kv_format(fmt)
    rows = np.asarray(rows, dtype=np.float32)
    if rows.ndim < 1:
        raise ValueError(f"a KV-cache row is a vector, got a scalar")
    flat = rows.reshape(-1, rows.shape[-1]) if rows.size else rows.reshape(0, rows.shape[-1])
    if flat.shape[0] == 0:
        return flat.reshape(rows.shape).copy()
    if fmt.layout is Layout.NONE:  # bf16 / f16: the store's rounding; an overflow is inf, as the CUDA store's
        return store(flat, fmt.element).astype(np.float32).reshape(rows.shape)
    finite = np.isfinite(flat)
    if finite.all():
        return fmt.quantize(flat).dequantize().astype(np.float32).reshape(rows.shape)
    return _with_non_finite(flat, finite, fmt).reshape(rows.shape)


def _with_non_finite(flat: np.ndarray, finite: np.ndarray, fmt: StorageFormat) -> np.ndarray:
    """A scaled FP8 row with inf/NaN in it, as the CUDA scatter writes it: the group's amax skips
    non-finite values, so the finite ones convert as usual; NaN stays NaN and +-inf saturates to
    +-fl32(448 s) (RN_e4m3,sat of an infinite ratio)."""
    width = flat.shape[-1]
    group = width if fmt.layout is Layout.CHANNEL else fmt.block
    if width % group:
        raise ValueError(f"{fmt.name}: a {width}-wide KV-cache row is not a whole number of {group}-wide groups")
    out = fmt.quantize(np.where(finite, flat, 0.0)).dequantize().astype(np.float32)
    grouped = np.where(finite, np.abs(flat), 0.0).reshape(flat.shape[0], -1, group)
    amax = grouped.max(axis=-1, keepdims=True).astype(np.float64)
    limit = fmt.element.max_finite
    s = np.where(amax > 0, np.maximum(amax / limit, 2.0 ** -126), 1.0).astype(np.float32)
    saturated = np.broadcast_to(np.float32(limit) * s, grouped.shape).reshape(flat.shape)
    out = np.where(np.isnan(flat), np.float32(np.nan), out)
    return np.where(np.isinf(flat), np.copysign(saturated, flat), out).astype(np.float32)


def cache_error(magnitude, fmt: str | StorageFormat) -> np.ndarray:
    """A bound on |cache_values(x) - x| per element, for any x with |x| <= magnitude elementwise:
    rel |x| + abs with the format's a-priori (rel, abs) at the largest magnitude (every row's own amax
    is at most that, and the AMAX bounds grow with amax); infinite where the format cannot hold it."""
    fmt = _kv_format(fmt)
    magnitude = np.asarray(magnitude, dtype=np.float64)
    amax = float(magnitude.max(initial=0.0))
    if not math.isfinite(amax):
        return np.full(magnitude.shape, np.inf)
    rel, absolute = fmt.element_error(amax)
    with np.errstate(invalid="ignore"):
        out = rel * magnitude + absolute
    return np.nan_to_num(out, nan=np.inf, posinf=np.inf)
