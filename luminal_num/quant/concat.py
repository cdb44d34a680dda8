"""Weights held in one storage format, concatenated along their rows (a horizontally fused Gemm's B).

Every storage format quantizes a (rows, K) weight with its blocks along K: a row's codes and scales
depend on that row alone (CHANNEL, GROUP), or on tiles of `block` rows (TILE). Concatenating parts
along the rows therefore keeps every stored value and scale of every part exactly, as long as no block
or scale spans two parts: a per-tensor scale (NVFP4's) does, and so does a tile of a part whose rows are
not a whole number of tiles. Concatenating along K (a weight read as x @ W, N on its columns) would
put one row's groups or channel scale across parts. `concat_refusal` says which case refuses and why;
`concat_quantized` / `concat_stored` build the concatenated tensor from the parts' own stored values
(never by quantizing the concatenation: a weight kept in its GGUF blocks stays in them).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from .layout import Layout, Part
from .storage import Quantized, StorageFormat, StoredTensor, storage_format


def concat_refusal(fmt: str | StorageFormat, shapes: Sequence[tuple[int, int]], axis: int = 0) -> str:
    """Why parts of these (rows, K) shapes, held as `fmt`, cannot be one stored tensor concatenated along
    `axis` without changing a stored value or scale; '' when they can."""
    fmt = storage_format(fmt)
    shapes = [tuple(int(d) for d in s) for s in shapes]
    if len(shapes) < 2 or any(len(s) != 2 for s in shapes):
        return f"{fmt.name}: concatenation needs two or more (rows, K) matrices, got {shapes}"
    if axis != 0:
        if fmt.layout is not Layout.NONE:
            return f"{fmt.name}: blocks run along K; concatenating along K would put a row's scales across parts"
        if len({s[0] for s in shapes}) != 1:
            return f"{fmt.name}: parts of {sorted({s[0] for s in shapes})} rows cannot be joined along K"
        return ""
    if len({s[1] for s in shapes}) != 1:
        return f"{fmt.name}: parts have different K {sorted({s[1] for s in shapes})}"
    if Part.TENSOR_SCALE in fmt.parts:
        return f"{fmt.name}: one tensor scale per part; the concatenation would need one over all parts"
    if fmt.layout is Layout.TILE and any(s[0] % fmt.block for s in shapes[:-1]):
        return f"{fmt.name}: {fmt.block}-row tiles would span parts of {[s[0] for s in shapes]} rows"
    return ""


def _check(fmt: StorageFormat, shapes, axis: int) -> None:
    why = concat_refusal(fmt, shapes, axis)
    if why:
        raise ValueError(why)


def concat_quantized(parts: Sequence[Quantized], axis: int = 0) -> Quantized:
    """The parts' values (codes, scales, zero points) side by side: the concatenation's own Quantized."""
    fmt = parts[0].fmt
    if any(p.fmt != fmt for p in parts):
        raise ValueError(f"parts are held in {sorted({p.fmt.name for p in parts})}: one format is needed")
    _check(fmt, [p.shape for p in parts], axis)
    shape = list(parts[0].shape)
    shape[axis] = sum(p.shape[axis] for p in parts)
    return Quantized(fmt, tuple(shape), {part: np.concatenate([p.values[part] for p in parts], axis=axis)
                                         for part in fmt.parts})


def concat_stored(parts: Sequence[StoredTensor]) -> StoredTensor:
    """The parts' stored containers (packed 4-bit rows, scales as stored) concatenated along the rows."""
    fmt = parts[0].fmt
    if any(p.fmt != fmt for p in parts):
        raise ValueError(f"parts are held in {sorted({p.fmt.name for p in parts})}: one format is needed")
    _check(fmt, [p.shape for p in parts], 0)
    shape = (sum(p.shape[0] for p in parts), parts[0].shape[1])
    return StoredTensor(fmt, shape, {part: np.concatenate([np.asarray(p.arrays[part]) for p in parts], axis=0)
                                     for part in fmt.parts})


def concat_widened(parts: Sequence[np.ndarray], fmt: str | StorageFormat, axis: int = 0) -> np.ndarray:
    """float32: the values a kernel reads from the concatenation of `parts` (widened weights, each as its
    own stored tensor dequantizes) once the concatenation is checked legal."""
    fmt = storage_format(fmt)
    _check(fmt, [np.shape(p) for p in parts], axis)
    return np.concatenate([np.asarray(p, dtype=np.float32) for p in parts], axis=axis)
