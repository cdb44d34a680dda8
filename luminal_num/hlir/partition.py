"""Cut a graph into chunks at graph_breaks and group structurally identical chunks.

Graph inputs (activations and weights) are not part of any chunk: they are external sources, like
the previous layer's output. That way layer 0 and layer 11 of a transformer compute the same
function of their sources and share one group (Luminal's dedupe), while each chunk keeps its own
weights for per-chunk precision choices.
"""
from __future__ import annotations

from dataclasses import dataclass

from .graph import Graph
from .ops import Op


@dataclass(frozen=True)
class Chunk:
    index: int
    nodes: tuple[int, ...]            # node ids in topological order (no Input nodes)
    external: tuple[int, ...]         # sources outside the chunk, in order of first use
    exported: tuple[int, ...]         # chunk nodes read by later chunks, plus Output nodes

    def local_of(self, node_id: int) -> int:
        return self.nodes.index(node_id)


@dataclass(frozen=True)
class Group:
    key: str
    chunks: tuple[Chunk, ...]

    @property
    def representative(self) -> Chunk:
        return self.chunks[0]


@dataclass(frozen=True)
class Partition:
    chunks: tuple[Chunk, ...]
    groups: tuple[Group, ...]

    def summary(self) -> str:
        lines = [f"{len(self.chunks)} chunks in {len(self.groups)} groups"]
        for gi, g in enumerate(self.groups):
            lines.append(f"  group {gi}: chunks {[c.index for c in g.chunks]}, "
                         f"{len(g.representative.nodes)} ops per chunk")
        return "\n".join(lines)


def partition(graph: Graph) -> Partition:
    """Chunks in graph order, then groups keyed by structural hash (first-seen order)."""
    consumers = graph.consumers()
    by_chunk: dict[int, list[int]] = {}
    for n in graph.nodes:
        if n.op is not Op.INPUT:
            by_chunk.setdefault(n.chunk, []).append(n.id)
    chunks = []
    for ci in sorted(by_chunk):
        ids = by_chunk[ci]
        inside = set(ids)
        external: list[int] = []
        for nid in ids:
            for s in graph.nodes[nid].srcs:
                if s.node not in inside and s.node not in external:
                    external.append(s.node)
        exported = tuple(nid for nid in ids
                         if graph.nodes[nid].op is Op.OUTPUT or any(c not in inside for c in consumers[nid]))
        chunks.append(Chunk(len(chunks), tuple(ids), tuple(external), exported))
    groups: dict[str, list[Chunk]] = {}
    for c in chunks:
        groups.setdefault(chunk_key(graph, c), []).append(c)
    return Partition(tuple(chunks), tuple(Group(k, tuple(v)) for k, v in groups.items()))


def chunk_key(graph: Graph, chunk: Chunk) -> str:
    """Structure of the chunk's ops plus its interface (which local nodes are exported)."""
    local = {nid: i for i, nid in enumerate(chunk.nodes)}
    exported = tuple(local[e] for e in chunk.exported)
    return graph.structural_key(chunk.nodes, extra=("exported", exported))
