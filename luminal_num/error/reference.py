"""The FP64 reference of one calibration batch, computed once and handed to every stage that judges.

Why one value: the judge (outputs), the per-group estimator (every chunk's exact inputs) and the
plan's calibration ranges (every export) all need the same FP64 evaluation and symbol bindings;
computing it once per batch keeps them consistent and the compile cost to one reference pass.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from ..hlir.evaluate import evaluate_nodes
from ..hlir.graph import Graph


@dataclass(frozen=True)
class Fp64Reference:
    batch: Mapping[str, np.ndarray]
    values: Mapping[int, np.ndarray]    # FP64 value of every evaluated graph node
    bindings: Mapping[str, int]         # symbolic dims bound by this batch

    @staticmethod
    def of(graph: Graph, batch: Mapping[str, np.ndarray]) -> "Fp64Reference":
        return Fp64Reference(batch, evaluate_nodes(graph, batch), graph.bind_symbols(batch))

    def outputs(self, graph: Graph) -> dict[str, np.ndarray]:
        return {name: self.values[nid] for name, nid in graph.outputs.items()}


def references(graph: Graph, calibration: Sequence[Mapping[str, np.ndarray]]) -> tuple[Fp64Reference, ...]:
    """One FP64 evaluation per calibration batch."""
    return tuple(Fp64Reference.of(graph, batch) for batch in calibration)
