"""Hadamard rotation of a Gemm's K dimension (issue 32): x W^T = (x H)(W H)^T for an orthogonal H.

Why: a rotation spreads a few outlier channels over all K, so rounding W (W4 groups) or x (FP8 per
token) loses less. H is block diagonal, K/b copies of the normalized Sylvester-Hadamard matrix
H_b = S_b / sqrt(b) (S_b has +-1 entries, is symmetric, S_b S_b = b I, so H_b H_b^T = I). b is a power
of 4: 1/sqrt(b) = 2^-log4(b) is exact in every float format, so H_b is exact in FP32/BF16/FP8 and a
product with it rounds only in its sums.

The rotated weight W H is a value derived from the weight, computed in FP64 and rounded once to FP32
(`rotated_weight`): the kernel that reads it holds it so or in a storage format (the static analysis
charges the FP32 rounding and the FP64 product's error, `rotation_error`, on top of the format's). The
online rotation x H is an FP32 Gemm (batched over the K/b blocks) reading H_b as a compile-time operand: a
dot product of length b per element (gamma_b), priced and emulated as the Gemm it is. Lowered kernels name a rotated weight with a
`Rotation` (codegen/llir.py `Kernel.rotation`), never by a string to parse.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from types import MappingProxyType
from typing import Mapping

import numpy as np

from .store import WeightArray, content_key, derived_key, keyed
from .weightcache import WEIGHTS

# Block sizes offered: powers of 4 (exact 1/sqrt(b)); 16 rotates too little to matter, 1024 nothing in the
# models here divides by.
ROTATION_BLOCKS: tuple[int, ...] = (64, 256)
U64 = 2.0 ** -53


@dataclass(frozen=True)
class Rotation:
    """The value of a derived EXTERNAL buffer: weight `source` (rows, K) times the block-diagonal H of
    blocks `block` (each row rotated), or with no source H_b itself, the online rotation's (b, b) operand."""

    block: int
    source: str | None = None

    def __post_init__(self):
        if self.block not in ROTATION_BLOCKS:
            raise ValueError(f"Hadamard block {self.block}: offered blocks are {ROTATION_BLOCKS}")

    @property
    def name(self) -> str:
        """The buffer's name in a program (unique per source and block)."""
        return f"hadamard{self.block}" + (f"({self.source})" if self.source is not None else "")

    @property
    def tag_variant(self) -> str:
        """The knob's variant name (search/tags.py `rot:` tags)."""
        return f"hadamard{self.block}"


# the `rot:` knob's variants (search/tags.py): one per offered block
ROTATIONS: Mapping[str, Rotation] = MappingProxyType({Rotation(b).tag_variant: Rotation(b) for b in ROTATION_BLOCKS})


def rotation_block(k: object) -> int | None:
    """The largest offered block dividing K (a static int), or None: that Gemm is not rotated."""
    if not isinstance(k, (int, np.integer)):
        return None
    return next((b for b in sorted(ROTATION_BLOCKS, reverse=True) if k % b == 0 and k >= b), None)


@lru_cache(maxsize=None)
def _hadamard(b: int) -> np.ndarray:
    s = np.ones((1, 1))
    while s.shape[0] < b:
        s = np.block([[s, s], [s, -s]])
    h = s / np.sqrt(float(b))  # a power of 2: exact
    h.flags.writeable = False
    return h


def hadamard(b: int) -> np.ndarray:
    """H_b (float64, read-only): Sylvester's construction, normalized; symmetric and orthogonal."""
    Rotation(b)  # refuses a block that is not offered
    return _hadamard(b)


def rotate_rows(x: np.ndarray, b: int) -> np.ndarray:
    """x (..., K) times the block-diagonal H (K/b blocks H_b), in FP64."""
    x = np.asarray(x, dtype=np.float64)
    k = x.shape[-1]
    if k % b:
        raise ValueError(f"a Hadamard rotation of block {b} needs K divisible by it, got K={k}")
    return (x.reshape(*x.shape[:-1], k // b, b) @ hadamard(b)).reshape(x.shape)


class RotatedWeight(WeightArray):
    """A rotated weight, knowing its source and block: a calibrated fill of it (GPTQ) finds its Hessian from
    the source's (quant/calibration.py). A copy sent to another process is a plain weight."""

    source: np.ndarray | None = None
    block: int = 0


def rotated_weight(w: np.ndarray, b: int) -> RotatedWeight:
    """W H computed in FP64 and rounded once to FP32 (what every kernel reads, or quantizes to its storage
    format), keyed by the source's content key and the block (the same source: the same key). The static
    bound charges its distance to the exact W H (error/static.py: rounding plus rotation_error)."""
    out = rotate_rows(w, b).astype(np.float32).view(RotatedWeight)
    out.flags.writeable = False
    out._key = derived_key("hadamard", b, "f32", content_key(w))
    out.source, out.block = w, b
    return out


def rotation_value(rot: Rotation, feed: Mapping[str, np.ndarray]) -> np.ndarray:
    """The FP32 value a Rotation names, from the weights by name: H_b (exact), or its source rotated (kept
    process-wide in the weight cache, as every value derived from a weight is)."""
    if rot.source is None:
        return keyed(hadamard(rot.block).astype(np.float32), derived_key("hadamard", rot.block, "f32"))
    w = feed[rot.source]
    return WEIGHTS.get(w, ("hadamard", rot.block), lambda: rotated_weight(w, rot.block))


def rotation_error(rot: Rotation, feed: Mapping[str, np.ndarray]) -> np.ndarray:
    """A bound on |rotation_value - exact W H| per element: its FP32 rounding of the FP64 product, plus the
    FP64 product's own error (each entry a sum of b products that are exact, H_b's entries being powers of 2:
    <= gamma_b(u64) * (|W| |H_b|)); 0 for H_b itself."""
    if rot.source is None:
        return np.zeros((rot.block, rot.block))
    w = np.asarray(feed[rot.source], dtype=np.float64)
    b = rot.block
    exact = rotate_rows(w, b)
    rounding = np.abs(np.asarray(rotation_value(rot, feed), dtype=np.float64) - exact)
    gamma = b * U64 / (1 - b * U64)
    mag = (np.abs(w).reshape(*w.shape[:-1], -1, b) @ np.abs(hadamard(b))).reshape(w.shape)  # |W| |H_b|
    return (rounding + gamma * mag) * (1 + 4 * U64)
