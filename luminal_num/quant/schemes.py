"""The arithmetic of each storage scheme: quantize, dequantize and an a-priori per-element error bound.

Every step is one IEEE operation in a stated format (round to nearest even unless said otherwise), so
the CPU emulator and a CUDA kernel doing the same operations agree bit for bit:
- AMAX (fp8 per channel / 128-tile, int8 per channel, MXFP4): luminal_num.quant's scales and
  quantize (s = amax / max_finite in FP32, E8M0 rounded up to a power of two; q = RN(fl32(x / s)));
  dequantize = fl32(q * s).
- INT4_SYMMETRIC: s = max(fl16(fl32(amax / 7)), 2^-14), q = clamp(RN(fl32(x / s)), -8, 7); q * s is
  exact in FP32. The f16 scale is what GPTQ/AWQ checkpoints store; flooring it at f16's min_normal
  keeps |x / s| <= 7 (a subnormal scale rounded down could push a code past the range).
- INT4_ASYMMETRIC (GPTQ/AWQ): the range [min(x, 0), max(x, 0)] in 15 steps: s = max(fl16(fl32(fl32(hi
  - lo) / 15)), 2^-14), zero z = clamp(RN(fl32(-lo / s)), 0, 15), q = clamp(RN(fl32(x / s)) + z, 0, 15);
  dequantize = (q - z) * s, exact in FP32.
- NVFP4: tensor scale s_t = max(fl32(amax / (6 * 448)), 2^-117), block scale s_b = max(RN_e4m3,sat(
  fl32(fl32(amax_b / 6) / s_t)), 2^-6) (never subnormal: one rounded down could push a block past
  E2M1's max), q = RN_e2m1,sat(fl32(x / fl32(s_b * s_t))); dequantize = fl32(fl32(q * s_b) * s_t).
Weights with a non-finite value are refused before any of this (StorageFormat.quantize).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Mapping

import numpy as np

from ..dtypes.formats import E8M0, F4E2M1, F8E4M3, F16, F32
from ..dtypes.rounding import Overflow, round_to
from ..dtypes.variants import WHOLE, Granularity, ScaleSpec, _operand_terms
from .layout import Layout, Part, expand_groups, grouped
from .quantize import QuantOverflow, convert, dequantize, quantize_tensor

if TYPE_CHECKING:  # the declarations module imports this one
    from .storage import StorageFormat

U32, ETA32 = F32.unit_roundoff, F32.min_subnormal / 2.0
SLACK = 1.0 + 2.0 ** -20  # covers the float64 evaluation of the bounds themselves


def _f32(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float32)


# -- IEEE: plain float storage ----------------------------------------------------------------------

def ieee_quantize(fmt: StorageFormat, x: np.ndarray) -> dict[Part, np.ndarray]:
    """RN to the element format; a weight that overflows it is refused (QuantOverflowError)."""
    return {Part.Q: _f32(convert(x, fmt.element, QuantOverflow.REJECT))}


def ieee_dequantize(fmt: StorageFormat, values: Mapping[Part, np.ndarray], shape) -> np.ndarray:
    return values[Part.Q]


def ieee_error(fmt: StorageFormat, amax: float) -> tuple[float, float]:
    if fmt.element is F32:
        return 0.0, 0.0
    if not np.isfinite(round_to(np.float64(amax), fmt.element, Overflow.INF)):  # overflow is on the rounded value
        return np.inf, np.inf
    return fmt.element.unit_roundoff, fmt.element.min_subnormal / 2.0


# -- AMAX: luminal_num.quant's scales ---------------------------------------------------------------

def scale_spec(fmt: StorageFormat) -> ScaleSpec:
    """The ScaleSpec of an AMAX format, in (rows, K) axes: per row, per tile, or MX groups along K."""
    if fmt.layout is Layout.CHANNEL:
        return ScaleSpec(Granularity.CHANNEL, (1, WHOLE), F32, static=True)
    if fmt.layout is Layout.TILE:
        return ScaleSpec(Granularity.BLOCK, (fmt.block, fmt.block), F32, static=True)
    if fmt.layout is Layout.GROUP and fmt.scale is E8M0:
        return ScaleSpec(Granularity.MX, (1, fmt.block), E8M0, static=True)
    if fmt.layout is Layout.GROUP and fmt.scale is F32:  # one FP32 scale per `block` elements of a row
        return ScaleSpec(Granularity.BLOCK, (1, fmt.block), F32, static=True)
    raise ValueError(f"{fmt.name}: no AMAX scale spec for layout {fmt.layout.name} with {fmt.scale} scales")


def amax_quantize(fmt: StorageFormat, x: np.ndarray) -> dict[Part, np.ndarray]:
    q = quantize_tensor(x, fmt.element, scale_spec(fmt), QuantOverflow.SATURATE)
    return {Part.Q: _f32(q.values), Part.SCALE: _f32(q.scales)}


def amax_dequantize(fmt: StorageFormat, values: Mapping[Part, np.ndarray], shape) -> np.ndarray:
    return _f32(dequantize(values[Part.Q], values[Part.SCALE], scale_spec(fmt)))


def amax_error(fmt: StorageFormat, amax: float) -> tuple[float, float]:
    """Quantization (variants._operand_terms: |q s - x| <= rel |x| + abs) plus the fl32(q * s) rounding."""
    rel, absolute, _, _ = _operand_terms(fmt.element, scale_spec(fmt), amax)
    return (rel + U32 * (1 + rel)) * SLACK, (absolute * (1 + U32) + ETA32) * SLACK


# -- INT4 with f16 group scales ---------------------------------------------------------------------

F16_SCALE_FLOOR = F16.min_normal


def _f16_scale(ratio: np.ndarray, fmt: StorageFormat, what: str) -> np.ndarray:
    """max(fl16(ratio), 2^-14); a ratio beyond f16's range is refused with the worst group's value."""
    scale = round_to(ratio, F16, Overflow.NAN)  # an infinite ratio (hi - lo overflowed) stays infinite
    if not np.all(np.isfinite(scale)):
        raise ValueError(f"{fmt.name}: {int((~np.isfinite(scale)).sum())} groups need an f16 scale {what} above "
                         f"{F16.max_finite!r} (worst {float(np.max(ratio))!r})")
    return np.maximum(scale, np.float32(F16_SCALE_FLOOR)).astype(np.float32)


def int4_symmetric_quantize(fmt: StorageFormat, x: np.ndarray) -> dict[Part, np.ndarray]:
    amax = np.abs(grouped(x, fmt.block)).max(axis=-1)
    scale = _f16_scale(amax / np.float32(7.0), fmt, "amax / 7")
    codes = np.rint(x / expand_groups(scale, fmt.block, x.shape[-1]))
    return {Part.Q: _f32(np.clip(codes, -8.0, 7.0)), Part.SCALE: scale}


def int4_symmetric_dequantize(fmt: StorageFormat, values: Mapping[Part, np.ndarray], shape) -> np.ndarray:
    return values[Part.Q] * expand_groups(values[Part.SCALE], fmt.block, shape[-1])


def _f16_scale_max(ratio_max: float) -> float:
    """Largest scale max(fl16(r), 2^-14) for r <= ratio_max (after an FP32 division)."""
    return max(ratio_max * (1 + U32) * (1 + F16.unit_roundoff), F16_SCALE_FLOOR)


def int4_symmetric_error(fmt: StorageFormat, amax: float) -> tuple[float, float]:
    """|x / s| <= 7 (1 + 2^-11)(1 + u32) < 7.5 never clamps; RN and the FP32 quotient: s (1/2 + 2^-21)."""
    return 0.0, _f16_scale_max(amax / 7.0) * (0.5 + 2.0 ** -21) * SLACK


def int4_asymmetric_quantize(fmt: StorageFormat, x: np.ndarray) -> dict[Part, np.ndarray]:
    groups = grouped(x, fmt.block)  # the zero padding is inside [lo, hi] already: lo <= 0 <= hi
    lo = np.minimum(groups.min(axis=-1), np.float32(0.0))
    hi = np.maximum(groups.max(axis=-1), np.float32(0.0))
    with np.errstate(over="ignore"):
        scale = _f16_scale((hi - lo) / np.float32(15.0), fmt, "(max - min) / 15")
    zero = np.clip(np.rint(-lo / scale), 0.0, 15.0).astype(np.float32)
    k = x.shape[-1]
    codes = np.rint(x / expand_groups(scale, fmt.block, k)) + expand_groups(zero, fmt.block, k)
    return {Part.Q: _f32(np.clip(codes, 0.0, 15.0)), Part.SCALE: scale, Part.ZERO: zero}


def int4_asymmetric_dequantize(fmt: StorageFormat, values: Mapping[Part, np.ndarray], shape) -> np.ndarray:
    k = shape[-1]
    offset = values[Part.Q] - expand_groups(values[Part.ZERO], fmt.block, k)
    return offset * expand_groups(values[Part.SCALE], fmt.block, k)


def int4_asymmetric_error(fmt: StorageFormat, amax: float) -> tuple[float, float]:
    """In steps of s: RN 1/2, the zero's RN and clamp 1/2 + 2^-20, the rounded-down scale's shortfall at
    the top ((hi - lo) / s - 15 <= 0.0074): every clamped or rounded code is within 0.51 s."""
    return 0.0, _f16_scale_max(2.0 * amax / 15.0) * 0.51 * SLACK


# -- NVFP4 ------------------------------------------------------------------------------------------

NVFP4_TENSOR_SCALE_FLOOR = 2.0 ** -117  # s_b * s_t >= 2^-6 * 2^-117 stays an FP32 normal
NVFP4_RANGE = F4E2M1.max_finite * F8E4M3.max_finite  # 6 * 448, exact


def nvfp4_quantize(fmt: StorageFormat, x: np.ndarray) -> dict[Part, np.ndarray]:
    amax = np.float32(np.abs(x).max(initial=0.0))
    tensor_scale = np.maximum(amax / np.float32(NVFP4_RANGE), np.float32(NVFP4_TENSOR_SCALE_FLOOR))
    block_amax = np.abs(grouped(x, fmt.block)).max(axis=-1)
    ratio = (block_amax / np.float32(F4E2M1.max_finite)) / tensor_scale
    block_scale = np.maximum(round_to(ratio, F8E4M3, Overflow.SATURATE), np.float32(F8E4M3.min_normal))
    combined = block_scale * tensor_scale
    with np.errstate(over="ignore"):
        scaled = x / expand_groups(combined, fmt.block, x.shape[-1])
    codes = round_to(scaled, F4E2M1, Overflow.SATURATE)
    return {Part.Q: _f32(codes), Part.SCALE: _f32(block_scale), Part.TENSOR_SCALE: _f32(tensor_scale)}


def nvfp4_dequantize(fmt: StorageFormat, values: Mapping[Part, np.ndarray], shape) -> np.ndarray:
    partial = values[Part.Q] * expand_groups(values[Part.SCALE], fmt.block, shape[-1])
    return _f32(partial * values[Part.TENSOR_SCALE])


def nvfp4_error(fmt: StorageFormat, amax: float) -> tuple[float, float]:
    """s_b >= ratio (1 - 2^-4) so |x| / (s_b s_t) <= 6.4: saturation costs <= u_e2m1 |y| like RN does;
    |q - y| <= 2^-2 |y| + 1/4, then three FP32 roundings (quotient, s_b * s_t, the two dequant products)."""
    tensor_scale = max(amax / NVFP4_RANGE * (1 + U32), NVFP4_TENSOR_SCALE_FLOOR)
    combined = max(amax / F4E2M1.max_finite * (1 + F8E4M3.unit_roundoff) * (1 + 4 * U32),
                   F8E4M3.min_normal * tensor_scale) * (1 + U32)
    rel = (1 + F4E2M1.unit_roundoff) * (1 + U32) ** 4 - 1
    return rel * SLACK, (0.25 * combined * (1 + U32) ** 3 + 2 * ETA32) * SLACK
