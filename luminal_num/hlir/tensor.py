"""GraphTensor: the user-facing frontend. Arithmetic builds primop nodes; movement edits views only.

Composite ops (exp, log, matmul, softmax's friends, norms, activations, concat) are written in terms
of the primops, so later stages only ever see the ~20 HLIR ops.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np

from ..dtypes.formats import F32, INT32, Format
from .node import InputInfo, Source
from .ops import CUSTOM_KINDS, Op
from .shape import ShapeTracker
from .symbolic import Dim, as_dim, is_const, prod

def _user_op(name: str):
    """Record the primops a method adds as one instance of the framework op `name` (Graph.op_scopes)."""
    def wrap(fn):
        @functools.wraps(fn)
        def inner(self, *args, **kwargs):
            with self.graph.op_scope(name):
                return fn(self, *args, **kwargs)
        return inner
    return wrap


if TYPE_CHECKING:  # annotations only: graph.py imports this module to return GraphTensors
    from .graph import Graph

LOG2_E = 1.4426950408889634  # float64 nearest to 1/ln 2
LN_2 = 0.6931471805599453    # float64 nearest to ln 2


@dataclass(frozen=True)
class GraphTensor:
    graph: Graph
    id: int
    st: ShapeTracker
    dtype: Format

    # -- construction -------------------------------------------------------------------------
    @staticmethod
    def _input(g: Graph, name: str, shape, dtype: Format, value_range, weight) -> "GraphTensor":
        if name in g.inputs:
            raise ValueError(f"input {name!r} already exists")
        shape = tuple(as_dim(d) for d in shape)
        nid = g.add(Op.INPUT, [], shape, dtype, {"name": name})
        g.inputs[name] = InputInfo(name, nid, shape, dtype, weight is not None, value_range)
        if weight is not None:
            g.weights[name] = weight
        return GraphTensor(g, nid, ShapeTracker.contiguous(shape), dtype)

    @staticmethod
    def _constant(g: Graph, value, dtype: Format) -> "GraphTensor":
        value = value if not isinstance(value, (int, float, np.floating, np.integer)) else float(value)
        key = (repr(value), dtype.name, g.chunk)  # one node per constant per chunk (no cross-chunk edges)
        if key not in g._consts:
            g._consts[key] = g.add(Op.CONSTANT, [], (), dtype, {"value": value})
        return GraphTensor(g, g._consts[key], ShapeTracker.contiguous(()), dtype)

    @staticmethod
    def _iota(g: Graph, length: Dim, dtype: Format) -> "GraphTensor":
        length = as_dim(length)
        nid = g.add(Op.IOTA, [], (length,), dtype, {"length": length})
        return GraphTensor(g, nid, ShapeTracker.contiguous((length,)), dtype)

    def _node(self, op: Op, srcs: Sequence["GraphTensor"], shape, dtype: Format | None = None, **attrs) -> "GraphTensor":
        nid = self.graph.add(op, [Source(t.id, t.st) for t in srcs], tuple(shape), dtype or self.dtype, attrs)
        return GraphTensor(self.graph, nid, ShapeTracker.contiguous(shape), dtype or self.dtype)

    # -- shape --------------------------------------------------------------------------------
    @property
    def shape(self) -> tuple[Dim, ...]:
        return self.st.shape

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def _with(self, st: ShapeTracker) -> "GraphTensor":
        return GraphTensor(self.graph, self.id, st, self.dtype)

    def permute(self, *order) -> "GraphTensor":
        order = order[0] if len(order) == 1 and isinstance(order[0], (tuple, list)) else order
        return self._with(self.st.permute(tuple(o % self.ndim for o in order)))

    def transpose(self, a: int = -2, b: int = -1) -> "GraphTensor":
        order = list(range(self.ndim))
        order[a], order[b] = order[b], order[a]
        return self.permute(order)

    def reshape(self, *shape) -> "GraphTensor":
        shape = shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape
        return self._with(self.st.reshape(shape))

    def expand_dim(self, axis: int, size: Dim) -> "GraphTensor":
        return self._with(self.st.expand_dim(axis if axis >= 0 else self.ndim + 1 + axis, size))

    def unsqueeze(self, axis: int) -> "GraphTensor":
        return self.expand_dim(axis, 1)

    def slice(self, *ranges) -> "GraphTensor":
        return self._with(self.st.slice(ranges))

    def pad(self, *pads) -> "GraphTensor":
        return self._with(self.st.pad(pads))

    def broadcast_to(self, shape: Sequence[Dim]) -> "GraphTensor":
        shape = tuple(as_dim(d) for d in shape)
        if len(shape) < self.ndim:
            raise ValueError(f"cannot broadcast {self.shape} to {shape}")
        t = self
        for _ in range(len(shape) - self.ndim):
            t = t.expand_dim(0, 1)
        for ax, (have, want) in enumerate(zip(t.shape, shape)):
            if have == want:
                continue
            if have != 1:
                raise ValueError(f"cannot broadcast {self.shape} to {shape} (dim {ax}: {have} vs {want})")
            t = t._with(t.st.expand(ax, want))
        return t

    # -- elementwise --------------------------------------------------------------------------
    def _lift(self, other) -> "GraphTensor":
        if isinstance(other, GraphTensor):
            if other.graph is not self.graph:
                raise ValueError("tensors belong to different graphs")
            return other
        return GraphTensor._constant(self.graph, other, self.dtype)

    def _binary(self, op: Op, other, reverse: bool = False) -> "GraphTensor":
        other = self._lift(other)
        a, b = (other, self) if reverse else (self, other)
        shape = _broadcast_shape(a.shape, b.shape)
        return self._node(op, [a.broadcast_to(shape), b.broadcast_to(shape)], shape)

    def _unary(self, op: Op) -> "GraphTensor":
        return self._node(op, [self], self.shape)

    def __add__(self, o): return self._binary(Op.ADD, o)
    def __radd__(self, o): return self._binary(Op.ADD, o, reverse=True)
    def __mul__(self, o): return self._binary(Op.MUL, o)
    def __rmul__(self, o): return self._binary(Op.MUL, o, reverse=True)
    @_user_op("neg")
    def __neg__(self): return self * -1.0
    @_user_op("sub")
    def __sub__(self, o): return self + (-self._lift(o))
    @_user_op("rsub")
    def __rsub__(self, o): return self._lift(o) + (-self)
    @_user_op("div")
    def __truediv__(self, o): return self * self._lift(o).recip()
    @_user_op("__rtruediv__")
    def __rtruediv__(self, o): return self._lift(o) * self.recip()
    def __mod__(self, o): return self._binary(Op.MOD, o)
    def __lt__(self, o): return self._binary(Op.LESS_THAN, o)
    def __gt__(self, o): return self._binary(Op.LESS_THAN, o, reverse=True)

    def exp2(self): return self._unary(Op.EXP2)
    def log2(self): return self._unary(Op.LOG2)
    def sin(self): return self._unary(Op.SIN)
    def recip(self): return self._unary(Op.RECIP)
    def sqrt(self): return self._unary(Op.SQRT)
    @_user_op("exp")
    def exp(self): return (self * LOG2_E).exp2()
    @_user_op("log")
    def log(self): return self.log2() * LN_2
    @_user_op("cos")
    def cos(self): return (self + math.pi / 2).sin()
    @_user_op("rsqrt")
    def rsqrt(self): return self.sqrt().recip()
    @_user_op("square")
    def square(self): return self * self
    @_user_op("sigmoid")
    def sigmoid(self): return ((-self).exp() + 1.0).recip()
    def tanh(self): return self.custom("tanh")  # one op: exact reference, tight static slope, CUDA tanhf
    @_user_op("relu")
    def relu(self): return self * (self > 0.0)
    @_user_op("maximum")
    def maximum(self, o):
        o = self._lift(o)
        gt = self > o
        return self * gt + o * (1.0 - gt)

    def custom(self, kind: str) -> "GraphTensor":
        if kind not in CUSTOM_KINDS:
            raise ValueError(f"unknown custom elementwise {kind!r}; known: {sorted(CUSTOM_KINDS)}")
        return self._node(Op.CUSTOM, [self], self.shape, kind=kind)

    def erf(self): return self.custom("erf")

    def cast(self, dtype: Format) -> "GraphTensor":
        return self._node(Op.CAST, [self], self.shape, dtype)

    # -- reductions ---------------------------------------------------------------------------
    def _reduce(self, op: Op, axis, keepdim: bool) -> "GraphTensor":
        axes = sorted({a % self.ndim for a in ((axis,) if isinstance(axis, int) else
                                                 tuple(range(self.ndim)) if axis is None else axis)}, reverse=True)
        t, shape = self, list(self.shape)
        for ax in axes:
            del shape[ax]
            t = t._node(op, [t], tuple(shape), axis=ax)
        if keepdim:
            for ax in sorted(axes):
                t = t.unsqueeze(ax)
        return t

    def sum(self, axis=-1, keepdim: bool = False): return self._reduce(Op.SUM_REDUCE, axis, keepdim)
    def max(self, axis=-1, keepdim: bool = False): return self._reduce(Op.MAX_REDUCE, axis, keepdim)

    @_user_op("mean")
    def mean(self, axis=-1, keepdim: bool = False):
        axes = (axis,) if isinstance(axis, int) else tuple(range(self.ndim)) if axis is None else axis
        n = prod(self.shape[a] for a in axes)
        inv = (1.0 / n) if is_const(n) else GraphTensor._constant(self.graph, n, self.dtype).recip()
        return self.sum(axis, keepdim) * inv

    def softmax(self, axis: int = -1) -> "GraphTensor":
        return self._node(Op.SOFTMAX, [self], self.shape, axis=axis % self.ndim)

    # -- linear algebra -----------------------------------------------------------------------
    @_user_op("matmul")
    def matmul(self, other: "GraphTensor") -> "GraphTensor":
        """(..., m, k) @ (..., k, n) as Mul over broadcast views + SumReduce over k."""
        a, b = self, other
        if a.ndim < 2 or b.ndim < 2:
            raise ValueError(f"matmul needs rank >= 2, got {a.shape} @ {b.shape}")
        if a.shape[-1] != b.shape[-2]:
            raise ValueError(f"matmul inner dims differ: {a.shape} @ {b.shape}")
        m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
        batch = _broadcast_shape(a.shape[:-2], b.shape[:-2])
        a3 = a.expand_dim(a.ndim - 1, n)          # (..., m, n, k)
        b3 = b.transpose(-2, -1).expand_dim(b.ndim - 2, m)  # (..., m, n, k)
        full = batch + (m, n, k)
        prod_ = a3._node(Op.MUL, [a3.broadcast_to(full), b3.broadcast_to(full)], full)
        out = prod_._node(Op.SUM_REDUCE, [prod_], full[:-1], axis=len(full) - 1)
        self.graph.matmuls.append(out.id)
        return out

    __matmul__ = matmul

    # -- norms and activations ----------------------------------------------------------------
    @_user_op("layer_norm")
    def layer_norm(self, weight=None, bias=None, eps: float = 1e-5, axis: int = -1) -> "GraphTensor":
        xc = self - self.mean(axis, keepdim=True)
        y = xc * (xc.square().mean(axis, keepdim=True) + eps).rsqrt()
        if weight is not None:
            y = y * weight
        return y + bias if bias is not None else y

    @_user_op("rms_norm")
    def rms_norm(self, weight=None, eps: float = 1e-6, axis: int = -1) -> "GraphTensor":
        y = self * (self.square().mean(axis, keepdim=True) + eps).rsqrt()
        return y * weight if weight is not None else y

    @_user_op("gelu")
    def gelu(self, approximate: str = "tanh") -> "GraphTensor":
        if approximate == "tanh":
            inner = (self + self * self.square() * 0.044715) * math.sqrt(2.0 / math.pi)
            return self * 0.5 * (inner.tanh() + 1.0)
        if approximate == "none":
            return self * 0.5 * ((self * (1.0 / math.sqrt(2.0))).erf() + 1.0)
        raise ValueError(f"gelu approximate must be 'tanh' or 'none', got {approximate!r}")

    @_user_op("silu")
    def silu(self) -> "GraphTensor":
        return self * self.sigmoid()

    # -- indexing -----------------------------------------------------------------------------
    def gather(self, indices: "GraphTensor") -> "GraphTensor":
        """Embedding lookup: rows of self (V, ...) picked by integer `indices` (any shape)."""
        return self._node(Op.GATHER, [self, indices], tuple(indices.shape) + tuple(self.shape[1:]))

    def scatter(self, src: "GraphTensor", indices: "GraphTensor") -> "GraphTensor":
        """KV-cache write: a copy of self (N, ...) with rows `indices` (M,) replaced by src (M, ...)."""
        if tuple(src.shape[1:]) != tuple(self.shape[1:]) or indices.ndim != 1 or src.shape[0] != indices.shape[0]:
            raise ValueError(f"scatter: dest {self.shape}, src {src.shape}, indices {indices.shape} do not fit")
        return self._node(Op.SCATTER, [self, src, indices], self.shape)


def _broadcast_shape(a: Sequence[Dim], b: Sequence[Dim]) -> tuple[Dim, ...]:
    out = []
    for i in range(max(len(a), len(b))):
        da = a[len(a) - 1 - i] if i < len(a) else 1
        db = b[len(b) - 1 - i] if i < len(b) else 1
        if da == db or db == 1:
            out.append(da)
        elif da == 1:
            out.append(db)
        else:
            raise ValueError(f"shapes {tuple(a)} and {tuple(b)} do not broadcast")
    return tuple(reversed(out))


def concat(tensors: Sequence[GraphTensor], axis: int = 0) -> GraphTensor:
    """Concatenate by padding each piece to the full extent (masked views) and adding."""
    axis = axis % tensors[0].ndim
    total: Dim = 0
    for t in tensors:
        total = total + t.shape[axis]
    out, before = None, 0
    for t in tensors:
        pads = [(0, 0)] * t.ndim
        pads[axis] = (before, total - before - t.shape[axis])
        piece = t.pad(*pads)
        out = piece if out is None else out + piece
        before = before + t.shape[axis]
    return out


def embedding(table: GraphTensor, ids: GraphTensor) -> GraphTensor:
    return table.gather(ids)


def index_input(graph: Graph, name: str, shape) -> GraphTensor:
    """An integer input (token ids, cache positions)."""
    return graph.input(name, shape, INT32)
