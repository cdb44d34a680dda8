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
from collections.abc import Mapping

import numpy as np

from ..hlir.store import keyed
from .gemma import EMBED, FINAL_NORM, GemmaConfig, rope_tables, weight_shapes
from .reference import Fp64Llama, Fp64State, _Fp64Weights, _Sequence  # noqa: F401 (Fp64State: named here too)


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

    def _layer(self, i: int, r: _Sequence) -> None:
        c, w, x = self.config, self.w, r.x
        n, start, dh, kv = x.shape[0], r.start, c.head_dim, c.num_key_value_heads
        group = c.num_attention_heads // kv
        p, glob = f"blk.{i}.", c.is_global(i)
        cos, sin = r.extra["tables"][c.rope_theta if glob else c.rope_local_theta]

        def rope(t):  # rotate-half on (n, heads, dh)
            return t * cos + np.concatenate([-t[..., dh // 2:], t[..., : dh // 2]], axis=-1) * sin
        h = self._norm(x, p + "attn_norm.weight")
        q = rope(self._norm((h @ w[p + "attn_q.weight"].T).reshape(n, c.num_attention_heads, dh),
                            p + "attn_q_norm.weight"))
        k = rope(self._norm((h @ w[p + "attn_k.weight"].T).reshape(n, kv, dh), p + "attn_k_norm.weight"))
        k_rows = np.concatenate([r.state.k[i], k.reshape(n, c.kv_dim)])
        v_rows = np.concatenate([r.state.v[i], h @ w[p + "attn_v.weight"].T])
        r.k.append(k_rows)
        r.v.append(v_rows)
        kh = np.repeat(k_rows.reshape(start + n, kv, dh), group, axis=1)
        vh = np.repeat(v_rows.reshape(start + n, kv, dh), group, axis=1)
        scores = np.einsum("qhd,khd->hqk", q, kh) * c.attention_scale
        scores = np.where((r.extra["causal"] if glob else r.extra["local"])[None], scores, -np.inf)
        probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
        probs /= probs.sum(axis=-1, keepdims=True)
        attn = np.einsum("hqk,khd->qhd", probs, vh).reshape(n, c.num_attention_heads * dh)
        x = x + self._norm(attn @ w[p + "attn_output.weight"].T, p + "post_attention_norm.weight")
        h = self._norm(x, p + "ffn_norm.weight")
        gate = h @ w[p + "ffn_gate.weight"].T
        gelu = 0.5 * gate * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (gate + 0.044715 * gate ** 3)))
        r.x = x + self._norm((gelu * (h @ w[p + "ffn_up.weight"].T)) @ w[p + "ffn_down.weight"].T,
                             p + "post_ffw_norm.weight")
