"""An ONNX file as a compile/audit job: import for the user's shapes, read calibration batches from .npz.

Calibration file convention: arrays keyed by ONNX input name. One batch: `input_ids`, `attention_mask`;
several batches: `input_ids:0`, `attention_mask:0`, `input_ids:1`, ... (every batch names every input).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..hlir.evaluate import evaluate
from ..models.registry import ModelJob
from .importer import OnnxModel, import_model
from ..files import read_npz
from .loader import LoadedModel, OnnxImportError, load_file, parse_shapes

ONNX_SUFFIX = ".onnx"
DEFAULT_BUDGET = "atol=1e-3,rtol=1e-3"  # an imported model has no model-specific default; say --budget
_BATCH_KEY = re.compile(r"^(?P<name>.+):(?P<index>\d+)$")


def is_onnx_path(model: str) -> bool:
    return model.lower().endswith(ONNX_SUFFIX)


@dataclass(frozen=True)
class OnnxJob:
    """The registry-style job plus what the ONNX side needs: the model, its file and the raw batches."""

    job: ModelJob
    model: OnnxModel
    loaded: LoadedModel
    onnx_batches: tuple[dict, ...]  # calibration batches as ONNX inputs (for ONNX Runtime peers)

    @property
    def source(self) -> dict:
        """What the plan records about the model file."""
        return {"format": "onnx", "file": self.loaded.path.name if self.loaded.path else "", "sha256": self.loaded.sha256}

    def fp64_references(self) -> list[dict]:
        """FP64 outputs of the imported graph per calibration batch, by ONNX output name."""
        return [self.model.restore(evaluate(self.model.graph, b)) for b in self.job.calibration]


def read_batches(path: str | Path) -> list[dict[str, np.ndarray]]:
    """Batches from an .npz: keys `name` (one batch) or `name:i` (batch i); one-line errors otherwise."""
    p = Path(path)
    try:
        arrays = read_npz(p, "calibration")
    except ValueError as exc:
        raise OnnxImportError(str(exc)) from None
    if not arrays:
        raise OnnxImportError(f"calibration file {p} holds no arrays")
    indexed = {k: _BATCH_KEY.match(k) for k in arrays}
    if all(m is None for m in indexed.values()):
        return [arrays]
    if any(m is None for m in indexed.values()):
        raise OnnxImportError(f"{p} mixes plain `name` keys and indexed `name:i` keys; use one convention")
    batches: dict[int, dict] = {}
    for key, m in indexed.items():
        batches.setdefault(int(m["index"]), {})[m["name"]] = arrays[key]
    names = set(next(iter(batches.values())))
    for i, b in sorted(batches.items()):
        if set(b) != names:
            raise OnnxImportError(f"{p}: batch {i} names inputs {sorted(b)}, batch 0 names {sorted(names)}")
    return [batches[i] for i in sorted(batches)]


def onnx_job(path: str, shape_text: str | None, calibration: str | None) -> OnnxJob:
    """Load, check and import the file for the given shapes; read and check the calibration batches."""
    if calibration is None:
        raise OnnxImportError("an ONNX model needs --calibration inputs.npz (arrays keyed by input name)")
    loaded = load_file(path)
    batches = read_batches(calibration)
    shapes = parse_shapes(shape_text)
    model = import_model(loaded, shapes)
    if model.fp64_only:
        raise OnnxImportError(f"{model.fp64_only}: ONNX computes it in double, which only the FP64 reference does; "
                              "every plan would run it at FP32, so the model is refused")
    feeds = []
    for i, b in enumerate(batches):
        extra = sorted(set(b) - {s.name for s in model.inputs})
        if extra:
            raise OnnxImportError(f"calibration batch {i} holds {extra}, which the model does not take")
        for name, a in b.items():
            if a.dtype.kind == "f" and not np.all(np.isfinite(a)):
                raise OnnxImportError(f"calibration batch {i}: input {name!r} contains NaN or Inf")
        feeds.append(model.feed(b))
    name = Path(path).stem
    desc = (f"ONNX model {Path(path).name} (opset {model.opset}, sha256 {loaded.sha256[:12]}), inputs "
            + ", ".join(f"{s.name}={'x'.join(map(str, s.shape))}" for s in model.inputs))
    job = ModelJob(name, model.graph, tuple(feeds), tuple(feeds), DEFAULT_BUDGET, desc)
    return OnnxJob(job, model, loaded, tuple(dict(b) for b in batches))
