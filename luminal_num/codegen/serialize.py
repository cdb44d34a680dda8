"""LLIR Programs as plain JSON data and back, exactly (a plan stores what runs, so audit and the
runtimes load it without rebuilding the e-graph).

Every value is encoded by type, never by printed text: dims as ints or {"poly": terms}, floats as
their hex form (exact, and inf/nan safe), formats, kinds and ops by name. `program_from_data`
refuses anything it does not recognise with one line and verifies the result.
"""
from __future__ import annotations

from typing import Any

from ..dtypes.formats import get as get_format
from ..hlir.gemm import GemmLayout
from ..hlir.ops import Op
from ..hlir.rotation import Rotation
from ..hlir.smoothing import Smoothing
from ..hlir.shape import ShapeTracker, View
from ..hlir.symbolic import Dim, Poly
from .attention import AttentionSpec
from .llir import FAcc, FApply, FAt, FConstV, FExpr, FLoad, FRoundTo, FRowSum, Kernel, KernelInput, KernelKind, Program, verify

LLIR_FORMAT = 1


class LlirDataError(ValueError):
    """Serialized LLIR that this compiler cannot read back."""


# -- values -----------------------------------------------------------------------------------------
def _dim(d: Dim) -> Any:
    return {"poly": [[list(m), c] for m, c in d.terms]} if isinstance(d, Poly) else int(d)


def _undim(x: Any) -> Dim:
    if isinstance(x, dict) and set(x) == {"poly"}:
        return Poly(tuple((tuple(m), int(c)) for m, c in x["poly"]))
    if isinstance(x, int) and not isinstance(x, bool):
        return x
    raise LlirDataError(f"not a dimension: {x!r}")


def _dims(ds) -> list:
    return [_dim(d) for d in ds]


def _undims(xs) -> tuple[Dim, ...]:
    return tuple(_undim(x) for x in xs)


def _scalar(v: object) -> Any:
    """A CONST / FConstV value: a float (hex, exact) or a symbolic dim; an ATTENTION kernel's spec."""
    if isinstance(v, AttentionSpec):
        spec = {"scale": float(v.scale).hex(), "key_tile": v.key_tile, "splits": v.splits}
        return {"attention": {**spec, "split_keys": v.split_keys} if v.split_keys else spec}
    return {"f": float(v).hex()} if isinstance(v, float) else {"dim": _dim(v)}


def _unscalar(x: Any) -> object:
    if isinstance(x, dict) and "f" in x:
        return float.fromhex(x["f"])
    if isinstance(x, dict) and "dim" in x:
        return _undim(x["dim"])
    if isinstance(x, dict) and "attention" in x:
        a = x["attention"]
        return AttentionSpec(float.fromhex(a["scale"]), int(a["key_tile"]), int(a["splits"]), int(a.get("split_keys", 0)))
    raise LlirDataError(f"not a constant: {x!r}")


def _view(st: ShapeTracker) -> list:
    return [{"shape": _dims(v.shape), "strides": _dims(v.strides), "offset": _dim(v.offset),
             "mask": None if v.mask is None else [[_dim(lo), _dim(hi)] for lo, hi in v.mask]} for v in st.views]


def _unview(xs) -> ShapeTracker:
    return ShapeTracker(tuple(View(_undims(v["shape"]), _undims(v["strides"]), _undim(v["offset"]),
                                   None if v["mask"] is None else tuple((_undim(lo), _undim(hi)) for lo, hi in v["mask"]))
                              for v in xs))


def _layout(lay: GemmLayout | None) -> Any:
    if lay is None:
        return None
    return {"full_shape": _dims(lay.full_shape), "k_axis": lay.k_axis, "batch_axes": list(lay.batch_axes),
            "m_axes": list(lay.m_axes), "n_axes": list(lay.n_axes), "variant": lay.variant}


def _unlayout(x: Any) -> GemmLayout | None:
    if x is None:
        return None
    return GemmLayout(_undims(x["full_shape"]), int(x["k_axis"]), tuple(x["batch_axes"]), tuple(x["m_axes"]),
                      tuple(x["n_axes"]), x["variant"])


def _body(e: FExpr | None) -> Any:
    if e is None:
        return None
    if isinstance(e, FLoad):
        return {"load": e.slot}
    if isinstance(e, FConstV):
        return {"const": _scalar(e.value)}
    if isinstance(e, FRoundTo):
        return {"round": _body(e.x), "fmt": e.fmt.name, "origin": e.origin}
    if isinstance(e, FAcc):  # not "acc": a row sum's accumulator format is "acc"
        return {"accumulator": True} if e.view is None else {"accumulator": True, "view": _view(e.view)}
    if isinstance(e, FRowSum):
        return {"rowsum": _body(e.body), "acc": e.acc.name, "fmt": e.dt.name, "shape": _dims(e.shape)}
    if isinstance(e, FAt):
        return {"at": _body(e.x), "view": _view(e.view), "shape": _dims(e.src_shape)}
    return {"apply": e.op.name, "kind": e.kind, "args": [_body(a) for a in e.args]}


def _unbody(x: Any) -> FExpr | None:
    if x is None:
        return None
    if "load" in x:
        return FLoad(int(x["load"]))
    if "const" in x:
        return FConstV(_unscalar(x["const"]))
    if "round" in x:
        return FRoundTo(_unbody(x["round"]), get_format(x["fmt"]), x["origin"])
    if "accumulator" in x:
        return FAcc(_unview(x["view"]) if "view" in x else None)
    if "apply" in x:
        return FApply(Op[x["apply"]], tuple(_unbody(a) for a in x["args"]), x["kind"])
    if "rowsum" in x:
        return FRowSum(_unbody(x["rowsum"]), get_format(x["acc"]), get_format(x["fmt"]), _undims(x["shape"]))
    if "at" in x:
        return FAt(_unbody(x["at"]), _unview(x["view"]), _undims(x["shape"]))
    raise LlirDataError(f"not a kernel body: {x!r}")


# -- kernels and programs ----------------------------------------------------------------------------
def _kernel(k: Kernel) -> dict:
    return {"id": k.id, "kind": k.kind.value, "inputs": [[i.buffer, _view(i.view)] for i in k.inputs],
            "shape": _dims(k.shape), "dtype": k.dtype.name, "body": _body(k.body), "body_shape": _dims(k.body_shape),
            "axis": k.axis, "acc": k.acc.name if k.acc else None, "precision": k.precision,
            "layout": _layout(k.layout), "aliases": k.aliases, "chunk": k.chunk, "external": k.external,
            "value": None if k.value is None else _scalar(k.value), "label": k.label, "eclass": k.eclass,
            **({"storage": k.storage} if k.storage is not None else {}),
            **({"fill": k.fill} if k.fill is not None else {}),
            **({"concat": list(k.concat), "concat_axis": k.concat_axis} if k.concat else {}),
            **({"rotation": {"block": k.rotation.block, "source": k.rotation.source}} if k.rotation else {}),
            **({"smoothing": {"variant": k.smoothing.variant, "group": list(k.smoothing.group),
                              "exponents": list(k.smoothing.exponents), "source": k.smoothing.source}}
               if k.smoothing else {})}


def _unkernel(x: dict) -> Kernel:
    return Kernel(id=int(x["id"]), kind=KernelKind(x["kind"]),
                  inputs=tuple(KernelInput(int(b), _unview(v)) for b, v in x["inputs"]),
                  shape=_undims(x["shape"]), dtype=get_format(x["dtype"]), body=_unbody(x["body"]),
                  body_shape=_undims(x["body_shape"]), axis=x["axis"], acc=get_format(x["acc"]) if x["acc"] else None,
                  precision=x["precision"], layout=_unlayout(x["layout"]), aliases=x["aliases"], chunk=int(x["chunk"]),
                  external=x["external"], value=None if x["value"] is None else _unscalar(x["value"]),
                  label=x["label"], eclass=x.get("eclass", ""), storage=x.get("storage"), fill=x.get("fill"),
                  concat=tuple(str(n) for n in x.get("concat", ())), concat_axis=int(x.get("concat_axis", 0)),
                  rotation=_unrotation(x.get("rotation")), smoothing=_unsmoothing(x.get("smoothing")))


def _unsmoothing(x) -> Smoothing | None:
    if x is None:
        return None
    if not isinstance(x, dict) or set(x) != {"variant", "group", "exponents", "source"}:
        raise LlirDataError(f"not a smoothing: {x!r}")
    try:
        return Smoothing(str(x["variant"]), tuple(str(n) for n in x["group"]), tuple(int(e) for e in x["exponents"]),
                         None if x["source"] is None else str(x["source"]))
    except (TypeError, ValueError) as exc:
        raise LlirDataError(f"not a smoothing: {exc}") from None


def _unrotation(x) -> Rotation | None:
    if x is None:
        return None
    if not isinstance(x, dict) or set(x) != {"block", "source"}:
        raise LlirDataError(f"not a rotation: {x!r}")
    return Rotation(int(x["block"]), None if x["source"] is None else str(x["source"]))


def program_to_data(p: Program) -> dict:
    return {"llir_format": LLIR_FORMAT, "kernels": [_kernel(k) for k in p.kernels],
            "inputs": [list(x) for x in p.inputs], "outputs": [list(x) for x in p.outputs],
            "exports": [list(x) for x in p.exports], **({"batch_invariant": True} if p.batch_invariant else {})}


def program_from_data(data: dict) -> Program:
    """The Program `program_to_data` wrote, verified; a one-line LlirDataError for anything else."""
    if not isinstance(data, dict) or data.get("llir_format") != LLIR_FORMAT:
        raise LlirDataError(f"LLIR data of format {data.get('llir_format') if isinstance(data, dict) else None!r}; "
                            f"this compiler reads {LLIR_FORMAT}")
    try:
        p = Program(tuple(_unkernel(k) for k in data["kernels"]), tuple((str(n), int(i)) for n, i in data["inputs"]),
                    tuple((str(n), int(i)) for n, i in data["outputs"]),
                    tuple((int(n), int(i)) for n, i in data["exports"]), bool(data.get("batch_invariant", False)))
    except (KeyError, TypeError, ValueError) as exc:
        raise LlirDataError(f"corrupt LLIR data: {type(exc).__name__}: {exc}") from None
    try:
        return verify(p)
    except ValueError as exc:
        raise LlirDataError(f"the stored LLIR does not verify: {exc}") from None
