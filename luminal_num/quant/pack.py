"""4-bit codes and their packing, two per byte.

Layout (the one MXFP4/NVFP4 hardware and GPTQ-style int4 kernels read): along the last axis, element
2i goes in the low nibble of byte i and element 2i+1 in its high nibble; a row of odd length gets a
zero high nibble in its last byte. Each row is packed on its own, so a row's bytes never straddle two
output channels. llama.cpp's Q4 blocks use another order (element j and j+16 share a byte): the GGUF
readers in `luminal_num.quant.gguf` translate it.

Codes: int4 is two's complement (-8..7 -> 0x8..0x7), uint4 the value itself, E2M1 is S.EE.M
(sign bit 3, exponent bits 2-1 with bias 1, mantissa bit 0; exponent 0 is subnormal: 0 and 0.5).
"""
from __future__ import annotations

import numpy as np

from ..dtypes.formats import F4E2M1, INT4, UINT4, Format


def _e2m1_magnitudes() -> np.ndarray:
    """|value| of the 8 non-negative E2M1 codes, derived from the encoding (not typed in)."""
    codes = np.arange(8)
    exponent, mantissa = codes >> 1, codes & 1
    normal = (1.0 + mantissa / 2.0) * np.exp2(exponent - 1.0)
    return np.where(exponent == 0, mantissa * 0.5, normal).astype(np.float32)


E2M1_MAGNITUDES = _e2m1_magnitudes()  # [0, 0.5, 1, 1.5, 2, 3, 4, 6]
FOUR_BIT_FORMATS = (INT4, UINT4, F4E2M1)


def encode_4bit(values, fmt: Format) -> np.ndarray:
    """Codes (uint8 0..15) of values exactly representable in `fmt`; anything else is an error."""
    values = np.asarray(values, dtype=np.float32)
    if fmt is F4E2M1:
        magnitude = np.abs(values)
        index = np.minimum(np.searchsorted(E2M1_MAGNITUDES, magnitude), 7)
        exact = E2M1_MAGNITUDES[index] == magnitude
        codes = index.astype(np.uint8) | (np.signbit(values).astype(np.uint8) << np.uint8(3))
    elif fmt in (INT4, UINT4):
        low = -8.0 if fmt is INT4 else 0.0
        exact = (values == np.rint(values)) & (values >= low) & (values <= fmt.max_finite)
        codes = (np.where(exact, values, 0.0).astype(np.int8).view(np.uint8) & np.uint8(0xF))
    else:
        raise ValueError(f"{fmt} is not a 4-bit format (4-bit formats: {', '.join(map(str, FOUR_BIT_FORMATS))})")
    if not np.all(exact):
        bad = values[~exact].flat[0]
        raise ValueError(f"{int((~exact).sum())} values are not representable in {fmt} (e.g. {bad!r})")
    return codes.astype(np.uint8)


def decode_4bit(codes, fmt: Format) -> np.ndarray:
    """The float32 values of uint8 codes 0..15 in `fmt` (exact); the inverse of encode_4bit."""
    codes = np.asarray(codes, dtype=np.uint8)
    if codes.size and codes.max() > 15:
        raise ValueError(f"4-bit codes must be 0..15, got {int(codes.max())}")
    if fmt is F4E2M1:
        magnitude = E2M1_MAGNITUDES[codes & np.uint8(7)]
        return np.where(codes & np.uint8(8), -magnitude, magnitude).astype(np.float32)
    if fmt is INT4:
        return ((codes.astype(np.int16) ^ 8) - 8).astype(np.float32)
    if fmt is UINT4:
        return codes.astype(np.float32)
    raise ValueError(f"{fmt} is not a 4-bit format (4-bit formats: {', '.join(map(str, FOUR_BIT_FORMATS))})")


def packed_length(n: int) -> int:
    """Bytes holding n 4-bit codes."""
    return (n + 1) // 2


def pack_nibbles(codes) -> np.ndarray:
    """(..., n) codes 0..15 -> (..., ceil(n/2)) bytes: element 2i low nibble, 2i+1 high nibble."""
    codes = np.asarray(codes, dtype=np.uint8)
    if codes.ndim == 0:
        raise ValueError("pack_nibbles packs along the last axis; got a 0-d array")
    if codes.size and codes.max() > 15:
        raise ValueError(f"4-bit codes must be 0..15, got {int(codes.max())}")
    if codes.shape[-1] % 2:
        codes = np.concatenate([codes, np.zeros(codes.shape[:-1] + (1,), np.uint8)], axis=-1)
    return (codes[..., 0::2] | (codes[..., 1::2] << np.uint8(4))).astype(np.uint8)


def unpack_nibbles(packed, n: int) -> np.ndarray:
    """(..., ceil(n/2)) bytes -> (..., n) codes; the inverse of pack_nibbles for rows of length n."""
    packed = np.asarray(packed)
    if packed.dtype != np.uint8:
        raise TypeError(f"packed 4-bit data is uint8, got {packed.dtype}")
    if packed.ndim == 0 or packed.shape[-1] != packed_length(n):
        raise ValueError(f"{n} codes per row pack into {packed_length(n)} bytes, got shape {packed.shape}")
    codes = np.stack([packed & np.uint8(0xF), packed >> np.uint8(4)], axis=-1)
    return codes.reshape(packed.shape[:-1] + (2 * packed.shape[-1],))[..., :n]
