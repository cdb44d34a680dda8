"""Quantize a tensor into a narrow format with per-tensor / channel / block scales, and back.

The arithmetic is the one a GPU kernel does, so the CPU emulator and the CUDA backend agree: the
float32 value is divided by its float32 scale (one IEEE rounding), then rounded to nearest even in
the format. Overflow is a verdict, not a NaN: SATURATE clamps to +-max_finite, REJECT raises.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

from ..dtypes.formats import Format, get
from ..dtypes.rounding import Overflow, round_to
from ..dtypes.variants import ScaleSpec
from .scales import compute_scales, expand_scales, row_blocks


class QuantOverflow(enum.Enum):
    SATURATE = "saturate"  # clamp to +-max_finite (PTX .satfinite)
    REJECT = "reject"  # raise QuantOverflowError: the plan's scales do not fit its data


class QuantOverflowError(ValueError):
    """Values do not fit the format after scaling; the message names how many and by how much."""

    def __init__(self, fmt: Format, count: int, total: int, worst: float):
        self.fmt, self.count, self.total, self.worst = fmt, count, total, worst
        super().__init__(f"{count} of {total} values overflow {fmt} after scaling: max |x|/scale = {worst!r} "
                         f"rounds above max_finite = {fmt.max_finite!r}")


def convert(scaled: np.ndarray, fmt: Format | str, overflow: QuantOverflow = QuantOverflow.SATURATE) -> np.ndarray:
    """Round already-scaled values to `fmt` (float32 result; float64 for int32) under the policy."""
    fmt = get(fmt)
    if overflow is QuantOverflow.SATURATE:
        return round_to(scaled, fmt, Overflow.SATURATE)
    marked = round_to(scaled, fmt, Overflow.NAN)
    over = np.isnan(marked) & ~np.isnan(scaled)
    if over.any():
        raise QuantOverflowError(fmt, int(over.sum()), int(over.size), float(np.abs(scaled[over]).max()))
    return marked


ROW_BLOCK_BYTES = 32 << 20  # a large tensor is (de)quantized this many bytes of rows at a time


def _by_rows(x: np.ndarray, scales: np.ndarray, spec: ScaleSpec, each) -> np.ndarray:
    """each(x's rows, their expanded scales) over row_blocks, assembled (float32 unless each says otherwise)."""
    out = None
    for rows, scale_rows in row_blocks(x.shape, spec, ROW_BLOCK_BYTES):
        part = x[..., rows, :] if x.ndim >= 2 else x
        s = scales[..., scale_rows, :] if scales.ndim >= 2 and scale_rows != slice(None) else scales
        got = each(part, expand_scales(s, part.shape, spec))
        if rows == slice(None):
            return got
        if out is None:
            out = np.empty(x.shape, dtype=got.dtype)
        out[..., rows, :] = got
    return out


def quantize(x, fmt: Format | str, scales: np.ndarray, spec: ScaleSpec,
             overflow: QuantOverflow = QuantOverflow.SATURATE) -> np.ndarray:
    """x / scale rounded to `fmt`: float32 values exactly representable in fmt (the quantized domain);
    a large tensor a block of rows at a time (the same values)."""
    x = np.asarray(x, dtype=np.float32)
    scales = np.asarray(scales, dtype=np.float32)

    def rows(part: np.ndarray, s: np.ndarray) -> np.ndarray:
        with np.errstate(over="ignore"):  # an overflowing quotient is the overflow policy's to judge
            scaled = part / s
        return convert(scaled, fmt, overflow)
    if overflow is not QuantOverflow.SATURATE:  # REJECT counts the overflows of the whole tensor
        return rows(x, expand_scales(scales, x.shape, spec))
    return _by_rows(x, scales, spec, rows)


def dequantize(q: np.ndarray, scales: np.ndarray, spec: ScaleSpec) -> np.ndarray:
    """q * scale rounded once to float32, as a kernel reading quantized data computes it (a large tensor a
    block of rows at a time: the same values)."""
    q = np.asarray(q, dtype=np.float32)
    return _by_rows(q, np.asarray(scales, dtype=np.float32), spec, np.multiply)


@dataclass(frozen=True, eq=False)
class QuantizedTensor:
    """A tensor in the quantized domain plus the scales that map it back: x ~= values * scales."""

    values: np.ndarray  # float32, exactly representable in fmt
    scales: np.ndarray  # float32, shaped as in luminal_num.quant.scales
    fmt: Format
    spec: ScaleSpec

    def dequantize(self) -> np.ndarray:
        return dequantize(self.values, self.scales, self.spec)


def quantize_tensor(x, fmt: Format | str, spec: ScaleSpec, overflow: QuantOverflow = QuantOverflow.SATURATE,
                    scales: np.ndarray | None = None) -> QuantizedTensor:
    """Quantize with the given (static) scales, or with scales computed from x itself (dynamic)."""
    fmt = get(fmt)
    x = np.asarray(x, dtype=np.float32)
    if scales is None:
        scales = compute_scales(x, fmt, spec)
    return QuantizedTensor(quantize(x, fmt, scales, spec, overflow), np.asarray(scales, np.float32), fmt, spec)
