"""A fast FP64 numpy Gemma 3 with a growing KV cache, for an LLM job's teacher-forced inputs.

Why (as models/reference.py for Llama): the graph's FP64 evaluator is the judge but far too slow to
generate continuations token by token; this computes the same function (tests hold it to the FP64
graph at 1e-10) with one numpy matmul per projection. Cache rows are the graph's: K after QK-norm and
RoPE, V, all KV heads side by side; a local layer's query at position p sees keys p - window < j <= p.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from ..hlir.store import keyed
from .gemma import EMBED, FINAL_NORM, GemmaConfig, rope_tables, weight_shapes
from .reference import Fp64Llama, Fp64State, _Fp64Weights


class Fp64Gemma(Fp64Llama):
    """forward / greedy / empty as Fp64Llama's (greedy is inherited), for Gemma 3's graph."""

    def __init__(self, config: GemmaConfig, weights: Mapping[str, np.ndarray]):
        for name, shape in weight_shapes(config).items():
            if name not in weights or tuple(weights[name].shape) != shape:
                raise ValueError(f"weight {name!r} is missing or not of shape {shape}")
        self.config = config
        self.w = _Fp64Weights({name: keyed(weights[name]) for name in weight_shapes(config)})

    def _norm(self, x: np.ndarray, gain: str) -> np.ndarray:  # the stored gain is 1 + w
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.config.rms_norm_eps) * self.w[gain]

    def forward(self, ids: Sequence[int], state: Fp64State | None = None) -> tuple[np.ndarray, Fp64State]:
        c, w = self.config, self.w
        state = state or self.empty()
        n, start, dh, kv = len(ids), state.length, c.head_dim, c.num_key_value_heads
        group = c.num_attention_heads // kv
        query, key = start + np.arange(n), np.arange(start + n)
        causal = key[None, :] <= query[:, None]
        local = causal & (query[:, None] - key[None, :] < c.sliding_window)
        tables = {base: tuple(t[:, None, :] for t in rope_tables(c, query, base))
                  for base in (c.rope_theta, c.rope_local_theta)}
        x = w[EMBED][np.asarray(ids, dtype=np.int64)] * c.embed_scale
        ks, vs = [], []
        for i in range(c.num_hidden_layers):
            p, glob = f"blk.{i}.", c.is_global(i)
            cos, sin = tables[c.rope_theta if glob else c.rope_local_theta]

            def rope(t):  # rotate-half on (n, heads, dh)
                return t * cos + np.concatenate([-t[..., dh // 2:], t[..., : dh // 2]], axis=-1) * sin
            h = self._norm(x, p + "attn_norm.weight")
            q = rope(self._norm((h @ w[p + "attn_q.weight"].T).reshape(n, c.num_attention_heads, dh),
                                p + "attn_q_norm.weight"))
            k = rope(self._norm((h @ w[p + "attn_k.weight"].T).reshape(n, kv, dh), p + "attn_k_norm.weight"))
            k_rows = np.concatenate([state.k[i], k.reshape(n, c.kv_dim)])
            v_rows = np.concatenate([state.v[i], h @ w[p + "attn_v.weight"].T])
            ks.append(k_rows)
            vs.append(v_rows)
            kh = np.repeat(k_rows.reshape(start + n, kv, dh), group, axis=1)
            vh = np.repeat(v_rows.reshape(start + n, kv, dh), group, axis=1)
            scores = np.einsum("qhd,khd->hqk", q, kh) * c.attention_scale
            scores = np.where((causal if glob else local)[None], scores, -np.inf)
            probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
            probs /= probs.sum(axis=-1, keepdims=True)
            attn = np.einsum("hqk,khd->qhd", probs, vh).reshape(n, c.num_attention_heads * dh)
            x = x + self._norm(attn @ w[p + "attn_output.weight"].T, p + "post_attention_norm.weight")
            h = self._norm(x, p + "ffn_norm.weight")
            gate = h @ w[p + "ffn_gate.weight"].T
            gelu = 0.5 * gate * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (gate + 0.044715 * gate ** 3)))
            x = x + self._norm((gelu * (h @ w[p + "ffn_up.weight"].T)) @ w[p + "ffn_down.weight"].T,
                               p + "post_ffw_norm.weight")
        logits = self._norm(x, FINAL_NORM) @ w[EMBED].T
        return logits, Fp64State(tuple(ks), tuple(vs))
