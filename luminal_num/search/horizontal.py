"""Which Gemms of a chunk can become one Gemm over weights concatenated along N (horizontal fusion).

Gemms reading the same activation through the same view (up to the broadcast N extent) whose B operands
are 2-D compile-time weights of the same K, read row by row (row stride K: contiguous rows), form one
group: q/k/v (GQA: k and v narrower), gate/up. The fused Gemm reads A through the same view with N
extended to sum(N_i), and the weights concatenated along their rows (KCatW: materialised once, like a
stored weight); part i is the fused output's columns [off_i, off_i + N_i) (KSlice). A part that is a
chunk export or graph output is left alone (its buffer would be the fused one's). Weights the genome holds
in one storage format concatenate in it where no block spans parts (quant/concat.py). Facts and the views,
layouts and concatenations they name are computed here; the rules are in rules/fuse_gemm.py.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Mapping, Sequence

from ..dtypes.variants import GEMM_VARIANTS, WHOLE, Granularity
from ..hlir.gemm import GemmLayout, gemm_layouts
from ..hlir.graph import Graph
from ..hlir.ops import Op
from ..hlir.partition import Chunk
from ..hlir.shape import ShapeTracker, View, contiguous_strides
from ..hlir.symbolic import prod
from ..codegen.llir import quantized_a_view
from ..quant.concat import concat_refusal
from ..quant.stored import CALIBRATED_CHOICES, GGUF_KEPT, SEARCHED_STORAGE
from .encode import ChunkTables
from .tags import Tag, TagKind


@dataclass(frozen=True)
class _Part:
    local: int            # the SumReduce's position in the chunk
    slot: int             # the weight's external slot
    n: int                # its output channels (the weight's extent along the concatenation axis)
    va: ShapeTracker
    vb: ShapeTracker


@dataclass(frozen=True)
class FusionGroup:
    """Parts in chunk order, sharing A (node `a_node`, one view up to its N extent) and K."""
    a_node: int
    parts: tuple[_Part, ...]
    n_axis: int
    k_axis: int
    weight_axis: int      # the weights' axis that N runs along: 0 for torch Linear (out, in), 1 for x @ W
    k_extent: int = 0     # the weights' K (their other axis)

    def stored_shapes(self) -> list[tuple[int, int]]:
        """The parts' weight shapes as stored (rows, last axis), as quant/concat.py checks them."""
        return [(p.n, self.k_extent) if self.weight_axis == 0 else (self.k_extent, p.n) for p in self.parts]

    def storable(self) -> tuple[str, ...]:
        """Storage formats whose parts concatenate keeping every stored value and scale (the others are
        refused: concat_refusal says why)."""
        plain = tuple(f for f in SEARCHED_STORAGE + GGUF_KEPT
                      if not concat_refusal(f, self.stored_shapes(), self.weight_axis))
        return plain + tuple(c for c, spec in CALIBRATED_CHOICES.items() if spec.fmt.name in plain)


def fusion_groups(graph: Graph, chunks: Sequence[Chunk], consumers: Mapping[int, list[int]]) -> list[FusionGroup]:
    rep = chunks[0]
    slot_of = {nid: s for s, nid in enumerate(rep.external)}
    outputs = set(graph.outputs.values())
    by_key: dict[tuple, list[_Part]] = {}
    keys: dict[tuple, tuple[int, int]] = {}
    for local, nid in enumerate(rep.nodes):
        node = graph.nodes[nid]
        if node.op is not Op.SUM_REDUCE or graph.nodes[node.srcs[0].node].op is not Op.MUL:
            continue
        if not all(_private(graph, c.nodes[local], c, consumers, outputs) for c in chunks):
            continue
        mul = graph.nodes[node.srcs[0].node]
        a, b = mul.srcs
        w = graph.nodes[b.node]
        if b.node not in slot_of or graph.weight_name(w.id) is None \
                or len(w.shape) != 2 or w.dtype.name != "f32":
            continue
        if len(a.view.views) != 1 or len(b.view.views) != 1 or a.view.views[0].mask or b.view.views[0].mask:
            continue
        ax = node.attr("axis")
        va, vb = a.view.views[0], b.view.views[0]
        n_axes = [i for i in range(len(va.shape)) if i != ax and va.strides[i] == 0 and vb.strides[i] != 0]
        if len(n_axes) != 1 or vb.offset != 0:
            continue
        n = n_axes[0]
        wa = _weight_axis(vb, n, ax, tuple(w.shape))
        if wa is None or va.shape[n] != w.shape[wa]:
            continue
        shape_key = tuple(d if i != n else None for i, d in enumerate(va.shape))
        b_key = tuple(s if i not in (n, ax) else None for i, s in enumerate(vb.strides))
        key = (a.node, shape_key, va.strides, va.offset, b_key, ax, wa, w.shape[1 - wa])
        by_key.setdefault(key, []).append(_Part(local, slot_of[b.node], int(w.shape[wa]), a.view, b.view))
        keys[key] = (n, ax, wa, int(w.shape[1 - wa]))
    return [FusionGroup(k[0], tuple(ps), *keys[k]) for k, ps in by_key.items() if len(ps) >= 2]


def _weight_axis(vb: View, n: int, k: int, shape: tuple[int, int]) -> int | None:
    """The weight axis N runs along when B reads the contiguous 2-D weight with N and K on its two axes
    (every other axis broadcast), else None."""
    rows, cols = shape
    if any(s != 0 for i, s in enumerate(vb.strides) if i not in (n, k)):
        return None
    if (vb.strides[n], vb.strides[k]) == (cols, 1):
        return 0
    if (vb.strides[n], vb.strides[k]) == (1, cols):
        return 1
    return None


def _private(graph: Graph, nid: int, chunk: Chunk, consumers, outputs) -> bool:
    """A part's value is read only inside its chunk, by no Output (so it is never a root buffer)."""
    if nid in outputs or nid in chunk.exported:
        return False
    return all(r in chunk.nodes and graph.nodes[r].op is not Op.OUTPUT for r in consumers.get(nid, []))


def _widen(st: ShapeTracker, axis: int, size: int, strides=None) -> ShapeTracker:
    v = st.views[0]
    return ShapeTracker((View.create(v.shape[:axis] + (size,) + v.shape[axis + 1:], strides or v.strides, v.offset),))


def _fused_b_strides(g: "FusionGroup", total: int) -> tuple:
    """B's strides over the concatenated weight (contiguous, `total` along the concatenation axis)."""
    v = g.parts[0].vb.views[0]
    k_extent = v.shape[g.k_axis]
    cat_strides = contiguous_strides((total, k_extent) if g.weight_axis == 0 else (k_extent, total))
    strides = list(v.strides)
    strides[g.n_axis], strides[g.k_axis] = cat_strides[g.weight_axis], cat_strides[1 - g.weight_axis]
    return tuple(strides)


def concat_compatible(prec: str, ns: Sequence[int]) -> bool:
    """Whether variant `prec` on the concatenated weight computes each part as it would alone: B's scales
    must not span parts (no per-tensor or whole-N scale; blocks along N must tile every part)."""
    spec = GEMM_VARIANTS[prec].b_scale
    if spec is None:
        return True
    cols = spec.block[1]
    return spec.granularity is not Granularity.TENSOR and cols != WHOLE and all(n % cols == 0 for n in ns)


@dataclass(frozen=True)
class FusedGemm:
    """One fused Gemm of a group for one layout variant: interned ids into the extended tables."""
    group: int
    parts: tuple[tuple[int, int, int], ...]  # (local SumReduce, its layout id, its slice view id)
    va: int
    vb: int
    layout: int
    quant_view: int
    cat: int
    variants: tuple[str, ...]               # Gemm variants that may be fused (concat_compatible)
    storable: tuple[str, ...] = ()          # storage formats the parts' weights may share (FusionGroup.storable)


def plan_fusions(groups: Sequence[FusionGroup], tables: ChunkTables) -> tuple[list[FusedGemm], ChunkTables]:
    """The fused Gemms of `groups` (one per layout variant every part has) and the tables with the new
    views, layouts and concatenations appended (existing ids keep their meaning)."""
    views, layouts, cats = list(tables.views), list(tables.layouts), list(tables.concats)

    def intern(xs: list, x) -> int:
        if x in xs:
            return xs.index(x)
        xs.append(x)
        return len(xs) - 1

    out = []
    for gi, g in enumerate(groups):
        total = sum(p.n for p in g.parts)
        va = _widen(g.parts[0].va, g.n_axis, total)
        vb = _widen(g.parts[0].vb, g.n_axis, total, _fused_b_strides(g, total))
        part_layouts = [{lay.variant: lay for lay in gemm_layouts(p.va, p.vb, g.k_axis)} for p in g.parts]
        cat = intern(cats, (g.weight_axis, tuple(p.slot for p in g.parts)))
        variants = tuple(name for name in GEMM_VARIANTS if concat_compatible(name, [p.n for p in g.parts]))
        for fused in gemm_layouts(va, vb, g.k_axis):
            if not all(fused.variant in pl for pl in part_layouts):
                continue
            out_shape = tuple(d for i, d in enumerate(fused.full_shape) if i != g.k_axis)
            strides = contiguous_strides(out_shape)
            n_out = g.n_axis - (g.n_axis > g.k_axis)
            parts, offset = [], 0
            for p, pl in zip(g.parts, part_layouts):
                lay = pl[fused.variant]
                part_shape = out_shape[:n_out] + (p.n,) + out_shape[n_out + 1:]
                sv = ShapeTracker((View.create(part_shape, strides, offset * strides[n_out]),))
                parts.append((p.local, intern(layouts, lay), intern(views, sv)))
                offset += p.n
            out.append(FusedGemm(gi, tuple(parts), intern(views, va), intern(views, vb), intern(layouts, fused),
                                 intern(views, quantized_a_view(fused)), cat, variants, g.storable()))
    return out, dataclasses.replace(tables, views=tuple(views), layouts=tuple(layouts), concats=tuple(cats))


def compose(slice_view: ShapeTracker, read: ShapeTracker) -> ShapeTracker:
    """Reading a part through `read` (over its contiguous buffer) = reading the fused buffer through the
    part's slice view below it: merged into `read`'s lowest view where the index math allows (kernels
    such as cuBLAS Gemms want one strided view), else stacked under it."""
    merged = _merge(slice_view.views[0], read.views[0])
    if merged is None:
        return ShapeTracker(slice_view.views + read.views)
    return ShapeTracker((merged, *read.views[1:]))


def _merge(low: View, top: View) -> View | None:
    """One view equal to `top` (over a contiguous buffer of low's shape) read through `low`: each top
    stride is a whole number of one low axis's contiguous strides (the coarsest it divides) and no
    coordinate of any low axis can reach its extent (the mixed-radix digits never carry); else None."""
    dims = (*low.shape, *low.strides, low.offset, *top.shape, *top.strides, top.offset)
    if low.mask is not None or not all(isinstance(d, int) for d in dims) or any(s < 0 for s in top.strides) \
            or top.offset < 0:
        return None
    cs = [prod(low.shape[i + 1:]) for i in range(len(low.shape))]  # (size-1 axes too: never 0)
    if 0 in cs:
        return None
    reach = []
    rest = top.offset
    for c in cs:
        reach.append(rest // c)
        rest %= c
    base = list(reach)
    strides = []
    for extent, stride in zip(top.shape, top.strides):
        if stride == 0 or extent == 1:
            strides.append(0)
            continue
        axis = next(i for i, c in enumerate(cs) if stride % c == 0)
        reach[axis] += (extent - 1) * (stride // cs[axis])
        strides.append(stride // cs[axis] * low.strides[axis])
    if any(r >= d for r, d in zip(reach, low.shape)):
        return None
    offset = low.offset + sum(b * s for b, s in zip(base, low.strides))
    return View.create(top.shape, strides, offset, top.mask)


class SliceChoice:
    """When extraction reads a part of a horizontally fused Gemm from the fused one (its KSlice): when the
    genome gives every part of that fused Gemm its variant and holds every part's weight alike (unstored:
    the concatenation of the FP32 weights; or in one storage format the concatenation keeps: KCatStored),
    so the fused form computes exactly what the genome asks; and when it saves launches: a GLU epilogue
    reads the fused accumulator (one kernel for gate and up), or fusing saves more (parts - 1) than the
    parts' own epilogues would (one each: a sliced part cannot take one), so MiniLM's biased q/k/v keep
    their bias epilogues and llama's q/k/v fuse."""

    def __init__(self, space):
        self.parts: dict[str, list[str]] = {}   # fused Gemm class -> its parts' classes
        self.weight: dict[str, str] = {}        # part class -> its weight's class
        self.prec: dict[str, str] = {}          # fused Gemm class -> its variant
        self.b: dict[str, str] = {}             # fused Gemm class -> its concatenated weights' class
        self.epilogues: dict[str, set[str]] = {}  # Gemm class -> variants an epilogue reading it has
        self.stored: dict[str, dict[str, int]] = {}  # concatenation class -> store: tag -> its KCatStored
        for cid, nodes in space.classes.items():
            for i, n in enumerate(nodes):
                if n.op == "KGemmEpi":
                    self.epilogues.setdefault(n.cls("acc"), set()).add(n.arg("prec"))
                elif n.op == "KSlice":
                    self.parts.setdefault(n.cls("src"), []).append(cid)
                elif n.op == "KGemm":
                    self.weight.setdefault(cid, n.cls("b"))
                    self.prec.setdefault(cid, n.arg("prec"))
                elif n.op == "KCatStored":
                    self.stored.setdefault(cid, {})[str(Tag(TagKind.STORE, n.arg("fmt")))] = i
        self.b = {src: self.weight[src] for src in self.parts}
        self.cat_parts = {self.b[src]: parts for src, parts in self.parts.items()}

    def weight_tag(self, src: str, genome: Mapping[str, str], base: str) -> str | None:
        """The tag every part's weight has in `genome` when the fused B can hold them so, else None."""
        tags = {genome.get(self.weight[p], base) for p in self.parts[src]}
        if len(tags) != 1:
            return None
        tag = tags.pop()
        return tag if tag == base or tag in self.stored.get(self.b[src], {}) else None

    def takes_src(self, src: str, genome: Mapping[str, str], base: str) -> bool:
        prec = self.prec[src]
        tag = base if prec == base else str(Tag(TagKind.GEMM, prec))
        parts = self.parts[src]
        if not all(genome.get(p, base) == tag for p in parts) or self.weight_tag(src, genome, base) is None:
            return False
        if prec in self.epilogues.get(src, ()):  # a GLU epilogue: every part in one kernel
            return True
        return len(parts) - 1 > sum(prec in self.epilogues.get(p, ()) for p in parts)

    def takes(self, n, genome: Mapping[str, str], base: str) -> bool:
        return self.takes_src(n.cls("src"), genome, base)

    def sliced(self, space, cid: str, genome: Mapping[str, str], base: str) -> bool:
        return any(n.op == "KSlice" and self.takes(n, genome, base) for n in space.classes[cid])

    def cat_order(self, cid: str, nodes, genome: Mapping[str, str], base: str) -> list[int] | None:
        """For a concatenated-weights class: its node holding the parts as the genome holds them first."""
        if cid not in self.cat_parts:
            return None
        tags = {genome.get(self.weight[p], base) for p in self.cat_parts[cid]}
        want = self.stored.get(cid, {}).get(tags.pop()) if len(tags) == 1 else None
        first = [want] if want is not None else [i for i, n in enumerate(nodes) if n.op == "KCatW"]
        return first + [i for i in range(len(nodes)) if i not in first]
