"""Lower chosen e-nodes (one candidate per chunk) to an LLIR Program.

Chunks are lowered in graph order; a chunk's external slots resolve to graph inputs or to the
kernels that earlier chunks exported. Interned ids (views, constants, layouts) are read back from
the group's tables. A Gemm whose variant scales A dynamically becomes two kernels: QUANTIZE (A in
the variant's format, contiguous (batch, M, K), scales beside it) and the Gemm reading that buffer.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from ..dtypes.formats import get as get_format
from ..dtypes.variants import GEMM_VARIANTS
from ..hlir.gemm import GemmLayout
from ..hlir.graph import Graph
from ..hlir.ops import Op
from ..hlir.partition import Partition
from ..hlir.shape import ShapeTracker
from ..search.choice import Candidate, ClassRef, ENode
from ..search.egraph import BINARY_BY_NAME, UNARY_BY_NAME
from ..search.saturate import GroupSpace
from .llir import (FApply, FConstV, FExpr, FLoad, FRoundTo, Kernel, KernelInput, KernelKind, Program,
                   quantized_a_view)


@dataclass
class _Builder:
    kernels: list[Kernel] = field(default_factory=list)
    quantized: dict[tuple, int] = field(default_factory=dict)  # one QUANTIZE per (A read, layout, variant)

    def add(self, **kw) -> int:
        k = Kernel(id=len(self.kernels), **kw)
        self.kernels.append(k)
        return k.id

    def quantize(self, a: KernelInput, layout: GemmLayout, precision: str, chunk: int, label: str) -> int:
        """The QUANTIZE kernel of A for this Gemm (shared by Gemms reading the same A the same way)."""
        key = (a, layout, precision)
        if key not in self.quantized:
            self.quantized[key] = self.add(kind=KernelKind.QUANTIZE, inputs=(a,),
                                           shape=(layout.batch, layout.m, layout.k),
                                           dtype=GEMM_VARIANTS[precision].a_format, precision=precision,
                                           layout=layout, chunk=chunk, label=label)
        return self.quantized[key]


class _ChunkLowering:
    def __init__(self, b: _Builder, gs: GroupSpace, cand: Candidate, slots: list[int], chunk: int):
        self.b, self.gs, self.space, self.t = b, gs, gs.space, gs.tables
        self.choice, self.slots, self.chunk = cand.as_dict(), slots, chunk
        self.memo: dict[str, int] = {}

    def node(self, cid: str) -> ENode:
        return self.space.classes[cid][self.choice[cid]]

    def view(self, vid: int) -> ShapeTracker:
        return self.t.views[vid]

    def const(self, c: int):
        v = self.t.constants[c]
        return float.fromhex(v[1]) if isinstance(v, tuple) and v[0] == "f" else v

    def tensor(self, cid: str) -> int:
        if cid not in self.memo:
            self.memo[cid] = self._tensor(cid, self.node(cid))
        return self.memo[cid]

    def _tensor(self, cid: str, n: ENode) -> int:
        op, ch = n.op, n.children
        origin = self.space.class_origin.get(cid, op)
        label = f"{origin} (chunk {self.chunk}, {op})"
        common = dict(chunk=self.chunk, label=label)
        if op == "KExt":
            return self.slots[ch[0]]
        if op == "KVariant":  # an alias: consumers read the low-precision buffer and widen on load
            return self.tensor(ch[0].id)
        if op == "KConst":
            return self.b.add(kind=KernelKind.CONST, inputs=(), shape=(), dtype=get_format(ch[1]),
                              value=self.const(ch[0]), **common)
        if op == "KIota":
            length = self.t.dims[ch[0]]
            return self.b.add(kind=KernelKind.IOTA, inputs=(), shape=(length,), dtype=get_format(ch[1]),
                              value=length, **common)
        if op in ("Ew", "KSum", "KMax", "KSoftmax"):
            inputs: list[KernelInput] = []
            shapes: list = []
            body = self.scalar(ch[0].id, inputs, shapes)
            body_shape = shapes[0]
            if any(s_ != body_shape for s_ in shapes):
                raise ValueError(f"{op} body reads views of different shapes {set(shapes)}")
            if op == "Ew":
                return self.b.add(kind=KernelKind.ELEMENTWISE, inputs=tuple(inputs), shape=body_shape,
                                  dtype=get_format(ch[1]), body=body, body_shape=body_shape, **common)
            axis = ch[1]
            out_shape = body_shape if op == "KSoftmax" else body_shape[:axis] + body_shape[axis + 1:]
            kind = {"KSum": KernelKind.SUM, "KMax": KernelKind.MAX, "KSoftmax": KernelKind.SOFTMAX}[op]
            acc = get_format(ch[2]) if op == "KSum" else None
            prec = ch[2] if op == "KSoftmax" else None
            return self.b.add(kind=kind, inputs=tuple(inputs), shape=out_shape, dtype=get_format(ch[-1]), body=body,
                              body_shape=body_shape, axis=axis, acc=acc, precision=prec, **common)
        if op == "KGemm":
            a, va, bb, vb, lay, prec, dt = ch
            layout = self.t.layouts[lay]
            a_in = KernelInput(self.tensor(a.id), self.view(va))
            a_scale = GEMM_VARIANTS[prec].a_scale
            if a_scale is not None and not a_scale.static:  # activations: scales computed at run time
                q = self.b.quantize(a_in, layout, prec, self.chunk,
                                    f"{origin} (chunk {self.chunk}, quantize A: {prec})")
                a_in = KernelInput(q, quantized_a_view(layout))
            ins = (a_in, KernelInput(self.tensor(bb.id), self.view(vb)))
            shape = tuple(d for i, d in enumerate(layout.full_shape) if i != layout.k_axis)
            return self.b.add(kind=KernelKind.GEMM, inputs=ins, shape=shape, dtype=get_format(dt), layout=layout,
                              precision=prec, **common)
        if op == "KGather":
            x, vx, y, vy, dt = ch
            ins = (KernelInput(self.tensor(x.id), self.view(vx)), KernelInput(self.tensor(y.id), self.view(vy)))
            shape = tuple(self.view(vy).shape) + tuple(self.view(vx).shape[1:])
            return self.b.add(kind=KernelKind.GATHER, inputs=ins, shape=shape, dtype=get_format(dt), **common)
        if op in ("KScatter", "KScatterNoCopy"):
            d, vd, s, vs, i, vi, dt = ch
            dest_cls = self.node(d.id).children[0].id if op == "KScatterNoCopy" else d.id
            ins = (KernelInput(self.tensor(dest_cls), self.view(vd)), KernelInput(self.tensor(s.id), self.view(vs)),
                   KernelInput(self.tensor(i.id), self.view(vi)))
            nocopy = op == "KScatterNoCopy"
            return self.b.add(kind=KernelKind.SCATTER_NOCOPY if nocopy else KernelKind.SCATTER, inputs=ins,
                              shape=tuple(self.view(vd).shape), dtype=get_format(dt), aliases=0 if nocopy else None,
                              **common)
        raise ValueError(f"e-node {op} is not a tensor kernel")

    def scalar(self, cid: str, inputs: list[KernelInput], shapes: list) -> FExpr:
        """The body expression; `shapes` collects the iteration shape of every leaf (all must agree)."""
        n = self.node(cid)
        op, ch = n.op, n.children
        if op == "Load":
            ki = KernelInput(self.tensor(ch[0].id), self.view(ch[1]))
            if ki not in inputs:
                inputs.append(ki)
            shapes.append(ki.view.shape)
            return FLoad(inputs.index(ki))
        if op == "FConst":
            shapes.append(self.view(ch[1]).shape)
            return FConstV(self.const(ch[0]))
        if op == "FRound":
            inner = self.scalar(ch[0].id, inputs, shapes)
            if ch[1] == "f32":
                return inner  # bodies compute in FP32: rounding to it is exact
            reads = [a.children[0].id for a in self.space.classes[cid] if a.op == "Load"]
            origin = self.space.class_origin.get(reads[0], "") if reads else ""
            return FRoundTo(inner, get_format(ch[1]), origin)
        if op == "FCustom":
            return FApply(Op.CUSTOM, (self.scalar(ch[1].id, inputs, shapes),), kind=ch[0])
        hop = UNARY_BY_NAME.get(op) or BINARY_BY_NAME.get(op)
        if hop is None:
            raise ValueError(f"e-node {op} is not a scalar expression")
        return FApply(hop, tuple(self.scalar(c.id, inputs, shapes) for c in ch if isinstance(c, ClassRef)))


def lower_program(graph: Graph, part: Partition, spaces: Mapping[str, GroupSpace],
                  choices: Mapping[int, Candidate]) -> Program:
    """The LLIR program for the whole graph: chunk c uses `choices[c]` in its group's space."""
    b = _Builder()
    node_kernel: dict[int, int] = {}
    inputs = []
    for name, info in graph.inputs.items():
        node_kernel[info.node] = b.add(kind=KernelKind.EXTERNAL, inputs=(), shape=info.shape, dtype=info.dtype,
                                       external=name, label=f"input:{name}")
        inputs.append((name, node_kernel[info.node]))
    group_of = {c.index: g.key for g in part.groups for c in g.chunks}
    for chunk in part.chunks:
        gs = spaces[group_of[chunk.index]]
        low = _ChunkLowering(b, gs, choices[chunk.index], [node_kernel[n] for n in chunk.external], chunk.index)
        for local, cid in gs.space.roots:
            node_kernel[chunk.nodes[local]] = low.tensor(cid)
    outputs = tuple((name, node_kernel[nid]) for name, nid in graph.outputs.items())
    exports = tuple((nid, node_kernel[nid]) for c in part.chunks for nid in c.exported)
    return _legalize_inplace(Program(tuple(b.kernels), tuple(inputs), outputs, exports))


def _legalize_inplace(p: Program) -> Program:
    """A no-copy scatter whose destination has another reader (or is an output) becomes a copy."""
    readers: dict[int, int] = {}
    for k in p.kernels:
        for inp in k.inputs:
            readers[inp.buffer] = readers.get(inp.buffer, 0) + 1
    outs = {kid for _, kid in p.outputs}
    fixed = []
    for k in p.kernels:
        if k.kind is KernelKind.SCATTER_NOCOPY:
            dest = k.inputs[0].buffer
            if readers.get(dest, 0) > 1 or dest in outs:
                k = Kernel(**{**k.__dict__, "kind": KernelKind.SCATTER, "aliases": None})
        fixed.append(k)
    return Program(tuple(fixed), p.inputs, p.outputs, p.exports)


def lower_chunk_program(graph: Graph, chunk, gs: GroupSpace, cand: Candidate) -> Program:
    """One chunk alone: its external sources become inputs named "%<node id>", its exports outputs.

    Used to judge a group in isolation from exact (FP64) inputs, and to measure its amplification.
    """
    b = _Builder()
    slots, inputs = [], []
    for nid in chunk.external:
        node = graph.nodes[nid]
        kid = b.add(kind=KernelKind.EXTERNAL, inputs=(), shape=node.shape, dtype=node.dtype, external=f"%{nid}",
                    label=f"external %{nid}")
        slots.append(kid)
        inputs.append((f"%{nid}", kid))
    low = _ChunkLowering(b, gs, cand, slots, chunk.index)
    outputs = tuple((f"%{chunk.nodes[local]}", low.tensor(cid)) for local, cid in gs.space.roots)
    return _legalize_inplace(Program(tuple(b.kernels), tuple(inputs), outputs))
