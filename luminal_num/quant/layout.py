"""The vocabulary of storage formats (parts, scale layouts, schemes) and the group reshapes they share."""
from __future__ import annotations

import enum

import numpy as np


class Part(enum.Enum):
    Q = "q"  # element codes
    SCALE = "scale"  # per channel / tile / group
    ZERO = "zero"  # asymmetric int4: value = (q - zero) * scale
    MIN = "min"  # GGUF Q4_1: value = scale * q + min
    TENSOR_SCALE = "tensor_scale"  # NVFP4: one FP32 scale over the whole tensor
    BLOCKS = "blocks"  # GGUF Q4_0/Q5_x/K-quants: the file's raw blocks, scales inside (quant/gguf_blocks.py)


class Layout(enum.Enum):
    NONE = "none"  # no scale
    CHANNEL = "channel"  # one scale per row
    TILE = "tile"  # one per block x block tile (DeepSeek-V3's 128 x 128 weight blocks)
    GROUP = "group"  # one per `block` consecutive elements of a row (along K); the last may be ragged
    BLOCKS = "blocks"  # llama.cpp blocks of `block` elements along K, their scales inside the block bytes


class Scheme(enum.Enum):
    """How values and scales are computed; each has one codec in `luminal_num.quant.schemes`."""

    IEEE = "ieee"  # round to a float format, no scale
    AMAX = "amax"  # scale = amax / max_finite as luminal_num.quant.scales computes it (fp8, int8, MXFP4)
    INT4_SYMMETRIC = "int4_symmetric"  # scale = amax / 7 (f16), q in -8..7
    INT4_ASYMMETRIC = "int4_asymmetric"  # GPTQ/AWQ: scale = (max - min) / 15 (f16), uint4 zero point
    NVFP4 = "nvfp4"  # E2M1 codes, E4M3 scale per 16, FP32 tensor scale
    GGUF_Q4_1 = "gguf_q4_1"  # llama.cpp Q4_1, bit for bit
    GGUF_Q8_0 = "gguf_q8_0"  # llama.cpp Q8_0, bit for bit
    GGUF_BLOCKS = "gguf_blocks"  # llama.cpp Q4_0 / Q5_0 / Q5_1 / Q4_K / Q5_K / Q6_K blocks, kept as stored


def grouped(x: np.ndarray, group: int) -> np.ndarray:
    """(rows, K) -> (rows, ceil(K / group), group), the ragged last group padded with zeros."""
    rows, k = x.shape
    count = -(-k // group)
    if count * group != k:
        x = np.pad(x, [(0, 0), (0, count * group - k)])
    return x.reshape(rows, count, group)


def expand_groups(per_group: np.ndarray, group: int, k: int) -> np.ndarray:
    """(rows, groups) -> (rows, K): each group's value repeated over its elements (ragged end cropped)."""
    return np.repeat(per_group, group, axis=-1)[:, :k]
