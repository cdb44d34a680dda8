"""Storage formats of persistent tensors (weights): one frozen declaration per format, a catalogue by name.

A weight is a (rows, K) array: one row per output channel, K (the reduction axis of the Gemm that
reads it) contiguous, as Hugging Face Linear weights, GGUF tensors and every 4-bit kernel lay it out.
Groups and blocks run along K. A stored tensor is a few named arrays (`Part`): the codes `q`, and
as the format needs them `scale`, `zero` (integer zero points), `min` (GGUF Q4_1's offset) and
`tensor_scale` (NVFP4); a weights file names them `<weight>.<part>`.

Two forms of the same data: `Quantized` holds every part as float32 VALUES (exactly representable in
the part's format) and is what the arithmetic reads; `StoredTensor` holds the part CONTAINERS as
stored (4-bit codes packed two per byte, `luminal_num.quant.pack`; E8M0 scales as their exponent
byte). `pack` and `unpack` convert losslessly between them; the stored bytes of a tensor follow from
the declaration alone (`stored_bytes`), which is what the cost model charges.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from types import MappingProxyType
from typing import Callable, Mapping

import numpy as np

from ..dtypes.formats import (BF16, E8M0, F4E2M1, F8E4M3, F8E5M2, F16, F32, INT4, INT8, UINT4, UINT8, Format, Kind)
from . import gguf, gguf_blocks, schemes
from .layout import Layout, Part, Scheme
from .pack import FOUR_BIT_FORMATS, decode_4bit, encode_4bit, pack_nibbles, packed_length, unpack_nibbles


@dataclass(frozen=True)
class StorageFormat:
    """One way to hold a weight: element format, scale layout and formats, the scheme computing them."""

    name: str
    scheme: Scheme
    element: Format
    layout: Layout = Layout.NONE
    block: int = 0  # GROUP: elements per group along K; TILE: tile edge
    scale: Format | None = None
    zero: Format | None = None  # ZERO's format (uint4) or MIN's (f16)
    tensor_scale: Format | None = None

    def __post_init__(self):
        if (self.layout in (Layout.NONE, Layout.BLOCKS)) != (self.scale is None):
            raise ValueError(f"{self.name}: a scale format goes with a scale layout and only with one")
        if (self.layout in (Layout.TILE, Layout.GROUP, Layout.BLOCKS)) != (self.block > 0):
            raise ValueError(f"{self.name}: TILE, GROUP and BLOCKS layouts need block > 0, the others block = 0")
        if (self.layout is Layout.BLOCKS) != (self.scheme is Scheme.GGUF_BLOCKS):
            raise ValueError(f"{self.name}: kept GGUF blocks and only they have the BLOCKS layout")
        if self.element.compute_only:
            raise ValueError(f"{self.name}: {self.element} is a compute rounding, not a storage format")

    # -- structure derived from the declaration -------------------------------------------------
    @property
    def parts(self) -> tuple[Part, ...]:
        if self.layout is Layout.BLOCKS:
            return (Part.BLOCKS,)
        out = [Part.Q] + ([Part.SCALE] if self.scale is not None else [])
        if self.zero is not None:
            out.append(Part.MIN if self.scheme is Scheme.GGUF_Q4_1 else Part.ZERO)
        if self.tensor_scale is not None:
            out.append(Part.TENSOR_SCALE)
        return tuple(out)

    def part_format(self, part: Part) -> Format:
        return {Part.Q: self.element, Part.SCALE: self.scale, Part.ZERO: self.zero, Part.MIN: self.zero,
                Part.TENSOR_SCALE: self.tensor_scale, Part.BLOCKS: UINT8}[part]

    @property
    def bits(self) -> int:
        """Bits per stored element code (scales not included: see stored_bytes)."""
        return gguf_blocks.block_type(self.name).code_bits if self.layout is Layout.BLOCKS else self.element.bits

    @property
    def keeps_only(self) -> bool:
        """True when the format only keeps a GGUF file's blocks (quantize refuses any other weight)."""
        return self.layout is Layout.BLOCKS

    def check_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        shape = tuple(int(d) for d in shape)
        if self.layout is not Layout.NONE and len(shape) != 2:
            raise ValueError(f"{self.name} stores (rows, K) matrices; got shape {shape}")
        if self.scheme in (Scheme.GGUF_Q4_1, Scheme.GGUF_Q8_0, Scheme.GGUF_BLOCKS) and shape[-1] % self.block:
            raise ValueError(f"{self.name}: llama.cpp blocks are {self.block} wide; K = {shape[-1]} is not a multiple")
        return shape

    def part_shape(self, part: Part, shape: tuple[int, ...]) -> tuple[int, ...]:
        """Shape of the part's VALUES for a tensor of `shape`."""
        shape = self.check_shape(shape)
        if part is Part.Q:
            return shape
        if part is Part.TENSOR_SCALE:
            return ()
        rows, k = shape
        if self.layout is Layout.BLOCKS:
            return rows, k // self.block * gguf_blocks.block_type(self.name).block_bytes
        if self.layout is Layout.CHANNEL:
            return rows, 1
        if self.layout is Layout.TILE:
            return -(-rows // self.block), -(-k // self.block)
        return rows, -(-k // self.block)

    def container(self, part: Part) -> np.dtype:
        """The dtype a part is stored in: packed 4-bit and E8M0 exponents are bytes."""
        fmt = self.part_format(part)
        return np.dtype(np.uint8) if fmt in FOUR_BIT_FORMATS or fmt is E8M0 else fmt.storage

    def container_shape(self, part: Part, shape: tuple[int, ...]) -> tuple[int, ...]:
        values = self.part_shape(part, shape)
        if self.part_format(part) in FOUR_BIT_FORMATS:
            return values[:-1] + (packed_length(values[-1]),)
        return values

    def stored_bytes(self, shape: tuple[int, ...]) -> int:
        """Bytes the tensor occupies in memory: packed 4-bit is half a byte, scales at their stored size."""
        return sum(math.prod(self.container_shape(p, shape)) * self.container(p).itemsize for p in self.parts)

    def bits_per_weight(self, shape: tuple[int, ...]) -> float:
        return 8.0 * self.stored_bytes(shape) / max(1, math.prod(self.check_shape(shape)))

    @property
    def nominal_bits_per_weight(self) -> float:
        """Bits per weight of a 128-row matrix whose K is a whole number of 128s and of this format's
        blocks: the shape-free figure a ranking compares formats by (a fixed 128 x 128 probe is no
        legal shape for llama.cpp's 256-wide K-quant blocks)."""
        return self.bits_per_weight((128, math.lcm(128, self.block or 1)))

    # -- the codec (luminal_num.quant.schemes) ------------------------------------------------------
    def quantize(self, x) -> "Quantized":
        """x (a float weight) in this format; deterministic, the compile-time conversion."""
        x = np.asarray(x, dtype=np.float32)
        shape = self.check_shape(x.shape)
        if not np.all(np.isfinite(x)):
            raise ValueError(f"{self.name}: weights must be finite ({int((~np.isfinite(x)).sum())} are not)")
        values = CODECS[self.scheme].quantize(self, x)
        for part, v in values.items():  # integer codes have no -0 (rint of a small negative gives one)
            if self.part_format(part).kind is Kind.INT:
                # in place where the codes are the codec's own array (a 1 GB LM head: no second copy)
                owned = v.flags.writeable and v.dtype == np.float32 and not np.may_share_memory(v, x)
                values[part] = np.add(v, np.float32(0.0), out=v) if owned else v + np.float32(0.0)
        quantized = Quantized(self, shape, values)
        with np.errstate(over="ignore"):
            widened = quantized.dequantize()
            if not np.all(np.isfinite(widened)):  # scaled codes next to FP32's max
                raise ValueError(f"{self.name}: weights near FP32's max ({float(np.abs(x).max())!r}) would "
                                 f"dequantize to infinity")
        object.__setattr__(quantized, "_widened", widened)  # the check's array, handed to the first reader
        return quantized

    def dequantize(self, q: "Quantized") -> np.ndarray:
        """The float32 values a kernel reading this format widens the codes to (defined per scheme)."""
        return CODECS[self.scheme].dequantize(self, q.values, q.shape)

    def element_error(self, amax: float) -> tuple[float, float]:
        """(rel, abs): |dequantize(quantize(w)) - w| <= rel |w| + abs for every w of a tensor with max |w| <= amax."""
        if not amax >= 0:
            raise ValueError(f"amax must be >= 0, got {amax!r}")
        return CODECS[self.scheme].element_error(self, float(amax))

    def pack(self, q: "Quantized") -> "StoredTensor":
        arrays = {p: _to_container(q.values[p], self.part_format(p)) for p in self.parts}
        return StoredTensor(self, q.shape, arrays)

    def unpack(self, stored: "StoredTensor") -> "Quantized":
        values = {}
        for p in self.parts:
            fmt, data = self.part_format(p), stored.arrays[p]
            values[p] = _from_container(data, fmt, self.part_shape(p, stored.shape))
        return Quantized(self, stored.shape, values)

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True)
class Codec:
    """A scheme's arithmetic: quantize(fmt, x) -> part values, dequantize(fmt, values, shape), element_error."""

    quantize: Callable[[StorageFormat, np.ndarray], dict[Part, np.ndarray]]
    dequantize: Callable[[StorageFormat, Mapping[Part, np.ndarray], tuple[int, ...]], np.ndarray]
    element_error: Callable[[StorageFormat, float], tuple[float, float]]


CODECS: Mapping[Scheme, Codec] = MappingProxyType({
    Scheme.IEEE: Codec(schemes.ieee_quantize, schemes.ieee_dequantize, schemes.ieee_error),
    Scheme.AMAX: Codec(schemes.amax_quantize, schemes.amax_dequantize, schemes.amax_error),
    Scheme.INT4_SYMMETRIC: Codec(schemes.int4_symmetric_quantize, schemes.int4_symmetric_dequantize,
                                 schemes.int4_symmetric_error),
    Scheme.INT4_ASYMMETRIC: Codec(schemes.int4_asymmetric_quantize, schemes.int4_asymmetric_dequantize,
                                  schemes.int4_asymmetric_error),
    Scheme.NVFP4: Codec(schemes.nvfp4_quantize, schemes.nvfp4_dequantize, schemes.nvfp4_error),
    Scheme.GGUF_Q4_1: Codec(gguf.q4_1_quantize, gguf.q4_1_dequantize, gguf.q4_1_error),
    Scheme.GGUF_Q8_0: Codec(gguf.q8_0_quantize, gguf.q8_0_dequantize, gguf.q8_0_error),
    Scheme.GGUF_BLOCKS: Codec(gguf_blocks.refuse_quantize, gguf_blocks.blocks_dequantize, gguf_blocks.kept_error),
})


def _check_parts(fmt: StorageFormat, shape: tuple[int, ...], arrays: Mapping[Part, np.ndarray], *, stored: bool):
    if set(arrays) != set(fmt.parts):
        raise ValueError(f"{fmt.name} has parts {[p.value for p in fmt.parts]}, got {[p.value for p in arrays]}")
    for p in fmt.parts:
        want_shape = fmt.container_shape(p, shape) if stored else fmt.part_shape(p, shape)
        want_dtype = fmt.container(p) if stored else np.dtype(np.float32)
        got = arrays[p]
        if tuple(got.shape) != want_shape or got.dtype != want_dtype:
            raise ValueError(f"{fmt.name} part {p.value!r} of a {list(shape)} tensor is {want_dtype}{list(want_shape)}, "
                             f"got {got.dtype}{list(got.shape)}")


@dataclass(frozen=True, eq=False)
class Quantized:
    """Every part as float32 values exactly representable in its format."""

    fmt: StorageFormat
    shape: tuple[int, ...]
    values: Mapping[Part, np.ndarray]

    def __post_init__(self):
        object.__setattr__(self, "values", MappingProxyType(dict(self.values)))
        _check_parts(self.fmt, self.shape, self.values, stored=False)

    def dequantize(self) -> np.ndarray:
        """The widened values. The conversion's finiteness check already computed them once: the first call
        takes that array instead of computing a second full-size copy (an IEEE format's are its codes array)."""
        widened = self.__dict__.pop("_widened", None)
        return widened if widened is not None else self.fmt.dequantize(self)


@dataclass(frozen=True, eq=False)
class StoredTensor:
    """Every part in its storage container, as written to and read from a weights file."""

    fmt: StorageFormat
    shape: tuple[int, ...]
    arrays: Mapping[Part, np.ndarray]

    def __post_init__(self):
        object.__setattr__(self, "arrays", MappingProxyType(dict(self.arrays)))
        _check_parts(self.fmt, self.shape, self.arrays, stored=True)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())


CHECK_BLOCK = 1 << 22  # elements checked or packed at a time: a 1 GB head's temporaries are 16 MB, not 1-5 GB


def _by_row_blocks(values: np.ndarray, width: int, dtype, each) -> np.ndarray:
    """each(block of rows) over (rows, ...) `values`, CHECK_BLOCK elements of rows at a time, into one array of
    last axis `width`: a 4-bit format's encode and nibble packing hold ~5 bytes of temporaries per value."""
    if values.ndim < 2 or values.size <= CHECK_BLOCK:
        return each(values)
    out = np.empty(values.shape[:-1] + (width,), dtype)
    step = max(1, CHECK_BLOCK // max(1, values[0].size))
    for i in range(0, values.shape[0], step):
        out[i:i + step] = each(values[i:i + step])
    return out


def _to_container(values: np.ndarray, fmt: Format) -> np.ndarray:
    if fmt in FOUR_BIT_FORMATS:
        return _by_row_blocks(np.asarray(values), packed_length(np.shape(values)[-1]), np.uint8,
                              lambda rows: pack_nibbles(encode_4bit(rows, fmt)))
    if fmt is E8M0:
        mantissa, exponent = np.frexp(values.astype(np.float64))
        if not (np.all(mantissa == 0.5) and np.all(values >= E8M0.min_normal) and np.all(values <= E8M0.max_finite)):
            raise ValueError(f"{fmt} stores powers of two in [2^-127, 2^127] only")
        return (exponent - 1 + 127).astype(np.uint8)  # the E8M0 byte is the biased exponent
    stored = values.astype(fmt.storage)
    if not _round_trips(stored, values):
        raise ValueError(f"values are not representable in {fmt}: packing would change them")
    return stored


def _round_trips(stored: np.ndarray, values: np.ndarray) -> bool:
    """stored widened back to float32 equals values, a block at a time (np.array_equal's semantics)."""
    if stored.shape != values.shape:
        return False
    a, b = stored.reshape(-1), np.asarray(values).reshape(-1)
    return all(np.array_equal(a[i:i + CHECK_BLOCK].astype(np.float32), b[i:i + CHECK_BLOCK])
               for i in range(0, a.size, CHECK_BLOCK))


def _from_container(data: np.ndarray, fmt: Format, shape: tuple[int, ...]) -> np.ndarray:
    if fmt in FOUR_BIT_FORMATS:
        return _by_row_blocks(np.asarray(data), shape[-1], np.float32,
                              lambda rows: decode_4bit(unpack_nibbles(rows, shape[-1]), fmt))
    if fmt is E8M0:
        if np.any(data == 0xFF):
            raise ValueError("E8M0 byte 0xFF is NaN: not a scale")
        return np.ldexp(np.float32(1.0), data.astype(np.int32) - 127).astype(np.float32)
    return data.astype(np.float32)


# -- the catalogue ----------------------------------------------------------------------------------

INT4_GROUPS = (32, 64, 128)
MXFP4_GROUP = 32
NVFP4_GROUP = 16
GGUF_BLOCK = 32
FP8_TILE = 128
FP8_GROUPS = (16, 32, 64, 128)


def _catalogue() -> dict[str, StorageFormat]:
    formats = [StorageFormat(f.name, Scheme.IEEE, f) for f in (F32, BF16, F16)]
    for fp8 in (F8E4M3, F8E5M2):
        formats.append(StorageFormat(f"{fp8.name}_channel", Scheme.AMAX, fp8, Layout.CHANNEL, scale=F32))
        formats.append(StorageFormat(f"{fp8.name}_block{FP8_TILE}", Scheme.AMAX, fp8, Layout.TILE, FP8_TILE, F32))
    for g in FP8_GROUPS:  # one FP32 scale per g elements of a row: per head for a KV-cache row of g-wide heads
        formats.append(StorageFormat(f"{F8E4M3.name}_g{g}", Scheme.AMAX, F8E4M3, Layout.GROUP, g, F32))
    formats.append(StorageFormat("int8_channel", Scheme.AMAX, INT8, Layout.CHANNEL, scale=F32))
    for g in INT4_GROUPS:
        formats.append(StorageFormat(f"int4_g{g}", Scheme.INT4_SYMMETRIC, INT4, Layout.GROUP, g, F16))
        formats.append(StorageFormat(f"int4_g{g}_asym", Scheme.INT4_ASYMMETRIC, UINT4, Layout.GROUP, g, F16, UINT4))
    formats.append(StorageFormat("mxfp4", Scheme.AMAX, F4E2M1, Layout.GROUP, MXFP4_GROUP, E8M0))
    formats.append(StorageFormat("nvfp4", Scheme.NVFP4, F4E2M1, Layout.GROUP, NVFP4_GROUP, F8E4M3,
                                 tensor_scale=F32))
    formats.append(StorageFormat("gguf_q4_1", Scheme.GGUF_Q4_1, UINT4, Layout.GROUP, GGUF_BLOCK, F16, F16))
    formats.append(StorageFormat("gguf_q8_0", Scheme.GGUF_Q8_0, INT8, Layout.GROUP, GGUF_BLOCK, F16))
    for t in gguf_blocks.BLOCK_TYPES.values():  # kept as the file's bytes (decoded by quant/gguf_blocks.py)
        formats.append(StorageFormat(gguf_blocks.format_name(t.ggml), Scheme.GGUF_BLOCKS, UINT8, Layout.BLOCKS, t.block))
    return {f.name: f for f in formats}


STORAGE_FORMATS: Mapping[str, StorageFormat] = MappingProxyType(_catalogue())


def storage_format(name: str | StorageFormat) -> StorageFormat:
    """Look a storage format up by name; a KeyError lists the known names."""
    if isinstance(name, StorageFormat):
        return name
    try:
        return STORAGE_FORMATS[name]
    except KeyError:
        raise KeyError(f"unknown storage format {name!r}; known: {', '.join(STORAGE_FORMATS)}") from None


def gguf_formats() -> dict[str, StorageFormat]:
    """GGMLQuantizationType name -> the storage format keeping its blocks exactly."""
    out = {gguf.GGUF_TYPE_NAMES[f.scheme]: f for f in STORAGE_FORMATS.values() if f.scheme in gguf.GGUF_TYPE_NAMES}
    out.update({t: STORAGE_FORMATS[gguf_blocks.format_name(t)] for t in gguf_blocks.BLOCK_TYPES})
    return out


def from_gguf(raw: np.ndarray, type_name: str) -> Quantized:
    """A GGUF tensor's raw blocks (uint8 (rows, bytes per row), its GGMLQuantizationType name) kept exactly."""
    by_type = gguf_formats()
    if type_name not in by_type:
        raise ValueError(f"GGUF type {type_name!r} is not kept exactly (kept: {', '.join(by_type)})")
    fmt = by_type[type_name]
    if fmt.layout is Layout.BLOCKS:
        t = gguf_blocks.BLOCK_TYPES[type_name]
        blocks = gguf_blocks.as_blocks(t, raw)
        rows = np.shape(raw)[0]
        return Quantized(fmt, (rows, blocks.shape[0] // rows * t.block), {Part.BLOCKS: blocks.reshape(rows, -1)
                                                                         .astype(np.float32)})
    shape, values = gguf.values_from_blocks(fmt.scheme, raw)
    return Quantized(fmt, shape, values)


def to_gguf(q: Quantized) -> np.ndarray:
    """The GGUF raw blocks of a kept GGUF tensor (the inverse of from_gguf)."""
    if q.fmt.layout is Layout.BLOCKS:
        return q.values[Part.BLOCKS].astype(np.uint8)
    if q.fmt.scheme not in gguf.GGUF_TYPE_NAMES:
        raise ValueError(f"{q.fmt.name} has no GGUF block layout")
    return gguf.blocks_from_values(q.fmt.scheme, q.values)
