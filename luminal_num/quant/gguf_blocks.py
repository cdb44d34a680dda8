"""llama.cpp's Q4_0, Q5_0, Q5_1 and K-quant (Q4_K, Q5_K, Q6_K) blocks, kept as the file holds them.

A weight loaded from such blocks is stored as those very bytes (Part.BLOCKS, uint8 (rows, K / block x
block bytes)): its stored size is the file's, and every reader decodes the same bytes. The decoders are
written from ggml-quants.c (dequantize_row_q4_0 ... dequantize_row_q6_K), in FP32 as it computes:
every element is fl32(fl32(code x scale) + offset) with one (scale, offset) per sub-block, where
- Q4_0: code = nibble - 8, scale = fp16 d, no offset (32 per block);
- Q5_0: code = (nibble | high bit << 4) - 16, scale = fp16 d; Q5_1: code = nibble | high bit << 4,
  scale = fp16 d, offset = fp16 m (32 per block; the 32 high bits in one little-endian uint32);
- Q4_K / Q5_K: 256 per super-block, 8 sub-blocks of 32 with 6-bit scale sc and min m packed in 12 bytes
  (get_scale_min_k4), scale = fl32(d x sc), offset = -fl32(dmin x m) (llama.cpp: d1 * q - m1; the
  negation is exact); Q5_K adds one high bit per element from qh (bit 2j / 2j + 1 of chunk j);
- Q6_K: 256 per super-block, 16 sub-blocks of 16 with int8 scales, code = (4 low | 2 high bits) - 32,
  scale = fl32(d x sc), no offset.
These formats only KEEP blocks (a weight that did not come in them is refused, never re-quantized),
so the value every reader sees is the file's value: their storage error is zero.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from .layout import Part


@dataclass(frozen=True)
class Decoded:
    codes: np.ndarray          # float32 (n_blocks, block)
    scale: np.ndarray          # float32 (n_blocks, block / group)
    offset: np.ndarray | None  # float32 (n_blocks, block / group), added after the product
    group: int


@dataclass(frozen=True)
class BlockType:
    ggml: str            # GGMLQuantizationType name
    block: int           # elements per (super-)block along K
    block_bytes: int
    code_bits: int       # bits of one element's code (scales not counted)
    decode: Callable[[np.ndarray], Decoded]   # uint8 (n_blocks, block_bytes) -> its parts


def _f16(b: np.ndarray) -> np.ndarray:
    """(n, 2) little-endian bytes -> (n, 1) float32."""
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """16 bytes -> 32 codes: byte j holds element j (low nibble) and j + 16 (high nibble)."""
    return np.concatenate([qs & np.uint8(0xF), qs >> np.uint8(4)], axis=-1).astype(np.int32)


def _high_bits_32(qh: np.ndarray) -> np.ndarray:
    """4 bytes (one little-endian uint32) -> bit j of element j, for j < 32."""
    word = np.ascontiguousarray(qh).view("<u4").astype(np.int64)  # (n, 1)
    return ((word >> np.arange(32)) & 1).astype(np.int32)


def _q4_0(b: np.ndarray) -> Decoded:
    return Decoded((_nibbles(b[:, 2:18]) - 8).astype(np.float32), _f16(b[:, 0:2]), None, 32)


def _q5_0(b: np.ndarray) -> Decoded:
    codes = _nibbles(b[:, 6:22]) | (_high_bits_32(b[:, 2:6]) << 4)
    return Decoded((codes - 16).astype(np.float32), _f16(b[:, 0:2]), None, 32)


def _q5_1(b: np.ndarray) -> Decoded:
    codes = _nibbles(b[:, 8:24]) | (_high_bits_32(b[:, 4:8]) << 4)
    return Decoded(codes.astype(np.float32), _f16(b[:, 0:2]), _f16(b[:, 2:4]), 32)


def _scale_min_k4(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml's get_scale_min_k4 for j = 0..7 over the 12 scale bytes: 6-bit (sc, m) per sub-block."""
    s = s.astype(np.int32)
    sc = np.concatenate([s[:, 0:4] & 63, (s[:, 8:12] & 0xF) | ((s[:, 0:4] >> 6) << 4)], axis=-1)
    m = np.concatenate([s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)], axis=-1)
    return sc.astype(np.float32), m.astype(np.float32)


def _k_low_nibbles(qs: np.ndarray) -> np.ndarray:
    """128 bytes in 4 chunks of 32: chunk j's low nibbles are sub-block 2j, its high nibbles 2j + 1."""
    chunks = qs.reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (chunks & np.uint8(0xF)).reshape(-1, 256).astype(np.int32)


def _k_scales(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, m = _scale_min_k4(b[:, 4:16])
    return d * sc, -(dmin * m)


def _q4_k(b: np.ndarray) -> Decoded:
    scale, offset = _k_scales(b)
    return Decoded(_k_low_nibbles(b[:, 16:144]).astype(np.float32), scale, offset, 32)


def _q5_k(b: np.ndarray) -> Decoded:
    scale, offset = _k_scales(b)
    qh = b[:, 16:48].astype(np.int32)  # bit i of qh[l] is the high bit of element 32 i + l
    high = ((qh[:, None, :] >> np.arange(8)[None, :, None]) & 1).reshape(-1, 256)
    return Decoded((_k_low_nibbles(b[:, 48:176]) | (high << 4)).astype(np.float32), scale, offset, 32)


def _q6_k(b: np.ndarray) -> Decoded:
    ql, qh = b[:, 0:128].astype(np.int32), b[:, 128:192].astype(np.int32)
    sc = np.ascontiguousarray(b[:, 192:208]).view(np.int8).astype(np.float32)
    d = _f16(b[:, 208:210])
    halves = []
    for half in range(2):  # 128 elements each: ql[64 h : 64 h + 64], qh[32 h : 32 h + 32]
        low, high = ql[:, 64 * half: 64 * half + 64], qh[:, 32 * half: 32 * half + 32]
        parts = [(low[:, :32] & 0xF) | (((high >> 0) & 3) << 4), (low[:, 32:] & 0xF) | (((high >> 2) & 3) << 4),
                 (low[:, :32] >> 4) | (((high >> 4) & 3) << 4), (low[:, 32:] >> 4) | (((high >> 6) & 3) << 4)]
        halves.append(np.concatenate(parts, axis=-1))
    codes = np.concatenate(halves, axis=-1) - 32
    return Decoded(codes.astype(np.float32), d * sc, None, 16)


BLOCK_TYPES: dict[str, BlockType] = {t.ggml: t for t in (
    BlockType("Q4_0", 32, 18, 4, _q4_0), BlockType("Q5_0", 32, 22, 5, _q5_0), BlockType("Q5_1", 32, 24, 5, _q5_1),
    BlockType("Q4_K", 256, 144, 4, _q4_k), BlockType("Q5_K", 256, 176, 5, _q5_k), BlockType("Q6_K", 256, 210, 6, _q6_k))}


def format_name(ggml: str) -> str:
    """The storage format keeping a GGML type's blocks: 'Q4_K' -> 'gguf_q4_k'."""
    return f"gguf_{ggml.lower()}"


def block_type(format_name_: str) -> BlockType:
    for t in BLOCK_TYPES.values():
        if format_name(t.ggml) == format_name_:
            return t
    raise KeyError(f"{format_name_!r} keeps no GGUF block type (known: {', '.join(BLOCK_TYPES)})")


def as_blocks(t: BlockType, raw: np.ndarray) -> np.ndarray:
    """uint8 (rows, K / block x block bytes) -> (rows x K / block, block bytes), checked."""
    raw = np.asarray(raw)
    if raw.ndim != 2 or raw.shape[1] % t.block_bytes or not np.all(raw == np.round(raw)):
        raise ValueError(f"GGUF {t.ggml} data is (rows, blocks * {t.block_bytes}) bytes; got {raw.dtype}{list(raw.shape)}")
    return np.ascontiguousarray(raw.astype(np.uint8)).reshape(-1, t.block_bytes)


def dequantize(t: BlockType, raw: np.ndarray) -> np.ndarray:
    """float32 (rows, K): every element fl32(fl32(code x scale) + offset), as ggml-quants.c computes it."""
    rows = np.shape(raw)[0]
    d = t.decode(as_blocks(t, raw))
    scale = np.repeat(d.scale, d.group, axis=-1)
    with np.errstate(over="ignore", invalid="ignore"):
        values = d.codes * scale
        if d.offset is not None:
            values = values + np.repeat(d.offset, d.group, axis=-1)
    return values.astype(np.float32).reshape(rows, -1)


def random_blocks(t: BlockType, rows: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Random valid blocks (every code pattern; finite, moderate fp16 scales): test data for a type."""
    if k % t.block:
        raise ValueError(f"{t.ggml}: K = {k} is not a multiple of {t.block}")
    raw = rng.integers(0, 256, (rows * (k // t.block), t.block_bytes), dtype=np.uint8)
    scales = (rng.uniform(0.5, 2.0, (raw.shape[0], 2)) * 10.0 ** rng.uniform(-4, -1, (raw.shape[0], 1)))
    f16_fields = {"Q4_0": (0,), "Q5_0": (0,), "Q5_1": (0, 2), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
    for i, at in enumerate(f16_fields[t.ggml]):
        raw[:, at:at + 2] = scales[:, i:i + 1].astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


# -- the storage codec (quant/storage.py: Scheme.GGUF_BLOCKS) --------------------------------------------

def refuse_quantize(fmt, x: np.ndarray):
    raise ValueError(f"{fmt.name} keeps a GGUF file's {block_type(fmt.name).ggml} blocks as they are; "
                     f"it does not quantize other weights")


def blocks_dequantize(fmt, values, shape) -> np.ndarray:
    return dequantize(block_type(fmt.name), values[Part.BLOCKS]).reshape(shape)


def kept_error(fmt, amax: float) -> tuple[float, float]:
    """Zero: the format holds only weights whose blocks it keeps (refuse_quantize), so every value
    a reader decodes IS the weight."""
    return 0.0, 0.0
