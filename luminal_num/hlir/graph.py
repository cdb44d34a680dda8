"""The HLIR graph: an append-only DAG of primop nodes (ids are creation order, hence topological).

Each node stores the views through which it reads its sources, its (symbolic) output shape, its
logical dtype and the chunk it belongs to (`graph_break()` starts a new chunk).
"""
from __future__ import annotations

import hashlib
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import numpy as np

from ..dtypes.formats import F32, Format
from .node import InputInfo, Node, Source
from .ops import Op
from .symbolic import Dim, bind_shapes, encode
from .store import keyed
from .tensor import GraphTensor


@dataclass
class Graph:
    nodes: list[Node] = field(default_factory=list)
    inputs: dict[str, InputInfo] = field(default_factory=dict)
    outputs: dict[str, int] = field(default_factory=dict)
    weights: dict[str, np.ndarray] = field(default_factory=dict)
    chunk: int = 0
    matmuls: list[int] = field(default_factory=list)  # SumReduce ids built by matmul() (test ground truth)
    _consts: dict[tuple, int] = field(default_factory=dict, repr=False)
    # node id -> (framework-level op name, instance number): which user-level op (layer_norm, gelu, matmul,
    # ...) a primop belongs to, outermost op wins; peer recipes (PyTorch autocast) read it, nothing else does
    op_scopes: dict[int, tuple[str, int]] = field(default_factory=dict, repr=False)
    _scope_stack: list[tuple[str, int]] = field(default_factory=list, repr=False)

    # -- building -----------------------------------------------------------------------------
    def add(self, op: Op, srcs: Iterable[Source], shape: tuple[Dim, ...], dtype: Format,
            attrs: Mapping[str, Any] | None = None) -> int:
        srcs = tuple(srcs)
        decl = op.decl
        if decl.arity >= 0 and len(srcs) != decl.arity:
            raise ValueError(f"{decl.name} takes {decl.arity} sources, got {len(srcs)}")
        attrs = tuple((attrs or {}).items())
        names = tuple(k for k, _ in attrs)
        if set(names) != set(decl.attrs):
            raise ValueError(f"{decl.name} needs attributes {decl.attrs}, got {names}")
        for s in srcs:
            if not 0 <= s.node < len(self.nodes):
                raise ValueError(f"source node {s.node} does not exist")
        node = Node(len(self.nodes), op, srcs, tuple(shape), dtype, attrs, self.chunk)
        self.nodes.append(node)
        if self._scope_stack and op is not Op.CONSTANT:  # constants are shared, they belong to no op
            self.op_scopes[node.id] = self._scope_stack[0]
        return node.id

    @contextmanager
    def op_scope(self, name: str):
        """Nodes added inside belong to one instance of the user-level op `name` (not structural)."""
        self._scope_stack.append((name, len(self.nodes)))
        try:
            yield
        finally:
            self._scope_stack.pop()

    def input(self, name: str, shape, dtype: Format = F32, value_range=None):
        return GraphTensor._input(self, name, shape, dtype, value_range, weight=None)

    def weight(self, name: str, value: np.ndarray, dtype: Format = F32):
        """A weight: an Input whose value is known at compile time (static scales come from it)."""
        return GraphTensor._input(self, name, value.shape, dtype, None, weight=keyed(value))

    def constant(self, value: float | Dim, dtype: Format = F32):
        return GraphTensor._constant(self, value, dtype)

    def arange(self, length: Dim, dtype: Format = F32):
        return GraphTensor._iota(self, length, dtype)

    def graph_break(self) -> None:
        """Start a new chunk: later nodes are searched separately (per layer, at KV writes)."""
        self.chunk += 1

    def output(self, tensor, name: str) -> int:
        if name in self.outputs:
            raise ValueError(f"output {name!r} already exists")
        nid = self.add(Op.OUTPUT, [Source(tensor.id, tensor.st)], tensor.shape, tensor.dtype, {"name": name})
        self.outputs[name] = nid
        return nid

    # -- queries ------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.nodes)

    def weight_name(self, nid: int) -> str | None:
        """The weight node `nid` reads (its name in `weights`), or None for any other node."""
        node = self.nodes[nid]
        if node.op is not Op.INPUT:
            return None
        name = node.attr("name")
        return name if self.inputs[name].is_weight else None

    def consumers(self) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {n.id: [] for n in self.nodes}
        for n in self.nodes:
            for s in n.srcs:
                out[s.node].append(n.id)
        return out

    def count(self, op: Op) -> int:
        return sum(1 for n in self.nodes if n.op is op)

    def bind_symbols(self, inputs: Mapping[str, np.ndarray], bindings: Mapping[str, int] | None = None) -> dict[str, int]:
        """Infer symbolic dims from input shapes (a dim that is a single symbol binds to the size)."""
        return bind_shapes({n: i.shape for n, i in self.inputs.items()},
                           {n: np.shape(a) for n, a in inputs.items()}, bindings)

    def structural_key(self, node_ids: Iterable[int] | None = None, extra: tuple = ()) -> str:
        """sha256 of a canonical encoding of ops, views, shapes and dtypes (names and values ignored).

        Sources outside `node_ids` are encoded by position of first appearance, so two chunks that
        compute the same function of their inputs get the same key.
        """
        ids = sorted(node_ids) if node_ids is not None else [n.id for n in self.nodes]
        local = {nid: i for i, nid in enumerate(ids)}
        external: dict[int, int] = {}
        items = []
        for nid in ids:
            n = self.nodes[nid]
            srcs = []
            for s in n.srcs:
                if s.node in local:
                    ref = ("local", local[s.node])
                else:
                    src = self.nodes[s.node]
                    is_weight = self.weight_name(s.node) is not None
                    ref = ("ext", external.setdefault(s.node, len(external)),
                           tuple(encode(d) for d in src.shape), src.dtype.name, is_weight)
                srcs.append((ref, s.view.encode()))
            op_attrs = n.structural_attrs()
            if n.op is Op.INPUT:
                info = self.inputs[n.attr("name")]
                op_attrs = op_attrs + (("weight", info.is_weight),)
            items.append((n.op.decl.name, tuple(srcs), tuple(encode(d) for d in n.shape), n.dtype.name, op_attrs))
        return hashlib.sha256(repr((tuple(items), extra)).encode()).hexdigest()

    def __str__(self) -> str:
        lines = []
        for n in self.nodes:
            args = ", ".join(f"%{s.node}" + ("" if s.view.is_contiguous and tuple(s.view.shape) == self.nodes[s.node].shape
                                                  else f"{list(map(str, s.view.shape))}") for s in n.srcs)
            attrs = ", ".join(f"{k}={v!r}" for k, v in n.attrs)
            shape = "x".join(map(str, n.shape)) or "scalar"
            lines.append(f"c{n.chunk} %{n.id} = {n.op.decl.name}({args}{'; ' if args and attrs else ''}{attrs}) "
                         f": {shape} {n.dtype}")
        return "\n".join(lines)
