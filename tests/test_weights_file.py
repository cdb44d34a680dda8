"""The weights file: quantize -> pack -> save -> load -> unpack is lossless for every storage format, the
file is plain safetensors (read back by the safetensors package itself), writes are atomic, and every
mismatch with the plan is refused with one line."""
from __future__ import annotations

import json
import os
from pathlib import Path

import gguf
import numpy as np
from kept_blocks import kept_sample
import pytest
from safetensors import safe_open

from luminal_num.models import weights as safetensors_io
from luminal_num.quant import STORAGE_FORMATS, Part, from_gguf
from luminal_num.quant import weights_file as wf
from luminal_num.quant.weights_file import WeightsFileError, load_weights, save_weights

GRAPH = "graph-3f9c"


def converted(seed: int = 0) -> dict:
    """One weight per storage format, named like a model's (dots in the names)."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, fmt in STORAGE_FORMATS.items():
        k = 192 if name.startswith("gguf") else 130
        x = (rng.standard_normal((5, k)) * 0.05).astype(np.float32)
        q = kept_sample(fmt, 5, k, seed) if fmt.keeps_only else fmt.quantize(x)
        out[f"model.layers.0.{name}.weight"] = fmt.pack(q)
    return out


def expected_of(tensors) -> dict:
    return {name: (s.fmt, s.shape) for name, s in tensors.items()}


def test_quantize_pack_save_load_unpack_is_lossless(tmp_path):
    tensors = converted()
    quantized = {name: s.fmt.unpack(s) for name, s in tensors.items()}
    path = tmp_path / "plan.weights.safetensors"
    digest = save_weights(path, tensors, GRAPH)
    loaded = load_weights(path, GRAPH, expected_of(tensors))
    assert loaded.content_hash == digest and loaded.graph_hash == GRAPH
    assert set(loaded.tensors) == set(tensors)
    for name, stored in loaded.tensors.items():
        back = stored.fmt.unpack(stored)
        for part in stored.fmt.parts:
            assert stored.arrays[part].dtype == tensors[name].arrays[part].dtype
            assert back.values[part].tobytes() == quantized[name].values[part].tobytes(), (name, part)
        assert np.array_equal(back.dequantize(), quantized[name].dequantize())


def test_the_file_is_plain_safetensors_with_named_parts_and_metadata(tmp_path):
    tensors = converted()
    path = tmp_path / "w.safetensors"
    save_weights(path, tensors, GRAPH)
    with safe_open(str(path), framework="np") as f:  # the safetensors package's own reader
        metadata = f.metadata()
        keys = set(f.keys())
        asym = "model.layers.0.int4_g32_asym.weight"
        packed = f.get_tensor(f"{asym}.q")
        zero = f.get_tensor(f"{asym}.zero")
    assert {f"{asym}.q", f"{asym}.scale", f"{asym}.zero", "model.layers.0.nvfp4.weight.tensor_scale",
            "model.layers.0.gguf_q4_1.weight.min"} <= keys
    assert packed.dtype == np.uint8 and packed.shape == (5, 65)  # 130 codes -> 65 bytes per row
    assert np.array_equal(packed, tensors[asym].arrays[Part.Q]) and np.array_equal(zero, tensors[asym].arrays[Part.ZERO])
    layout = json.loads(metadata["tensors"])
    assert layout[asym] == {"format": "int4_g32_asym", "shape": [5, 130]}
    assert metadata["graph_hash"] == GRAPH and len(metadata["content_sha256"]) == 64
    assert os.path.getsize(path) >= sum(s.nbytes for s in tensors.values())


def test_a_kept_gguf_tensor_survives_the_file_exactly(tmp_path, smollm2_gguf):
    reader = smollm2_gguf
    tensor = next(t for t in reader.tensors if t.tensor_type.name == "Q4_1")
    kept = from_gguf(np.asarray(tensor.data), "Q4_1")
    path = tmp_path / "kept.safetensors"
    save_weights(path, {tensor.name: kept.fmt.pack(kept)}, GRAPH)
    loaded = load_weights(path, GRAPH, {tensor.name: ("gguf_q4_1", kept.shape)}).tensors[tensor.name]
    assert np.array_equal(loaded.fmt.unpack(loaded).dequantize(), gguf.quants.dequantize(tensor.data, tensor.tensor_type))


def test_writes_are_atomic(tmp_path, monkeypatch):
    path = tmp_path / "w.safetensors"
    first = converted(seed=1)
    save_weights(path, first, GRAPH)
    before = path.read_bytes()

    def half_written(target, tensors, metadata=None):
        Path(target).write_bytes(b"\x10\x00\x00\x00")  # a crash after a few bytes
        raise OSError("disk full")

    monkeypatch.setattr(wf, "save_safetensors", half_written)
    with pytest.raises(OSError, match="disk full"):
        save_weights(path, converted(seed=2), GRAPH)
    assert path.read_bytes() == before  # the old file, untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w.safetensors"]  # no temporary left behind
    load_weights(path, GRAPH, expected_of(first))


def _refusal(call) -> str:
    with pytest.raises(WeightsFileError) as caught:
        call()
    message = str(caught.value)
    assert "\n" not in message and len(message) < 400
    return message


def _rewrite(path: Path, drop: str | None = None, metadata_edit=None):
    """Rewrite a weights file with safetensors_io (bypassing save_weights' checks)."""
    header = safetensors_io.read_header(path)
    arrays = safetensors_io.load_safetensors(path)
    metadata = dict(header.metadata)
    if metadata_edit:
        metadata_edit(metadata)
    safetensors_io.save_safetensors(path, {k: v for k, v in arrays.items() if k != drop}, metadata)


def test_every_mismatch_is_refused_with_one_line(tmp_path):
    tensors = converted()
    path = tmp_path / "w.safetensors"
    save_weights(path, tensors, GRAPH)
    expected = expected_of(tensors)
    name = "model.layers.0.int4_g128.weight"

    assert "written for graph 'graph-3f9c'" in _refusal(lambda: load_weights(path, "another-graph", expected))
    wrong_shape = {**expected, name: ("int4_g128", (5, 131))}
    assert "has shape [5, 130], the plan says [5, 131]" in _refusal(lambda: load_weights(path, GRAPH, wrong_shape))
    wrong_format = {**expected, name: ("int4_g64", (5, 130))}
    assert "stored as int4_g128, the plan says int4_g64" in _refusal(lambda: load_weights(path, GRAPH, wrong_format))
    more = {**expected, "lm_head.weight": ("bf16", (10, 4))}
    assert "missing weight(s) the plan needs: lm_head.weight" in _refusal(lambda: load_weights(path, GRAPH, more))
    fewer = {k: v for k, v in expected.items() if k != name}
    assert f"the plan does not have: {name}" in _refusal(lambda: load_weights(path, GRAPH, fewer))

    data = bytearray(path.read_bytes())
    data[-3] ^= 0x01  # one flipped bit in the last tensor
    path.write_bytes(bytes(data))
    assert "content hash" in _refusal(lambda: load_weights(path, GRAPH, expected))

    save_weights(path, tensors, GRAPH)
    _rewrite(path, drop=f"{name}.scale")
    assert f"tensor '{name}.scale' of weight '{name}' (int4_g128) is missing" in _refusal(
        lambda: load_weights(path, GRAPH, expected))

    save_weights(path, tensors, GRAPH)
    header = safetensors_io.read_header(path)
    arrays = {**safetensors_io.load_safetensors(path), "stray.q": np.zeros(3, np.uint8)}
    safetensors_io.save_safetensors(path, arrays, header.metadata)
    assert "tensors that belong to no weight: stray.q" in _refusal(lambda: load_weights(path, GRAPH, expected))

    save_weights(path, tensors, GRAPH)
    full = path.read_bytes()
    path.write_bytes(full[:-100])
    assert "truncated" in _refusal(lambda: load_weights(path, GRAPH, expected))
    path.write_bytes(full[:5])
    assert "not a safetensors weights file" in _refusal(lambda: load_weights(path, GRAPH))
    path.write_bytes(b"\xff" * 64)
    assert "not a safetensors weights file" in _refusal(lambda: load_weights(path, GRAPH))
    assert "cannot read weights file" in _refusal(lambda: load_weights(tmp_path / "absent.safetensors", GRAPH))

    save_weights(path, tensors, GRAPH)
    _rewrite(path, metadata_edit=lambda m: m.update({"luminal_num.weights": "0"}))
    assert "not a luminal_num weights file of version 1" in _refusal(lambda: load_weights(path, GRAPH))
    save_weights(path, tensors, GRAPH)
    _rewrite(path, metadata_edit=lambda m: m.update(
        {"tensors": m["tensors"].replace('"format":"nvfp4","shape":[5,130]', '"format":"nvfp4","shape":[5,128]')}))
    assert "weight 'model.layers.0.nvfp4.weight': nvfp4 part 'q'" in _refusal(lambda: load_weights(path, GRAPH))


def test_save_refuses_bad_input(tmp_path):
    with pytest.raises(ValueError, match="needs the graph hash"):
        save_weights(tmp_path / "w.safetensors", converted(), "")
    with pytest.raises(TypeError, match="StoredTensor values"):
        save_weights(tmp_path / "w.safetensors", {"w": np.zeros(3)}, GRAPH)
    assert not list(tmp_path.iterdir())
