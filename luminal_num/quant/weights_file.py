"""The weights file of a plan: every converted weight in one safetensors file, tied to its plan by hash.

Each weight `w` is stored as its parts `w.q`, `w.scale`, `w.zero`, `w.min`, `w.tensor_scale` (as its
StorageFormat declares them; packed 4-bit as uint8, E8M0 scales as their exponent byte). The header
metadata records the file version, the plan's graph hash, the format and logical shape of every
weight, and a SHA-256 over every weight's name, format, shape and part bytes. Loading checks all of
it and refuses a file that does not match (WeightsFileError, one line). Writes go to a temporary file
in the same folder, flushed to disk, then renamed over the target: a reader sees the old file or the
new one, never half of one.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Mapping

import numpy as np

from ..models.weights import SAFETENSORS_DTYPES, parse_header, save_safetensors
from .storage import Part, StorageFormat, StoredTensor, storage_format

VERSION = "1"
_KEY_VERSION, _KEY_GRAPH, _KEY_CONTENT, _KEY_TENSORS = ("luminal_num.weights", "graph_hash", "content_sha256",
                                                        "tensors")


class WeightsFileError(ValueError):
    """A weights file that is damaged or belongs to another plan; the message is one line."""


@dataclass(frozen=True, eq=False)
class WeightsFile:
    graph_hash: str
    content_hash: str
    tensors: Mapping[str, StoredTensor]


def _key(name: str, part: Part) -> str:
    return f"{name}.{part.value}"  # parts have no dot, so the last dot splits a key unambiguously


def content_hash(tensors: Mapping[str, StoredTensor]) -> str:
    """SHA-256 over every weight (sorted by name): name, format, shape, then each part's dtype, shape, bytes."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        stored = tensors[name]
        digest.update(json.dumps([name, stored.fmt.name, list(stored.shape)]).encode())
        for part in stored.fmt.parts:
            array = np.ascontiguousarray(stored.arrays[part])
            digest.update(json.dumps([part.value, array.dtype.str, list(array.shape)]).encode())
            digest.update(array.tobytes())
    return digest.hexdigest()


def save_weights(path: str | Path, tensors: Mapping[str, StoredTensor], graph_hash: str, durable: bool = True) -> str:
    """Write `tensors` atomically; returns the content hash recorded in the file. `durable`: flushed to disk
    before the rename (a cache whose entries are verified on load and can be made again skips it)."""
    path = Path(path)
    if not graph_hash:
        raise ValueError("a weights file needs the graph hash of its plan")
    arrays: dict[str, np.ndarray] = {}
    for name, stored in tensors.items():
        if not name or not isinstance(stored, StoredTensor):
            raise TypeError(f"weights map names to StoredTensor values; got {name!r}: {type(stored).__name__}")
        for part in stored.fmt.parts:
            arrays[_key(name, part)] = stored.arrays[part]
    digest = content_hash(tensors)
    layout = {name: {"format": s.fmt.name, "shape": list(s.shape)} for name, s in sorted(tensors.items())}
    metadata = {_KEY_VERSION: VERSION, _KEY_GRAPH: graph_hash, _KEY_CONTENT: digest,
                _KEY_TENSORS: json.dumps(layout, separators=(",", ":"))}
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        save_safetensors(temporary, arrays, metadata)
        if durable:
            with open(temporary, "rb+") as f:
                os.fsync(f.fileno())
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
    return digest


def _read(path: Path) -> tuple[dict[str, str], dict[str, np.ndarray]]:
    """Header metadata and every array of the file, or a one-line WeightsFileError."""
    try:
        buffer = bytearray(path.read_bytes())
    except OSError as error:
        raise WeightsFileError(f"{path}: cannot read weights file ({error.strerror or error})") from None
    try:
        header = parse_header(buffer)
    except (ValueError, UnicodeDecodeError) as error:
        raise WeightsFileError(f"{path}: not a safetensors weights file ({str(error).splitlines()[0]})") from None
    data = len(buffer) - header.data_start
    need = max((entry.end for entry in header.tensors.values()), default=0)
    if need > data:
        raise WeightsFileError(f"{path}: truncated: the header describes {need} data bytes, the file holds {data}")
    arrays = {}
    for entry in header.tensors.values():
        dtype = SAFETENSORS_DTYPES[entry.dtype]
        flat = np.frombuffer(buffer, dtype=dtype, count=(entry.end - entry.begin) // dtype.itemsize,
                             offset=header.data_start + entry.begin)
        arrays[entry.name] = flat.reshape(entry.shape)
    return dict(header.metadata), arrays


def _layout(path: Path, metadata: Mapping[str, str]) -> dict[str, tuple[StorageFormat, tuple[int, ...]]]:
    if metadata.get(_KEY_VERSION) != VERSION:
        raise WeightsFileError(f"{path}: not a luminal_num weights file of version {VERSION} "
                               f"(found {metadata.get(_KEY_VERSION)!r})")
    try:
        layout = json.loads(metadata[_KEY_TENSORS])
        return {name: (storage_format(record["format"]), tuple(int(d) for d in record["shape"]))
                for name, record in layout.items()}
    except (KeyError, TypeError, ValueError) as error:
        raise WeightsFileError(f"{path}: malformed tensor table in the header ({error})") from None


def load_weights(path: str | Path, graph_hash: str,
                 expected: Mapping[str, tuple[str | StorageFormat, tuple[int, ...]]] | None = None) -> WeightsFile:
    """Load and verify a weights file against its plan's graph hash and (optionally) the weights it expects.

    expected: weight name -> (storage format, logical shape); every one must be in the file with that
    format and shape, and the file must hold no other weight. Any mismatch raises WeightsFileError.
    """
    path = Path(path)
    metadata, arrays = _read(path)
    layout = _layout(path, metadata)
    if metadata.get(_KEY_GRAPH) != graph_hash:
        raise WeightsFileError(f"{path}: written for graph {metadata.get(_KEY_GRAPH)!r}, the plan's graph is "
                               f"{graph_hash!r}")
    tensors: dict[str, StoredTensor] = {}
    for name, (fmt, shape) in layout.items():
        parts = {}
        for part in fmt.parts:
            key = _key(name, part)
            if key not in arrays:
                raise WeightsFileError(f"{path}: tensor {key!r} of weight {name!r} ({fmt.name}) is missing")
            parts[part] = arrays.pop(key)
        try:
            tensors[name] = StoredTensor(fmt, shape, parts)
        except ValueError as error:
            raise WeightsFileError(f"{path}: weight {name!r}: {error}") from None
    if arrays:
        raise WeightsFileError(f"{path}: tensors that belong to no weight: {', '.join(sorted(arrays))}")
    digest = content_hash(tensors)
    if digest != metadata.get(_KEY_CONTENT):
        raise WeightsFileError(f"{path}: content hash {digest[:16]}... does not match the recorded "
                               f"{str(metadata.get(_KEY_CONTENT))[:16]}... (file damaged or edited)")
    if expected is not None:
        _check_expected(path, tensors, expected)
    return WeightsFile(graph_hash, digest, MappingProxyType(tensors))


def _check_expected(path: Path, tensors: Mapping[str, StoredTensor],
                    expected: Mapping[str, tuple[str | StorageFormat, tuple[int, ...]]]) -> None:
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise WeightsFileError(f"{path}: missing weight(s) the plan needs: {', '.join(missing)}")
    extra = sorted(set(tensors) - set(expected))
    if extra:
        raise WeightsFileError(f"{path}: weight(s) the plan does not have: {', '.join(extra)}")
    for name, (fmt, shape) in expected.items():
        stored, fmt, shape = tensors[name], storage_format(fmt), tuple(int(d) for d in shape)
        if stored.fmt != fmt:
            raise WeightsFileError(f"{path}: weight {name!r} is stored as {stored.fmt.name}, the plan says {fmt.name}")
        if stored.shape != shape:
            raise WeightsFileError(f"{path}: weight {name!r} has shape {list(stored.shape)}, the plan says "
                                   f"{list(shape)}")
