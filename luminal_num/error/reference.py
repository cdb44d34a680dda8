"""The FP64 reference of one calibration batch, computed once and handed to every stage that judges.

Why one value: the judge (outputs), the per-chunk effects (every chunk's exact inputs) and the
plan's calibration ranges (every export) all need the same FP64 evaluation and symbol bindings;
computing it once per batch keeps them consistent and the compile cost to one reference pass.
Only the values at chunk boundaries are kept (what those stages read: every chunk's external inputs
and exports, and the outputs): the evaluation frees every other value after its last reader, so a
reference holds boundary rows, not every intermediate of every layer. Values are keyed read-only
arrays (hlir/store.py): what the metrics derive from a reference (its log-softmax rows) is cached by
its content. Past a byte budget (`SPILL`, set from the compile's memory plan) further batches' values
are spilled: held in unlinked memory-mapped files (hlir/store.file_backed), which the kernel may drop
from memory and read back, instead of in the process's own memory.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Mapping, Sequence

import numpy as np

from ..hlir.evaluate import GemmObserver, evaluate_nodes
from ..hlir.graph import Graph
from ..hlir.partition import Partition
from ..hlir.store import file_backed, keyed
from ..hlir.symbolic import evaluate as eval_dim
from ..runtime.heap import trim_heap
from .hessians import HessianCollector


@dataclass
class SpillBudget:
    """Bytes of boundary values kept in memory before further references are spilled to files."""
    budget_bytes: int = 2 << 30


SPILL = SpillBudget()


@dataclass(frozen=True)
class Fp64Reference:
    batch: Mapping[str, np.ndarray]
    values: Mapping[int, np.ndarray]    # FP64 value of every kept graph node (chunk boundaries, outputs)
    bindings: Mapping[str, int]         # symbolic dims bound by this batch

    @staticmethod
    def of(graph: Graph, batch: Mapping[str, np.ndarray], keep: Collection[int] | None = None,
           spill: bool = False, observe: GemmObserver | None = None) -> "Fp64Reference":
        """`keep`: the nodes whose values are kept (None: every node); `spill`: held in files, not memory;
        `observe`: sees every weight Gemm's operands (calibration Hessians)."""
        values = evaluate_nodes(graph, batch, keep=keep, observe=observe)
        trim_heap()  # the pass's freed intermediates (every node's FP64 value) back to the system
        held = {n: keyed(file_backed(v) if spill else v) for n, v in values.items()}
        return Fp64Reference(batch, held, graph.bind_symbols(batch))

    @property
    def nbytes(self) -> int:
        return sum(v.nbytes for v in self.values.values())

    def outputs(self, graph: Graph) -> dict[str, np.ndarray]:
        return {name: self.values[nid] for name, nid in graph.outputs.items()}


def boundary_nodes(graph: Graph, part: Partition) -> frozenset[int]:
    """The nodes whose FP64 values the judging stages read: chunk inputs and exports, graph outputs.
    Weights are not among them: their FP64 values come from the weight cache when a chunk is evaluated
    (a reference holding them would pin every weight's FP64 copy for the whole compile)."""
    nodes = {n for c in part.chunks for n in (*c.external, *c.exported)} | set(graph.outputs.values())
    return frozenset(n for n in nodes if graph.weight_name(n) is None)


def references(graph: Graph, calibration: Sequence[Mapping[str, np.ndarray]],
               part: Partition | None = None, hessians: HessianCollector | None = None) -> tuple[Fp64Reference, ...]:
    """One FP64 evaluation per calibration batch (with `part`: keeping its chunk boundaries only); the
    batches past SPILL's budget are spilled to files. `hessians` collects the weights' calibration
    Hessians in the same pass."""
    keep = None if part is None else boundary_nodes(graph, part)
    out, held = [], 0
    for batch in calibration:
        if hessians is not None:
            hessians.batch()
        out.append(Fp64Reference.of(graph, batch, keep, spill=held >= SPILL.budget_bytes, observe=hessians))
        held += out[-1].nbytes
    return tuple(out)


def reference_bytes(graph: Graph, part: Partition, calibration: Sequence[Mapping[str, np.ndarray]]) -> int:
    """What references() keeps, from the shapes alone: every batch's boundary values in FP64."""
    keep = boundary_nodes(graph, part)
    total = 0
    for batch in calibration:
        bindings = graph.bind_symbols(batch)
        total += sum(8 * int(np.prod([eval_dim(d, bindings) for d in graph.nodes[n].shape], dtype=np.int64))
                     for n in keep)
    return total
