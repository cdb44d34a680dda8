"""Calibration Hessians (and each channel's max |x_j|, hlir/smoothing.py) collected from FP64 evaluations (quant/calibration.py): the compile's reference pass
over its calibration batches, or an LLM's teacher-forced positions (`positions_hessians`).

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

from ..hlir.evaluate import WeightGemm, evaluate_nodes
from ..hlir.gemm import GemmLayout
from ..hlir.graph import Graph
from ..hlir.store import content_key, file_backed
from ..quant.calibration import Hessian, Hessians
from .pooled import PositionSource


class HessianCollector:
    """An observer of evaluate_nodes (one per compile); `batch()` before each calibration batch."""

    def __init__(self, graph: Graph):
        self.graph = graph
        self._sums: dict[Hashable, np.ndarray] = {}     # activation key -> sum of x x^T
        self._rows: dict[Hashable, int] = {}
        self._amax: dict[Hashable, np.ndarray] = {}      # activation key -> max |x_j| per channel
        self._seen: set[Hashable] = set()                # activations added in the current batch
        self._real: tuple[int, int] | None = None         # (real, of) sequences of the current batch
        self._of_weight: dict[str, list[Hashable]] = {}  # weight content key -> its activations, first seen first

    def batch(self, real: int | None = None, of: int | None = None) -> None:
        """A new batch; with `real` and `of`: only its first `real` of `of` sequences are calibration rows (a
        decode step's rows lead batch-major; the rest repeat them to fill the step)."""
        self._seen = set()
        self._real = None if real is None else (real, of)

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
        if self._real is not None:
            real, of = self._real
            if len(x) % of:
                raise ValueError(f"an activation of {len(x)} rows is not {of} sequences' rows")
            x = x[:len(x) // of * real]
        xx = x.T @ x
        amax = np.max(np.abs(x), axis=0) if len(x) else np.zeros(x.shape[-1])
        if key in self._sums:
            self._sums[key] += xx
            self._rows[key] += len(x)
            np.maximum(self._amax[key], amax, out=self._amax[key])
        else:
            self._sums[key], self._rows[key], self._amax[key] = xx, len(x), amax

    def result(self) -> Hessians:
        """Each weight's Hessian, held in file-backed pages (shared with forked workers, droppable)."""
        per_act = {k: Hessian.of(file_backed(s), self._rows[k], self._amax[k]) for k, s in self._sums.items()}
        joint: dict[tuple, Hessian] = {}
        out = {}
        for weight, acts in sorted(self._of_weight.items()):
            acts_key = tuple(acts)
            if acts_key not in joint:
                joint[acts_key] = per_act[acts[0]] if len(acts) == 1 else Hessian.of(
                    file_backed(sum(per_act[k].sum_xx for k in acts)), sum(per_act[k].rows for k in acts),
                    np.max([per_act[k].amax for k in acts], axis=0))
            out[weight] = joint[acts_key]
        return Hessians(out)


def _without_broadcast(st) -> tuple:
    """A view's identity without its stride-0 axes (Q and K read x as (S, N_q, K) and (S, N_k, K))."""
    *inner, top = st.views
    axes = tuple((d, s) for d, s in zip(top.shape, top.strides) if s != 0)
    return tuple(v.encode() for v in inner) + (axes, top.offset, top.mask)


def positions_hessians(source: PositionSource, rows: int) -> Hessians:
    """Each weight's Hessian over every teacher-forced position of `source`, run `rows` sequences a decode step
    (one FP64 evaluation of the step's graph per step, every value freed after its last reader: what is held is
    the K x K sums, never the activations). Why: GPTQ under the 24 rows of an LLM's calibration batches
    over-fits them (issue 32: W4 + rotation + GPTQ 0.783 top-1 on 2,048 positions, 0.809 with 2,048 rows).
    Each position counts once (a short last group's repeated windows are not rows)."""
    wide = source.widened(rows)
    collector = HessianCollector(wide.graph)
    for batch in wide.batches():
        collector.batch(batch.rows, wide.rows)
        evaluate_nodes(wide.graph, batch.inputs, keep=(), observe=collector)
    return collector.result()
