"""Reading an ONNX file: load (with external data), check, infer shapes, hash, bind input shapes.

Every failure is an `OnnxImportError` whose message is one line naming the file, node or input, so
the CLI can print it and exit 2 before anything is written.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

FLOAT, BOOL, INT = "float", "bool", "int"  # the three value kinds a graph tensor can carry

# ONNX element type -> value kind. Only FP32 data enters the graph as floats (the graph has FP32
# semantics; choosing FP16/BF16 storage is the compiler's job); integers are indices or shape values.
ELEM_KINDS: dict[int, str] = {
    TensorProto.FLOAT: FLOAT,
    TensorProto.BOOL: BOOL,
    TensorProto.INT64: INT,
    TensorProto.INT32: INT,
}


def _register_contrib_schemas() -> None:
    """ONNX Runtime's SimplifiedLayerNormalization (RMS norm in ORT-optimized graphs) lives in the
    default domain but has no ONNX schema: declare ORT's signature so the checker accepts it."""
    if onnx.defs.has("SimplifiedLayerNormalization"):
        return
    S = onnx.defs.OpSchema
    opt = S.FormalParameterOption.Optional
    onnx.defs.register_schema(S(
        "SimplifiedLayerNormalization", "", 1, "ONNX Runtime: x * rsqrt(mean(x^2) + epsilon) * scale",
        inputs=[S.FormalParameter("X", "T"), S.FormalParameter("scale", "V")],
        outputs=[S.FormalParameter("Y", "V"), S.FormalParameter("inv_std_var", "U", param_option=opt)],
        type_constraints=[("T", ["tensor(float)", "tensor(float16)", "tensor(double)", "tensor(bfloat16)"], ""),
                          ("U", ["tensor(float)", "tensor(double)"], ""),
                          ("V", ["tensor(float)", "tensor(float16)", "tensor(double)", "tensor(bfloat16)"], "")],
        attributes=[S.Attribute("axis", S.AttrType.INT, "", required=False),
                    S.Attribute("epsilon", S.AttrType.FLOAT, "", required=False),
                    S.Attribute("stash_type", S.AttrType.INT, "", required=False)]))


_register_contrib_schemas()


class OnnxImportError(ValueError):
    """A model the importer refuses: malformed, unsupported op/attribute/dtype, or unbound shape."""


@dataclass(frozen=True)
class LoadedModel:
    """A checked, shape-inferred model and the sha256 of its bytes (file plus external data)."""

    proto: onnx.ModelProto
    sha256: str
    path: Path | None = None


def elem_kind(elem_type: int, what: str) -> str:
    if elem_type not in ELEM_KINDS:
        name = TensorProto.DataType.Name(elem_type) if elem_type in TensorProto.DataType.values() else elem_type
        raise OnnxImportError(f"{what} has element type {name}; supported: float32 and double data, integers, "
                              "narrow floats (float16, bfloat16, FP8, FP4), bool masks")
    return ELEM_KINDS[elem_type]


def _tensors(graph: onnx.GraphProto):
    """Every TensorProto a graph holds: initializers and tensor attributes, subgraphs included."""
    yield from graph.initializer
    for node in graph.node:
        for a in node.attribute:
            if a.HasField("t"):
                yield a.t
            yield from a.tensors
            for g in ([a.g] if a.HasField("g") else []) + list(a.graphs):
                yield from _tensors(g)


def _external_files(proto: onnx.ModelProto) -> list[str]:
    out = []
    for t in _tensors(proto.graph):
        if t.data_location == TensorProto.EXTERNAL:
            out.extend(e.value for e in t.external_data if e.key == "location")
    return sorted(set(out))


def file_sha256(path: Path) -> str:
    """sha256 over the .onnx file and every external data file it names (in name order)."""
    h = hashlib.sha256(path.read_bytes())
    header = onnx.load(str(path), load_external_data=False)
    for loc in _external_files(header):
        h.update(loc.encode())
        h.update((path.parent / loc).read_bytes())
    return h.hexdigest()


def load_file(path: str | Path) -> LoadedModel:
    """Load, check (onnx.checker, full) and shape-infer an ONNX file; external data is read beside it."""
    p = Path(path)
    if not p.is_file():
        raise OnnxImportError(f"ONNX file {p} does not exist")
    try:
        header = onnx.load(str(p), load_external_data=False)
    except Exception as exc:  # noqa: BLE001 - any parse failure is a malformed file
        raise OnnxImportError(f"{p} is not a readable ONNX model: {_one_line(exc)}") from None
    missing = [loc for loc in _external_files(header) if not (p.parent / loc).is_file()]
    if missing:
        raise OnnxImportError(f"{p}: external data file(s) {missing} not found beside the model")
    try:
        onnx.checker.check_model(str(p), full_check=False)
        proto = onnx.load(str(p), load_external_data=True)
    except Exception as exc:  # noqa: BLE001
        raise OnnxImportError(f"{p} fails the ONNX checker: {_one_line(exc)}") from None
    return LoadedModel(infer(proto, str(p)), file_sha256(p), p)


def load_proto(proto: onnx.ModelProto) -> LoadedModel:
    """The in-memory twin of load_file (tests, node cases): check, infer, hash the serialized bytes."""
    try:
        onnx.checker.check_model(proto)
    except Exception as exc:  # noqa: BLE001
        raise OnnxImportError(f"model fails the ONNX checker: {_one_line(exc)}") from None
    return LoadedModel(infer(proto, "model"), hashlib.sha256(proto.SerializeToString()).hexdigest())


def infer(proto: onnx.ModelProto, what: str) -> onnx.ModelProto:
    try:
        return onnx.shape_inference.infer_shapes(proto, check_type=True, strict_mode=True, data_prop=True)
    except Exception as exc:  # noqa: BLE001
        raise OnnxImportError(f"{what}: ONNX shape inference failed: {_one_line(exc)}") from None


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= 300 else text[:297] + "..."


def parse_shapes(text: str | None) -> dict[str, tuple[int, ...]]:
    """`input_ids=16x128,attention_mask=16x128` -> {name: (16, 128)}; a scalar is `name=` (empty)."""
    out: dict[str, tuple[int, ...]] = {}
    if not text:
        return out
    for item in text.split(","):
        name, sep, dims = item.strip().partition("=")
        if not sep or not name:
            raise OnnxImportError(f"bad --shape item {item!r}: expected name=AxB (e.g. input_ids=16x128)")
        try:
            shape = tuple(int(d) for d in dims.split("x")) if dims else ()
        except ValueError:
            raise OnnxImportError(f"bad --shape item {item!r}: dims must be integers joined by 'x'") from None
        if any(d < 1 for d in shape):
            raise OnnxImportError(f"bad --shape item {item!r}: dims must be >= 1")
        if name in out:
            raise OnnxImportError(f"--shape names {name!r} twice")
        out[name] = shape
    return out


def graph_inputs(proto: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    """Real inputs: graph inputs that are not initializers (old exporters list weights as inputs)."""
    inits = {t.name for t in proto.graph.initializer}
    return [i for i in proto.graph.input if i.name not in inits]


def bind_input_shapes(proto: onnx.ModelProto, shapes: Mapping[str, tuple[int, ...]],
                      known: frozenset[str] = frozenset()) -> dict[str, tuple[int, ...]]:
    """Concrete shape of every input: declared fixed dims, symbolic ones bound from `shapes`.

    Inputs in `known` are values frozen at import; their shapes come from the values themselves."""
    inputs = [i for i in graph_inputs(proto) if i.name not in known]
    unknown = sorted(set(shapes) - {i.name for i in inputs})
    if unknown:
        raise OnnxImportError(f"--shape names {unknown}, which the model does not take (inputs: "
                              f"{', '.join(i.name for i in inputs)})")
    out: dict[str, tuple[int, ...]] = {}
    symbols: dict[str, int] = {}
    for inp in inputs:
        if not inp.type.HasField("tensor_type"):
            raise OnnxImportError(f"input {inp.name!r} is not a tensor (sequences and maps are not supported)")
        given, dims = shapes.get(inp.name), inp.type.tensor_type.shape.dim
        if given is None:
            continue
        if len(given) != len(dims):
            raise OnnxImportError(f"--shape {inp.name}: rank {len(given)} but the model declares rank {len(dims)}")
        for d, size in zip(dims, given):
            if d.HasField("dim_value") and d.dim_value != size:
                raise OnnxImportError(f"--shape {inp.name}: size {size} where the model fixes {d.dim_value}")
            if d.HasField("dim_param") and symbols.setdefault(d.dim_param, size) != size:
                raise OnnxImportError(f"symbolic dim {d.dim_param!r} bound to {symbols[d.dim_param]} and {size}")
        out[inp.name] = tuple(given)
    for inp in inputs:
        if inp.name in out:
            continue
        dims, shape = inp.type.tensor_type.shape.dim, []
        for d in dims:
            if d.HasField("dim_value"):
                shape.append(int(d.dim_value))
            elif d.HasField("dim_param") and d.dim_param in symbols:
                shape.append(symbols[d.dim_param])
            else:
                hint = "x".join(str(x.dim_value) if x.HasField("dim_value") else "N" for x in dims)
                raise OnnxImportError(f"input {inp.name!r} has dynamic dim {d.dim_param or '?'!r}: give its shape "
                                      f"with --shape {inp.name}={hint}")
        out[inp.name] = tuple(shape)
    return out


def initializer_arrays(proto: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}
