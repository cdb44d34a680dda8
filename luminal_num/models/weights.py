"""Read and write safetensors files with numpy, for every dtype the compiler emits.

Why our own parser: `safetensors.numpy` cannot materialise F8_E4M3 / F8_E5M2 tensors (numpy has no
float8 types), and quantized plans store exactly those. The format is small enough to own: an
8-byte little-endian header length, a JSON header mapping each tensor name to
{dtype, shape, data_offsets=[begin, end)} relative to the data section, then the raw little-endian
bytes. One dtype table drives both directions.
"""

from __future__ import annotations

import json
import struct
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

# safetensors dtype name -> numpy dtype. Declared once; the writer uses the inverse.
SAFETENSORS_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U64": np.dtype(np.uint64),
    "U32": np.dtype(np.uint32),
    "U16": np.dtype(np.uint16),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_NAME_OF_DTYPE: dict[np.dtype, str] = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}

_HEADER_LENGTH = struct.Struct("<Q")
_METADATA_KEY = "__metadata__"
# The reference writer pads the JSON header with spaces so the data section starts 8-aligned.
_DATA_ALIGNMENT = 8


@dataclass(frozen=True)
class TensorEntry:
    """One tensor's header record; `begin`/`end` are byte offsets into the data section."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True)
class SafetensorsHeader:
    """The parsed header: tensor records, free-form string metadata, where the data section starts."""

    tensors: Mapping[str, TensorEntry]
    metadata: Mapping[str, str]
    data_start: int


def _require_little_endian_host() -> None:
    # Arrays are viewed straight from the file bytes with native-order dtypes.
    if sys.byteorder != "little":
        raise NotImplementedError("safetensors data is little-endian; big-endian hosts are not supported")


def _entry_from_json(name: str, record: Mapping[str, object]) -> TensorEntry:
    try:
        dtype = record["dtype"]
        shape = tuple(int(d) for d in record["shape"])
        begin, end = (int(o) for o in record["data_offsets"])
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(f"tensor {name!r}: malformed header record {record!r}") from error
    if dtype not in SAFETENSORS_DTYPES:
        raise ValueError(f"tensor {name!r}: unsupported safetensors dtype {dtype!r}")
    expected = int(np.prod(shape, dtype=np.int64)) * SAFETENSORS_DTYPES[dtype].itemsize
    if end - begin != expected or begin < 0:
        raise ValueError(
            f"tensor {name!r}: data_offsets {[begin, end]} do not hold {dtype} of shape {list(shape)}"
        )
    return TensorEntry(name=name, dtype=dtype, shape=shape, begin=begin, end=end)


def parse_header(raw: bytes | bytearray | memoryview) -> SafetensorsHeader:
    """Parse and validate the header at the start of `raw` (the file's first bytes, or all of it)."""
    if len(raw) < _HEADER_LENGTH.size:
        raise ValueError("not a safetensors file: shorter than the 8-byte header length")
    (header_length,) = _HEADER_LENGTH.unpack_from(raw, 0)
    data_start = _HEADER_LENGTH.size + header_length
    if data_start > len(raw):
        raise ValueError(f"header length {header_length} runs past the end of the file")
    header = json.loads(bytes(raw[_HEADER_LENGTH.size : data_start]).decode("utf-8"))
    if not isinstance(header, dict):
        raise ValueError("safetensors header is not a JSON object")
    metadata = header.pop(_METADATA_KEY, None) or {}
    tensors = {name: _entry_from_json(name, record) for name, record in header.items()}
    return SafetensorsHeader(tensors=tensors, metadata=dict(metadata), data_start=data_start)


def read_header(path: str | Path) -> SafetensorsHeader:
    """Read only the header, without touching the tensor bytes."""
    with open(path, "rb") as f:
        prefix = f.read(_HEADER_LENGTH.size)
        if len(prefix) < _HEADER_LENGTH.size:
            raise ValueError(f"{path}: not a safetensors file")
        (header_length,) = _HEADER_LENGTH.unpack(prefix)
        return parse_header(prefix + f.read(header_length))


def load_safetensors(path: str | Path) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file as a read-only numpy array in its stored dtype.

    BF16 and F8 come back as ml_dtypes arrays. The arrays are views of the file memory-mapped: a
    tensor's pages are read when a stage first touches them and stay in the page cache, which the
    kernel can drop under pressure, so a model larger than the free memory still loads (nothing is
    copied up front).
    """
    _require_little_endian_host()
    path = Path(path)
    if path.stat().st_size == 0:
        raise ValueError(f"{path}: not a safetensors file (empty)")
    buffer = np.memmap(path, dtype=np.uint8, mode="r")
    header = read_header(path)
    data_length = len(buffer) - header.data_start
    arrays: dict[str, np.ndarray] = {}
    for entry in header.tensors.values():
        if entry.end > data_length:
            raise ValueError(f"{path}: tensor {entry.name!r} ends past the end of the file")
        dtype = SAFETENSORS_DTYPES[entry.dtype]
        count = (entry.end - entry.begin) // dtype.itemsize
        flat = np.frombuffer(buffer, dtype=dtype, count=count, offset=header.data_start + entry.begin)
        arrays[entry.name] = flat.reshape(entry.shape)
    return arrays


def save_safetensors(
    path: str | Path,
    tensors: Mapping[str, np.ndarray],
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Write `tensors` in the safetensors layout (names sorted, data 8-aligned, C order)."""
    _require_little_endian_host()
    header: dict[str, object] = {}
    if metadata:
        header[_METADATA_KEY] = {str(k): str(v) for k, v in metadata.items()}
    payloads: list[bytes] = []
    offset = 0
    for name in sorted(tensors):
        array = np.asarray(tensors[name], order="C")  # ascontiguousarray would turn 0-d into 1-d
        if array.dtype not in _NAME_OF_DTYPE:
            raise ValueError(f"tensor {name!r}: dtype {array.dtype} has no safetensors name")
        payload = array.tobytes()
        header[name] = {
            "dtype": _NAME_OF_DTYPE[array.dtype],
            "shape": list(array.shape),
            "data_offsets": [offset, offset + len(payload)],
        }
        payloads.append(payload)
        offset += len(payload)
    header_bytes = json.dumps(header, separators=(",", ":")).encode("utf-8")
    header_bytes += b" " * (-(len(header_bytes) + _HEADER_LENGTH.size) % _DATA_ALIGNMENT)
    with open(path, "wb") as f:
        f.write(_HEADER_LENGTH.pack(len(header_bytes)))
        f.write(header_bytes)
        for payload in payloads:
            f.write(payload)


def save_safetensors_streamed(
    path: str | Path,
    shapes: Mapping[str, tuple[tuple[int, ...], np.dtype]],
    fill,
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Write a safetensors file tensor by tensor without holding them all: `shapes` maps each name to
    (shape, dtype); `fill(name)` yields that tensor's C-order values in consecutive row blocks. The
    file appears only when complete (written beside it, then renamed): an error leaves nothing."""
    _require_little_endian_host()
    path = Path(path)
    header: dict[str, object] = {}
    if metadata:
        header[_METADATA_KEY] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for name in sorted(shapes):
        shape, dtype = shapes[name]
        dtype = np.dtype(dtype)
        if dtype not in _NAME_OF_DTYPE:
            raise ValueError(f"tensor {name!r}: dtype {dtype} has no safetensors name")
        size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        header[name] = {"dtype": _NAME_OF_DTYPE[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    header_bytes = json.dumps(header, separators=(",", ":")).encode("utf-8")
    header_bytes += b" " * (-(len(header_bytes) + _HEADER_LENGTH.size) % _DATA_ALIGNMENT)
    partial = path.with_name(f".{path.name}.partial")
    try:
        with open(partial, "wb") as f:
            f.write(_HEADER_LENGTH.pack(len(header_bytes)))
            f.write(header_bytes)
            for name in sorted(shapes):
                shape, dtype = shapes[name]
                written = 0
                for block in fill(name):
                    block = np.ascontiguousarray(block, dtype=dtype)
                    f.write(memoryview(block).cast("B"))
                    written += block.nbytes
                expected = header[name]["data_offsets"][1] - header[name]["data_offsets"][0]
                if written != expected:
                    raise ValueError(f"tensor {name!r}: fill wrote {written} bytes, its shape needs {expected}")
        partial.replace(path)
    finally:
        partial.unlink(missing_ok=True)
