"""PyTorch's own export of all-MiniLM-L6-v2, driven from the project's environment (which has no torch).

`torch_export.py` runs in a subprocess under a Python that can import torch, transformers and
onnxscript (the `export` extra): `$LUMINAL_EXPORT_PYTHON` if set, else this interpreter if it has them.
The ONNX file it writes is then imported here with luminal_num.onnx like any user's file.

`with_exact_scalars` is the measuring tool behind "the FP64 graph equals the project's MiniLM graph":
the exporter stores closed-form scale constants (1/sqrt(head_dim), sqrt(2)) as FP32 scalars, so their
FP64 evaluation differs from the project's FP64 constants by ~1e-8 relative. It rewrites exactly those
scalars (an FP32 initializer or Constant equal to fl32 of the closed form, and not exact) as the
closed form computed in the graph from exact constants, and reports which it replaced; nothing else
in the file changes.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..models.assets import MiniLMFiles

EXPORT_PYTHON_VAR = "LUMINAL_EXPORT_PYTHON"
SCRIPT = Path(__file__).with_name("torch_export.py")
EXPORT_MODULES = ("torch", "transformers", "onnxscript")
INSTALL_HINT = (f"set {EXPORT_PYTHON_VAR} to a Python with the export extra (pip install 'luminal_num[export]' "
                "or torch, transformers, onnxscript in a separate venv)")


def _can_export(python: str) -> bool:
    probe = f"import {', '.join(EXPORT_MODULES)}"
    try:
        return subprocess.run([python, "-c", probe], capture_output=True, timeout=120).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def export_python() -> str | None:
    """The interpreter that runs the export: $LUMINAL_EXPORT_PYTHON, else this one; None if neither can."""
    python = os.environ.get(EXPORT_PYTHON_VAR) or sys.executable
    return python if _can_export(python) else None


@dataclass(frozen=True)
class TorchExport:
    """What torch_export.py reports about the file it wrote."""

    path: Path
    exporter: str
    opset: int
    attention: str
    dynamic_axes: Mapping[str, Mapping[str, str]]
    torch: str
    transformers: str
    export_s: float      # torch.onnx.export itself
    wall_s: float        # the subprocess: interpreter start, model build, export
    size_bytes: int      # model.onnx plus its external data


def export_minilm(out: str | Path, python: str, files: MiniLMFiles, attention: str = "eager") -> TorchExport:
    """Export the checkpoint in `files` to `out` with torch.onnx.export (dynamo) in a subprocess."""
    out = Path(out)
    cmd = [python, str(SCRIPT), "--config", str(files.config), "--safetensors", str(files.safetensors),
           "--out", str(out), "--attention", attention]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise RuntimeError(f"torch export failed (exit {proc.returncode}): {tail}")
    info = json.loads(Path(str(out) + ".json").read_text())
    size = sum(p.stat().st_size for p in out.parent.iterdir() if p.name.startswith(out.name) and p.suffix != ".json")
    return TorchExport(out, info["exporter"], info["opset"], info["attention"], info["dynamic_axes"], info["torch"],
                       info["transformers"], info["export_s"], wall, size)


# closed form -> (the ops applied, in order, to the exact constant): evaluated in the graph, not folded
ClosedForm = tuple[tuple[str, ...], float]


def bert_closed_forms(head_dim: int) -> dict[str, ClosedForm]:
    """The irrational scale constants of a BERT export: the attention scale (either way up) and GELU's."""
    return {f"1/sqrt({head_dim})": (("Sqrt", "Reciprocal"), float(head_dim)),
            f"sqrt({head_dim})": (("Sqrt",), float(head_dim)), "sqrt(2)": (("Sqrt",), 2.0)}


def _value(form: ClosedForm) -> float:
    ops, x = form
    for op in ops:
        x = {"Sqrt": math.sqrt, "Reciprocal": lambda v: 1.0 / v}[op](x)
    return x


def _match(value: np.ndarray, forms: Mapping[str, ClosedForm]) -> str | None:
    if value.dtype != np.float32 or value.size != 1:
        return None
    v = value.reshape(())
    return next((label for label, f in forms.items() if np.float32(_value(f)) == v and float(v) != _value(f)), None)


def _chain(name: str, form: ClosedForm) -> list[onnx.NodeProto]:
    """Nodes computing the closed form into `name` (a scalar of the original's shape)."""
    ops, x = form
    nodes = [helper.make_node("Constant", [], [f"{name}:exact:0"], value=numpy_helper.from_array(np.array(x, np.float32)))]
    for i, op in enumerate(ops, 1):
        nodes.append(helper.make_node(op, [f"{name}:exact:{i - 1}"], [name if i == len(ops) else f"{name}:exact:{i}"]))
    return nodes


def with_exact_scalars(proto: onnx.ModelProto, forms: Mapping[str, ClosedForm]) -> tuple[onnx.ModelProto, dict[str, str]]:
    """A copy of `proto` with each FP32-rounded closed-form scalar recomputed exactly; {value name: form}."""
    out = onnx.ModelProto()
    out.CopyFrom(proto)
    g, replaced, head = out.graph, {}, []
    for t in list(g.initializer):
        label = _match(numpy_helper.to_array(t), forms) if t.data_type == TensorProto.FLOAT else None
        if label and len(t.dims) == 0:
            g.initializer.remove(t)
            head += _chain(t.name, forms[label])
            replaced[t.name] = label
    body = []
    for n in g.node:
        value = next((numpy_helper.to_array(a.t) for a in n.attribute if a.name == "value"), None)
        label = _match(value, forms) if n.op_type == "Constant" and value is not None and value.ndim == 0 else None
        if label:
            body += _chain(n.output[0], forms[label])
            replaced[n.output[0]] = label
        else:
            body.append(n)
    inputs = [i for i in g.input if i.name not in replaced]
    del g.node[:], g.input[:]
    g.node.extend(head + body)
    g.input.extend(inputs)
    return out, replaced
