"""Per-group error: each chunk run alone from its exact (FP64) inputs, its amplification of input
error estimated by finite differences, and an end-to-end estimate composed across chunks.

e_out(chunk) ~= local(chunk) + A(chunk) * max e_out(sources): relative L2 errors. Local errors are
cached per (chunk, candidate), so a genome that changes one group re-measures only that group's
chunks. The estimate screens candidates before the end-to-end measurement that finalists get.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Protocol

import numpy as np

from ..codegen.llir import Program
from ..hlir.evaluate import evaluate_chunk
from ..hlir.graph import Graph
from ..hlir.partition import Chunk, Partition
from ..runtime.cpu import CpuRuntime
from .metrics import rel_l2
from .reference import Fp64Reference


class ChunkChoice(Protocol):
    """What a chunk runs (the search's per-chunk candidate): identified by its key."""

    @property
    def key(self) -> str: ...


@dataclass
class GroupEstimator:
    """`lower_chunk(chunk, choice)` is the chunk alone as a Program (inputs "%<node>", weights by their
    names, exports as outputs): the search supplies it, so the error stage judges programs without
    importing search."""

    graph: Graph
    part: Partition
    batch: Mapping[str, np.ndarray]
    lower_chunk: Callable[[Chunk, ChunkChoice], Program]
    reference: Fp64Reference | None = None  # FP64 of `batch` (computed here when not given)
    seed: int = 0
    local_cache: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.reference is None:
            self.reference = Fp64Reference.of(self.graph, self.batch)
        self.bindings = self.reference.bindings
        self.values = self.reference.values
        self.source_chunks = {}
        owner = {nid: c.index for c in self.part.chunks for nid in c.exported}
        for c in self.part.chunks:
            self.source_chunks[c.index] = sorted({owner[n] for n in c.external if n in owner})
        self.amplification = {c.index: self._amplification(c) for c in self.part.chunks}

    def _ext_values(self, chunk) -> dict[int, np.ndarray]:
        return {nid: np.asarray(self.values[nid]) for nid in chunk.external}

    def _amplification(self, chunk) -> float:
        """max over two random directions of (rel change of outputs) / (rel change of inputs), FP64."""
        rng = np.random.default_rng(self.seed + chunk.index)
        ext = self._ext_values(chunk)
        base = evaluate_chunk(self.graph, chunk.nodes, ext, self.bindings)
        movable = [n for n in chunk.external if self._is_activation(n) and self.graph.nodes[n].dtype.is_float]
        if not movable:
            return 0.0
        worst = 0.0
        for _ in range(2):
            pert = dict(ext)
            num = den = 0.0
            for n in movable:
                x = ext[n].astype(np.float64)
                d = rng.standard_normal(x.shape) * 1e-6 * (np.abs(x) + 1e-30)
                pert[n] = x + d
                den = max(den, float(rel_l2(pert[n], x)))
            out = evaluate_chunk(self.graph, chunk.nodes, pert, self.bindings)
            for nid in chunk.exported:
                num = max(num, float(rel_l2(out[nid], base[nid])))
            worst = max(worst, num / den if den > 0 else 0.0)
        return worst

    def _is_activation(self, nid: int) -> bool:
        return self.graph.weight_name(nid) is None

    def local_error(self, chunk: Chunk, candidate: ChunkChoice) -> float:
        key = (chunk.index, candidate.key)
        if key not in self.local_cache:
            prog = self.lower_chunk(chunk, candidate)
            feed = {f"%{n}": v for n, v in self._ext_values(chunk).items() if self.graph.weight_name(n) is None}
            # weights as the runtime's weights (not inputs), so their converted/prepared forms are cached
            out = CpuRuntime(prog, self.graph.weights).run(feed, self.bindings).outputs
            errs = [float(rel_l2(out[f"%{nid}"], self.values[nid])) for nid in chunk.exported]
            self.local_cache[key] = max(errs) if errs else 0.0
        return self.local_cache[key]

    def estimate(self, candidates: Mapping[int, ChunkChoice]) -> dict[int, float]:
        """Composed relative L2 error of every chunk's exports under per-chunk candidates."""
        est: dict[int, float] = {}
        for c in self.part.chunks:
            e_in = max((est[s] for s in self.source_chunks[c.index]), default=0.0)
            est[c.index] = self.local_error(c, candidates[c.index]) + self.amplification[c.index] * e_in
        return est

    def output_estimate(self, candidates) -> dict[str, float]:
        est = self.estimate(candidates)
        owner = {nid: c.index for c in self.part.chunks for nid in c.exported}
        return {name: est[owner[nid]] for name, nid in self.graph.outputs.items()}
