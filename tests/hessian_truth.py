"""The independent truth the calibration-Hessian tests compare with: X^T X of each weight Gemm's activation,
recomputed from the FP64 evaluator's node values (every node kept, read through the Mul's own view)."""
from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from luminal_num.hlir.evaluate import evaluate_nodes, weight_gemm
from luminal_num.hlir.gemm import gemm_layouts, split_operand
from luminal_num.hlir.graph import Graph


def independent_hessians(graph: Graph, batches: Sequence[Mapping[str, np.ndarray]],
                         real: Sequence[int] | None = None, of: int | None = None) -> dict[str, np.ndarray]:
    """weight name -> sum over batches and over its distinct activations of X^T X; with `real` (per batch) and
    `of`: only each batch's first real[i] of its `of` sequences (the leading axis of the activation)."""
    consumers = graph.consumers()
    out: dict[str, np.ndarray] = {}
    seen: dict[str, set] = {}
    for i, batch in enumerate(batches):
        values = evaluate_nodes(graph, batch)
        for node in graph.nodes:
            use = weight_gemm(graph, node, consumers)
            if use is None:
                continue
            mul = graph.nodes[node.srcs[0].node]
            act = mul.srcs[1 - use.side]
            x = act.view.realize(values[act.node], graph.bind_symbols(batch))  # over the Mul's full shape
            k_axis = node.attr("axis")
            (lay, *_) = gemm_layouts(split_operand(mul.srcs[0].view)[1], split_operand(mul.srcs[1].view)[1], k_axis)
            drop = lay.n_axes if use.side == 1 else lay.m_axes  # the weight's axis: the activation is broadcast there
            x = x[tuple(0 if ax in drop else slice(None) for ax in range(x.ndim))]
            k_at = k_axis - sum(1 for d in drop if d < k_axis)
            x = np.moveaxis(x, k_at, -1).reshape(-1, x.shape[k_at])
            if real is not None:
                x = x[:len(x) // of * real[i]]
            name = graph.weight_name(use.weight)
            key = (act.node, i)
            if key in seen.setdefault(name, set()):
                continue
            seen[name].add(key)
            out[name] = out.get(name, 0) + x.T @ x
    return out
