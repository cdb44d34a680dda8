"""Lower chosen e-nodes (one candidate per chunk) to an LLIR Program: a translation, not a decision.

Chunks are lowered in graph order; a chunk's external slots resolve to graph inputs or to the
kernels that earlier chunks exported. Interned ids (views, constants, layouts) are read back from
the group's tables; children are read by their declared names (codegen/kinds.py). Every choice (a
Gemm's QUANTIZE of A, an in-place scatter) was made in the e-graph; `llir.verify` checks the result.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable, Mapping

from ..codegen.attention import spec_for
from ..codegen.kinds import TENSOR_DECLS, Sort
from ..codegen.llir import (FAcc, acc_views, FApply, FAt, FConstV, FExpr, FLoad, FRoundTo, FRowSum, Kernel, KernelInput,
                            KernelKind, Program, verify)
from ..dtypes.formats import F32
from ..dtypes.formats import get as get_format
from ..hlir.graph import Graph
from ..hlir.partition import Partition
from ..hlir.rotation import Rotation
from ..hlir.smoothing import Smoothing
from ..quant.calibration import smoothing_exponents
from ..hlir.shape import ShapeTracker
from ..quant.stored import held_format, split_choice
from .choice import Candidate, ENode
from .horizontal import compose
from .saturate import GroupSpace


@dataclass
class _Builder:
    kernels: list[Kernel] = field(default_factory=list)
    stored: dict[tuple[int, str], int] = field(default_factory=dict)  # (weight buffer, format) -> its stored buffer
    concats: dict[tuple[int, ...], int] = field(default_factory=dict)  # (axis, weight buffers) -> concatenation
    rotated: dict[tuple, int] = field(default_factory=dict)  # (Rotation | Smoothing, format, fill) -> derived buffer
    weights: Mapping[str, object] = field(default_factory=dict)  # the graph's weights (smoothing exponents)

    def add(self, **kw) -> int:
        k = Kernel(id=len(self.kernels), **kw)
        self.kernels.append(k)
        return k.id

    def provenance(self, kid: int, cid: str) -> int:
        """Record the e-class a kernel was just lowered from (aliases return an older kernel: unchanged)."""
        k = self.kernels[kid]
        if kid == len(self.kernels) - 1 and not k.eclass and k.kind is not KernelKind.EXTERNAL:
            self.kernels[kid] = dataclasses.replace(k, eclass=cid)
        return kid


class _ChunkLowering:
    def __init__(self, b: _Builder, gs: GroupSpace, cand: Candidate, slots: list[int], chunk: int,
                 batch_invariant: bool = False):
        self.b, self.gs, self.space, self.t = b, gs, gs.space, gs.tables
        self.choice, self.slots, self.chunk = cand.as_dict(), slots, chunk
        self.batch_invariant = batch_invariant
        self.memo: dict[str, int] = {}

    def node(self, cid: str) -> ENode:
        return self.space.classes[cid][self.choice[cid]]

    def view(self, vid: int) -> ShapeTracker:
        return self.t.views[vid]

    def const(self, c: int):
        v = self.t.constants[c]
        return float.fromhex(v[1]) if isinstance(v, tuple) and v[0] == "f" else v

    def tensor(self, cid: str, reader: str | None = None) -> int:
        """The kernel computing e-class `cid`. A QUANTIZE class implements no HLIR op of its own: it is
        labelled by the op of the Gemm reading it (`reader`), as the Gemms a rotation adds are (KRotated's)."""
        if cid not in self.memo:
            n = self.node(cid)
            hint = reader if n.decl.kind in (KernelKind.QUANTIZE, KernelKind.GEMM) else None
            self.memo[cid] = self.b.provenance(_TENSOR[n.op](self, n, self.space.class_origin.get(cid) or hint or n.op),
                                               cid)
        return self.memo[cid]

    def common(self, n: ENode, origin: str) -> dict:
        return dict(chunk=self.chunk, label=f"{origin} (chunk {self.chunk}, {n.op})")

    def operands(self, n: ENode, origin: str | None = None) -> tuple[KernelInput, ...]:
        """The kernel's inputs: its declared (tensor, view) parameter pairs, in order."""
        return tuple(self._operand(n, t, self.view(n.arg(v)), origin) for t, v in n.decl.operands)

    def _operand(self, n: ENode, param: str, view: ShapeTracker, origin: str | None) -> KernelInput:
        if n.decl.params[n.decl.index(param)].sort is Sort.B:  # a consumed buffer: the value it holds
            return KernelInput(self.tensor(self.node(n.cls(param)).cls("t")), view)
        return self.read(n.cls(param), view, origin)

    def read(self, cid: str, view: ShapeTracker, origin: str | None = None) -> KernelInput:
        """Reading e-class `cid` through `view`: a slice alias (KSlice) reads its source's buffer through
        the slice's view with `view` on top; anything else reads its own kernel's buffer."""
        n = self.node(cid)
        if n.op == "KSlice":
            return KernelInput(self.tensor(n.cls("src"), origin), compose(self.view(n.arg("view")), view))
        return KernelInput(self.tensor(cid, origin), view)

    def body(self, n: ENode) -> tuple[FExpr, tuple[KernelInput, ...], tuple]:
        inputs: list[KernelInput] = []
        shapes: list = []
        body = self.scalar(n.cls("body"), inputs, shapes)
        if any(s_ != shapes[0] for s_ in shapes):
            raise ValueError(f"{n.op} body reads views of different shapes {set(shapes)}")
        return body, tuple(inputs), shapes[0]

    def scalar(self, cid: str, inputs: list[KernelInput], shapes: list, acc: str | None = None) -> FExpr:
        """The body expression; `shapes` collects the iteration shape of every leaf (all must agree).
        `acc`: a Gemm epilogue's Gemm class, whose identity-view loads read the accumulator (FAcc)."""
        n = self.node(cid)
        if n.decl.sort is not Sort.F:
            raise ValueError(f"e-node {n.op} is not a scalar expression")
        if n.op == "Load" and n.cls("t") == acc:
            view = self.view(n.arg("view"))
            if view != ShapeTracker.contiguous(view.shape):  # the rule only matches identity-view reads
                raise ValueError(f"an epilogue reads its Gemm through the non-identity view {view}")
            shapes.append(view.shape)
            return FAcc()
        # a GLU epilogue's read of a part: the part's class holds a slice of the fused accumulator (whichever
        # alternative the part itself chose, it is the same value)
        src = next((a for a in self.space.classes[n.cls("t")] if a.op == "KSlice" and a.cls("src") == acc),
                   None) if n.op == "Load" and acc is not None else None
        if src is not None:
            view = compose(self.view(src.arg("view")), self.view(n.arg("view")))
            shapes.append(view.shape)
            return FAcc(view)
        if n.op == "Load":
            ki = self.read(n.cls("t"), self.view(n.arg("view")))
            if ki not in inputs:
                inputs.append(ki)
            shapes.append(ki.view.shape)
            return FLoad(inputs.index(ki))
        if n.op == "FConst":
            shapes.append(self.view(n.arg("view")).shape)
            return FConstV(self.const(n.arg("cid")))
        if n.op == "FRound":
            inner = self.scalar(n.cls("x"), inputs, shapes, acc)
            if n.arg("dt") == "f32":
                return inner  # bodies compute in FP32: rounding to it is exact
            reads = [a.cls("t") for a in self.space.classes[cid] if a.op == "Load"]
            origin = self.space.class_origin.get(reads[0], "") if reads else ""
            return FRoundTo(inner, get_format(n.arg("dt")), origin)
        if n.op in _ROW_SCALARS:
            return _ROW_SCALARS[n.op](self, n, inputs, shapes)
        args = tuple(self.scalar(n.cls(p.name), inputs, shapes, acc) for p in n.decl.params if p.sort is Sort.F)
        return FApply(n.decl.op, args, kind=n.arg("kind") if n.op == "FCustom" else None)

    def space_of(self, cid: str, inputs: list[KernelInput]) -> tuple[FExpr, tuple]:
        """A sub-expression over a space of its own (a row sum's body, what FAt reads) and that shape."""
        shapes: list = []
        e = self.scalar(cid, inputs, shapes)
        if not shapes or any(s_ != shapes[0] for s_ in shapes):
            raise ValueError(f"a row-kernel sub-body reads views of shapes {set(shapes)} (one shape needed)")
        return e, tuple(shapes[0])


# Row-kernel body nodes (search/rules/fuse_rows.py): RowBody is transparent; FRowSum and FAt open a space.
def _row_sum(lo: _ChunkLowering, n: ENode, inputs: list, shapes: list) -> FExpr:
    body, space = lo.space_of(n.cls("body"), inputs)
    shapes.append(space[:-1])
    return FRowSum(body, get_format(n.arg("acc")), get_format(n.arg("dt")), space)


def _at(lo: _ChunkLowering, n: ENode, inputs: list, shapes: list) -> FExpr:
    x, space = lo.space_of(n.cls("x"), inputs)
    view = lo.view(n.arg("view"))
    shapes.append(view.shape)
    return FAt(x, view, space)


_ROW_SCALARS = {"RowBody": lambda lo, n, inputs, shapes: lo.scalar(n.cls("x"), inputs, shapes),
                "FRowSum": _row_sum, "FAt": _at}


# -- one lowering per tensor constructor ----------------------------------------------------------
def _ext(lo: _ChunkLowering, n: ENode, origin: str) -> int:
    return lo.slots[n.arg("slot")]


def _stored(lo: _ChunkLowering, n: ENode, origin: str) -> int:
    """The weight's buffer held in storage format `fmt` (one per weight and format, shared by chunks);
    SOURCE_BLOCKS names the format of this chunk's own GGUF blocks (data of the chunk, as its weights are)."""
    src = lo.b.kernels[lo.slots[n.arg("slot")]]
    choice, fill = split_choice(n.arg("fmt"))
    fmt = held_format(choice, lo.t.chunk_source(lo.chunk, n.arg("slot")))
    key = (src.id, fmt, fill)
    if key not in lo.b.stored:
        held = fmt + (f" filled by {fill}" if fill else "")
        lo.b.stored[key] = lo.b.add(kind=KernelKind.EXTERNAL, inputs=(), shape=src.shape, dtype=src.dtype,
                                    external=src.external, storage=fmt, fill=fill, label=f"{src.label} stored as {held}")
    return lo.b.stored[key]


def _concat(lo: _ChunkLowering, n: ENode, origin: str) -> int:
    """The weights of the concats entry concatenated along its axis: one buffer per set of weights and
    storage format (shared by chunks); KCatStored holds it in `fmt` (each part's stored values kept)."""
    axis, slots = lo.t.concats[n.arg("cat")]
    fmt, fill = split_choice(n.arg("fmt")) if n.op == "KCatStored" else (None, None)
    srcs = [lo.b.kernels[lo.slots[s]] for s in slots]
    key = (axis, *(k.id for k in srcs)) + ((fmt, fill) if fmt else ())
    if key not in lo.b.concats:
        names = tuple(k.external for k in srcs)
        shape = list(srcs[0].shape)
        shape[axis] = sum(k.shape[axis] for k in srcs)
        held = (f" stored as {fmt}" + (f" filled by {fill}" if fill else "")) if fmt else ""
        lo.b.concats[key] = lo.b.add(kind=KernelKind.EXTERNAL, inputs=(), shape=tuple(shape), dtype=srcs[0].dtype,
                                     external=f"concat{axis}(" + ",".join(names) + ")", concat=names, concat_axis=axis,
                                     storage=fmt, fill=fill, label=f"{' + '.join(names)} concatenated along axis {axis}{held}")
    return lo.b.concats[key]


def _slice(lo: _ChunkLowering, n: ENode, origin: str) -> int:
    raise ValueError(f"{origin}: a slice of a fused Gemm has no buffer of its own; only readers (through their "
                     "views) may use it, never a root or an in-place destination")


def _cache_stored(lo: _ChunkLowering, n: ENode, origin: str) -> int:
    """A KV-cache input held in KV format `fmt`: the graph input's buffer, converted on entry (rows a
    caller hands in) and by the in-place Scatter that writes into it (the rows a step adds)."""
    src = lo.b.kernels[lo.slots[n.arg("slot")]]
    if src.kind is not KernelKind.EXTERNAL:
        raise ValueError(f"KCacheStored: chunk source {n.arg('slot')} is kernel {src.id} ({src.kind.value}), "
                         "not a graph input")
    return _stored(lo, n, origin)


def _rotated_weight(lo: _ChunkLowering, n: ENode, origin: str) -> int:
    """KRotW / KRotStored / KHadamard: a buffer the compiler derives (hlir/rotation.py), one per weight, block
    and format (shared by chunks); a rotated weight needs its chunk source to be a graph weight."""
    block = n.arg("block")
    source = None
    if n.op != "KHadamard":
        src = lo.b.kernels[lo.slots[n.arg("slot")]]
        if src.kind is not KernelKind.EXTERNAL or src.derived:
            raise ValueError(f"{origin}: chunk source {n.arg('slot')} is kernel {src.id} ({src.kind.value}), not a "
                             "weight to rotate")
        source = src.external
    rot = Rotation(block, source)
    fmt, fill = split_choice(n.arg("fmt")) if n.op == "KRotStored" else (None, None)
    key = (rot, fmt, fill)
    if key not in lo.b.rotated:
        shape = (block, block) if source is None else lo.b.kernels[lo.slots[n.arg("slot")]].shape
        held = (f" stored as {fmt}" + (f" filled by {fill}" if fill else "")) if fmt else ""
        lo.b.rotated[key] = lo.b.add(kind=KernelKind.EXTERNAL, inputs=(), shape=tuple(shape), dtype=F32,
                                     external=rot.name, rotation=rot, storage=fmt, fill=fill,
                                     label=f"{rot.name}{held}")
    return lo.b.rotated[key]


def _smoothed_buffer(lo: _ChunkLowering, n: ENode, origin: str) -> int:
    """KSmoothW / KSmoothStored / KSmoothInv: a buffer the compiler derives (hlir/smoothing.py), one per weight
    (or group, for the scale vector), variant and format; its exponents are computed here from the installed
    calibration statistics and the group's weights, and carried in the LLIR from then on."""
    names = []
    for slot in lo.t.smooth_groups[n.arg("grp")]:
        src = lo.b.kernels[lo.slots[slot]]
        if src.kind is not KernelKind.EXTERNAL or src.derived or src.external not in lo.b.weights:
            raise ValueError(f"{origin}: chunk source {slot} is kernel {src.id} ({src.kind.value}), not a weight "
                             "to smooth")
        names.append(src.external)
    variant = n.arg("sm")
    exponents = smoothing_exponents(variant, tuple(lo.b.weights[name] for name in names))
    source = None if n.op == "KSmoothInv" else lo.b.kernels[lo.slots[n.arg("slot")]].external
    sm = Smoothing(variant, tuple(names), exponents, source)
    fmt, fill = split_choice(n.arg("fmt")) if n.op == "KSmoothStored" else (None, None)
    key = (sm, fmt, fill)
    if key not in lo.b.rotated:
        shape = (len(exponents),) if source is None else lo.b.kernels[lo.slots[n.arg("slot")]].shape
        held = (f" stored as {fmt}" + (f" filled by {fill}" if fill else "")) if fmt else ""
        lo.b.rotated[key] = lo.b.add(kind=KernelKind.EXTERNAL, inputs=(), shape=tuple(shape), dtype=F32,
                                     external=sm.name, smoothing=sm, storage=fmt, fill=fill, label=f"{sm.name}{held}")
    return lo.b.rotated[key]


def _smoothed(lo: _ChunkLowering, n: ENode, origin: str) -> int:
    return lo.tensor(n.cls("inner"), f"{origin} smoothed")  # an alias: the Gemm of the smoothed operands


def _variant(lo: _ChunkLowering, n: ENode, origin: str) -> int:
    return lo.tensor(n.cls("inner"))  # an alias: consumers read the low-precision buffer and widen on load


def _rotated(lo: _ChunkLowering, n: ENode, origin: str) -> int:
    return lo.tensor(n.cls("inner"), f"{origin} rotated")  # an alias: the Gemm of the rotated operands


def _const(lo: _ChunkLowering, n: ENode, origin: str) -> int:
    return lo.b.add(kind=KernelKind.CONST, inputs=(), shape=(), dtype=get_format(n.arg("dt")),
                    value=lo.const(n.arg("cid")), **lo.common(n, origin))


def _iota(lo: _ChunkLowering, n: ENode, origin: str) -> int:
    length = lo.t.dims[n.arg("length")]
    return lo.b.add(kind=KernelKind.IOTA, inputs=(), shape=(length,), dtype=get_format(n.arg("dt")), value=length,
                    **lo.common(n, origin))


def _elementwise(lo: _ChunkLowering, n: ENode, origin: str) -> int:
    body, inputs, shape = lo.body(n)
    return lo.b.add(kind=KernelKind.ELEMENTWISE, inputs=inputs, shape=shape, dtype=get_format(n.arg("dt")),
                    body=body, body_shape=shape, **lo.common(n, origin))


def _rows(lo: _ChunkLowering, n: ENode, origin: str) -> int:
    """A row kernel: its body (row sums and the elementwise tail) over its shape, rows on the last axis."""
    body, inputs, shape = lo.body(n)
    return lo.b.add(kind=KernelKind.ROWS, inputs=inputs, shape=shape, dtype=get_format(n.arg("dt")), body=body,
                    body_shape=shape, axis=len(shape) - 1, **lo.common(n, origin))


def _scatter_ew(lo: _ChunkLowering, n: ENode, origin: str) -> int:
    """An in-place scatter whose body computes the source rows; inputs (dest, indices, the body's loads)."""
    inputs = list(lo.operands(n))
    shapes: list = []
    body = lo.scalar(n.cls("body"), inputs, shapes)
    if not shapes or any(s_ != shapes[0] for s_ in shapes):
        raise ValueError(f"{n.op} body reads views of different shapes {set(shapes)}")
    storage = lo.b.kernels[inputs[0].buffer].storage  # a KV cache held in a format: rows written converted
    return lo.b.add(kind=KernelKind.SCATTER_EW, inputs=tuple(inputs), shape=tuple(inputs[0].view.shape),
                    dtype=get_format(n.arg("dt")), body=body, body_shape=tuple(shapes[0]), aliases=0,
                    storage=storage, **lo.common(n, origin))


def _reduction(lo: _ChunkLowering, n: ENode, origin: str) -> int:
    """KSum / KMax / KSoftmax: the body over the un-reduced space, reduced (or normalised) along axis."""
    body, inputs, shape = lo.body(n)
    axis = n.arg("axis")
    out_shape = shape if n.decl.kind is KernelKind.SOFTMAX else shape[:axis] + shape[axis + 1:]
    acc = get_format(n.arg("acc")) if n.decl.kind is KernelKind.SUM else None
    prec = n.arg("prec") if n.decl.kind is KernelKind.SOFTMAX else None
    return lo.b.add(kind=n.decl.kind, inputs=inputs, shape=out_shape, dtype=get_format(n.arg("dt")), body=body,
                    body_shape=shape, axis=axis, acc=acc, precision=prec, **lo.common(n, origin))


def _gemm(lo: _ChunkLowering, n: ENode, origin: str) -> int:
    layout = lo.t.layouts[n.arg("layout")]
    if lo.node(n.cls("b")).op == "KHadamard":
        origin = f"{origin.removesuffix(' rotated')}: x H (Hadamard rotation)"
    ins = lo.operands(n, origin)
    shape = tuple(d for i, d in enumerate(layout.full_shape) if i != layout.k_axis)
    return lo.b.add(kind=KernelKind.GEMM, inputs=ins, shape=shape, dtype=get_format(n.arg("dt")), layout=layout,
                    precision=n.arg("prec"), **lo.common(n, origin))


def _gemm_epilogue(lo: _ChunkLowering, n: ENode, origin: str) -> int:
    """KGemmEpi: the Gemm's A and B, then the epilogue's own loads; its reads of `acc` are the accumulator."""
    layout = lo.t.layouts[n.arg("layout")]
    inputs = list(lo.operands(n, origin))
    shape = tuple(d for i, d in enumerate(layout.full_shape) if i != layout.k_axis)
    shapes: list = []
    body = lo.scalar(n.cls("epi"), inputs, shapes, acc=n.cls("acc"))
    if acc_views(body):  # a GLU epilogue: the body's shape (its reads of the accumulator's column slices)
        shape = tuple(shapes[0])
    if any(tuple(s_) != shape for s_ in shapes):
        raise ValueError(f"epilogue of {origin} reads views of shapes {set(shapes)}, not its output {shape}")
    return lo.b.add(kind=KernelKind.GEMM_EPILOGUE, inputs=tuple(inputs), shape=shape, dtype=get_format(n.arg("dt")),
                    layout=layout, precision=n.arg("prec"), body=body, body_shape=shape, **lo.common(n, origin))


def _quantize(lo: _ChunkLowering, n: ENode, origin: str) -> int:
    layout = lo.t.layouts[n.arg("layout")]
    prec = n.arg("prec")
    return lo.b.add(kind=KernelKind.QUANTIZE, inputs=lo.operands(n), shape=(layout.batch, layout.m, layout.k),
                    dtype=get_format(n.arg("dt")), precision=prec, layout=layout, chunk=lo.chunk,
                    label=f"{origin} (chunk {lo.chunk}, quantize A: {prec})")


def _gather(lo: _ChunkLowering, n: ENode, origin: str) -> int:
    ins = lo.operands(n)
    shape = tuple(ins[1].view.shape) + tuple(ins[0].view.shape[1:])
    return lo.b.add(kind=KernelKind.GATHER, inputs=ins, shape=shape, dtype=get_format(n.arg("dt")),
                    **lo.common(n, origin))


def _scatter(lo: _ChunkLowering, n: ENode, origin: str) -> int:
    """KScatter copies dest; KScatterNoCopy (legal only as decided in the e-graph) overwrites it."""
    ins = lo.operands(n)
    nocopy = n.decl.kind is KernelKind.SCATTER_NOCOPY
    # in place into a cache held in a KV format: the output is that buffer, so it holds rows in that format
    storage = lo.b.kernels[ins[0].buffer].storage if nocopy else None
    return lo.b.add(kind=n.decl.kind, inputs=ins, shape=tuple(ins[0].view.shape), dtype=get_format(n.arg("dt")),
                    aliases=0 if nocopy else None, storage=storage, **lo.common(n, origin))


def _attention(lo: _ChunkLowering, n: ENode, origin: str) -> int:
    """One attention kernel: its four operands' views, the scale constant, the launch parameters."""
    ins = lo.operands(n, origin)
    scores = tuple(ins[2].view.shape)
    spec = spec_for(float(lo.const(n.arg("scale"))), scores[-2], scores[-1], lo.batch_invariant)
    return lo.b.add(kind=KernelKind.ATTENTION, inputs=ins, shape=scores[:-1] + (ins[3].view.shape[-2],),
                    dtype=get_format(n.arg("dt")), body_shape=scores, axis=len(scores) - 1, precision=n.arg("prec"),
                    value=spec, **lo.common(n, origin))


_TENSOR: dict[str, Callable[[_ChunkLowering, ENode, str], int]] = {
    "KExt": _ext, "KStored": _stored, "KVariant": _variant, "KConst": _const, "KIota": _iota, "Ew": _elementwise,
    "KSum": _reduction, "KMax": _reduction, "KSoftmax": _reduction, "KGemm": _gemm, "KQuantize": _quantize,
    "KGather": _gather, "KScatter": _scatter, "KScatterNoCopy": _scatter, "KGemmEpi": _gemm_epilogue,
    "KRotW": _rotated_weight, "KRotStored": _rotated_weight, "KHadamard": _rotated_weight, "KRotated": _rotated,
    "KSmoothW": _smoothed_buffer, "KSmoothStored": _smoothed_buffer, "KSmoothInv": _smoothed_buffer,
    "KSmoothed": _smoothed,
    "KCatW": _concat, "KCatStored": _concat, "KSlice": _slice, "KCacheStored": _cache_stored, "KAttention": _attention,
    "KRows": _rows, "KScatterEw": _scatter_ew,
}
assert set(_TENSOR) == {d.name for d in TENSOR_DECLS}, "every tensor constructor has exactly one lowering"


def lower_program(graph: Graph, part: Partition, spaces: Mapping[str, GroupSpace],
                  choices: Mapping[int, Candidate], batch_invariant: bool = False) -> Program:
    """The LLIR program for the whole graph: chunk c uses `choices[c]` in its group's space.
    `batch_invariant`: the program says so (backends then run fixed-order kernels) and its attention
    kernels split keys at fixed sizes (codegen/attention.spec_for)."""
    b = _Builder(weights=graph.weights)
    node_kernel: dict[int, int] = {}
    inputs = []
    for name, info in graph.inputs.items():
        node_kernel[info.node] = b.add(kind=KernelKind.EXTERNAL, inputs=(), shape=info.shape, dtype=info.dtype,
                                       external=name, label=f"input:{name}")
        inputs.append((name, node_kernel[info.node]))
    group_of = {c.index: g.key for g in part.groups for c in g.chunks}
    for chunk in part.chunks:
        gs = spaces[group_of[chunk.index]]
        low = _ChunkLowering(b, gs, choices[chunk.index], [node_kernel[n] for n in chunk.external], chunk.index,
                             batch_invariant)
        for local, cid in gs.space.roots:
            node_kernel[chunk.nodes[local]] = low.tensor(cid)
    outputs = tuple((name, node_kernel[nid]) for name, nid in graph.outputs.items())
    exports = tuple((nid, node_kernel[nid]) for c in part.chunks for nid in c.exported)
    return verify(Program(tuple(b.kernels), tuple(inputs), outputs, exports, batch_invariant))


def lower_chunk_program(graph: Graph, chunk, gs: GroupSpace, cand: Candidate, batch_invariant: bool = False) -> Program:
    """One chunk alone: its external sources become inputs named "%<node id>", its exports outputs;
    a weight keeps its name, so the chunk reads it as the whole program does (the runtime's weights:
    held in its storage format, converted once per process), never as a value handed in, which the
    runtime would take for a KV cache when it has a storage format.

    Used to judge a group in isolation from exact (FP64) inputs, and to measure its amplification.
    """
    b = _Builder(weights=graph.weights)
    slots, inputs = [], []
    for nid in chunk.external:
        node = graph.nodes[nid]
        name = graph.weight_name(nid) or f"%{nid}"
        kid = b.add(kind=KernelKind.EXTERNAL, inputs=(), shape=node.shape, dtype=node.dtype, external=name,
                    label=f"external {name}")
        slots.append(kid)
        inputs.append((name, kid))
    low = _ChunkLowering(b, gs, cand, slots, chunk.index, batch_invariant)
    outputs = tuple((f"%{chunk.nodes[local]}", low.tensor(cid)) for local, cid in gs.space.roots)
    return verify(Program(tuple(b.kernels), tuple(inputs), outputs, batch_invariant=batch_invariant))
