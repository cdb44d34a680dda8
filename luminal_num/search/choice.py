"""The choice space read back from a saturated e-graph, and candidates (one e-node per e-class).

Only kernel-level e-nodes are selectable (HLIR constructors are dropped after lowering). The
e-graph can contain cycles (x == FRound(x, f32) style unions), so random selection is a
depth-first search that never picks a node reaching back into the class being chosen.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from functools import cached_property
from typing import Iterable, Union

import numpy as np

from ..codegen.kinds import ENodeDecl, decl
from .egraph import HLIR_NAMES, SELECTABLE


@dataclass(frozen=True)
class ClassRef:
    id: str


Child = Union[ClassRef, int, str]  # an e-class, or a primitive i64 / String value


@dataclass(frozen=True)
class ENode:
    op: str
    children: tuple[Child, ...]

    def child_classes(self) -> tuple[str, ...]:
        return tuple(c.id for c in self.children if isinstance(c, ClassRef))

    @property
    def decl(self) -> ENodeDecl:
        return decl(self.op)

    def arg(self, param: str) -> Child:
        """The child bound to the declared parameter `param` (codegen/kinds.py)."""
        return self.children[self.decl.index(param)]

    def cls(self, param: str) -> str:
        """The e-class of a tensor/scalar/buffer parameter."""
        c = self.arg(param)
        if not isinstance(c, ClassRef):
            raise TypeError(f"{self.op}.{param} is a primitive value, not an e-class")
        return c.id


@dataclass(frozen=True)
class ChoiceSpace:
    classes: dict[str, tuple[ENode, ...]]
    roots: tuple[tuple[int, str], ...]   # (local node index of an exported value, e-class)
    class_view: dict[str, int]           # e-class -> id of the identity view of its value (its shape)
    class_origin: dict[str, str]         # e-class -> the HLIR op it implements (for messages, op tables)
    class_node: dict[str, int] = field(default_factory=dict)  # e-class -> HLIR node id (representative chunk)

    @property
    def n_classes(self) -> int:
        return len(self.classes)

    @property
    def n_nodes(self) -> int:
        return sum(len(v) for v in self.classes.values())

    @cached_property
    def extractable_classes(self) -> frozenset[str]:
        """extractable(), computed once per space (every candidate's extractor asks)."""
        return self.extractable()

    def extractable(self) -> frozenset[str]:
        ok: set[str] = set()
        changed = True
        while changed:
            changed = False
            for cid, nodes in self.classes.items():
                if cid not in ok and any(all(c in ok for c in n.child_classes()) for n in nodes):
                    ok.add(cid)
                    changed = True
        return frozenset(ok)


@dataclass(frozen=True)
class Candidate:
    """One choice per reachable e-class: class id -> index into space.classes[class id]."""

    choices: tuple[tuple[str, int], ...]

    def as_dict(self) -> dict[str, int]:
        return dict(self.choices)

    @cached_property
    def key(self) -> str:  # cached: the judge asks for it per chunk per candidate (a hash of every choice)
        return hashlib.sha256(json.dumps(self.choices).encode()).hexdigest()[:16]


def read_choice_space(serialized_json: str, root_relation: str) -> ChoiceSpace:
    """Parse egglog's serialized e-graph (egraph-serialize JSON) into selectable classes and roots."""
    data = json.loads(serialized_json)
    nodes, class_data = data["nodes"], data.get("class_data", {})

    def prim_value(node) -> int | str:
        typ = class_data.get(node["eclass"], {}).get("type")
        return json.loads(node["op"]) if typ == "String" else int(node["op"])

    def is_prim(nid: str) -> bool:
        """A primitive value node (function rows living in a primitive class are not values)."""
        return nid.startswith("primitive-") and class_data.get(nodes[nid]["eclass"], {}).get("type") in ("i64", "String")

    classes: dict[str, list[ENode]] = {}
    roots = []
    prim_of_class = {n["eclass"]: prim_value(n) for nid, n in nodes.items() if is_prim(nid)}
    class_view: dict[str, int] = {}
    origins: dict[str, set[str]] = {}
    for nid, node in nodes.items():
        op = node["op"]
        if op == "identity_view":
            class_view[nodes[node["children"][0]]["eclass"]] = prim_of_class[node["eclass"]]
            continue
        if op == root_relation:
            t_node, idx = node["children"]
            roots.append((prim_value(nodes[idx]), nodes[t_node]["eclass"]))
            continue
        if op in HLIR_NAMES:
            origins.setdefault(node["eclass"], set()).add(op[1:])
            continue
        if op not in SELECTABLE or node.get("subsumed"):
            continue
        kids = tuple(prim_value(nodes[c]) if is_prim(c) else ClassRef(nodes[c]["eclass"]) for c in node["children"])
        classes.setdefault(node["eclass"], []).append(ENode(op, kids))
    # deterministic order of alternatives (the serializer's order is not part of the contract)
    ordered = {cid: tuple(sorted(ns, key=lambda n: (n.op, repr(n.children)))) for cid, ns in sorted(classes.items())}
    origin = {cid: "/".join(sorted(ops)) for cid, ops in origins.items()}
    # egglog names each bound HLIR term's class after its lets (`$n<node id>, ...`, see encode.encode_chunk);
    # a class holding several nodes' values is named after the first (the value's own computation)
    node_of = {cid: min(int(x.strip()[2:]) for x in str(d["let"]).split(","))
               for cid, d in class_data.items() if str(d.get("let", "")).startswith("$n")}
    return ChoiceSpace(ordered, tuple(sorted(roots)), class_view, origin, node_of)


class _Picker:
    """Cycle-safe random DFS with undo, so a dead end never leaves half a candidate behind."""

    def __init__(self, space: ChoiceSpace, rng: np.random.Generator | None, fixed: dict[str, int] | None = None,
                 order=None):
        self.space, self.rng = space, rng
        self.ok = space.extractable_classes
        self.fixed = fixed or {}
        self.order = order  # optional (class id, picker) -> preferred alternative order (deterministic)
        self.chosen: dict[str, int] = {}
        self.on_stack: set[str] = set()

    def pick(self, cid: str) -> bool:
        if cid in self.chosen:
            return cid not in self.on_stack
        if cid in self.on_stack:
            return False
        nodes = self.space.classes.get(cid, ())
        self.on_stack.add(cid)  # before ordering: an order callback may pick other classes
        if self.order is not None:
            order = self.order(cid, self)
        else:
            order = list(range(len(nodes)))
            self.rng.shuffle(order)
        if cid in self.fixed and self.fixed[cid] < len(nodes):
            order.remove(self.fixed[cid])
            order.insert(0, self.fixed[cid])
        for i in order:
            kids = nodes[i].child_classes()
            if not all(k in self.ok for k in kids):
                continue
            snapshot = set(self.chosen)
            self.chosen[cid] = i
            if all(self.pick(k) for k in kids):
                self.on_stack.discard(cid)
                return True
            for k in set(self.chosen) - snapshot:
                del self.chosen[k]
        self.on_stack.discard(cid)
        return False


def random_candidate(space: ChoiceSpace, rng: np.random.Generator, fixed: dict[str, int] | None = None) -> Candidate:
    """A uniformly-shuffled cycle-free choice for every class reachable from the roots."""
    p = _Picker(space, rng, fixed)
    for _, cid in space.roots:
        if not p.pick(cid):
            raise RuntimeError(f"no acyclic extraction for root class {cid}")
    return Candidate(tuple(sorted(p.chosen.items())))


def mutate(space: ChoiceSpace, cand: Candidate, rng: np.random.Generator, n_changes: int = 2) -> Candidate:
    """Re-pick `n_changes` reachable classes that have alternatives; keep every other choice."""
    current = cand.as_dict()
    multi = [c for c in current if len(space.classes[c]) > 1]
    if not multi:
        return cand
    fixed = dict(current)
    for c in rng.choice(multi, size=min(n_changes, len(multi)), replace=False):
        alts = [i for i in range(len(space.classes[c])) if i != current[c]]
        fixed[str(c)] = int(rng.choice(alts))
    return random_candidate(space, rng, fixed)


def reachable(space: ChoiceSpace, cand: Candidate) -> list[str]:
    """Classes reachable from the roots under this candidate, children before parents."""
    choice = cand.as_dict()
    order: list[str] = []
    seen: set[str] = set()

    def visit(cid: str) -> None:
        if cid in seen:
            return
        seen.add(cid)
        for k in space.classes[cid][choice[cid]].child_classes():
            visit(k)
        order.append(cid)
    for _, cid in space.roots:
        visit(cid)
    return order


def nodes_chosen(space: ChoiceSpace, cand: Candidate) -> Iterable[tuple[str, ENode]]:
    choice = cand.as_dict()
    for cid in reachable(space, cand):
        yield cid, space.classes[cid][choice[cid]]
