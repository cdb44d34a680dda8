"""Reference evaluation of an HLIR graph with numpy.

`precision="f64"`: every op in float64 — the judge of every later stage.
`precision="f32"`: each elementwise op computed exactly (float64) then rounded once to the node's
dtype (what a correctly rounded FP32 unit does); SumReduce accumulates in float32 (numpy's pairwise
order); Softmax, a fused op, is computed in float64 and rounded once. Inputs are rounded to their
declared dtype first.

A model whose FP64 weights do not fit half the weight cache (`streams`: a 1B model's are 10 GB) is
evaluated without an FP64 copy of any large weight: such a weight's value stays its FP32 array, a
Gemm reading it converts B a block of columns at a time, a Gather converts the rows it reads, and any
other reader converts what it reads. Every value is the float64 the cached copy would give (an FP32
value widens exactly); only what is held at once changes. Cached conversions would be evicted before
their next use (every pass reads the layers in order), so caching them only pushes out what the cache
is for.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Callable, Collection, Mapping, Sequence

import numpy as np

from ..dtypes.formats import Kind
from ..dtypes.rounding import store
from .gemm import (GemmLayout, gemm_layouts, gemm_operand_a, gemm_operand_b, gemm_result, read_operand, reads_k_major,
                   split_operand)
from .graph import Graph, Node
from .ops import BINARY_OPS, CUSTOM_KINDS, UNARY_OPS, Op
from .store import STREAMING, release_points
from .symbolic import evaluate as eval_dim
from .weightcache import WEIGHTS

PRECISIONS = ("f64", "f32")


def softmax(x: np.ndarray, axis: int, out: np.ndarray | None = None) -> np.ndarray:
    """exp(x - max) / sum, each step in x's precision; `out` (may be x itself) saves the temporaries."""
    m = np.max(x, axis=axis, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.subtract(x, m, out=out)
    np.exp(e, out=e)
    e /= np.sum(e, axis=axis, keepdims=True)
    return e


def _round(x: np.ndarray, node_dtype, precision: str) -> np.ndarray:
    if precision == "f64":
        return x
    return store(x, node_dtype)


def _input(node: Node, srcs, graph: Graph, inputs, bindings, precision: str) -> np.ndarray:
    """A graph input rounded to its dtype; a weight's value is converted once per process (weightcache)."""
    name = node.attr("name")
    if name in graph.weights:
        val = graph.weights[name]
        return WEIGHTS.get(val, ("reference", precision, node.dtype.name), lambda: _input_value(val, node, precision))
    return _input_value(inputs[name], node, precision)


def fp64_weight(val: np.ndarray) -> np.ndarray:
    """An FP32 weight's float64 value, converted once per process and shared with the graph's FP64
    evaluation (the same cache entry as _input's): no caller holds a model's FP64 copy of its own."""
    return WEIGHTS.get(val, ("reference", "f64", "F32"), lambda: _read_only(np.asarray(val, dtype=np.float64)))


STREAM_MIN_BYTES = 4 << 20    # FP32 weights below this are converted as before (norm gains, biases)
GEMM_BLOCK_BYTES = 2 << 20    # FP64 columns of a streamed Gemm's B converted at a time (in cache: as fast as an FP64 copy)


def streams(graph: Graph) -> bool:
    """Whether the graph's FP64 evaluation streams its weights: their FP64 copies exceed half the
    process's weight cache (the budget the compile's memory plan sets)."""
    fp64 = sum(8 * int(np.size(w)) for w in graph.weights.values())
    return fp64 > WEIGHTS.budget_bytes // 2


def _streamed_weight(graph: Graph, node: Node, precision: str):
    """A large FP32 weight's own array, for an FP64 evaluation that streams (None: converted as before)."""
    name = node.attr("name") if node.op is Op.INPUT else None
    if precision != "f64" or name not in graph.weights:
        return None
    w = graph.weights[name]
    return w if w.dtype == np.float32 and w.nbytes >= STREAM_MIN_BYTES and node.dtype.kind is Kind.FLOAT else None


def _wide(x: np.ndarray) -> np.ndarray:
    """An FP32 value (a streamed weight, or what was read of it) as float64 (exact)."""
    return np.asarray(x, dtype=np.float64) if x.dtype == np.float32 else x


def _matmul_streamed(a_each: Sequence[np.ndarray], b: np.ndarray) -> list[np.ndarray]:
    """a @ b for each float64 a, with one FP32 b (batch, K, N): B widened a block of columns at a time,
    each block once for every a (batches evaluated together read a streamed weight once, not once each;
    every product is the one a lone evaluation computes, block by block)."""
    outs = [np.empty((*np.broadcast_shapes(a.shape[:-2], b.shape[:-2]), a.shape[-2], b.shape[-1])) for a in a_each]
    step = max(1, GEMM_BLOCK_BYTES // (8 * max(1, b.shape[-2] * int(np.prod(b.shape[:-2])))))
    for s in range(0, b.shape[-1], step):
        block = np.asarray(b[..., s:s + step], dtype=np.float64)
        for a, out in zip(a_each, outs):
            out[..., s:s + step] = np.matmul(a, block)
    return outs


def _same_array(arrays: Sequence[np.ndarray]) -> bool:
    """Whether these are one array's values (one buffer, shape and strides): a weight's operand views."""
    first = arrays[0]
    key = lambda x: (x.__array_interface__["data"][0], x.shape, x.strides, x.dtype)  # noqa: E731
    return all(key(x) == key(first) for x in arrays[1:])


def _read_only(out: np.ndarray) -> np.ndarray:
    out.flags.writeable = False  # shared between evaluations: nobody may write into it
    return out


def _input_value(val, node: Node, precision: str) -> np.ndarray:
    val = np.asarray(val)
    out = val.astype(np.int64) if node.dtype.kind is Kind.INT else _round(val.astype(np.float64), node.dtype, precision)
    return _read_only(np.asarray(out))


def _constant(node: Node, srcs, graph, inputs, bindings, precision) -> np.ndarray:
    v = node.attr("value")
    return np.asarray(float(v) if isinstance(v, float) else float(eval_dim(v, bindings)), dtype=np.float64)


def _iota(node: Node, srcs, graph, inputs, bindings, precision) -> np.ndarray:
    return np.arange(eval_dim(node.attr("length"), bindings), dtype=np.float64)


def _elementwise(node: Node, srcs, graph, inputs, bindings, precision) -> np.ndarray:
    fn = CUSTOM_KINDS[node.attr("kind")].fn if node.op is Op.CUSTOM else node.op.decl.fn
    with np.errstate(all="ignore"):
        return _round(fn(*srcs), node.dtype, precision)


def _cast(node: Node, x: np.ndarray, precision: str) -> np.ndarray:
    """A Cast's value: integers (an INT32 input's int64 values) cast to a float dtype become float64, so the
    ops reading them compute on floats (numpy's reciprocal of an int64 array is an integer division)."""
    if node.dtype.kind is Kind.FLOAT and np.asarray(x).dtype.kind in "iub":
        x = np.asarray(x, dtype=np.float64)
    return _round(x, node.dtype, precision)


def _sum_reduce(node: Node, srcs, graph, inputs, bindings, precision) -> np.ndarray:
    acc = np.float32 if precision == "f32" else np.float64
    return _round(np.sum(srcs[0].astype(acc), axis=node.attr("axis")).astype(np.float64), node.dtype, precision)


def _softmax(node: Node, srcs, graph, inputs, bindings, precision) -> np.ndarray:
    with np.errstate(all="ignore"):
        return _round(softmax(srcs[0], node.attr("axis")), node.dtype, precision)


def _gather(node: Node, srcs, graph, inputs, bindings, precision) -> np.ndarray:
    table, idx = srcs
    return _wide(table[_indices(idx, table.shape[0], "gather")])  # a streamed table: the rows read


def _scatter(node: Node, srcs, graph, inputs, bindings, precision) -> np.ndarray:
    dest, src, idx = srcs
    out = np.array(dest, dtype=np.float64)
    out[_indices(idx, dest.shape[0], "scatter")] = src
    return out


# The reference semantics of every Op, one entry each (a test checks the coverage).
EVALUATORS: dict[Op, Callable[..., np.ndarray]] = {
    Op.INPUT: _input, Op.CONSTANT: _constant, Op.IOTA: _iota,
    Op.OUTPUT: lambda node, srcs, *_: srcs[0],
    Op.CAST: lambda node, srcs, graph, inputs, bindings, precision: _cast(node, srcs[0], precision),
    **{op: _elementwise for op in (*UNARY_OPS, *BINARY_OPS, Op.CUSTOM)},
    Op.SUM_REDUCE: _sum_reduce,
    Op.MAX_REDUCE: lambda node, srcs, *_: np.max(srcs[0], axis=node.attr("axis")),
    Op.SOFTMAX: _softmax, Op.GATHER: _gather, Op.SCATTER: _scatter,
}


def eval_node(node: Node, srcs: list[np.ndarray], graph: Graph, inputs: Mapping[str, np.ndarray],
              bindings: Mapping[str, int], precision: str) -> np.ndarray:
    """One node's value from its (already viewed) source values."""
    return EVALUATORS[node.op](node, srcs, graph, inputs, bindings, precision)


def _indices(idx: np.ndarray, n: int, what: str) -> np.ndarray:
    i = np.asarray(idx)
    if i.dtype.kind == "f":
        if not np.all(np.isfinite(i)) or not np.all(i == np.round(i)):
            raise ValueError(f"{what}: indices must be integers")
        i = i.astype(np.int64)
    if i.size and (i.min() < 0 or i.max() >= n):
        raise IndexError(f"{what}: index out of range [0, {n})")
    return i


def evaluate_nodes(graph: Graph, inputs: Mapping[str, np.ndarray], bindings: Mapping[str, int] | None = None,
                   precision: str = "f64", keep: Collection[int] | None = None,
                   observe: GemmObserver | None = None) -> dict[int, np.ndarray]:
    """Values of every node (Mul nodes folded into a BLAS matmul are skipped: only their sum exists);
    with `keep`, only those (every other value is freed after its last reader: a large model's
    evaluation holds a few layers' values at a time, not all of them). `observe` sees the operands of
    every WeightGemm as the evaluation computes them (calibration Hessians, error/hessians.py)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    missing = [n for n, info in graph.inputs.items() if not info.is_weight and n not in inputs]
    if missing:
        raise KeyError(f"missing inputs: {missing}")
    bindings = graph.bind_symbols(inputs, bindings)
    values: dict[int, np.ndarray] = {}
    _run_nodes(graph, [n.id for n in graph.nodes], [_Batch(values, inputs, bindings)], precision, keep, observe)
    if keep is not None:
        for nid in [n for n in values if n not in keep]:
            del values[nid]
    return values


def _matmul_layout(graph: Graph, node: Node, consumers: dict[int, list[int]]):
    """The Gemm layout of a SumReduce whose Mul source feeds nothing else (then the Mul is skipped)."""
    if node.op is not Op.SUM_REDUCE:
        return None
    mul = graph.nodes[node.srcs[0].node]
    if mul.op is not Op.MUL or consumers[mul.id] != [node.id] or not node.srcs[0].view.is_contiguous:
        return None
    lays = gemm_layouts(split_operand(mul.srcs[0].view)[1], split_operand(mul.srcs[1].view)[1], node.attr("axis"))
    return (mul, lays[0]) if lays else None


@dataclass(frozen=True)
class WeightGemm:
    """A Gemm the reference runs as one product whose one operand is a 2-D weight read K-major
    (hlir.gemm.reads_k_major) and whose other operand is an activation: the weight's calibration
    Hessian is that activation's K columns, X^T X (quant/calibration.py)."""

    weight: int   # the weight's node id
    side: int     # the weight's operand side (0: A, 1: B); the activation is the other


def weight_gemm(graph: Graph, node: Node, consumers: dict[int, list[int]]) -> WeightGemm | None:
    """The WeightGemm a SumReduce node is, else None: the one definition the reference's Hessian collection
    and the search's offer of calibrated roundings (search/encode.py) share."""
    hit = _matmul_layout(graph, node, consumers)
    if hit is None:
        return None
    mul, lay = hit
    weights = [graph.weight_name(s.node) is not None for s in mul.srcs]
    if weights.count(True) != 1:
        return None
    side = weights.index(True)
    w = graph.nodes[mul.srcs[side].node]
    if w.dtype.kind is not Kind.FLOAT or not reads_k_major(mul.srcs[side].view, lay.k_axis, w.shape):
        return None
    return WeightGemm(w.id, side)


# (a WeightGemm, the SumReduce's node id, its layout, A as (batch, M, K) and B as (batch, K, N) in FP64 / FP32)
GemmObserver = Callable[[WeightGemm, int, GemmLayout, np.ndarray, np.ndarray], None]


def _gemm_operand(graph: Graph, src, values, bindings, lay, side: int, precision: str) -> np.ndarray:
    """A (side 0) as (batch, M, K) or B (side 1) as (batch, K, N) in the evaluation dtype. A weight's
    is a transposed/reshaped view of its cached value where numpy can express it (BLAS reads it with
    a transpose flag), so no evaluation copies a weight and no second copy is cached."""
    dt = np.float32 if precision == "f32" else np.float64
    full = read_operand(src.view, values[src.node], bindings)
    node = graph.nodes[src.node]
    if node.op is Op.INPUT and node.attr("name") in graph.weights and full.dtype == dt:
        return _operand_view(full, lay, side)
    if side == 1 and precision == "f64" and full.dtype == np.float32 and node.op is Op.INPUT:
        return _operand_view(full, lay, side)  # a streamed weight: widened by blocks in the product
    return (gemm_operand_b if side else gemm_operand_a)(full, lay).astype(dt, copy=False)


def _operand_view(full: np.ndarray, lay, side: int) -> np.ndarray:
    """gemm_operand_a/b without the contiguous copy: the same values, as a view where possible."""
    drop, order = ((lay.n_axes, (*lay.batch_axes, *lay.m_axes, lay.k_axis)) if side == 0
                   else (lay.m_axes, (*lay.batch_axes, lay.k_axis, *lay.n_axes)))
    x = full[tuple(0 if ax in drop else slice(None) for ax in range(full.ndim))]
    keep = [ax for ax in range(full.ndim) if ax not in drop]
    x = np.transpose(x, [keep.index(ax) for ax in order])
    size = lambda axes: int(np.prod([full.shape[ax] for ax in axes], dtype=np.int64))  # noqa: E731
    k = full.shape[lay.k_axis]
    shape = (size(lay.batch_axes), size(lay.m_axes), k) if side == 0 else (size(lay.batch_axes), k, size(lay.n_axes))
    return x.reshape(shape)  # a view when the axes merge, else numpy copies


_CONSUMERS: dict[int, tuple[weakref.ref, int, dict[int, list[int]]]] = {}


def _consumers(graph: Graph) -> dict[int, list[int]]:
    """graph.consumers(), kept per graph while it lives and has the same nodes (a chunk evaluated alone
    is a few hundred nodes of a graph of thousands: recomputing the whole map per chunk dominated)."""
    hit = _CONSUMERS.get(id(graph))
    if hit is None or hit[0]() is not graph or hit[1] != len(graph.nodes):
        hit = (weakref.ref(graph, lambda _, k=id(graph): _CONSUMERS.pop(k, None)), len(graph.nodes), graph.consumers())
        _CONSUMERS[id(graph)] = hit
    return hit[2]


def _last_reads(graph: Graph, node_ids, fused: Mapping[int, tuple]) -> dict[int, list[int]]:
    """Position in `node_ids` -> the values last read there (a folded Mul's sources are read by its sum)."""
    at = {nid: i for i, nid in enumerate(node_ids)}
    last: dict[int, int] = {}
    for i, nid in enumerate(node_ids):
        reader = at[fused[nid][0]] if nid in fused else i
        for s in graph.nodes[nid].srcs:
            last[s.node] = max(last.get(s.node, -1), reader)
    out: dict[int, list[int]] = {}
    for src, i in last.items():
        out.setdefault(i, []).append(src)
    return out


@dataclass
class _Batch:
    """One evaluation's state in _run_nodes: its values (filled in), graph inputs and symbol bindings."""

    values: dict
    inputs: Mapping[str, np.ndarray]
    bindings: Mapping[str, int]


def _run_nodes(graph: Graph, node_ids, batches: Sequence[_Batch], precision: str,
               keep: Collection[int] | None = None, observe: GemmObserver | None = None) -> None:
    """Evaluate nodes in order, for each batch; Mul+SumReduce matmuls go through BLAS instead of
    (m, n, k) products, and a Gemm whose B is one streamed weight in every batch widens it once for all.
    `keep`: only these values stay in `values` (each other value is dropped after its last reader)."""
    consumers = _consumers(graph)
    stream = precision == "f64" and streams(graph)
    fused = {}
    members = set(node_ids)
    for nid in node_ids:
        hit = _matmul_layout(graph, graph.nodes[nid], consumers)
        if hit is not None and hit[0].id in members:
            fused[hit[0].id] = (nid, hit[1])
    by_reduce = {r: (m, lay) for m, (r, lay) in fused.items()}
    with STREAMING.by_last_reader():  # a read inside (a weight's key, its FP64 copy) leaves releasing to the map
        last_reads = _last_reads(graph, node_ids, fused) if keep is not None or STREAMING.on else {}
        pages = _page_releases(graph, last_reads) if STREAMING.on else {}
        for i, nid in enumerate(node_ids):
            node = graph.nodes[nid]
            if i > 0:
                STREAMING.release(pages.get(i - 1, ()))
            if keep is not None and i > 0:
                for done in last_reads.get(i - 1, ()):
                    if done not in keep:
                        for bt in batches:
                            bt.values.pop(done, None)
            if nid in fused:
                continue
            if nid in by_reduce:
                _run_gemm(graph, node, *by_reduce[nid], batches, precision, consumers, observe)
                continue
            held = _streamed_weight(graph, node, precision) if stream else None
            for bt in batches:
                if held is not None:
                    bt.values[nid] = held
                    continue
                srcs = [s.view.realize(bt.values[s.node], bt.bindings) for s in node.srcs]
                if stream and node.op is not Op.GATHER:
                    srcs = [_wide(x) for x in srcs]  # a streamed weight read whole by another op: widened here
                bt.values[nid] = np.asarray(eval_node(node, srcs, graph, bt.inputs, bt.bindings, precision))
        if node_ids:
            STREAMING.release(pages.get(len(node_ids) - 1, ()))


def _page_releases(graph: Graph, last_reads: Mapping[int, list[int]]) -> dict[int, list[np.ndarray]]:
    """Position -> the file-backed weights whose pages a streaming evaluation gives back after it (every
    batch has run it): each weight after its last read in these nodes, or a later read of a weight sharing
    its bytes (hlir.store.release_points). A chunk evaluated alone releases its weights as it finishes them."""
    read = {}
    for pos, srcs in last_reads.items():
        for src in srcs:
            name = graph.weight_name(src)
            if name is not None:
                read[name] = max(read.get(name, -1), pos)
    return release_points(read, graph.weights)


def _run_gemm(graph: Graph, node: Node, mul_id: int, lay: GemmLayout, batches: Sequence[_Batch], precision: str,
              consumers, observe: GemmObserver | None) -> None:
    """A folded Mul+SumReduce as one BLAS product per batch (a streamed FP32 B shared by all of them)."""
    mul = graph.nodes[mul_id]
    use = weight_gemm(graph, node, consumers) if observe is not None else None
    shapes, a_each, b_each = [], [], []
    for bt in batches:
        shapes.append(read_operand(mul.srcs[0].view, bt.values[mul.srcs[0].node], bt.bindings).shape)
        a, b = (_gemm_operand(graph, src, bt.values, bt.bindings, lay, side, precision)
                for side, src in enumerate(mul.srcs))
        a_each.append(_wide(a))
        b_each.append(b)
        if use is not None:
            observe(use, node.id, lay, a_each[-1], b)
    if b_each[0].dtype == np.float32 and _same_array(b_each):
        outs = _matmul_streamed(a_each, b_each[0])
    else:
        outs = [_matmul_streamed([a], b)[0] if b.dtype == np.float32 else np.matmul(a, b)
                for a, b in zip(a_each, b_each)]
    for bt, out, shape in zip(batches, outs, shapes):
        bt.values[node.id] = _round(np.asarray(gemm_result(out, lay, shape), dtype=np.float64), node.dtype, precision)


def evaluate(graph: Graph, inputs: Mapping[str, np.ndarray], bindings: Mapping[str, int] | None = None,
             precision: str = "f64") -> dict[str, np.ndarray]:
    """Output values by name."""
    values = evaluate_nodes(graph, inputs, bindings, precision)
    return {name: values[nid] for name, nid in graph.outputs.items()}


def evaluate_chunk(graph: Graph, node_ids, external: Mapping[int, np.ndarray], bindings: Mapping[str, int],
                   precision: str = "f64") -> dict[int, np.ndarray]:
    """Values of a chunk's nodes given the values of its external sources (by graph node id).

    Used to judge one group in isolation (its FP64 output from exact inputs) and to estimate how much
    a chunk amplifies error in its inputs (finite differences).
    """
    return evaluate_chunk_batches(graph, node_ids, [external], [bindings], precision)[0]


def evaluate_chunk_batches(graph: Graph, node_ids, externals: Sequence[Mapping[int, np.ndarray]],
                           bindings: Sequence[Mapping[str, int]], precision: str = "f64") -> list[dict[int, np.ndarray]]:
    """evaluate_chunk for several batches at once, each value the one evaluate_chunk gives: a large
    model's streamed weights are read and widened once for all the batches (the FP64 rest of the model a
    chunk's deviation is injected into runs once per calibration batch)."""
    if len(externals) != len(bindings):
        raise ValueError(f"{len(externals)} batches of external values but {len(bindings)} of bindings")
    batches = [_Batch(dict(ext), {}, bnd) for ext, bnd in zip(externals, bindings)]
    stream = precision == "f64" and streams(graph)
    with STREAMING.by_last_reader():  # the weights' pages go after their last reader in the chunk (_run_nodes)
        for nid in node_ids:  # weights not handed in: their cached value (the caller need not hold them)
            for s in graph.nodes[nid].srcs:
                if graph.weight_name(s.node) is None:
                    continue
                for bt in batches:
                    if s.node not in bt.values:
                        held = _streamed_weight(graph, graph.nodes[s.node], precision) if stream else None
                        bt.values[s.node] = held if held is not None else \
                            eval_node(graph.nodes[s.node], [], graph, {}, bt.bindings, precision)
        _run_nodes(graph, list(node_ids), batches, precision)
    return [{nid: bt.values[nid] for nid in node_ids if nid in bt.values} for bt in batches]
