"""A fast FP64 numpy Gemma 3 with a growing KV cache, for an LLM job's teacher-forced inputs.

Why (as models/reference.py for Llama): the graph's FP64 evaluator is the judge but far too slow to
generate continuations token by token; this computes the same function (tests hold it to the FP64
graph at 1e-10) with one numpy matmul per projection. Cache rows are the graph's: K after QK-norm and
RoPE, V, all KV heads side by side; a local layer's query at position p sees keys p - window < j <= p.
Sequences go through the layers together (Fp64Llama.forward_many), so a model whose FP64 weights do
not fit the weight cache converts each layer once per call.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from ..hlir.store import keyed
from .gemma import EMBED, FINAL_NORM, GemmaConfig, rope_tables, weight_shapes
from .reference import Fp64Llama, Fp64State, _attend, _Fp64Weights, _rope, _Sequence, _stacked  # noqa: F401


class Fp64Gemma(Fp64Llama):
    """forward / forward_many / greedy / empty as Fp64Llama's, for Gemma 3's graph."""

    def __init__(self, config: GemmaConfig, weights: Mapping[str, np.ndarray]):
        for name, shape in weight_shapes(config).items():
            if name not in weights or tuple(weights[name].shape) != shape:
                raise ValueError(f"weight {name!r} is missing or not of shape {shape}")
        self.config = config
        self.w = _Fp64Weights({name: keyed(weights[name]) for name in weight_shapes(config)})

    def _norm(self, x: np.ndarray, gain: str) -> np.ndarray:  # the stored gain is 1 + w
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.config.rms_norm_eps) * self.w[gain]

    def _start(self, ids: np.ndarray, state: Fp64State) -> _Sequence:
        c, n, start = self.config, len(ids), state.length
        query, key = start + np.arange(n), np.arange(start + n)
        causal = key[None, :] <= query[:, None]
        local = causal & (query[:, None] - key[None, :] < c.sliding_window)
        tables = {base: tuple(t[:, None, :] for t in rope_tables(c, query, base))
                  for base in (c.rope_theta, c.rope_local_theta)}
        return _Sequence(self.w.rows(EMBED, ids) * c.embed_scale, start, state,
                         {"causal": causal, "local": local, "tables": tables}, [], [])

    def _head(self, x: np.ndarray) -> np.ndarray:
        return self.w.times_transposed(self._norm(x, FINAL_NORM), EMBED)

    def _layer(self, i: int, runs: Sequence[_Sequence]) -> None:
        """Layer i for every sequence: projections on the stacked rows, attention per sequence."""
        c, w = self.config, self.w
        dh, kv = c.head_dim, c.num_key_value_heads
        p, glob = f"blk.{i}.", c.is_global(i)
        x, parts = _stacked(runs)
        h = self._norm(x, p + "attn_norm.weight")
        q_all, k_all, v_all = (h @ w[p + f"attn_{t}.weight"].T for t in "qkv")
        attn = []
        for r, rows in zip(runs, parts):
            n = rows.stop - rows.start
            cos, sin = r.extra["tables"][c.rope_theta if glob else c.rope_local_theta]
            q = _rope(self._norm(q_all[rows].reshape(n, c.num_attention_heads, dh), p + "attn_q_norm.weight"), cos, sin)
            k = _rope(self._norm(k_all[rows].reshape(n, kv, dh), p + "attn_k_norm.weight"), cos, sin)
            attn.append(_attend(r, i, q, k, v_all[rows], kv, c.num_attention_heads // kv,
                                lambda s: s * c.attention_scale, r.extra["causal" if glob else "local"]))
        x = x + self._norm(np.concatenate(attn) @ w[p + "attn_output.weight"].T, p + "post_attention_norm.weight")
        h = self._norm(x, p + "ffn_norm.weight")
        gate = h @ w[p + "ffn_gate.weight"].T
        gelu = 0.5 * gate * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (gate + 0.044715 * gate ** 3)))
        x = x + self._norm((gelu * (h @ w[p + "ffn_up.weight"].T)) @ w[p + "ffn_down.weight"].T,
                           p + "post_ffw_norm.weight")
        for r, rows in zip(runs, parts):
            r.x = x[rows]
