"""llama.cpp's Q4_1 and Q8_0 blocks, bit for bit, so a GGUF model's weights can be kept exactly.

Written from ggml-quants.c (quantize_row_q4_1_ref / quantize_row_q8_0_ref and the dequantizers),
all in FP32 arithmetic:
- Q4_1, per block of 32 along K: mn = min, mx = max, d = (mx - mn) / 15, id = d ? 1 / d : 0,
  q = min(15, trunc(fl32(fl32(x - mn) * id) + 0.5)); stored fp16(d), fp16(mn), q (uint4).
  Dequantize: fl32(q * d16 + m16) (q * d16 is exact, so an FMA gives the same bits).
- Q8_0, per block of 32: d = amax / 127, id = d ? 1 / d : 0, q = roundf(fl32(x * id)) (half away
  from zero); stored fp16(d), q (int8). Dequantize: q * d16, exact in FP32.
Note the quantizers use the FP32 d and mn, the dequantizers the fp16-rounded ones (llama.cpp's own
asymmetry, kept). GGUF block bytes: Q4_1 = d, m, then 16 bytes where byte j holds element j (low
nibble) and element j + 16 (high nibble); Q8_0 = d, then 32 int8.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Mapping

import numpy as np

from ..dtypes.formats import F16, F32
from ..dtypes.rounding import Overflow, round_to
from .layout import Part, Scheme, expand_groups

if TYPE_CHECKING:
    from .storage import StorageFormat

BLOCK = 32
BLOCK_BYTES = {Scheme.GGUF_Q4_1: 2 + 2 + BLOCK // 2, Scheme.GGUF_Q8_0: 2 + BLOCK}
GGUF_TYPE_NAMES = {Scheme.GGUF_Q4_1: "Q4_1", Scheme.GGUF_Q8_0: "Q8_0"}  # GGMLQuantizationType names
U32, U16, ETA16 = F32.unit_roundoff, F16.unit_roundoff, F16.min_subnormal / 2.0
CODE_SLACK = 2.0 ** -16  # |q - exact code| <= 1/2 + this: the FP32 roundings before RN / trunc


def _blocks(x: np.ndarray) -> np.ndarray:
    rows, k = x.shape
    return x.reshape(rows, k // BLOCK, BLOCK)


def _to_f16(values: np.ndarray, fmt: StorageFormat, what: str) -> np.ndarray:
    rounded = round_to(values, F16, Overflow.NAN)  # an infinite value (max - min overflowed) stays infinite
    if not np.all(np.isfinite(rounded)):
        raise ValueError(f"{fmt.name}: a block's {what} ({float(np.max(np.abs(values)))!r}) overflows fp16")
    return rounded.astype(np.float32)


def _inverse(d: np.ndarray) -> np.ndarray:
    """id = d ? 1 / d : 0, and 0 where 1 / d overflows (d < 2^-128: llama.cpp's C is undefined there; the
    fp16 d of such a block is 0, so its codes do not matter and 0 is the deterministic choice)."""
    with np.errstate(divide="ignore", over="ignore"):
        inverse = np.float32(1.0) / d
    return np.where(np.isfinite(inverse), inverse, np.float32(0.0)).astype(np.float32)


def q4_1_quantize(fmt: StorageFormat, x: np.ndarray) -> dict[Part, np.ndarray]:
    blocks = _blocks(x)
    mn, mx = blocks.min(axis=-1), blocks.max(axis=-1)
    with np.errstate(over="ignore"):
        d = (mx - mn) / np.float32(15.0)
    d16 = _to_f16(d, fmt, "scale (max - min) / 15")  # refuses before any infinity is used
    inverse = _inverse(d)
    scaled = (blocks - mn[..., None]) * inverse[..., None]
    codes = np.minimum(np.trunc(scaled + np.float32(0.5)), np.float32(15.0))
    return {Part.Q: codes.reshape(x.shape).astype(np.float32), Part.SCALE: d16,
            Part.MIN: _to_f16(mn, fmt, "min")}


def q4_1_dequantize(fmt: StorageFormat, values: Mapping[Part, np.ndarray], shape) -> np.ndarray:
    k = shape[-1]
    return values[Part.Q] * expand_groups(values[Part.SCALE], BLOCK, k) + expand_groups(values[Part.MIN], BLOCK, k)


def q4_1_error(fmt: StorageFormat, amax: float) -> tuple[float, float]:
    """|d q + mn - x| <= d (1/2 + CODE_SLACK); then fp16 d (times q <= 15) and fp16 mn, and fl32 of the sum."""
    d = 2.0 * amax / 15.0 * (1 + U32) ** 2
    absolute = d * (0.5 + CODE_SLACK) + 15 * (U16 * d + ETA16) + U16 * amax + ETA16
    return U32 * 1.01, absolute * (1 + 2 * U32)


def _round_half_away(v: np.ndarray) -> np.ndarray:
    """C roundf: exact (v - trunc(v) is exact in FP32), unlike floor(|v| + 0.5)."""
    whole = np.trunc(v)
    return whole + np.sign(v) * (np.abs(v - whole) >= np.float32(0.5))


def q8_0_quantize(fmt: StorageFormat, x: np.ndarray) -> dict[Part, np.ndarray]:
    blocks = _blocks(x)
    d = np.abs(blocks).max(axis=-1) / np.float32(127.0)
    inverse = _inverse(d)
    codes = _round_half_away(blocks * inverse[..., None])
    return {Part.Q: codes.reshape(x.shape).astype(np.float32), Part.SCALE: _to_f16(d, fmt, "scale amax / 127")}


def q8_0_dequantize(fmt: StorageFormat, values: Mapping[Part, np.ndarray], shape) -> np.ndarray:
    return values[Part.Q] * expand_groups(values[Part.SCALE], BLOCK, shape[-1])


def q8_0_error(fmt: StorageFormat, amax: float) -> tuple[float, float]:
    """|d q - x| <= d (1/2 + CODE_SLACK), plus |q| <= 127 times the fp16 rounding of d."""
    d = amax / 127.0 * (1 + U32)
    return 0.0, (d * (0.5 + CODE_SLACK) + 127 * (U16 * d + ETA16)) * (1 + 2 * U32)


# -- GGUF block bytes ---------------------------------------------------------------------------------

def values_from_blocks(scheme: Scheme, raw: np.ndarray) -> tuple[tuple[int, int], dict[Part, np.ndarray]]:
    """(rows, K) and the part values of a GGUF tensor's raw blocks, uint8 (rows, K / 32 * block bytes)."""
    raw = np.asarray(raw)
    size = BLOCK_BYTES[scheme]
    if raw.dtype != np.uint8 or raw.ndim != 2 or raw.shape[1] % size:
        raise ValueError(f"GGUF {GGUF_TYPE_NAMES[scheme]} data is uint8 (rows, blocks * {size}); got "
                         f"{raw.dtype}{list(raw.shape)}")
    rows, count = raw.shape[0], raw.shape[1] // size
    blocks = np.ascontiguousarray(raw).reshape(rows, count, size)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if scheme is Scheme.GGUF_Q8_0:
        codes = blocks[..., 2:].copy().view(np.int8).astype(np.float32)
        return (rows, count * BLOCK), {Part.Q: codes.reshape(rows, -1), Part.SCALE: d}
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    qs = blocks[..., 4:]
    codes = np.concatenate([qs & np.uint8(0xF), qs >> np.uint8(4)], axis=-1).astype(np.float32)
    return (rows, count * BLOCK), {Part.Q: codes.reshape(rows, -1), Part.SCALE: d, Part.MIN: m}


def blocks_from_values(scheme: Scheme, values: Mapping[Part, np.ndarray]) -> np.ndarray:
    """The GGUF raw blocks of part values; the inverse of values_from_blocks."""
    codes = values[Part.Q]
    rows = codes.shape[0]
    count = codes.shape[1] // BLOCK
    d = values[Part.SCALE].astype(np.float16).reshape(rows, count, 1).view(np.uint8)
    if scheme is Scheme.GGUF_Q8_0:
        qs = codes.astype(np.int8).reshape(rows, count, BLOCK).view(np.uint8)
        return np.concatenate([d, qs], axis=-1).reshape(rows, -1)
    m = values[Part.MIN].astype(np.float16).reshape(rows, count, 1).view(np.uint8)
    nibbles = codes.astype(np.uint8).reshape(rows, count, 2, BLOCK // 2)
    qs = nibbles[..., 0, :] | (nibbles[..., 1, :] << np.uint8(4))
    return np.concatenate([d, m, qs], axis=-1).reshape(rows, -1)
