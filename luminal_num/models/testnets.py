"""Small seeded test models used across the test suite: each stage is checked on all of them.

Each builder returns a `TestModel`: the graph plus a seeded input generator, so genome fuzzing,
bounds and search tests run on the same networks.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..hlir import Graph, GraphTensor, index_input


@dataclass(frozen=True)
class TestModel:
    name: str
    graph: Graph
    make_inputs: Callable[[int], dict[str, np.ndarray]]  # seed -> activation inputs


def _w(rng: np.random.Generator, *shape, scale: float | None = None) -> np.ndarray:
    fan_in = shape[0]
    return rng.standard_normal(shape) * (scale if scale is not None else 1.0 / math.sqrt(fan_in))


def matmul_chain(m: int = 16, dims=(32, 48, 24), seed: int = 0) -> TestModel:
    rng = np.random.default_rng(seed)
    g = Graph()
    x = g.input("x", (m, dims[0]))
    for i, (a, b) in enumerate(zip(dims, dims[1:])):
        x = x @ g.weight(f"w{i}", _w(rng, a, b))
    g.output(x, "y")
    return TestModel("matmul_chain", g, lambda s: {"x": np.random.default_rng(s).standard_normal((m, dims[0]))})


def mlp(m: int = 16, d: int = 32, hidden: int = 64, seed: int = 0) -> TestModel:
    rng = np.random.default_rng(seed)
    g = Graph()
    x = g.input("x", (m, d))
    h = (x @ g.weight("w1", _w(rng, d, hidden)) + g.weight("b1", 0.1 * rng.standard_normal(hidden))).gelu("tanh")
    y = h @ g.weight("w2", _w(rng, hidden, d)) + g.weight("b2", 0.1 * rng.standard_normal(d))
    g.output(y.layer_norm(), "y")
    return TestModel("mlp", g, lambda s: {"x": np.random.default_rng(s).standard_normal((m, d))})


def _causal_bias(g: Graph, s) -> GraphTensor:
    """0 where key j <= query i, -1e4 elsewhere: LessThan over two broadcast Iota views.

    -1e4 hides a key exactly (exp(-1e4) == 0 in FP64) and still fits FP16, so storing scores in FP16
    is a precision choice, not a certain overflow."""
    pos = g.arange(s)
    i = pos.reshape(s, 1).broadcast_to((s, s))
    j = pos.reshape(1, s).broadcast_to((s, s))
    allowed = j < (i + 1.0)
    return (allowed - 1.0) * 1e4


def attention(x: GraphTensor, wq, wk, wv, wo, heads: int, causal: bool = True,
              cache: tuple[GraphTensor, GraphTensor, GraphTensor] | None = None) -> GraphTensor:
    """Multi-head attention; with `cache=(k_cache, v_cache, positions)` new K/V rows are scattered in."""
    g = x.graph
    s, d = x.shape
    dh = d // heads
    q, k, v = x @ wq, x @ wk, x @ wv
    if cache is not None:
        k_cache, v_cache, positions = cache
        k, v = k_cache.scatter(k, positions), v_cache.scatter(v, positions)
    t = k.shape[0]
    qh = q.reshape(s, heads, dh).permute(1, 0, 2)
    kh = k.reshape(t, heads, dh).permute(1, 0, 2)
    vh = v.reshape(t, heads, dh).permute(1, 0, 2)
    scores = (qh @ kh.transpose(-1, -2)) * (1.0 / math.sqrt(dh))
    if causal and cache is None:
        scores = scores + _causal_bias(g, s)
    out = scores.softmax(-1) @ vh  # (heads, s, dh)
    return out.permute(1, 0, 2).reshape(s, d) @ wo


def attention_kv(s: int = 4, t: int = 16, d: int = 32, heads: int = 4, seed: int = 0) -> TestModel:
    rng = np.random.default_rng(seed)
    g = Graph()
    x = g.input("x", (s, d))
    kc, vc = g.input("k_cache", (t, d)), g.input("v_cache", (t, d))
    pos = index_input(g, "positions", (s,))
    ws = [g.weight(n, _w(rng, d, d)) for n in ("wq", "wk", "wv", "wo")]
    g.output(attention(x, *ws, heads=heads, cache=(kc, vc, pos)), "y")

    def inputs(seed_: int) -> dict[str, np.ndarray]:
        r = np.random.default_rng(seed_)
        return {"x": r.standard_normal((s, d)), "k_cache": r.standard_normal((t, d)),
                "v_cache": r.standard_normal((t, d)), "positions": np.arange(t - s, t, dtype=np.int64)}
    return TestModel("attention_kv", g, inputs)


def transformer(layers: int = 4, s: int = 8, d: int = 32, heads: int = 4, hidden: int = 64, seed: int = 0,
                symbolic_seq: bool = False) -> TestModel:
    """Pre-LN transformer blocks with a graph_break after each layer (one chunk per layer)."""
    rng = np.random.default_rng(seed)
    g = Graph()
    seq = "s" if symbolic_seq else s
    x = g.input("x", (seq, d))
    for layer in range(layers):
        p = f"l{layer}."
        h = x.layer_norm(g.weight(p + "ln1.w", 1 + 0.1 * rng.standard_normal(d)),
                         g.weight(p + "ln1.b", 0.1 * rng.standard_normal(d)))
        ws = [g.weight(p + n, _w(rng, d, d)) for n in ("wq", "wk", "wv", "wo")]
        x = x + attention(h, *ws, heads=heads)
        h = x.layer_norm(g.weight(p + "ln2.w", 1 + 0.1 * rng.standard_normal(d)),
                         g.weight(p + "ln2.b", 0.1 * rng.standard_normal(d)))
        h = (h @ g.weight(p + "w1", _w(rng, d, hidden))).gelu("tanh")
        x = x + h @ g.weight(p + "w2", _w(rng, hidden, d))
        g.graph_break()
    g.output(x.layer_norm(), "y")
    return TestModel(f"transformer{layers}", g, lambda s_: {"x": np.random.default_rng(s_).standard_normal((s, d))})


def all_test_models() -> list[TestModel]:
    return [matmul_chain(), mlp(), attention_kv(), transformer(4)]
