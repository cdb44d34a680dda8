"""A weight held in a storage format, as every kernel reading it sees it: the plan's storage choice.

A stored weight is an EXTERNAL LLIR buffer with `Kernel.storage` set: in memory it occupies the
format's bytes (packed 4-bit, scales beside it, `StorageFormat.stored_bytes`); a kernel reading it
widens each element on load to the FP32 value `dequantize(quantize(w))`. So a Gemm in bf16 reading an
int8_channel weight is W8A16 (runtime/weight_only.py defines the arithmetic: w^ = RN_bf16(dequant)),
an embedding Gather reading it is a dequantizing gather, and the value every reader sees is one array.

The tensor is quantized as written in the graph, (rows, K) with groups along its last axis: for
Hugging Face Linear weights (out, in) and embedding tables that is the Gemm's K axis. The compiler
converts weights once (`convert`); the widened values are cached per (format, source array).
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Mapping

import numpy as np

from ..models.gguf import kept_source
from .gguf import GGUF_TYPE_NAMES
from .storage import STORAGE_FORMATS, Quantized, StorageFormat, StoredTensor, from_gguf, storage_format

# Storage formats the precision rules offer for a 2-D weight: one per kind of recipe (the catalogue
# has more; GGUF blocks are kept only where the source was GGUF, which needs the source's blocks).
GGUF_KEPT: tuple[str, ...] = ("gguf_q4_1", "gguf_q8_0")  # offered only for weights loaded from such blocks
SEARCHED_STORAGE: tuple[str, ...] = ("bf16", "f16", "f8e4m3_channel", "int8_channel", "int4_g128", "int4_g32_asym",
                                     "mxfp4", "nvfp4")
_GGUF_FORMAT = {GGUF_TYPE_NAMES[f.scheme]: f.name for f in STORAGE_FORMATS.values() if f.scheme in GGUF_TYPE_NAMES}
_CACHE_SIZE = 64
_CACHE: "OrderedDict[tuple, tuple[np.ndarray, Quantized, np.ndarray]]" = OrderedDict()


def source_format(w) -> str | None:
    """The storage format of the GGUF blocks `w` was loaded from (models.gguf.keep_source), else None:
    storing `w` in it keeps those blocks, with zero added error (they dequantize to exactly `w`)."""
    src = kept_source(w)
    return None if src is None else _GGUF_FORMAT[src.format]


def _kept(w: np.ndarray, fmt: StorageFormat) -> Quantized | None:
    src = kept_source(w)
    return from_gguf(src.raw, src.format) if src is not None and _GGUF_FORMAT[src.format] == fmt.name else None


def stored_key(name: str, fmt: str | StorageFormat) -> str:
    """The weights-file name of weight `name` stored as `fmt` (one weight may be stored in two formats
    when two chunks choose differently)."""
    return f"{name}@{storage_format(fmt).name}"


def convert(w, fmt: str | StorageFormat) -> Quantized:
    """The compile-time conversion of a weight to its storage format (deterministic): a weight loaded
    from GGUF blocks of this format keeps them (models.gguf.keep_source), any other is quantized."""
    fmt = storage_format(fmt)
    w = np.asarray(w, dtype=np.float32)
    if w.ndim != 2:
        raise ValueError(f"storage format {fmt.name}: weights are (rows, K) matrices, got shape {list(w.shape)}")
    kept = _kept(w, fmt)
    return kept if kept is not None else fmt.quantize(w)


def _converted(w: np.ndarray, fmt: StorageFormat) -> tuple[Quantized, np.ndarray]:
    """Cached by the source array's identity, then by its content (static bounds pass fresh copies)."""
    key = (fmt.name, id(w))
    hit = _CACHE.get(key)
    if hit is not None and hit[0] is w:
        _CACHE.move_to_end(key)
        return hit[1], hit[2]
    content = (fmt.name, w.shape, hashlib.blake2b(np.ascontiguousarray(w).tobytes(), digest_size=16).digest())
    hit = _CACHE.get(content)
    if hit is not None and np.array_equal(hit[0], w):
        _CACHE.move_to_end(content)
        return hit[1], hit[2]
    q = convert(w, fmt)
    widened = q.dequantize().astype(np.float32)
    _CACHE[key] = _CACHE[content] = (w, q, widened)
    while len(_CACHE) > _CACHE_SIZE:
        _CACHE.popitem(last=False)
    return q, widened


def widened(w, fmt: str | StorageFormat, stored: Quantized | StoredTensor | None = None) -> np.ndarray:
    """float32 (rows, K): the values a kernel reads from weight `w` held as `fmt`. `stored` (loaded from a
    plan's weights file) is used as is; else `w` is converted (cached)."""
    fmt = storage_format(fmt)
    if stored is not None:
        if stored.fmt != fmt:
            raise ValueError(f"stored weight is {stored.fmt.name}, the plan reads {fmt.name}")
        q = stored if isinstance(stored, Quantized) else fmt.unpack(stored)
        return q.dequantize().astype(np.float32)
    w = w if isinstance(w, np.ndarray) and w.dtype == np.float32 else np.asarray(w, dtype=np.float32)
    return _converted(w, fmt)[1]


def storage_error(w, fmt: str | StorageFormat, stored: Quantized | StoredTensor | None = None) -> np.ndarray:
    """|widened - w| per element in float64 (exact for FP32 weights; a float64 weight also carries its
    FP32 rounding): the static bound's input error."""
    w64 = np.asarray(w, dtype=np.float64)  # the graph's value; the stored one starts from its FP32 rounding
    diff = np.abs(widened(w64.astype(np.float32), fmt, stored).astype(np.float64) - w64)
    return diff * (1.0 + 2.0 ** -52)  # the float64 subtraction may round (a float64 weight): never undercut


def convert_all(weights: Mapping[str, np.ndarray], wanted: Mapping[str, tuple[str, str]]) -> dict[str, StoredTensor]:
    """Packed stored tensors for a weights file: wanted maps stored_key -> (weight name, format)."""
    return {key: storage_format(fmt).pack(_converted(np.asarray(weights[name], dtype=np.float32),
                                                     storage_format(fmt))[0])
            for key, (name, fmt) in sorted(wanted.items())}
