"""Extraction inside row-kernel bodies (search/rules/fuse_rows.py): which alternative of a RowBody class.

A RowBody class mirrors an ordinary scalar class. Its preferred alternative follows what the ordinary
class chose, so a row kernel computes exactly the values (and roundings) the unfused kernels would:
a read of a row sum whose SUM form (accumulator, storage) is the one the genome chose for that sum
becomes the fused row sum; an op becomes the same op over row bodies; otherwise the wrapper (the
ordinary expression, read from buffers).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..codegen.kinds import Sort
from .choice import ChoiceSpace, ENode, _Picker


@dataclass(frozen=True)
class RowBodies:
    inner: dict[str, str]     # RowBody class -> the ordinary class it wraps
    of_class: dict[str, str]  # ordinary class -> its RowBody class

    @staticmethod
    def of_one(space: ChoiceSpace, row_class: str) -> str | None:
        """The ordinary class a RowBody class wraps."""
        return next((n.cls("x") for n in space.classes[row_class] if n.op == "RowBody"), None)

    @staticmethod
    def of(space: ChoiceSpace) -> "RowBodies":
        inner: dict[str, str] = {}
        for cid, nodes in space.classes.items():
            for n in nodes:
                if n.op == "RowBody" and cid not in inner:
                    inner[cid] = n.cls("x")
        return RowBodies(inner, {x: cid for cid, x in sorted(inner.items(), reverse=True)})


def as_elementwise(space: ChoiceSpace, cid: str, node: ENode) -> ENode:
    """A row kernel chosen for a value stands for its Ew sibling (same body per element) when a consumer
    fuses the value: the consumer computes the ordinary body."""
    if node.op != "KRows":
        return node
    rows = RowBodies.of_one(space, node.cls("body"))
    return next((n for n in space.classes[cid] if n.op == "Ew" and n.cls("body") == rows
                 and n.arg("dt") == node.arg("dt")), node)


def _chosen(space: ChoiceSpace, cid: str, picker: _Picker) -> ENode | None:
    return space.classes[cid][picker.chosen[cid]] if picker.pick(cid) else None


def _producer(space: ChoiceSpace, load: ENode, picker: _Picker) -> ENode | None:
    """The kernel node the genome chose for a load's tensor (through a KVariant alias)."""
    t = _chosen(space, load.cls("t"), picker)
    if t is not None and t.op == "KVariant":
        t = _chosen(space, t.cls("inner"), picker)
    return t


def _has(space: ChoiceSpace, cid: str, want) -> bool:
    return any(want(n) for n in space.classes[cid])


def _fused_reads(space: ChoiceSpace, nodes, load: ENode, rows: RowBodies, picker: _Picker) -> list[int]:
    prod = _producer(space, load, picker)
    if prod is None or prod.op not in ("KSum", "Ew", "KRows"):
        return []
    body = prod.cls("body") if prod.op == "KRows" else rows.of_class.get(prod.cls("body"))
    view, dt = load.arg("view"), prod.arg("dt")
    if prod.op == "KSum":
        acc = prod.arg("acc")
        return [i for i, n in enumerate(nodes) if n.op == "FAt" and n.arg("view") == view and _has(
            space, n.cls("x"), lambda s: s.op == "FRowSum" and (s.cls("body"), s.arg("acc"), s.arg("dt")) == (body, acc, dt))]
    return [i for i, n in enumerate(nodes) if n.op == "FRound" and n.arg("dt") == dt and _has(
        space, n.cls("x"), lambda a: a.op == "FAt" and a.arg("view") == view and a.cls("x") == body)]


def _mirrors(n: ENode, chosen: ENode, rows: RowBodies) -> bool:
    if n.op != chosen.op or n.op in ("Load", "FConst"):
        return False
    for p in n.decl.params:
        if p.sort is Sort.F:
            if n.cls(p.name) != rows.of_class.get(chosen.cls(p.name)):
                return False
        elif n.arg(p.name) != chosen.arg(p.name):
            return False
    return True


def row_order(space: ChoiceSpace, cid: str, rows: RowBodies, picker: _Picker) -> list[int]:
    """Fused reads matching the genome's sums first, then the ordinary choice over row bodies, then the
    wrapper (the ordinary expression), then the rest."""
    nodes = space.classes[cid]
    wrapper = [i for i, n in enumerate(nodes) if n.op == "RowBody"]
    chosen = _chosen(space, rows.inner[cid], picker)
    first: list[int] = []
    if chosen is not None:
        first = _fused_reads(space, nodes, chosen, rows, picker) if chosen.op == "Load" else []
        first += [i for i, n in enumerate(nodes) if i not in first and _mirrors(n, chosen, rows)]
    return first + wrapper + [i for i in range(len(nodes)) if i not in first and i not in wrapper]


def _into_stored_cache(space: ChoiceSpace, scatter, picker: _Picker) -> bool:
    """Whether the in-place scatter's destination is a KV cache held in a KV format (KCacheStored): its
    rows must be written converted, which only the plain in-place scatter does."""
    for buf in space.classes[scatter.cls("dest")]:
        if buf.op == "ConsumedBuffer":
            dest = _chosen(space, buf.cls("t"), picker)
            return dest is not None and dest.op == "KCacheStored"
    return False


def fused_scatter_first(space: ChoiceSpace, nodes, idx: list[int], rows: RowBodies, picker: _Picker) -> list[int]:
    """Of the fused KV writes (KScatterEw) only the one computing the source as the genome chose it (same
    body, same stored rounding) stays ahead of the in-place scatter; the others go last."""
    fused = [i for i in idx if nodes[i].op == "KScatterEw"]
    plain = next((nodes[i] for i in idx if nodes[i].op == "KScatterNoCopy"), None)
    if not fused or plain is None:
        return idx
    if _into_stored_cache(space, plain, picker):  # the fused write has no KV-format store: the plain one does
        return [i for i in idx if i not in fused] + fused
    cls = plain.cls("src")
    src = _chosen(space, cls, picker)
    if src is not None and src.op == "KVariant":
        cls = src.cls("inner")
        src = _chosen(space, cls, picker)
    src = None if src is None else as_elementwise(space, cls, src)
    match = []
    if src is not None and src.op in ("Ew", "KRows"):
        body = src.cls("body") if src.op == "KRows" else rows.of_class.get(src.cls("body"))
        for i in fused:
            rnd = space.classes[nodes[i].cls("body")]
            if any(r.op == "FRound" and r.arg("dt") == src.arg("dt") and _has(
                    space, r.cls("x"), lambda a: a.op == "FAt" and a.arg("view") == plain.arg("vs")
                    and a.cls("x") == body) for r in rnd):
                match.append(i)
    return match[:1] + [i for i in idx if i not in fused] + [i for i in fused if i not in match[:1]]
