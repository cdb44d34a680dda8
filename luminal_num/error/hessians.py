"""Calibration Hessians collected during the compile's FP64 reference pass (quant/calibration.py).

Every Gemm the reference runs with one K-major weight operand (hlir.evaluate.weight_gemm) hands its FP64
activation to the collector, which adds X^T X of its rows (K columns) to that activation's accumulator.
Gemms reading the same activation (Q/K/V, gate/up: one node read through views that differ only in the
broadcast N axis) share one accumulator, added once per batch; a weight's Hessian is the sum over the
distinct activations it meets (one, in a transformer). Same graph and batches -> the same sums, in the
same order: the bytes of a GPTQ weight follow from the inputs.
"""
from __future__ import annotations

from typing import Hashable

import numpy as np

from ..hlir.evaluate import WeightGemm
from ..hlir.gemm import GemmLayout
from ..hlir.graph import Graph
from ..hlir.store import content_key, file_backed
from ..quant.calibration import Hessian, Hessians


class HessianCollector:
    """An observer of evaluate_nodes (one per compile); `batch()` before each calibration batch."""

    def __init__(self, graph: Graph):
        self.graph = graph
        self._sums: dict[Hashable, np.ndarray] = {}     # activation key -> sum of x x^T
        self._rows: dict[Hashable, int] = {}
        self._seen: set[Hashable] = set()                # activations added in the current batch
        self._of_weight: dict[str, list[Hashable]] = {}  # weight content key -> its activations, first seen first

    def batch(self) -> None:
        self._seen = set()

    def __call__(self, use: WeightGemm, nid: int, lay: GemmLayout, a: np.ndarray, b: np.ndarray) -> None:
        mul = self.graph.nodes[self.graph.nodes[nid].srcs[0].node]
        act = mul.srcs[1 - use.side]
        key = (act.node, _without_broadcast(act.view))
        weight = content_key(self.graph.weights[self.graph.weight_name(use.weight)])
        acts = self._of_weight.setdefault(weight, [])
        if key not in acts:
            acts.append(key)
        if key in self._seen:
            return
        self._seen.add(key)
        x = a if use.side == 1 else np.swapaxes(b, 1, 2)  # the activation's rows over K
        x = np.asarray(x, dtype=np.float64).reshape(-1, x.shape[-1])
        xx = x.T @ x
        if key in self._sums:
            self._sums[key] += xx
            self._rows[key] += len(x)
        else:
            self._sums[key], self._rows[key] = xx, len(x)

    def result(self) -> Hessians:
        """Each weight's Hessian, held in file-backed pages (shared with forked workers, droppable)."""
        per_act = {k: Hessian.of(file_backed(s), self._rows[k]) for k, s in self._sums.items()}
        joint: dict[tuple, Hessian] = {}
        out = {}
        for weight, acts in sorted(self._of_weight.items()):
            acts_key = tuple(acts)
            if acts_key not in joint:
                joint[acts_key] = per_act[acts[0]] if len(acts) == 1 else Hessian.of(
                    file_backed(sum(per_act[k].sum_xx for k in acts)), sum(per_act[k].rows for k in acts))
            out[weight] = joint[acts_key]
        return Hessians(out)


def _without_broadcast(st) -> tuple:
    """A view's identity without its stride-0 axes (Q and K read x as (S, N_q, K) and (S, N_k, K))."""
    *inner, top = st.views
    axes = tuple((d, s) for d, s in zip(top.shape, top.strides) if s != 0)
    return tuple(v.encode() for v in inner) + (axes, top.offset, top.mask)
