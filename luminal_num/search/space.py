"""Build the searchable space of a graph: partition, saturate every group (with precision rules),
and turn precision genomes into lowered programs (cached per group and genome)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping

from ..codegen.llir import Program
from ..hlir.graph import Graph
from ..hlir.partition import Chunk, Partition, partition
from .choice import Candidate
from .extract import BASE, Knob, extract, knobs
from .lower import lower_chunk_program, lower_program
from .rules.precision import precision
from .saturate import GroupSpace, saturate_group

Change = tuple[str, str, str]  # (group key, e-class, tag)
Genome = frozenset  # of Change


@dataclass
class SearchSpace:
    graph: Graph
    part: Partition
    groups: dict[str, GroupSpace]
    knobs: dict[str, tuple[Knob, ...]]
    _extracted: dict[tuple, Candidate] = field(default_factory=dict, repr=False)

    @staticmethod
    def build(graph: Graph, with_precision: bool = True, fusion: bool = True) -> "SearchSpace":
        """`fusion=False`: the space without the fusion rules (every kernel as the lowering made it)."""
        part = partition(graph)
        consumers = graph.consumers()
        groups = {g.key: saturate_group(graph, g, consumers, precision if with_precision else None, fusion=fusion)
                  for g in part.groups}
        return SearchSpace(graph, part, groups, {k: knobs(gs.space) for k, gs in groups.items()})

    def group_index(self, key: str) -> int:
        return [g.key for g in self.part.groups].index(key)

    def all_changes(self) -> list[Change]:
        """Every single precision change, Gemms first (where the time goes), then reductions, softmax,
        elementwise storage; group order and tag order are kept, so the list is deterministic."""
        kinds = {"gemm": 0, "sum": 1, "softmax": 2, "ew": 3}
        out = [(gk, k.cls, tag) for gk, ks in self.knobs.items() for k in ks for tag in k.tags if tag != BASE]
        return sorted(out, key=lambda c: kinds.get(c[2].split(":")[0], 4))

    def candidates(self, genome: Iterable[Change]) -> dict[int, Candidate]:
        per_group: dict[str, dict[str, str]] = {gk: {} for gk in self.groups}
        for gk, cls, tag in genome:
            if cls in per_group[gk]:
                raise ValueError(f"genome sets class {cls} twice")
            per_group[gk][cls] = tag
        out = {}
        for g in self.part.groups:
            key = (g.key, frozenset(per_group[g.key].items()))
            if key not in self._extracted:
                self._extracted[key] = extract(self.groups[g.key].space, per_group[g.key])
            for c in g.chunks:
                out[c.index] = self._extracted[key]
        return out

    def program(self, genome: Iterable[Change]) -> Program:
        return lower_program(self.graph, self.part, self.groups, self.candidates(genome))

    def lower_chunk(self, chunk: Chunk, cand: Candidate) -> Program:
        """One chunk alone under `cand` (for the per-group error estimate)."""
        key = next(g.key for g in self.part.groups if any(c.index == chunk.index for c in g.chunks))
        return lower_chunk_program(self.graph, chunk, self.groups[key], cand)

    def knob_kind(self, change: Change) -> str:
        return change[2].split(":")[0]


def genome_of(changes: Mapping[tuple[str, str], str]) -> Genome:
    return frozenset((g, c, t) for (g, c), t in changes.items() if t != BASE)
