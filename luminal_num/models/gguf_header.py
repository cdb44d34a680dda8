"""A GGUF header read byte by byte with every length checked, before the `gguf` reader maps the file.

Why our own reader for the header: `gguf.GGUFReader` parses the whole metadata (a 262,144-token
vocabulary included) before anyone can look at `general.architecture`, fails on a cut file with
whatever numpy or struct says ("cannot reshape array ...", an IndexError), and maps tensor data past
the end of a truncated file. Here:
- the key/value pairs are read in file order and `on_architecture` is called the moment
  `general.architecture` is read (llama.cpp's writer puts it first), so an unsupported model is
  refused after a few hundred bytes;
- a read past the end of the file raises GGUFTruncated naming what was being read and the sizes;
- every tensor's data extent (offset + blocks x block bytes, from the tensor infos) is checked
  against the file size, so a cut in the tensor data is named as truncation, not a reshape error.
Array values are skipped by seeking (numbers) or length-reading (strings): nothing is kept but
scalars, so the check costs milliseconds and no memory.
"""
from __future__ import annotations

import math
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import gguf

MAGIC = b"GGUF"
ARCHITECTURE_KEY = "general.architecture"
ALIGNMENT_KEY = "general.alignment"
DEFAULT_ALIGNMENT = 32

# GGUFValueType -> struct code of the scalar types (8 = string, 9 = array).
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class GGUFError(ValueError):
    """A GGUF file this graph cannot run exactly; the message names the setting."""


class GGUFFormatError(GGUFError):
    """Not a GGUF file this reader can parse; the message says where and why."""


class GGUFTruncated(GGUFFormatError):
    """The file ends before what its header promises."""


@dataclass(frozen=True)
class TensorExtent:
    name: str
    type_name: str      # GGMLQuantizationType name
    start: int          # absolute byte offset of its data
    nbytes: int


@dataclass(frozen=True)
class GGUFHeader:
    version: int
    scalars: dict[str, object]          # scalar and string metadata (arrays are skipped)
    tensors: tuple[TensorExtent, ...]
    data_start: int
    file_size: int


class _Reader:
    def __init__(self, f: BinaryIO, size: int, path: Path):
        self.f, self.size, self.path = f, size, path

    def take(self, n: int, what: str) -> bytes:
        at = self.f.tell()
        if n < 0 or at + n > self.size:
            raise GGUFTruncated(f"{self.path} is truncated: {what} needs bytes {at}..{at + n}, the file has "
                                f"{self.size} bytes")
        return self.f.read(n)

    def skip(self, n: int, what: str) -> None:
        at = self.f.tell()
        if at + n > self.size:
            raise GGUFTruncated(f"{self.path} is truncated: {what} needs bytes {at}..{at + n}, the file has "
                                f"{self.size} bytes")
        self.f.seek(at + n)

    def scalar(self, code: str, what: str):
        return struct.unpack(code, self.take(struct.calcsize(code), what))[0]

    def string(self, what: str) -> str:
        raw = self.take(self.scalar("<Q", what), what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise GGUFFormatError(f"{self.path}: {what} is not UTF-8") from None

    def value(self, kind: int, what: str):
        """A scalar or string value; arrays are skipped (returns None)."""
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind], what)
        if kind == _STRING:
            return self.string(what)
        if kind != _ARRAY:
            raise GGUFFormatError(f"{self.path}: {what} has unknown value type {kind}")
        item, count = self.scalar("<I", what), self.scalar("<Q", what)
        if item in _SCALARS:
            self.skip(count * struct.calcsize(_SCALARS[item]), what)
        elif item == _STRING:
            for i in range(count):
                self.skip(self.scalar("<Q", f"{what}[{i}]"), f"{what}[{i}]")
        else:
            raise GGUFFormatError(f"{self.path}: {what} holds items of type {item} (nested arrays are not read)")
        return None


def read_header(path: str | Path, on_architecture: Callable[[object], None] | None = None) -> GGUFHeader:
    """Parse and check a GGUF file's header; `on_architecture(value)` runs as soon as the architecture
    is read (it raises to refuse the model). GGUFFormatError / GGUFTruncated name what is wrong."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        r = _Reader(f, size, path)
        if size < 4 or r.take(4, "the magic") != MAGIC:
            raise GGUFFormatError(f"{path} is not a readable GGUF file (it does not start with 'GGUF')")
        version = r.scalar("<I", "the version")
        if version not in (2, 3):
            raise GGUFFormatError(f"{path}: GGUF version {version} is not supported (2 and 3 are)")
        tensor_count, kv_count = r.scalar("<Q", "the tensor count"), r.scalar("<Q", "the key count")
        scalars: dict[str, object] = {}
        for i in range(kv_count):
            key = r.string(f"metadata key {i}")
            value = r.value(r.scalar("<I", f"the type of {key}"), f"metadata {key}")
            if value is not None:
                scalars[key] = value
            if key == ARCHITECTURE_KEY and on_architecture is not None:
                on_architecture(value)
        if ARCHITECTURE_KEY not in scalars and on_architecture is not None:
            on_architecture(None)
        infos = []
        for i in range(tensor_count):
            name = r.string(f"tensor name {i}")
            dims = [r.scalar("<Q", f"tensor {name} dims") for _ in range(r.scalar("<I", f"tensor {name} rank"))]
            kind, offset = r.scalar("<I", f"tensor {name} type"), r.scalar("<Q", f"tensor {name} offset")
            infos.append((name, dims, kind, offset))
        alignment = int(scalars.get(ALIGNMENT_KEY, DEFAULT_ALIGNMENT))
        if alignment <= 0:
            raise GGUFFormatError(f"{path}: {ALIGNMENT_KEY}={alignment} is not a positive alignment")
        data_start = -(-f.tell() // alignment) * alignment
    tensors = tuple(_extent(path, name, dims, kind, data_start + offset) for name, dims, kind, offset in infos)
    for t in tensors:
        if t.start + t.nbytes > size:
            raise GGUFTruncated(f"{path} is truncated: tensor {t.name!r} ({t.type_name}) needs bytes "
                                f"{t.start}..{t.start + t.nbytes}, the file has {size} bytes")
    return GGUFHeader(version, scalars, tensors, data_start, size)


def _extent(path: Path, name: str, dims: list[int], kind: int, start: int) -> TensorExtent:
    try:
        qtype = gguf.GGMLQuantizationType(kind)
    except ValueError:
        raise GGUFFormatError(f"{path}: tensor {name!r} has unknown GGML type {kind}") from None
    block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    count = math.prod(dims)
    if dims and dims[0] % block:
        raise GGUFFormatError(f"{path}: tensor {name!r} rows of {dims[0]} are not whole {qtype.name} blocks of {block}")
    return TensorExtent(name, qtype.name, start, count // block * block_bytes)
