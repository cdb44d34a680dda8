"""Build the searchable space of a graph: partition, saturate every group (with precision rules),
and turn precision genomes into lowered programs (cached per group and genome)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping

from ..codegen.llir import Program
from ..error.predict import Change
from ..hlir.graph import Graph
from ..hlir.partition import Chunk, Partition, partition
from .choice import Candidate
from .extract import BASE, Knob, extract, knobs
from .lower import lower_chunk_program, lower_program
from .rules.precision import precision
from .saturate import GroupSpace, saturate_group
from ..quant.stored import CALIBRATED_CHOICES
from .tags import Tag, TagKind, is_kind, priority



@dataclass(frozen=True)
class ChunkSite:
    """One chunk of a group. A change whose first field is a ChunkSite applies to that chunk only and
    overrides its group's change for the same e-class (its tag may be BASE: that chunk stays FP32).
    Compares with group keys (str) so genomes that mix both sort deterministically."""

    group: str
    chunk: int

    def _key(self) -> tuple[str, int]:
        return (self.group, self.chunk)

    def __lt__(self, other):
        return self._key() < _site_key(other)

    def __gt__(self, other):
        return self._key() > _site_key(other)

    def __le__(self, other):
        return self._key() <= _site_key(other)

    def __ge__(self, other):
        return self._key() >= _site_key(other)


def _site_key(x) -> tuple[str, int]:
    """A group key sorts before the chunk sites of the same group."""
    if isinstance(x, ChunkSite):
        return x._key()
    if isinstance(x, str):
        return (x, -1)
    raise TypeError(f"cannot compare a ChunkSite with {type(x).__name__}")


def group_of(site: "str | ChunkSite") -> str:
    return site.group if isinstance(site, ChunkSite) else site


@dataclass(frozen=True)
class Offers:
    """What the space offers beyond formats and fusions (each adds e-classes and compile time)."""

    calibrated: bool = False  # weights may also be stored filled by GPTQ under their calibration Hessians
                              # (quant/gptq.py): one more storage class per quantized format and Gemm weight
    rotation: bool = False    # weight Gemms may also run with their K Hadamard-rotated (search/rules/rotate.py):
                              # one more alternative per Gemm, its rotated weight stored in any format
    smoothing: bool = False   # ... or with their K smoothed per channel (search/rules/smooth.py, SmoothQuant
                              # scales from the calibration activations): likewise


Genome = frozenset  # of Change (declared once, error/predict.py: the judge keys its verdicts by it)


@dataclass
class SearchSpace:
    graph: Graph
    part: Partition
    groups: dict[str, GroupSpace]
    knobs: dict[str, tuple[Knob, ...]]
    batch_invariant: bool = False  # every program lowered from it is a batch-invariant one (issue 37)
    _extracted: dict[tuple, Candidate] = field(default_factory=dict, repr=False)
    _knobs_of: dict[str, frozenset] = field(default_factory=dict, repr=False)  # candidate key -> knobs

    @staticmethod
    def build(graph: Graph, with_precision: bool = True, fusion: bool = True,
              calibrated: bool = False, rotation: bool = False, smoothing: bool = False) -> "SearchSpace":
        """`fusion=False`: the space without the fusion rules (every kernel as the lowering made it);
        `calibrated`: weights may also be stored filled by GPTQ (the compile collects their Hessians);
        `rotation`: weight Gemms may also run with their K Hadamard-rotated (search/rules/rotate.py);
        `smoothing`: ... or smoothed per channel (search/rules/smooth.py)."""
        return SearchSpace.saturated(graph, partition(graph), with_precision, fusion, calibrated, rotation, smoothing)

    @staticmethod
    def saturated(graph: Graph, part: Partition, with_precision: bool = True, fusion: bool = True,
                  calibrated: bool = False, rotation: bool = False, smoothing: bool = False) -> "SearchSpace":
        """The space of an already partitioned graph: each group saturated once."""
        consumers = graph.consumers()
        groups = {g.key: saturate_group(graph, g, consumers, precision if with_precision else None, fusion=fusion,
                                        calibrated=calibrated, rotation=rotation, smoothing=smoothing)
                  for g in part.groups}
        return SearchSpace(graph, part, groups, {k: knobs(gs.space) for k, gs in groups.items()})

    def offers_calibrated(self) -> bool:
        """Whether some weight may be stored filled by a calibrated rounding, or some Gemm smoothed (then the
        calibration statistics are needed: Hessians, channel max)."""
        return any((is_kind(t, TagKind.STORE) and Tag.parse(t).variant in CALIBRATED_CHOICES)
                   or is_kind(t, TagKind.SMOOTH) for ks in self.knobs.values() for k in ks for t in k.tags)

    def group_index(self, key: str) -> int:
        return [g.key for g in self.part.groups].index(key)

    def all_changes(self) -> list[Change]:
        """Every single precision change, Gemms first (where the time goes), then reductions, softmax,
        elementwise storage; group order and tag order are kept, so the list is deterministic."""
        out = [(gk, k.cls, tag) for gk, ks in self.knobs.items() for k in ks for tag in k.tags if tag != BASE]
        return sorted(out, key=lambda c: priority(c[2]))

    def candidates(self, genome: Iterable[Change]) -> dict[int, Candidate]:
        """Chunk index -> its candidate: the group's changes, then the chunk's own overrides."""
        per_group: dict[str, dict[str, str]] = {gk: {} for gk in self.groups}
        per_chunk: dict[int, dict[str, str]] = {}
        owner = {c.index: g.key for g in self.part.groups for c in g.chunks}
        for site, cls, tag in genome:
            if isinstance(site, ChunkSite):
                if owner.get(site.chunk) != site.group:
                    raise ValueError(f"genome names chunk {site.chunk}, which is not in group {site.group[:12]}")
                table = per_chunk.setdefault(site.chunk, {})
            else:
                table = per_group[site]
            if cls in table:
                raise ValueError(f"genome sets class {cls} twice")
            table[cls] = tag
        out = {}
        for g in self.part.groups:
            for c in g.chunks:
                choice = {**per_group[g.key], **per_chunk.get(c.index, {})}
                key = (g.key, frozenset((k, t) for k, t in choice.items() if t != BASE))
                if key not in self._extracted:
                    cand = self._extracted[key] = extract(self.groups[g.key].space, dict(key[1]))
                    # knob sets extracting the same candidate: the smallest stands for it (a knob that
                    # changes nothing there is left out)
                    known = self._knobs_of.get(cand.key)
                    if known is None or (len(key[1]), sorted(key[1])) < (len(known), sorted(known)):
                        self._knobs_of[cand.key] = key[1]
                out[c.index] = self._extracted[key]
        return out

    def knobs_of(self, cand: Candidate) -> frozenset | None:
        """The fewest (e-class, tag) changes a chunk candidate was extracted from (None: never extracted)."""
        return self._knobs_of.get(cand.key)

    def program(self, genome: Iterable[Change]) -> Program:
        return lower_program(self.graph, self.part, self.groups, self.candidates(genome), self.batch_invariant)

    def lower_chunk(self, chunk: Chunk, cand: Candidate) -> Program:
        """One chunk alone under `cand` (for the per-group error estimate)."""
        return lower_chunk_program(self.graph, chunk, self.groups[self.group_key_of(chunk.index)], cand,
                                   self.batch_invariant)

    def with_batch_invariance(self, batch_invariant: bool) -> "SearchSpace":
        """The same saturated groups, lowering batch-invariant programs or not (extractions are shared:
        they do not depend on it)."""
        if batch_invariant == self.batch_invariant:
            return self
        return SearchSpace(self.graph, self.part, self.groups, self.knobs, batch_invariant, self._extracted,
                           self._knobs_of)

    def group_key_of(self, chunk_index: int) -> str:
        return next(g.key for g in self.part.groups if any(c.index == chunk_index for c in g.chunks))

    def per_chunk(self, genome: Iterable[Change], chunk: int, changes: Iterable[tuple[str, str]]) -> Genome:
        """`genome` with (e-class, tag) `changes` applied to one chunk only (BASE keeps it FP32)."""
        site = ChunkSite(self.group_key_of(chunk), chunk)
        over = dict(changes)
        keep = [ch for ch in genome if not (ch[0] == site and ch[1] in over)]
        return frozenset(keep + [(site, cls, tag) for cls, tag in over.items()])


def genome_of(changes: Mapping[tuple[str, str], str]) -> Genome:
    return frozenset((g, c, t) for (g, c), t in changes.items() if t != BASE)
