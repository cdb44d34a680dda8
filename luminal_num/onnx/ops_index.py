"""ONNX Gather, GatherND, Slice, Concat and Tile: values moved or picked, never changed.

Views where the pattern allows (slices, steps), one Gather of known indices otherwise (negative steps),
a concatenation of padded pieces (Concat, Tile: adding zeros is exact). Indices (INT32 in the graph) that
are moved by arithmetic (Concat, Tile) or gathered from are taken as integer data: exact in FP32 within
the ranges OnnxModel.feed checks.
"""
from __future__ import annotations

import math

import numpy as np

from ..hlir.tensor import GraphTensor, concat
from .kinds import ANY_KIND, EXACT_KINDS, np_dtype
from .loader import BOOL, INT
from .values import NodeCtx, Tensor, Value

ANY = ANY_KIND
DATA = EXACT_KINDS + (BOOL,)


def _ax(axis: int, ndim: int) -> int:
    if not -ndim <= axis < max(ndim, 1):
        raise ValueError(f"axis {axis} out of range for rank {ndim}")
    return axis % max(ndim, 1)


def _out(t: GraphTensor, kind: str) -> list[Value]:
    return [Tensor(t, kind)]


def _holds_indices(c: NodeCtx, i: int) -> bool:
    v = c.values[i]
    return isinstance(v, Tensor) and v.kind == INT or isinstance(v, np.ndarray) and v.dtype.kind in "iu"


def _table(c: NodeCtx) -> Tensor:
    """A Gather's data: values of any kind but indices, which are taken as integer data (exact in FP32)."""
    return c.integer(0) if _holds_indices(c, 0) else c.tensor(0, DATA)



def gather(c: NodeCtx) -> list[Value]:
    data = _table(c)
    axis = _ax(c.attr("axis", 0), len(data.shape))
    n = data.shape[axis]
    idx_v = c.values[1]
    if isinstance(idx_v, np.ndarray):
        idx = idx_v.astype(np.int64)
        if np.any((idx < -n) | (idx >= n)):
            raise c.refuse(f"index out of range [-{n}, {n})")
        idx = np.where(idx < 0, idx + n, idx)
        if idx.ndim == 0:  # one index: a slice view that drops the axis
            ranges = [(0, d) for d in data.shape]
            ranges[axis] = (int(idx), int(idx) + 1)
            shape = data.shape[:axis] + data.shape[axis + 1:]
            return _out(data.t.slice(*ranges).reshape(shape), data.kind)
        indices = c.importer.materialize(f"{c.names[1]}:normalized:{n}", idx).t
    else:
        indices = c.tensor(1, (INT,)).t
    order = [axis] + [i for i in range(len(data.shape)) if i != axis]
    table = data.t.permute(order) if axis else data.t
    out = table.gather(indices)  # (idx..., other dims in order)
    k = indices.ndim
    if axis:
        perm = list(range(k, k + axis)) + list(range(k)) + list(range(k + axis, out.ndim))
        out = out.permute(perm)
    return _out(out, data.kind)



def gather_nd(c: NodeCtx) -> list[Value]:
    """GatherND with indices known at import (the exporters' mask indexing): the first k axes of data
    flattened into one, the index tuples raveled into it, then one Gather."""
    data = _table(c)
    if c.attr("batch_dims", 0) != 0:
        raise c.refuse("batch_dims other than 0 is not supported")
    idx = c.const(1, "the indices").astype(np.int64)
    k, shape = idx.shape[-1] if idx.ndim else 0, data.shape
    if not 1 <= k <= len(shape):
        raise c.refuse(f"index tuples of length {k} do not fit data of rank {len(shape)}")
    lead = np.array(shape[:k], dtype=np.int64)
    if np.any((idx < -lead) | (idx >= lead)):
        raise c.refuse(f"index out of range for the leading dims {tuple(shape[:k])}")
    flat = np.ravel_multi_index(tuple(np.moveaxis(np.where(idx < 0, idx + lead, idx), -1, 0)), tuple(shape[:k]))
    table = data.t.reshape(math.prod(shape[:k]), *shape[k:])
    if idx.ndim == 1:  # one index tuple: a slice view
        return _out(table.slice((int(flat), int(flat) + 1), *[(0, d) for d in shape[k:]]).reshape(shape[k:]),
                    data.kind)
    indices = c.importer.materialize(f"{c.names[1]}:raveled:{shape[:k]}", flat.astype(np.int64)).t
    return _out(table.gather(indices), data.kind)



def concat_(c: NodeCtx) -> list[Value]:
    """Concatenation is padding and adding zeros: exact for every kind the graph holds as FP32 values;
    indices (INT32 in the graph) are taken as integer data, whose range feed checks."""
    parts = [c.integer(i) if _holds_indices(c, i) else c.tensor(i, DATA) for i in range(len(c.values))]
    kinds = {p.kind for p in parts}
    if len(kinds) != 1:
        raise c.refuse(f"inputs mix {' and '.join(sorted(kinds))} values")
    return _out(concat([p.t for p in parts], _ax(c.attr("axis"), len(parts[0].shape))), parts[0].kind)


def _step_slice(t: GraphTensor, axis: int, start: int, stop: int, step: int) -> GraphTensor:
    """Every `step`-th element of [start, stop) on `axis`, as views: slice, pad to n*step, fold, pick column 0."""
    n = -(-(stop - start) // step)
    shape = list(t.shape)
    ranges = [(0, d) for d in shape]
    ranges[axis] = (start, min(start + n * step, shape[axis]))
    t = t.slice(*ranges)
    pads = [(0, 0)] * len(shape)
    pads[axis] = (0, n * step - (ranges[axis][1] - start))
    t = t.pad(*pads) if pads[axis][1] else t
    folded = shape[:axis] + [n, step] + shape[axis + 1:]
    t = t.reshape(tuple(folded))
    pick = [(0, d) for d in folded]
    pick[axis + 1] = (0, 1)
    return t.slice(*pick).reshape(tuple(shape[:axis] + [n] + shape[axis + 1:]))



def slice_(c: NodeCtx) -> list[Value]:
    x = c.tensor(0, ANY)
    ndim = len(x.shape)
    if c.opset < 10:
        starts, ends = list(c.attr("starts")), list(c.attr("ends"))
        axes, steps = list(c.attr("axes", range(len(starts)))), [1] * len(starts)
    else:
        starts = [int(v) for v in c.const(1, "starts")]
        ends = [int(v) for v in c.const(2, "ends")]
        axes = [int(v) for v in c.const(3, "axes")] if c.has(3) else list(range(len(starts)))
        steps = [int(v) for v in c.const(4, "steps")] if c.has(4) else [1] * len(starts)
    if 0 in steps:
        raise c.refuse("Slice with a zero step")
    # Python's clamping of start/stop is ONNX's, negative steps included
    picks = [(_ax(a, ndim), st, range(*slice(s, e, st).indices(x.shape[_ax(a, ndim)])))
             for s, e, a, st in zip(starts, ends, axes, steps)]
    if any(len(p) == 0 for _, _, p in picks):  # a zero-sized result has one value: known
        shape = list(x.shape)
        for a, _, p in picks:
            shape[a] = len(p)
        return [np.zeros(shape, dtype=np_dtype(x.kind))]
    t = x
    for a, st, picked in picks:
        s, e = picked.start, picked.stop
        if st < 0:
            t = _gather_along(c, t, a, np.array(picked, dtype=np.int64), f"{c.names[0]}:slice:{a}:{s}:{e}:{st}")
        elif st == 1:
            ranges = [(0, dd) for dd in t.shape]
            ranges[a] = (picked.start, picked.stop)
            t = Tensor(t.t.slice(*ranges), t.kind)
        else:
            t = Tensor(_step_slice(t.t, a, picked.start, picked.start + len(picked) * st, st), t.kind)
    return [t]


def _gather_along(c: NodeCtx, data: Tensor, axis: int, idx: np.ndarray, key: str) -> Tensor:
    """data's rows `idx` (known, in range) along `axis`: one Gather of the axis moved to the front."""
    if data.kind == INT:
        raise c.refuse("reversing indices (a negative step over an index tensor) is not supported")
    indices = c.importer.materialize(key, idx).t
    order = [axis] + [i for i in range(len(data.shape)) if i != axis]
    out = (data.t.permute(order) if axis else data.t).gather(indices)
    if axis:
        out = out.permute(list(range(1, axis + 1)) + [0] + list(range(axis + 1, out.ndim)))
    return Tensor(out, data.kind)


def tile(c: NodeCtx) -> list[Value]:
    """Tile: the input repeated along each axis, as a concatenation (pads and exact additions of zeros)."""
    x = c.integer(0) if _holds_indices(c, 0) else c.tensor(0, DATA)
    reps = [int(r) for r in c.const(1, "repeats").reshape(-1)]
    if len(reps) != len(x.shape) or any(r < 1 for r in reps):
        raise c.refuse(f"repeats {reps} for rank {len(x.shape)} (zero repeats give an empty tensor: not supported)")
    t = x.t
    for axis, r in enumerate(reps):
        if r > 1:
            t = concat([t] * r, axis)
    return _out(t, x.kind)
