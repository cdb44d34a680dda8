"""The ONNX op table: one entry per ONNX op type, keyed by its name (the coverage test reads it).

Each entry names the attributes it understands (any other attribute is refused, never ignored), the
handler that builds the op from GraphTensor calls, and whether folding it on known inputs is exact
(movement and selection ops are; float arithmetic is not, so it stays in the graph). An entry with no
handler is only ever folded: it may appear in shape subgraphs, never on run-time tensors.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..hlir.tensor import GraphTensor
from .kinds import ANY_KIND, EXACT_KINDS, INTEGER_KINDS
from .loader import BOOL, FLOAT, INT
from .values import NodeCtx, Tensor, Value
from .ops_cast import abs_, cast, castlike, compare, extreme
from .ops_index import concat_, gather, gather_nd, slice_, tile
from .ops_numeric import arith, floor_ceil, mod, neg

ANY = ANY_KIND  # movement: every kind
DATA = EXACT_KINDS + (BOOL,)  # values (not indices): selection and reductions that pick a value


@dataclass(frozen=True)
class OpSpec:
    fn: Callable[[NodeCtx], list[Value]] | None  # None: folded only (all inputs known at import)
    attrs: frozenset[str] | None = frozenset()  # None: any (folded by ONNX's reference, which reads them all)
    exact: bool = False  # folding on known inputs is exact, so do it even for float outputs
    static: tuple[int, ...] = ()  # inputs that must be known at import (shapes, axes, exponents)


def _spec(fn, attrs: str = "", exact: bool = False, static: tuple[int, ...] = ()) -> OpSpec:
    return OpSpec(fn, frozenset(attrs.split()), exact, static)


def _ax(axis: int, ndim: int) -> int:
    if not -ndim <= axis < max(ndim, 1):
        raise ValueError(f"axis {axis} out of range for rank {ndim}")
    return axis % max(ndim, 1)


def _out(t: GraphTensor, kind: str = FLOAT) -> list[Value]:
    return [Tensor(t, kind)]


# -- elementwise ------------------------------------------------------------------------------
def _unary(fn: Callable[[GraphTensor], GraphTensor]):
    return lambda c: _out(fn(c.tensor(0).t))


def _power(x: GraphTensor, n: int) -> GraphTensor:
    """x**n for an integer n >= 1 by repeated squaring (each product rounds once, as a chain does)."""
    result, base = None, x
    while n:
        if n & 1:
            result = base if result is None else result * base
        n >>= 1
        if n:
            base = base * base
    return result


def _pow(c: NodeCtx) -> list[Value]:
    x = c.tensor(0)
    y = np.unique(c.const(1, "the exponent").astype(np.float64))
    if y.size != 1:
        raise c.refuse("the exponent must be one value (a per-element exponent is not supported)")
    e = float(y[0])
    if e == 0.0:
        return [np.ones(x.shape, np.float32)]  # x**0 == 1 for every x, NaN included
    if e == int(e) and abs(e) <= 64:
        p = _power(x.t, abs(int(e)))
        return _out(p if e > 0 else p.recip())
    if abs(e) == 0.5:
        return _out(x.t.sqrt() if e > 0 else x.t.rsqrt())
    return _out((x.t.log2() * e).exp2())  # non-integer exponent: NaN for x < 0, as pow itself


def _where(c: NodeCtx) -> list[Value]:
    """cond*x + (1-cond)*y: exact for finite values of one kind (integers: held exactly in FP32)."""
    x, y = c.values[1], c.values[2]
    for i, v in ((1, x), (2, y)):
        if isinstance(v, np.ndarray) and not np.all(np.isfinite(v.astype(np.float64))):
            raise c.refuse(f"input {c.names[i]!r} holds inf/nan: Where is built as cond*x + (1-cond)*y, "
                           "which is exact only for finite values")
    integer = [isinstance(v, np.ndarray) and v.dtype.kind in "iu" or isinstance(v, Tensor) and v.kind in
               INTEGER_KINDS + (INT,) for v in (x, y)]
    a, b = ((c.integer(1), c.integer(2)) if any(integer) else (c.tensor(1, EXACT_KINDS), c.tensor(2, EXACT_KINDS)))
    if a.kind != b.kind:
        raise c.refuse(f"x and y hold {a.kind} and {b.kind} values")
    cond = c.values[0]
    if isinstance(cond, np.ndarray) and cond.size and np.all(cond == cond.flat[0]):
        pick = a if bool(cond.flat[0]) else b
        shape = np.broadcast_shapes(cond.shape, a.shape, b.shape)
        return _out(pick.t.broadcast_to(shape), a.kind)
    m = c.tensor(0, (BOOL,)).t
    return _out(m * a.t + (1.0 - m) * b.t, a.kind)


def _clip(c: NodeCtx) -> list[Value]:
    """max then min with constant bounds: selections, exact for floats and integers (held exactly)."""
    v = c.values[0]
    integer = isinstance(v, Tensor) and v.kind in INTEGER_KINDS + (INT,) or isinstance(v, np.ndarray) and \
        v.dtype.kind in "iu"
    x = c.integer(0) if integer else c.tensor(0)
    kind, x = x.kind, x.t
    lo = c.attr("min") if c.opset < 11 else (float(c.const(1, "min")) if c.has(1) else None)
    hi = c.attr("max") if c.opset < 11 else (float(c.const(2, "max")) if c.has(2) else None)
    if lo is not None:
        x = x.maximum(float(lo))
    if hi is not None:
        x = -((-x).maximum(-float(hi)))
    return _out(x, kind)


# -- logic on bool masks (held as 0/1 floats): each form below is exact on 0/1 ---------------------
def _logic(fn: Callable[[GraphTensor, GraphTensor], GraphTensor]):
    return lambda c: _out(fn(c.tensor(0, (BOOL,)).t, c.tensor(1, (BOOL,)).t), BOOL)


def _not(c: NodeCtx) -> list[Value]:
    return _out(1.0 - c.tensor(0, (BOOL,)).t, BOOL)


# -- reductions, norms, softmax ---------------------------------------------------------------
def _reduce_axes(c: NodeCtx, ndim: int) -> tuple[int, ...] | None:
    """The axes to reduce, () for 'all', None for 'no-op' (empty axes with noop_with_empty_axes)."""
    if c.has(1):
        axes = [int(a) for a in c.const(1, "axes").reshape(-1)]
    else:
        axes = list(c.attr("axes", []))
    if not axes:
        return None if c.attr("noop_with_empty_axes", 0) else tuple(range(ndim))
    return tuple(sorted({_ax(a, ndim) for a in axes}))


def _reduce(kind: str):
    def run(c: NodeCtx) -> list[Value]:
        x = c.tensor(0, DATA if kind == "max" else (FLOAT,))
        axes = _reduce_axes(c, len(x.shape))
        if axes is None:
            return [x]
        keep = bool(c.attr("keepdims", 1))
        t = x.t
        if kind == "sum":
            out = t.sum(axes, keep)
        elif kind == "mean":
            out = t.mean(axes, keep)
        elif kind == "max":
            out = t.max(axes, keep)
        else:  # l2
            out = t.square().sum(axes, keep).sqrt()
        return _out(out, x.kind if kind == "max" else FLOAT)
    return run


PROD_MAX_FACTORS = 256  # a ReduceProd is a chain of products: refused past this many per output value


def _reduce_prod(c: NodeCtx) -> list[Value]:
    """The product over the axes as a chain of FP32 products in index order (each rounds once, as every
    FP32 op of the graph; the FP64 reference multiplies exactly)."""
    x = c.tensor(0)
    axes = _reduce_axes(c, len(x.shape))
    if axes is None:
        return [x]
    if math.prod(x.shape[a] for a in axes) > PROD_MAX_FACTORS:
        raise c.refuse(f"a product of more than {PROD_MAX_FACTORS} factors per value is not supported")
    t = x.t
    for a in axes:
        parts = [t.slice(*[(i, i + 1) if ax == a else (0, d) for ax, d in enumerate(t.shape)])
                 for i in range(t.shape[a])]
        acc = parts[0]
        for p in parts[1:]:
            acc = acc * p
        t = acc  # the axis kept with size 1
    if not c.attr("keepdims", 1):
        t = t.reshape(tuple(d for ax, d in enumerate(t.shape) if ax not in axes))
    return _out(t)


def _softmax(c: NodeCtx) -> list[Value]:
    x = c.tensor(0).t
    if c.opset >= 13:
        return _out(x.softmax(_ax(c.attr("axis", -1), x.ndim)))
    axis = _ax(c.attr("axis", 1), x.ndim)  # opset < 13: softmax over the flattened trailing block
    shape = tuple(x.shape)
    flat = x.reshape(math.prod(shape[:axis]), math.prod(shape[axis:]))
    return _out(flat.softmax(-1).reshape(shape))


def _norm_axes(c: NodeCtx, ndim: int) -> tuple[int, ...]:
    if c.attr("stash_type", 1) != 1:
        raise c.refuse("stash_type other than 1 (FP32 statistics) is not supported")
    return tuple(range(_ax(c.attr("axis", -1), ndim), ndim))


def _layer_norm(c: NodeCtx) -> list[Value]:
    """(x - mean) * rsqrt(var + eps) * scale + bias, and the Mean / InvStdDev outputs when asked for."""
    x = c.tensor(0).t
    axes = _norm_axes(c, x.ndim)
    mean = x.mean(axes, keepdim=True)
    xc = x - mean
    inv_std = (xc.square().mean(axes, keepdim=True) + float(np.float32(c.attr("epsilon", 1e-5)))).rsqrt()
    y = xc * inv_std * c.tensor(1).t
    return [Tensor(y + c.tensor(2).t if c.has(2) else y, FLOAT), Tensor(mean, FLOAT), Tensor(inv_std, FLOAT)]


def _rms_norm(c: NodeCtx) -> list[Value]:
    x = c.tensor(0).t
    axes = _norm_axes(c, x.ndim)
    if len([o for o in c.node.output if o]) > 1:
        raise c.refuse("the InvStdDev output is not supported")
    y = x * (x.square().mean(axes, keepdim=True) + float(np.float32(c.attr("epsilon", 1e-5)))).rsqrt()
    return _out(y * c.tensor(1).t)


# -- linear algebra ---------------------------------------------------------------------------
def _matmul(c: NodeCtx) -> list[Value]:
    """numpy matmul; a 1-D operand makes it a matrix-vector product, Mul + SumReduce over k directly."""
    a, b = c.tensor(0).t, c.tensor(1).t
    if b.ndim == 1:
        return _out((a * b).sum(-1))
    if a.ndim == 1:
        return _out((a.reshape(a.shape[0], 1) * b).sum(-2))
    return _out(a @ b)


def _gemm(c: NodeCtx) -> list[Value]:
    a, b = c.tensor(0).t, c.tensor(1).t
    a = a.transpose() if c.attr("transA", 0) else a
    b = b.transpose() if c.attr("transB", 0) else b
    y = a @ b
    alpha, beta = float(np.float32(c.attr("alpha", 1.0))), float(np.float32(c.attr("beta", 1.0)))
    if alpha != 1.0:
        y = y * alpha
    if c.has(2) and beta != 0.0:
        bias = c.tensor(2).t
        y = y + (bias if beta == 1.0 else bias * beta)
    return _out(y)


# -- movement and indexing --------------------------------------------------------------------
def _reshape(c: NodeCtx) -> list[Value]:
    x = c.tensor(0, ANY)
    want = [int(d) for d in c.const(1, "shape")]
    if not c.attr("allowzero", 0):
        want = [x.shape[i] if d == 0 else d for i, d in enumerate(want)]
    if -1 in want:
        known = math.prod(d for d in want if d != -1)
        want[want.index(-1)] = math.prod(x.shape) // known
    return [Tensor(x.t.reshape(tuple(want)), x.kind)]


def _flatten(c: NodeCtx) -> list[Value]:
    x = c.tensor(0, ANY)
    axis = c.attr("axis", 1)
    axis = axis + len(x.shape) if axis < 0 else axis
    return [Tensor(x.t.reshape(math.prod(x.shape[:axis]), math.prod(x.shape[axis:])), x.kind)]


def _transpose(c: NodeCtx) -> list[Value]:
    x = c.tensor(0, ANY)
    perm = c.attr("perm", list(reversed(range(len(x.shape)))))
    return [Tensor(x.t.permute(tuple(perm)), x.kind)]


def _axes_arg(c: NodeCtx) -> list[int] | None:
    if c.has(1):
        return [int(a) for a in c.const(1, "axes").reshape(-1)]
    a = c.attr("axes")
    return None if a is None else list(a)


def _unsqueeze(c: NodeCtx) -> list[Value]:
    x = c.tensor(0, ANY)
    ndim = len(x.shape) + len(_axes_arg(c) or [])
    shape = list(x.shape)
    for a in sorted(_ax(a, ndim) for a in _axes_arg(c) or []):
        shape.insert(a, 1)
    return [Tensor(x.t.reshape(tuple(shape)), x.kind)]


def _squeeze(c: NodeCtx) -> list[Value]:
    x = c.tensor(0, ANY)
    axes = _axes_arg(c)
    drop = {_ax(a, len(x.shape)) for a in axes} if axes else {i for i, d in enumerate(x.shape) if d == 1}
    if any(x.shape[a] != 1 for a in drop):
        raise c.refuse(f"cannot squeeze axes {sorted(drop)} of shape {x.shape}")
    return [Tensor(x.t.reshape(tuple(d for i, d in enumerate(x.shape) if i not in drop)), x.kind)]


def _expand(c: NodeCtx) -> list[Value]:
    x = c.tensor(0, ANY)
    shape = np.broadcast_shapes(x.shape, tuple(int(d) for d in c.const(1, "shape")))
    return [Tensor(x.t.broadcast_to(shape), x.kind)]


def _split(c: NodeCtx) -> list[Value]:
    x = c.tensor(0, ANY)
    axis = _ax(c.attr("axis", 0), len(x.shape))
    d, n_out = x.shape[axis], len(c.node.output)
    if c.has(1):
        sizes = [int(v) for v in c.const(1, "split")]
    elif c.attr("split") is not None:
        sizes = list(c.attr("split"))
    else:
        n = c.attr("num_outputs", n_out)
        chunk = -(-d // n)
        sizes = [min(chunk, d - i * chunk) for i in range(n)]
    if sum(sizes) != d or len(sizes) != n_out:
        raise c.refuse(f"split sizes {sizes} do not cover dim {d} with {n_out} outputs")
    out, start = [], 0
    for size in sizes:
        ranges = [(0, dd) for dd in x.shape]
        ranges[axis] = (start, start + size)
        out.append(Tensor(x.t.slice(*ranges), x.kind))
        start += size
    return out


def _shape(c: NodeCtx) -> list[Value]:
    shape = np.array(c.values[0].shape, dtype=np.int64)
    end = c.attr("end")
    return [shape[c.attr("start", 0): end if end is not None else len(shape)]]


def _size(c: NodeCtx) -> list[Value]:
    return [np.array(math.prod(c.values[0].shape), dtype=np.int64)]


def _fold_only() -> OpSpec:
    return OpSpec(None, None, True)


REDUCE_ATTRS = "axes keepdims noop_with_empty_axes"
NORM_ATTRS = "axis epsilon stash_type"

OPS: dict[str, OpSpec] = {
    "Add": _spec(arith("Add")),
    "Sub": _spec(arith("Sub")),
    "Mul": _spec(arith("Mul")),
    "Div": _spec(arith("Div")),
    "Mod": _spec(mod, "fmod", exact=True),
    "Pow": _spec(_pow, static=(1,)),
    "Sqrt": _spec(_unary(GraphTensor.sqrt)),
    "Reciprocal": _spec(_unary(GraphTensor.recip)),
    "Exp": _spec(_unary(GraphTensor.exp)),
    "Log": _spec(_unary(GraphTensor.log)),
    "Tanh": _spec(_unary(GraphTensor.tanh)),
    "Erf": _spec(_unary(GraphTensor.erf)),
    "Relu": _spec(_unary(GraphTensor.relu), exact=True),
    "Sigmoid": _spec(_unary(GraphTensor.sigmoid)),
    "Neg": _spec(neg, exact=True),
    "Clip": _spec(_clip, "min max", exact=True, static=(1, 2)),
    "Where": _spec(_where, exact=True),
    "Cast": _spec(cast, "to saturate", exact=True),
    "CastLike": _spec(castlike, "saturate", exact=True),
    "Abs": _spec(abs_, exact=True),
    **{op: _spec(compare(op), exact=True) for op in ("Less", "Greater", "Equal", "LessOrEqual", "GreaterOrEqual")},
    "Max": _spec(extreme(True), exact=True),
    "Min": _spec(extreme(False), exact=True),
    "Softmax": _spec(_softmax, "axis"),
    "LayerNormalization": _spec(_layer_norm, NORM_ATTRS),
    "RMSNormalization": _spec(_rms_norm, NORM_ATTRS),
    "SimplifiedLayerNormalization": _spec(_rms_norm, NORM_ATTRS),
    "ReduceMean": _spec(_reduce("mean"), REDUCE_ATTRS, static=(1,)),
    "ReduceSum": _spec(_reduce("sum"), REDUCE_ATTRS, static=(1,)),
    "ReduceMax": _spec(_reduce("max"), REDUCE_ATTRS, exact=True, static=(1,)),
    "ReduceL2": _spec(_reduce("l2"), REDUCE_ATTRS, static=(1,)),
    "MatMul": _spec(_matmul),
    "Gemm": _spec(_gemm, "alpha beta transA transB"),
    "Gather": _spec(gather, "axis", exact=True),
    "GatherND": _spec(gather_nd, "batch_dims", exact=True, static=(1,)),
    "And": _spec(_logic(lambda a, b: a * b), exact=True),
    "Or": _spec(_logic(lambda a, b: a + b - a * b), exact=True),
    "Xor": _spec(_logic(lambda a, b: (a - b).square()), exact=True),
    "Not": _spec(_not, exact=True),
    "Reshape": _spec(_reshape, "allowzero", exact=True, static=(1,)),
    "Transpose": _spec(_transpose, "perm", exact=True),
    "Flatten": _spec(_flatten, "axis", exact=True),
    "Unsqueeze": _spec(_unsqueeze, "axes", exact=True, static=(1,)),
    "Squeeze": _spec(_squeeze, "axes", exact=True, static=(1,)),
    "Concat": _spec(concat_, "axis", exact=True),
    "Slice": _spec(slice_, "starts ends axes", exact=True, static=(1, 2, 3, 4)),
    "Expand": _spec(_expand, exact=True, static=(1,)),
    "Split": _spec(_split, "axis split num_outputs", exact=True, static=(1,)),
    "Identity": _spec(lambda c: [c.values[0]], exact=True),
    "Shape": _spec(_shape, "start end", exact=True),
    "Size": _spec(_size, exact=True),
    "Constant": OpSpec(None, frozenset("value value_float value_floats value_int value_ints".split()), True),
    "ConstantOfShape": OpSpec(None, frozenset({"value"}), True, (0,)),
    # shape-subgraph arithmetic: folded on known values, refused on run-time tensors
    "Floor": _spec(floor_ceil(ceil=False), exact=True),
    "Ceil": _spec(floor_ceil(ceil=True), exact=True),
    "ReduceProd": _spec(_reduce_prod, REDUCE_ATTRS, static=(1,)),
    "Tile": _spec(tile, exact=True, static=(1,)),
    **{op: _fold_only() for op in ("Range", "NonZero")},
}

# Ops whose integer results are values of some of their inputs (moved or selected): the importer gives
# such a result the range of those inputs (None: every input); every other op records its own range step.
VALUE_INPUTS: dict[str, tuple[int, ...] | None] = {
    **{op: (0,) for op in ("Reshape", "Transpose", "Flatten", "Unsqueeze", "Squeeze", "Slice", "Expand", "Split",
                           "Identity", "Gather", "GatherND", "ReduceMax", "Tile", "Cast", "CastLike")},
    "Concat": None, "Max": None, "Min": None, "Clip": None, "Where": (1, 2)}

