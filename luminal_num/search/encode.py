"""Write one chunk as an egglog program: HLIR terms bound with `let`, plus the Python-computed facts.

Views, constants, dims and Gemm layouts are interned into tables (value -> i64 id) that travel with
the choice space, so the lowering reads them back by id, never by printed text.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, Hashable, Sequence, TypeVar

from egglog import EGraph, set_

from ..codegen.llir import quantized_a_view
from ..hlir.evaluate import weight_gemm
from ..hlir.gemm import GemmLayout, gemm_layouts, split_operand
from ..hlir.graph import Graph
from ..hlir.ops import Op
from ..hlir.partition import Chunk
from ..hlir.rotation import rotation_block
from ..hlir.shape import ShapeTracker, View, contiguous_strides
from ..quant.stored import source_format
from . import egraph as E

V = TypeVar("V", bound=Hashable)


@dataclass
class Interner(Generic[V]):
    """Value <-> dense id; values are frozen dataclasses or canonical encodings."""

    values: list[V] = field(default_factory=list)
    ids: dict[V, int] = field(default_factory=dict)

    def __call__(self, value: V) -> int:
        if value not in self.ids:
            self.ids[value] = len(self.values)
            self.values.append(value)
        return self.ids[value]

    def __getitem__(self, i: int) -> V:
        return self.values[i]


@dataclass(frozen=True)
class ChunkTables:
    """The interned values a group's choice space refers to."""

    views: tuple[ShapeTracker, ...]
    constants: tuple[object, ...]       # float or symbolic Dim
    dims: tuple[object, ...]
    layouts: tuple[GemmLayout, ...]
    ext_dtypes: tuple[str, ...]         # dtype per external slot
    ext_shapes: tuple[tuple, ...]
    ext_is_weight: tuple[bool, ...]
    roots: tuple[tuple[str, int], ...]  # (let name, local node index) for every exported node
    concats: tuple[tuple[int, tuple[int, ...]], ...] = ()  # (axis, external weight slots) concatenated (KCatW)
    # the external weight slots of the Gemms reading one activation, which share one smoothing (KSmoothW's grp)
    smooth_groups: tuple[tuple[int, ...], ...] = ()
    # (chunk index, external slot, storage format of its GGUF blocks) where the group's chunks differ
    chunk_sources: tuple[tuple[int, int, str], ...] = ()

    def chunk_source(self, chunk: int, slot: int) -> str | None:
        """The format of the GGUF blocks chunk `chunk`'s weight at `slot` was loaded from (GGUFSourcePerChunk)."""
        return next((fmt for c, s, fmt in self.chunk_sources if (c, s) == (chunk, slot)), None)


@dataclass
class EncodedChunk:
    egraph: EGraph
    tables: ChunkTables
    terms: dict[int, object]   # graph node id -> egglog term (HLIR) of the representative chunk
    gemm_candidates: int       # Mul+SumReduce pairs with at least one Gemm layout


def encode_chunk(graph: Graph, chunk: Chunk, consumers: dict[int, list[int]] | None = None,
                 group_chunks: Sequence[Chunk] = (), calibrated: bool = False, rotation: bool = False,
                 smoothing: bool = False) -> EncodedChunk:
    """`group_chunks`: every chunk sharing this structure (default: `chunk` alone); facts that differ
    per chunk (who else reads a buffer) hold for the group only when they hold in every chunk.
    `calibrated`: weights a Gemm reads K-major get CalibratedWeight (calibrated roundings are offered);
    `rotation`: such Gemms get RotationOf (their K may be Hadamard-rotated, search/rules/rotate.py);
    `smoothing`: and SmoothOf (their K may be smoothed, search/rules/smooth.py)."""
    consumers = consumers if consumers is not None else graph.consumers()
    group_chunks = tuple(group_chunks) or (chunk,)
    eg = EGraph()
    views: Interner[ShapeTracker] = Interner()
    consts: Interner = Interner()
    dims: Interner = Interner()
    layouts: Interner[GemmLayout] = Interner()
    terms: dict[int, object] = {}
    facts: list = []

    def view_id(st: ShapeTracker) -> int:
        if st in views.ids:
            return views.ids[st]
        vid = views(st)
        if all(v.mask is None for v in st.views):
            facts.append(E.Unmasked(vid))
        if len(st.views) > 1:  # read = materialise the lower views, then read with the top one
            facts.append(E.SplitView(vid, view_id(ShapeTracker(st.views[:-1])), view_id(ShapeTracker((st.views[-1],)))))
        return vid

    ext_dtypes, ext_shapes, ext_weight, chunk_sources = [], [], [], []
    for slot, nid in enumerate(chunk.external):
        node = graph.nodes[nid]
        term = E.HExt(slot, node.dtype.name)
        terms[nid] = term
        ext_dtypes.append(node.dtype.name)
        ext_shapes.append(node.shape)
        is_w = graph.weight_name(nid) is not None
        ext_weight.append(is_w)
        facts.append(set_(E.identity_view(term)).to(view_id(ShapeTracker.contiguous(node.shape))))
        if is_w:
            facts.append(E.IsWeight(term))
            if len(node.shape) == 2:
                facts.append(E.MatrixWeight(term))
                kept = _gguf_sources(graph, group_chunks, slot)
                if None not in kept and len(set(kept)) == 1:
                    facts.append(E.GGUFSource(term, kept[0]))
                elif None not in kept:  # each chunk keeps its own blocks (quant.stored.SOURCE_BLOCKS)
                    facts.append(E.GGUFSourcePerChunk(term))
                    chunk_sources += [(c.index, slot, fmt) for c, fmt in zip(group_chunks, kept)]
        facts.append(set_(E.dtype(term)).to(node.dtype.name))

    gemm_candidates = 0
    smooth_sites: list[tuple] = []  # (activation key, weight slot, va, vb, layouts, views of the smoothed Gemm)
    for nid in chunk.nodes:
        node = graph.nodes[nid]
        args: list = []
        for s in node.srcs:
            args += [terms[s.node], view_id(s.view)]
        for a in node.op.decl.attrs:
            v = node.attr(a)
            if a == "name":
                args.append(len(terms))  # outputs: positional slot, names live outside the structure
            elif a == "value":
                args.append(consts(v if not isinstance(v, float) else ("f", v.hex())))
            elif a == "length":
                args.append(dims(v))
            else:
                args.append(v)
        term = eg.let(f"n{nid}", E.HLIR[node.op](*args, node.dtype.name))
        terms[nid] = term
        facts.append(set_(E.identity_view(term)).to(view_id(ShapeTracker.contiguous(node.shape))))
        if node.op is Op.SCATTER and _sole_reader_everywhere(graph, group_chunks, chunk.nodes.index(nid), consumers):
            facts.append(E.SoleReader(terms[node.srcs[0].node]))
            if _cache_input_everywhere(graph, group_chunks, chunk.nodes.index(nid)):
                facts.append(E.KVCache(terms[node.srcs[0].node], _head_width(graph, nid, consumers)))
        if node.op is Op.SUM_REDUCE and graph.nodes[node.srcs[0].node].op is Op.MUL:
            mul = graph.nodes[node.srcs[0].node]
            va, vb = _gemm_operand_views(mul)
            ax = node.attr("axis")
            found = False
            for lay in gemm_layouts(va, vb, ax):
                lid = layouts(lay)
                facts.append(E.GemmLayoutOf(view_id(va), view_id(vb), ax, lid))
                facts.append(E.QuantView(lid, view_id(quantized_a_view(lay))))
                found = True
            gemm_candidates += found
            use = weight_gemm(graph, node, consumers) if calibrated or rotation or smoothing else None
            if calibrated and use is not None and use.weight in chunk.external:  # its Hessian: error/hessians.py
                facts.append(E.CalibratedWeight(terms[use.weight]))
            if rotation and use is not None and use.side == 1 and use.weight in chunk.external:
                facts += _rotation_facts(va, vb, ax, view_id, layouts)
            if smoothing and use is not None and use.side == 1 and use.weight in chunk.external:
                views_ = _smoothing_views(va, vb, ax)
                if views_ is not None:
                    act = mul.srcs[0].node
                    smooth_sites.append(((act, views_[0]), chunk.external.index(use.weight), va, vb, ax, views_))
    smooth_groups = _smooth_groups(smooth_sites)
    for key, slot, va, vb, ax, (plain, vec, main) in smooth_sites:
        grp = smooth_groups.index(next(g for g in smooth_groups if slot in g))
        for lay in gemm_layouts(va, vb, ax):
            if lay in gemm_layouts(main, vb, ax):
                facts.append(E.SmoothOf(slot, view_id(va), view_id(vb), layouts(lay), grp, view_id(plain),
                                        view_id(vec), view_id(main)))
    eg.register(*facts)
    local = {nid: i for i, nid in enumerate(chunk.nodes)}
    tables = ChunkTables(tuple(views.values), tuple(consts.values), tuple(dims.values), tuple(layouts.values),
                         tuple(ext_dtypes), tuple(ext_shapes), tuple(ext_weight),
                         tuple((f"n{e}", local[e]) for e in chunk.exported), chunk_sources=tuple(chunk_sources),
                         smooth_groups=smooth_groups)
    return EncodedChunk(eg, tables, terms, gemm_candidates)


def _sole_reader_everywhere(graph: Graph, chunks: Sequence[Chunk], local: int,
                            consumers: dict[int, list[int]]) -> bool:
    """In every chunk, the scatter at position `local` is the only reader of its destination (so
    overwriting it in place is unobservable) and the destination is no graph output."""
    outputs = set(graph.outputs.values())
    for c in chunks:
        dest = graph.nodes[c.nodes[local]].srcs[0].node
        if len(consumers[dest]) != 1 or dest in outputs:
            return False
    return True


def _gguf_sources(graph: Graph, chunks: Sequence[Chunk], slot: int) -> tuple[str | None, ...]:
    """Per chunk of the group, the storage format keeping the GGUF blocks (gguf_q4_k, gguf_q8_0, ...) the
    weight at external `slot` was loaded from, or None (not loaded from kept blocks)."""
    found = []
    for c in chunks:
        node = graph.nodes[c.external[slot]]
        name = node.attr("name") if node.op is Op.INPUT else None
        found.append(source_format(graph.weights[name]) if name in graph.weights else None)
    return tuple(found)


def _cache_input_everywhere(graph: Graph, chunks: Sequence[Chunk], local: int) -> bool:
    """In every chunk, the scatter at `local` overwrites a 2-D graph input that is no weight (a KV cache
    the caller hands in and gets back) through its identity view: it may be held in a KV format."""
    for c in chunks:
        node = graph.nodes[c.nodes[local]]
        dest = graph.nodes[node.srcs[0].node]
        if dest.op is not Op.INPUT or graph.inputs[dest.attr("name")].is_weight or len(dest.shape) != 2 \
                or node.srcs[0].view != ShapeTracker.contiguous(dest.shape):
            return False
    return True


def _head_width(graph: Graph, nid: int, consumers: dict[int, list[int]]) -> int:
    """The width of one head of a cache row: the extent of the unit-stride axis every reader of the
    updated cache indexes it by (attention reads (..., head_dim) slices); 0 when readers disagree or
    read whole rows (one head: per-token scales already are per head)."""
    width = graph.nodes[nid].shape[-1]
    found = set()
    for c in consumers.get(nid, []):
        if graph.nodes[c].op is Op.OUTPUT:  # handing the cache back reads whole rows
            continue
        for src in graph.nodes[c].srcs:
            if src.node == nid:
                v = src.view.views[0]
                found |= {d for d, st in zip(v.shape, v.strides) if st == 1}
    head = next(iter(found)) if len(found) == 1 else 0
    return head if isinstance(head, int) and isinstance(width, int) and 0 < head < width and width % head == 0 else 0


def _rotation_facts(va: ShapeTracker, vb: ShapeTracker, ax: int, view_id, layouts: Interner) -> list:
    """RotationOf for a Gemm x W^T (W read K-major as B, every other axis of A an M axis of static size)
    whose K an offered Hadamard block divides: x H as a Gemm over (M..., K/b, b_out, b_in) reading x through
    its own strides and H_b (b, b), then the rotated weight's Gemm reading x H (contiguous (M..., K)) with
    the original layout. Nothing when the shapes are symbolic or the layout does not carry over."""
    a, wv = va.views[0], vb.views[0]
    k = a.shape[ax]
    b = rotation_block(k)
    n_axes = [i for i in range(len(a.shape)) if i != ax and wv.strides[i] != 0]
    m_axes = [i for i in range(len(a.shape)) if i != ax and i not in n_axes]
    if (b is None or len(n_axes) != 1 or a.strides[n_axes[0]] != 0 or a.mask is not None
            or not all(isinstance(d, int) for d in a.shape)
            or any(a.strides[i] == 0 and a.shape[i] != 1 for i in m_axes)):
        return []
    ms = tuple(a.shape[i] for i in m_axes)
    rot_shape = (*ms, k // b, b, b)  # (M..., block, output column, input column = the rotation's K)
    rot_a = ShapeTracker((View.create(rot_shape, (*(a.strides[i] for i in m_axes), b * a.strides[ax], 0,
                                                  a.strides[ax]), a.offset),))
    rot_b = ShapeTracker((View.create(rot_shape, (*(0 for _ in m_axes), 0, 1, b)),))
    rot_lays = gemm_layouts(rot_a, rot_b, len(rot_shape) - 1)
    if not rot_lays:
        return []
    rot_lay = next((lay for lay in rot_lays if lay.variant == "flattened"), rot_lays[0])
    out_strides = dict(zip(m_axes, contiguous_strides((*ms, k))[:len(ms)]))  # x H is (M..., K) contiguous
    main_a = ShapeTracker((View.create(a.shape, tuple(out_strides.get(i, 0) if i != ax else 1
                                                      for i in range(len(a.shape)))),))
    kept = gemm_layouts(main_a, vb, ax)
    rot_lid = layouts(rot_lay)
    facts = [E.QuantView(rot_lid, view_id(quantized_a_view(rot_lay)))]
    for lay in gemm_layouts(va, vb, ax):
        if lay in kept:
            facts.append(E.RotationOf(view_id(va), view_id(vb), layouts(lay), b, view_id(rot_a), view_id(rot_b),
                                      rot_lid, view_id(main_a)))
    return facts if len(facts) > 1 else []


def _smoothing_views(va: ShapeTracker, vb: ShapeTracker, ax: int) -> tuple[ShapeTracker, ...] | None:
    """For a Gemm x W^T (W read K-major as B, one unmasked view of x, every other axis of A an M axis of static
    size): x read as (M..., K) through its own strides, the (K,) scale vector broadcast over the M axes, and
    the view the smoothed Gemm reads x diag(2^-e) (contiguous (M..., K)) by; None where the shapes do not allow."""
    if len(va.views) != 1:
        return None
    a, wv = va.views[0], vb.views[0]
    n_axes = [i for i in range(len(a.shape)) if i != ax and wv.strides[i] != 0]
    m_axes = [i for i in range(len(a.shape)) if i != ax and i not in n_axes]
    if (len(n_axes) != 1 or a.strides[n_axes[0]] != 0 or a.mask is not None
            or not all(isinstance(d, int) for d in a.shape)
            or any(a.strides[i] == 0 and a.shape[i] != 1 for i in m_axes)):
        return None
    ms, k = tuple(a.shape[i] for i in m_axes), a.shape[ax]
    plain = ShapeTracker((View.create((*ms, k), (*(a.strides[i] for i in m_axes), a.strides[ax]), a.offset),))
    vec = ShapeTracker((View.create((*ms, k), (*(0 for _ in m_axes), 1)),))
    out_strides = dict(zip(m_axes, contiguous_strides((*ms, k))[:len(ms)]))
    main = ShapeTracker((View.create(a.shape, tuple(out_strides.get(i, 0) if i != ax else 1
                                                    for i in range(len(a.shape)))),))
    return plain, vec, main


def _smooth_groups(sites: list[tuple]) -> tuple[tuple[int, ...], ...]:
    """The weight slots of the Gemms reading one activation (the same node through the same view), one group
    each, in the order first read: they share one smoothing."""
    groups: dict = {}
    for key, slot, *_ in sites:
        members = groups.setdefault(key, [])
        if slot not in members:
            members.append(slot)
    return tuple(tuple(m) for m in groups.values())


def _gemm_operand_views(mul) -> tuple[ShapeTracker, ShapeTracker]:
    """The views the Gemm reads: the Mul's views, or the top view of each if it must be split."""
    return split_operand(mul.srcs[0].view)[1], split_operand(mul.srcs[1].view)[1]
