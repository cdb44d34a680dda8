"""Scales for quantizing a tensor into a narrow format: one scale per tensor, channel or block.

A scale array has the operand's rank: each of its last two axes counts the blocks along that axis
(ceil(extent / block); the last block may be ragged), leading batch axes keep their extent (each
matrix has its own scales), and a TENSOR scale is all ones in shape (it spans everything).

s = amax * margin / max_finite, so the block's largest |x| lands exactly on the format's largest
value (E8M0: the next power of two up, 2^ceil(log2(...)), so nothing overflows). A block whose amax is
0 gets s = 1: every scale is finite and positive, never NaN, inf or 0, so dividing by it is safe.
Non-finite entries are left out of amax: they are the overflow policy's business, not the scale's.
"""
from __future__ import annotations

import numpy as np

from ..dtypes.formats import E8M0, F32, Format
from ..dtypes.variants import WHOLE, Granularity, ScaleSpec


def resolved_block(spec: ScaleSpec, shape: tuple[int, ...]) -> tuple[int, int]:
    """The (rows, cols) block extents for a tensor of `shape`, WHOLE replaced by the axis extent."""
    if len(shape) < 2:
        raise ValueError(f"scales apply to the last two axes; got shape {shape}")
    rows, cols = shape[-2:]
    return (spec.block[0] or max(rows, 1)), (spec.block[1] or max(cols, 1))


def scale_shape(spec: ScaleSpec, shape: tuple[int, ...]) -> tuple[int, ...]:
    if spec.granularity is Granularity.TENSOR:
        return (1,) * len(shape)
    block_rows, block_cols = resolved_block(spec, shape)
    return (*shape[:-2], -(-shape[-2] // block_rows), -(-shape[-1] // block_cols))


AMAX_BLOCK_BYTES = 32 << 20  # a large tensor's block maxima are taken this many bytes of rows at a time


def row_blocks(shape: tuple[int, ...], spec: ScaleSpec, max_bytes: int):
    """(rows, the scale rows they read) slices covering a tensor of FP32 `shape` past `max_bytes`, each block
    starting on a scale block's first row (scale rows: slice(None) where one scale row spans every row); one
    whole block for anything smaller. Why: |x|, expanded scales, quotients and roundings of a whole tensor
    are each a full-size temporary (a 1B model's LM head: 1 GB each, the compile's memory peaks), and every
    value or block maximum depends on its own rows only, so block by block gives the same bits."""
    rows = shape[-2] if len(shape) >= 2 else 0
    row_bytes = 4 * int(np.prod(shape, dtype=np.int64)) // max(rows, 1)
    if rows < 2 or row_bytes * rows <= max_bytes:
        yield slice(None), slice(None)
        return
    per_scale_row = spec.block[0] if spec.granularity is not Granularity.TENSOR and spec.block[0] != WHOLE else None
    align = per_scale_row or 1
    step = max(align, max_bytes // row_bytes // align * align)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        yield slice(r0, r1), (slice(r0 // align, -(-r1 // align)) if per_scale_row else slice(None))


def block_amax(x: np.ndarray, spec: ScaleSpec) -> np.ndarray:
    """max |x| over each block (finite entries only), shaped like the scale array; a large tensor a block
    of rows at a time (row_blocks)."""
    x = np.asarray(x, dtype=np.float32)
    blocks = list(row_blocks(x.shape, spec, AMAX_BLOCK_BYTES))
    if len(blocks) == 1:
        return _block_amax(x, spec)
    parts = [_block_amax(x[..., rows, :], spec) for rows, _ in blocks]
    spans_rows = blocks[0][1] == slice(None)  # one scale row for all rows: the blocks' maxima combine
    return np.maximum.reduce(parts) if spans_rows else np.concatenate(parts, axis=-2)


def _block_amax(x: np.ndarray, spec: ScaleSpec) -> np.ndarray:
    magnitude = np.abs(np.asarray(x, dtype=np.float32))
    if not np.isfinite(magnitude.max(initial=0.0)):
        magnitude = np.where(np.isfinite(magnitude), magnitude, 0.0).astype(np.float32)
    if spec.granularity is Granularity.TENSOR:
        return np.full(scale_shape(spec, x.shape), magnitude.max(initial=0.0), dtype=np.float32)
    block_rows, block_cols = resolved_block(spec, x.shape)
    lead, (rows, cols) = x.shape[:-2], x.shape[-2:]
    n_rows, n_cols = -(-rows // block_rows), -(-cols // block_cols)
    pad_rows, pad_cols = n_rows * block_rows - rows, n_cols * block_cols - cols
    if pad_rows or pad_cols:  # ragged last block: zeros never raise a maximum of magnitudes
        magnitude = np.pad(magnitude, [(0, 0)] * len(lead) + [(0, pad_rows), (0, pad_cols)])
    tiles = magnitude.reshape(*lead, n_rows, block_rows, n_cols, block_cols)
    return tiles.max(axis=(-3, -1), initial=0.0)


def scales_from_amax(amax: np.ndarray, fmt: Format, spec: ScaleSpec) -> np.ndarray:
    """float32 scales (exactly representable in spec.scale_format) for blocks with the given amax."""
    amax = np.asarray(amax, dtype=np.float64)
    ratio = amax * spec.margin / fmt.max_finite
    if spec.scale_format is E8M0:
        mantissa, exponent = np.frexp(ratio)  # ratio = mantissa * 2^exponent, mantissa in [0.5, 1)
        ceil_log2 = np.where(mantissa == 0.5, exponent - 1, exponent)  # exact powers of two stay
        low, high = np.log2(E8M0.min_normal), np.log2(E8M0.max_finite)
        scale = np.ldexp(1.0, np.clip(ceil_log2, low, high).astype(np.int64))
    else:  # FP32 scales: rounded to nearest; clamped to normal so x / s never loses a subnormal's bits
        scale = np.maximum(ratio, F32.min_normal)
    return np.where(amax > 0, scale, 1.0).astype(np.float32)


def compute_scales(x: np.ndarray, fmt: Format, spec: ScaleSpec) -> np.ndarray:
    """The scales a kernel (dynamic) or the compiler (static) computes for `x` quantized to `fmt`."""
    return scales_from_amax(block_amax(x, spec), fmt, spec)


def expand_scales(scales: np.ndarray, shape: tuple[int, ...], spec: ScaleSpec) -> np.ndarray:
    """Scales repeated over their blocks (ragged last block cropped), broadcastable to `shape`."""
    scales = np.asarray(scales, dtype=np.float32)
    expected = scale_shape(spec, shape)
    if scales.shape != expected:
        raise ValueError(f"scales of shape {scales.shape} do not fit a {shape} tensor with {spec.block} "
                         f"blocks (expected {expected})")
    block_rows, block_cols = resolved_block(spec, shape)
    for axis, block, extent in ((-2, block_rows, shape[-2]), (-1, block_cols, shape[-1])):
        if scales.shape[axis] > 1:  # a single block along an axis just broadcasts
            scales = np.repeat(scales, block, axis=axis)
            scales = scales[..., :extent] if axis == -1 else scales[..., :extent, :]
    return scales
