"""Per-chunk verdicts: a genome's end-to-end outputs composed from its chunks, each judged alone.

One FP64 pass per calibration batch keeps every chunk's exact inputs and outputs (Fp64Reference). A
chunk's candidate runs alone on its exact inputs: its local error is the deviation of its exports from
FP64. Its effect on the final outputs is the FP64 run of the rest of the model with that deviation
injected at the chunk's exports (EXACT), or, cheaper, the injected effect of the chunk's FP32 local
error scaled by the ratio of the two local errors' L2 norms (SCALED: first order, the rest of the model
is linear in a small error and rounding errors of one chunk share a pattern). A genome's predicted
outputs are FP64 plus the sum of its chunks' effects (first-order additivity across chunks); the judge
checks the budget on them and calibrates the composition against end-to-end runs.

Everything is cached by (group structure, chunk index, chunk candidate key, batch), so a genome that
changes one layer costs one chunk run, and per-layer mixtures of known chunk choices cost nothing.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import numpy as np

from ..codegen.llir import Program
from ..hlir.evaluate import evaluate_chunk
from ..hlir.graph import Graph
from ..hlir.partition import Chunk, Partition, chunk_key
from .groups import ChunkChoice
from .reference import Fp64Reference
from .tasks import RunTask, TaskPool, run_task

Outputs = dict[str, np.ndarray]


class Propagation(enum.Enum):
    EXACT = "exact"    # the FP64 run of the rest of the model with the chunk's own deviation injected
    SCALED = "scaled"  # the FP32 chunk's injected effect, scaled by the local errors' L2 ratio


@dataclass(frozen=True)
class ChunkEffect:
    """`outputs` = `scale` x `basis`: a SCALED effect keeps its basis's arrays (one set per chunk, not one
    per chunk choice: on SmolLM2 each is a batch of 49152-wide logits) and scales them when read."""

    local: float                  # relative L2 of the chunk's exports vs FP64 (all exports together)
    basis: tuple[Outputs, ...]    # per batch: deviation of every final output caused by this chunk alone ...
    scale: float = 1.0            # ... times this

    @property
    def outputs(self) -> tuple[Outputs, ...]:
        if self.scale == 1.0:
            return self.basis
        return tuple({k: self.scale * v for k, v in out.items()} for out in self.basis)


@dataclass
class ChunkEffects:
    """`lower_chunk(chunk, choice)` is the chunk alone as a Program (inputs "%<node>", exports as
    outputs), supplied by the search; `base` is each chunk's FP32 candidate (the SCALED basis)."""

    graph: Graph
    part: Partition
    references: Sequence[Fp64Reference]
    lower_chunk: Callable[[Chunk, ChunkChoice], Program]
    base: Mapping[int, ChunkChoice]
    propagation: Propagation = Propagation.SCALED
    pool: TaskPool | None = None                # runs the chunk programs a genome needs in parallel
    cache: dict = field(default_factory=dict)  # (structure, chunk, choice key, propagation) -> ChunkEffect
    runs: int = 0                               # chunk programs run (each on every batch)
    injections: int = 0                         # FP64 runs of the rest of the model

    def __post_init__(self):
        if not self.references:
            raise ValueError("per-chunk verdicts need at least one FP64 reference batch")
        self.structure = {c.index: chunk_key(self.graph, c) for c in self.part.chunks}
        self.chunks = {c.index: c for c in self.part.chunks}
        self._ran: dict[tuple[int, str], object] = {}  # (chunk, choice key) -> outputs run on the pool

    def _key(self, chunk_index: int, choice: ChunkChoice) -> tuple:
        mode = self.propagation
        if mode is Propagation.SCALED and choice.key == self.base[chunk_index].key:
            mode = Propagation.EXACT  # the basis itself is injected exactly
        return (self.structure[chunk_index], chunk_index, choice.key, mode)

    def effect(self, chunk_index: int, choice: ChunkChoice) -> ChunkEffect:
        key = self._key(chunk_index, choice)
        mode = key[3]
        if key not in self.cache:
            self.cache[key] = self._effect(self.chunks[chunk_index], choice, mode)
        return self.cache[key]

    def _effect(self, chunk: Chunk, choice: ChunkChoice, mode: Propagation) -> ChunkEffect:
        try:
            devs = self._local(chunk, choice)
        except (ValueError, FloatingPointError):  # e.g. a REJECT overflow policy: the chunk cannot run
            return ChunkEffect(float("inf"), tuple({k: np.full(np.shape(ref.values[nid]), np.inf)
                                                    for k, nid in self.graph.outputs.items()} for ref in self.references))
        local = _rel(devs, self.references, chunk)
        if mode is Propagation.SCALED:
            basis = self.effect(chunk.index, self.base[chunk.index])
            if basis.local > 0 and np.isfinite(local):
                s = local / basis.local
                return ChunkEffect(local, basis.basis, s * basis.scale)
        return ChunkEffect(local, tuple(self._inject(chunk, ref, dev) for ref, dev in zip(self.references, devs)))

    def _task(self, chunk: Chunk, choice: ChunkChoice) -> RunTask:
        """The chunk alone on its exact FP64 inputs, every batch: a pure task (error/tasks.py)."""
        return RunTask(self.lower_chunk(chunk, choice),
                       tuple({f"%{n}": np.asarray(ref.values[n]) for n in chunk.external} for ref in self.references),
                       tuple(ref.bindings for ref in self.references))

    def prefetch(self, candidates: Mapping[int, ChunkChoice]) -> None:
        """Run, on the pool, every chunk program the candidates' effects still need (and their bases)."""
        if self.pool is None:
            return
        todo = {}
        for i, choice in candidates.items():
            for ch in (choice, self.base[i]) if self.propagation is Propagation.SCALED else (choice,):
                if self._key(i, ch) not in self.cache and (i, ch.key) not in self._ran:
                    todo.setdefault((i, ch.key), (self.chunks[i], ch))
        results = self.pool.map([self._task(c, ch) for c, ch in todo.values()])
        self.runs += len(todo)
        self._ran.update(zip(todo, results))

    def _local(self, chunk: Chunk, choice: ChunkChoice) -> list[dict[int, np.ndarray]]:
        """Per batch: the chunk's exports minus FP64, run alone on the exact FP64 inputs."""
        got = self._ran.pop((chunk.index, choice.key), None)
        if got is None:
            self.runs += 1
            got = run_task(self._task(chunk, choice), self.graph.weights)
        if isinstance(got, Exception):
            raise got
        return [{n: np.asarray(o[f"%{n}"], np.float64) - np.asarray(ref.values[n], np.float64) for n in chunk.exported}
                for o, ref in zip(got, self.references)]

    def _inject(self, chunk: Chunk, ref: Fp64Reference, dev: Mapping[int, np.ndarray]) -> Outputs:
        """The final outputs' deviation when `dev` is added at the chunk's exports and everything after
        runs in FP64 (only the chunks that read a changed value are re-run)."""
        self.injections += 1
        changed = {n: np.asarray(ref.values[n], np.float64) + d for n, d in dev.items()}
        for c in self.part.chunks[chunk.index + 1:]:
            if not any(n in changed for n in c.external):
                continue
            ext = {n: changed[n] if n in changed else np.asarray(ref.values[n]) for n in c.external}
            vals = evaluate_chunk(self.graph, c.nodes, ext, ref.bindings)
            changed.update({n: np.asarray(vals[n], np.float64) for n in c.exported})
        return {name: (changed[nid] - np.asarray(ref.values[nid], np.float64)) if nid in changed
                else np.zeros(np.shape(ref.values[nid])) for name, nid in self.graph.outputs.items()}

    def compose(self, candidates: Mapping[int, ChunkChoice], refs: Sequence[Mapping[str, np.ndarray]],
                only: Sequence[int] | None = None) -> list[Outputs]:
        """Predicted outputs per batch: FP64 plus the sum of the chunks' effects (`only`: those chunks)."""
        idx = sorted(candidates) if only is None else list(only)
        effects = [self.effect(i, candidates[i]) for i in idx]
        return [{k: np.asarray(r, np.float64) + sum(e.scale * e.basis[b][k] for e in effects) for k, r in ref.items()}
                for b, ref in enumerate(refs)]


def _rel(devs: list[dict[int, np.ndarray]], refs: Sequence[Fp64Reference], chunk: Chunk) -> float:
    """Relative L2 of all exports over all batches together (float exports only)."""
    num = den = 0.0
    for dev, ref in zip(devs, refs):
        for n, d in dev.items():
            r = np.asarray(ref.values[n])
            if r.dtype.kind != "f":
                continue
            num += float(np.sum(d * d))
            den += float(np.sum(np.asarray(r, np.float64) ** 2))
    if not np.isfinite(num):
        return float("inf")
    return float(np.sqrt(num / den)) if den > 0 else (0.0 if num == 0 else float("inf"))
