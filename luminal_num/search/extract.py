"""Deterministic extraction from a precision genome: which variant each value uses, then the best
structure for it (Gemm over Mul+Sum, fused elementwise chains, in-place scatter).

A *knob* is an e-class whose alternatives carry different precision tags (a Gemm variant, a
KVariant storage/accumulator choice, a softmax compute precision). A genome maps knobs to tags;
every other choice follows from fixed preferences, so the search explores precision, not plumbing.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from ..codegen.kinds import Sort, decl
from .choice import Candidate, ChoiceSpace, ENode, _Picker
from .horizontal import SliceChoice
from .tags import Tag, TagKind
from .rows_extract import RowBodies, as_elementwise, fused_scatter_first, row_order

BASE = "f32"


def node_tag(n: ENode) -> str:
    """The precision tag of an alternative: its declared knob parameter, prefixed (BASE when FP32)."""
    knob = n.decl.knob
    if knob is None:
        return BASE
    value = n.arg(knob[0])
    return BASE if value == BASE else knob[1] + value


@dataclass(frozen=True)
class Knob:
    cls: str
    tags: tuple[str, ...]  # BASE first
    origin: str            # the HLIR op this value implements


def knobs(space: ChoiceSpace) -> tuple[Knob, ...]:
    out = []
    for cid, nodes in space.classes.items():
        tags = sorted({node_tag(n) for n in nodes}, key=lambda t: (t != BASE, t))
        if len(tags) > 1 and tags[0] == BASE:
            out.append(Knob(cid, tuple(tags), space.class_origin.get(cid, "?")))
    return tuple(out)


# Preferred structure among alternatives of the same tag (lower first; undeclared names are an error).
_T_RANK = {decl(n).name: 0 for n in ("KGemm", "KScatterNoCopy", "KVariant", "KRows")} | {decl("KScatterEw").name: -1}


def _t_rank(n: ENode, genome: Mapping[str, str], space: ChoiceSpace, slices: SliceChoice) -> int:
    """A Gemm epilogue comes first when its variant is the one the genome chose for its Gemm (the same
    value with one kernel less) and that Gemm is not read from a horizontally fused one (it would run
    twice), and after everything else when not (never a second variant); a slice never unless taken. A GLU
    epilogue (its `acc` a fused Gemm) comes before all when the genome takes the fused Gemm."""
    if n.op == "KGemmEpi" and n.cls("acc") in slices.parts:
        return -2 if slices.takes_src(n.cls("acc"), genome, BASE) else 9
    if n.op == "KGemmEpi":
        prec, acc = n.arg("prec"), n.cls("acc")
        ok = genome.get(acc, BASE) == (BASE if prec == BASE else str(Tag(TagKind.GEMM, prec)))
        return -1 if ok and not slices.sliced(space, acc, genome, BASE) else 9
    if n.op == "KSlice":
        return 10
    return _T_RANK.get(n.op, 1)


def extract(space: ChoiceSpace, genome: Mapping[str, str] | None = None) -> Candidate:
    """The candidate realising `genome` (class -> tag; missing = BASE) with preferred structure."""
    genome = dict(genome or {})
    slices = SliceChoice(space)
    rows = RowBodies.of(space)

    def order(cid: str, picker: _Picker) -> list[int]:
        nodes = space.classes[cid]
        if cid in rows.inner:
            return row_order(space, cid, rows, picker)
        want = genome.get(cid, BASE)
        idx = [i for i, n in enumerate(nodes) if node_tag(n) == want and n.op != "KSlice"] or list(range(len(nodes)))
        if nodes[idx[0]].decl.sort is Sort.F:
            return _scalar_order(space, cid, idx, picker)
        cat = slices.cat_order(cid, nodes, genome, BASE)  # concatenated weights held as the parts are
        if cat is not None:
            return cat
        # a part of a horizontally fused Gemm reads the fused one when the genome allows (horizontal.py)
        taken = [i for i, n in enumerate(nodes) if n.op == "KSlice" and slices.takes(n, genome, BASE)]
        ranked = taken + sorted((i for i in idx if i not in taken),
                                key=lambda i: (_t_rank(nodes[i], genome, space, slices), i))
        return fused_scatter_first(space, nodes, ranked, rows, picker)

    p = _Picker(space, None, None, order)
    for _, cid in space.roots:
        if not p.pick(cid):
            raise RuntimeError(f"no acyclic extraction for root class {cid}")
    return Candidate(tuple(sorted(p.chosen.items())))


def _scalar_order(space: ChoiceSpace, cid: str, idx: list[int], picker: _Picker) -> list[int]:
    """Fuse the producer when the value read is an elementwise kernel, with exactly the rounding the
    producer's chosen variant has; otherwise read its buffer. So the variant chosen for a value is
    what every consumer sees."""
    nodes = space.classes[cid]
    loads = [i for i in idx if nodes[i].op == "Load"]
    lowp = [i for i in idx if nodes[i].op == "FRound" and nodes[i].arg("dt") != BASE]
    plain = [i for i in idx if i not in loads and i not in lowp]
    for i in loads:
        t = nodes[i].cls("t")
        if not picker.pick(t):
            continue
        chosen = as_elementwise(space, t, space.classes[t][picker.chosen[t]])
        if chosen.op == "Ew":
            return plain + loads + lowp
        if chosen.op == "KVariant" and picker.pick(chosen.cls("inner")):
            inner = as_elementwise(space, chosen.cls("inner"),
                                   space.classes[chosen.cls("inner")][picker.chosen[chosen.cls("inner")]])
            if inner.op == "Ew":
                match = [j for j in lowp if (nodes[j].arg("x"), nodes[j].arg("dt")) == (inner.arg("body"), inner.arg("dt"))]
                return match + loads + plain + [j for j in lowp if j not in match]
        return loads + plain + lowp
    return plain + loads + lowp
