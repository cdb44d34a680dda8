"""A weight held in a storage format, as every kernel reading it sees it: the plan's storage choice.

A stored weight is an EXTERNAL LLIR buffer with `Kernel.storage` set: in memory it occupies the
format's bytes (packed 4-bit, scales beside it, `StorageFormat.stored_bytes`); a kernel reading it
widens each element on load to the FP32 value `dequantize(quantize(w))`. So a Gemm in bf16 reading an
int8_channel weight is W8A16 (runtime/weight_only.py defines the arithmetic: w^ = RN_bf16(dequant)),
an embedding Gather reading it is a dequantizing gather, and the value every reader sees is one array.

The tensor is quantized as written in the graph, (rows, K) with groups along its last axis: for
Hugging Face Linear weights (out, in) and embedding tables that is the Gemm's K axis. The compiler
converts weights once (`convert`); the widened values are cached per (format, weight content) within a
byte budget (ConvertedWeights).
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Iterator, Mapping

import numpy as np

from ..hlir.store import STREAMING, content_key
from ..hlir.weightcache import DEFAULT_BUDGET_BYTES, ByteLRU
from ..models.gguf import kept_source
from .calibration import Fill, Hessian, hessian_of
from .converted_disk import ConvertedDisk
from .gptq import fills, gptq
from .storage import STORAGE_FORMATS, Quantized, StorageFormat, StoredTensor, from_gguf, gguf_formats, storage_format

# Storage formats the precision rules offer for a 2-D weight: one per kind of recipe (the catalogue
# has more; GGUF blocks are kept only where the source was GGUF, which needs the source's blocks).
_GGUF_FORMAT = {ggml: f.name for ggml, f in gguf_formats().items()}  # GGML type name -> format keeping it
GGUF_KEPT: tuple[str, ...] = tuple(_GGUF_FORMAT.values())  # offered only for weights loaded from such blocks
SEARCHED_STORAGE: tuple[str, ...] = ("bf16", "f16", "f8e4m3_channel", "int8_channel", "int4_g128", "int4_g32_asym",
                                     "mxfp4", "nvfp4")
# "Keep each chunk's own source blocks": the storage choice for a weight every chunk of a group loaded from
# GGUF blocks whose type differs across the chunks (llama.cpp's Q4_K_M holds attn_v / ffn_down in Q6_K in
# some layers, Q4_K or Q5_0 in the others). Each chunk's weight is held in the format of its own blocks
# (held_format), so every chunk adds zero error; the LLIR names that concrete format.
SOURCE_BLOCKS = "gguf_source"


@dataclass(frozen=True)
class SourceBlocks:
    """SOURCE_BLOCKS as the search's tag registry sees a storage choice: zero element error, and the bits
    per weight of the widest kept block type (a ranking must not call it cheaper than any chunk holds it)."""

    name: str = SOURCE_BLOCKS
    keeps_only: bool = True

    def element_error(self, amax: float) -> tuple[float, float]:
        return 0.0, 0.0

    @property
    def nominal_bits_per_weight(self) -> float:
        return max(storage_format(f).nominal_bits_per_weight for f in GGUF_KEPT)


FILL_SEPARATOR = "+"


@dataclass(frozen=True)
class CalibratedChoice:
    """A searched format filled by a calibration-aware rounding ("int4_g128+gptq"): the same format, bytes and
    kernels, other codes. Its per-element error is not the format's round-to-nearest bound (GPTQ moves a
    weight by more than half a step to cancel its neighbours' errors): bounds read the stored values."""

    fmt: StorageFormat
    fill: Fill
    keeps_only: bool = False

    @property
    def name(self) -> str:
        return f"{self.fmt.name}{FILL_SEPARATOR}{self.fill.value}"

    @property
    def nominal_bits_per_weight(self) -> float:
        return self.fmt.nominal_bits_per_weight


# The searched formats a calibrated rounding is offered for: the quantized ones (8 bits or fewer per code)
# that GPTQ fills; a 16-bit float's round-to-nearest error (2^-9 relative) leaves it nothing worth a knob.
CALIBRATED_STORAGE: tuple[str, ...] = tuple(f for f in SEARCHED_STORAGE if fills(storage_format(f))
                                            and storage_format(f).element.bits <= 8)
CALIBRATED_CHOICES: Mapping[str, CalibratedChoice] = MappingProxyType({
    c.name: c for c in (CalibratedChoice(storage_format(f), Fill.GPTQ) for f in CALIBRATED_STORAGE)})

# storage choices a weight's tag may name: every storage format, keeping each chunk's source blocks, and the
# calibrated fills of the searched formats
STORE_CHOICES: Mapping[str, StorageFormat | SourceBlocks | CalibratedChoice] = MappingProxyType(
    {**STORAGE_FORMATS, SOURCE_BLOCKS: SourceBlocks(), **CALIBRATED_CHOICES})


def split_choice(choice: str) -> tuple[str, str | None]:
    """(storage format or SOURCE_BLOCKS, fill or None) of a storage choice's name."""
    name, sep, fill = choice.partition(FILL_SEPARATOR)
    if not sep:
        return choice, None
    if choice not in CALIBRATED_CHOICES:
        raise ValueError(f"storage choice {choice!r}: no calibrated fill of that name "
                         f"(known: {', '.join(CALIBRATED_CHOICES)})")
    return name, Fill(fill).value


def source_format(w) -> str | None:
    """The storage format of the GGUF blocks `w` was loaded from (models.gguf.keep_source), else None:
    storing `w` in it keeps those blocks, with zero added error (they dequantize to exactly `w`)."""
    src = kept_source(w)
    return None if src is None else _GGUF_FORMAT[src.format]


def held_format(choice: str, source: str | None) -> str:
    """The storage format a weight is held in under storage choice `choice` when its source blocks are kept
    as `source` (source_format of the chunk's weight): `choice` itself, or for SOURCE_BLOCKS `source`."""
    if choice != SOURCE_BLOCKS:
        return choice
    if source is None:
        raise ValueError(f"storage choice {SOURCE_BLOCKS!r} keeps a weight's GGUF blocks; this weight has none")
    return source


def _kept(w: np.ndarray, fmt: StorageFormat) -> Quantized | None:
    src = kept_source(w)
    return from_gguf(src.raw, src.format) if src is not None and _GGUF_FORMAT[src.format] == fmt.name else None


def stored_key(name: str, fmt: str | StorageFormat, fill: str | None = None) -> str:
    """The weights-file name of weight `name` stored as `fmt` (one weight may be stored in two formats, or
    filled two ways, when two chunks choose differently)."""
    return f"{name}@{storage_format(fmt).name}" + (f"{FILL_SEPARATOR}{Fill(fill).value}" if fill else "")


def required_hessian(w, fmt: StorageFormat, fill: str | None) -> Hessian | None:
    """The calibration Hessian a fill needs (None for round-to-nearest); one line when none is installed."""
    if fill is None:
        return None
    Fill(fill)
    h = hessian_of(w)
    if h is None:
        raise MissingCalibration(f"a weight of shape {list(np.shape(w))} stored as {fmt.name}{FILL_SEPARATOR}{fill} "
                                 f"needs its calibration Hessian: read it from its plan's weights file, or run it in "
                                 f"the compile that collected its calibration")
    return h


class MissingCalibration(RuntimeError):
    """A calibrated fill asked for outside the compile that has the weight's Hessian (and with no weights file):
    not a verdict on a candidate (runtimes and bounds turn ValueErrors into rejects), a caller's mistake."""


def convert(w, fmt: str | StorageFormat, fill: str | None = None, hessian: Hessian | None = None) -> Quantized:
    """The compile-time conversion of a weight to its storage format (deterministic): a weight loaded
    from GGUF blocks of this format keeps them (models.gguf.keep_source), any other is quantized; with a
    fill (GPTQ), filled under the weight's calibration Hessian (given, or the installed one)."""
    fmt = storage_format(fmt)
    if np.ndim(w) != 2:
        raise ValueError(f"storage format {fmt.name}: weights are (rows, K) matrices, got shape {list(np.shape(w))}")
    if fill is not None:
        h = hessian if hessian is not None else required_hessian(w, fmt, fill)
        return gptq(np.asarray(w, dtype=np.float32), h.matrix, fmt)
    kept = _kept(w, fmt)  # by the weight's own content key (np.asarray would give a copy without it)
    return kept if kept is not None else fmt.quantize(np.asarray(w, dtype=np.float32))


@dataclass(frozen=True, eq=False)
class Conversion:
    """A weight in its storage format as the cache holds it: the format's own packed bytes (not FP32 codes:
    a 1 GB FP32 LM head's int8 codes are 0.26 GB packed, 1 GB as FP32) and the widened FP32 values every
    reader sees, read-only so that readers share this array instead of copying it."""

    packed: StoredTensor
    widened: np.ndarray

    def quantized(self) -> Quantized:
        """The codes and scales as FP32 values (unpacked now: unpack(pack(q)) is q, bit for bit)."""
        return self.packed.fmt.unpack(self.packed)

    @property
    def nbytes(self) -> int:
        return self.widened.nbytes + self.packed.nbytes


class ConvertedWeights:
    """A Conversion per (format, weight content), kept least-recently-used within a byte budget.

    One entry per (format, content), whatever the number of weights: a model with hundreds of matrix
    weights does not thrash it (the old 64-entry LRU held 32 weights, so callers other than the CPU
    backend, which keeps its own copies, re-quantized every weight of a larger model every time).
    A weight finds its entry by its content key (hlir/store.py, computed once), any other array (a
    float64 weight's FP32 rounding) by its bytes' digest.
    """

    def __init__(self, budget_bytes: int = DEFAULT_BUDGET_BYTES):
        self._entries = ByteLRU(budget_bytes)  # (format, content key) -> Conversion
        self.conversions = 0
        self.disk: ConvertedDisk | None = None  # entries also on disk (a compile with a cache folder)

    @contextmanager
    def on_disk(self, folder: str | Path | None) -> Iterator[None]:
        """Conversions read from and written to `folder` while the block runs (None: memory only); forked
        workers started inside it inherit it."""
        previous, self.disk = self.disk, ConvertedDisk(folder) if folder is not None else None
        try:
            yield
        finally:
            self.disk = previous

    def get(self, w: np.ndarray, fmt: StorageFormat, fill: str | None = None,
            hessian: Hessian | None = None) -> Conversion:
        """`fill` (with the Hessian it is filled under, looked up by the caller from the original weight)."""
        key = (fmt.name, content_key(w)) + ((fill, hessian.key) if fill is not None else ())
        hit = self._entries.get(key)
        if hit is not None:
            return hit
        # a weight's own GGUF blocks of this format are read from the model file, never from the disk cache
        kept = _kept(w, fmt) if fill is None else None
        cacheable = self.disk is not None and kept is None
        # room first: the entries it evicts are freed before the conversion allocates beside them
        self._entries.make_room(min(4 * int(np.size(w)) + fmt.stored_bytes(tuple(np.shape(w))),
                                    self._entries.budget_bytes))
        loaded = self.disk.load(key, fmt, tuple(np.shape(w))) if cacheable else None
        if loaded is None:
            q = kept if kept is not None else convert(w, fmt, fill, hessian)
            STREAMING.after_read(w)  # converted: a streaming compile gives the source's pages back (not in a run)
            packed = fmt.pack(q)
            self.conversions += 1
            if cacheable:
                self.disk.save(key, packed)
        else:
            packed, q = loaded
        widened = q.dequantize().astype(np.float32, copy=False)
        del q  # the FP32 codes: only the packed form is kept
        widened.flags.writeable = False
        entry = Conversion(packed, widened)
        self._entries.put(key, entry, entry.nbytes)
        return entry

    @property
    def budget_bytes(self) -> int:
        return self._entries.budget_bytes

    @budget_bytes.setter
    def budget_bytes(self, value: int) -> None:
        self._entries.resize(value)

    @property
    def bytes(self) -> int:
        return self._entries.bytes

    def resize(self, budget_bytes: int) -> None:
        self._entries.resize(budget_bytes)

    def clear(self) -> None:
        self._entries.clear()


CONVERTED = ConvertedWeights()  # the process-wide conversions of weights to their storage formats


def _converted(w, fmt: StorageFormat, fill: str | None = None) -> Conversion:
    hessian = required_hessian(w, fmt, fill)  # by the original weight's content key (its FP32 copy has none)
    f32 = _f32_weight(w)
    if f32 is not w:
        STREAMING.after_read(w)  # read whole into its FP32 copy: a streaming compile gives its pages back
    return CONVERTED.get(f32, fmt, fill, hessian)


def widened(w, fmt: str | StorageFormat, stored: Quantized | StoredTensor | None = None,
            fill: str | None = None) -> np.ndarray:
    """float32 (rows, K): the values a kernel reads from weight `w` held as `fmt` (filled by `fill`, None:
    round-to-nearest). `stored` (loaded from a plan's weights file) is used as is; else `w` is converted
    (cached)."""
    fmt = storage_format(fmt)
    if stored is not None:
        if stored.fmt != fmt:
            raise ValueError(f"stored weight is {stored.fmt.name}, the plan reads {fmt.name}")
        q = stored if isinstance(stored, Quantized) else fmt.unpack(stored)
        return q.dequantize().astype(np.float32)
    return _converted(w, fmt, fill).widened


def stored_values(w, fmt: str | StorageFormat, stored: Quantized | StoredTensor | None = None,
                  fill: str | None = None) -> Quantized:
    """The Quantized a kernel reads weight `w` from: `stored` (a weights file's) or the conversion."""
    fmt = storage_format(fmt)
    if stored is not None:
        return stored if isinstance(stored, Quantized) else fmt.unpack(stored)
    return _converted(w, fmt, fill).quantized()


def _f32_weight(w) -> np.ndarray:
    """The FP32 weight itself (keeping its content key) or, for another dtype, its FP32 rounding."""
    return w if isinstance(w, np.ndarray) and w.dtype == np.float32 else np.asarray(w, dtype=np.float32)


def storage_error(w, fmt: str | StorageFormat, stored: Quantized | StoredTensor | None = None,
                  fill: str | None = None) -> np.ndarray:
    """|widened - w| per element in float64 (exact for FP32 weights; a float64 weight also carries its
    FP32 rounding): the static bound's input error. A filled weight's are its own stored values' (a GPTQ
    weight's error is not its format's round-to-nearest bound)."""
    w64 = np.asarray(w, dtype=np.float64)  # the graph's value; the stored one starts from its FP32 rounding
    w32 = w if isinstance(w, np.ndarray) and w.dtype == np.float32 else w64.astype(np.float32)  # the live array: its entry by identity
    source = w if fill is not None else w32  # a fill's Hessian is found by the original weight's content key
    diff = np.abs(widened(source, fmt, stored, fill).astype(np.float64) - w64)
    STREAMING.after_read(w)  # read whole (its FP64 copy): a streaming compile gives its pages back
    return diff * (1.0 + 2.0 ** -52)  # the float64 subtraction may round (a float64 weight): never undercut


def convert_all(weights: Mapping[str, np.ndarray], wanted: Mapping[str, tuple[str, str]],
                fills: Mapping[str, str] = MappingProxyType({})) -> dict[str, StoredTensor]:
    """Packed stored tensors for a weights file: wanted maps stored_key -> (weight name, format); `fills`
    the stored keys whose codes a calibrated rounding chooses."""
    return {key: _converted(weights[name], storage_format(fmt), fills.get(key)).packed
            for key, (name, fmt) in sorted(wanted.items())}
