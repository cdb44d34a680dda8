"""A fast FP64 numpy Llama with a growing KV cache: makes FP64 continuations and cache contents.

Why a second implementation: the graph's FP64 evaluator is the judge, but it interprets thousands of
nodes per step, far too slow to generate a continuation token by token for every prompt. This one
computes the same function (tests hold it to the FP64 graph at 1e-10) with one numpy matmul per
projection, so a job can build its teacher-forced inputs (FP64 greedy tokens, FP64 cache rows) fast.
Its cache rows are laid out as the graph's: K after RoPE and V, all KV heads side by side.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from ..hlir.evaluate import fp64_weight
from ..hlir.store import keyed
from .llama import EMBED, FINAL_NORM, LM_HEAD, LlamaConfig, check_weights, rope_tables


@dataclass(frozen=True)
class Fp64State:
    """Cache rows of one sequence: k[layer], v[layer] are (positions so far, kv_dim)."""

    k: tuple[np.ndarray, ...]
    v: tuple[np.ndarray, ...]

    @property
    def length(self) -> int:
        return int(self.k[0].shape[0]) if self.k else 0


class _Fp64Weights(Mapping[str, np.ndarray]):
    """The weights' float64 values, each converted when read (hlir.evaluate.fp64_weight: a byte-budgeted
    process cache shared with the FP64 graph), so the model holds no FP64 copy of every weight (1B
    parameters would be 8 GB)."""

    def __init__(self, weights: Mapping[str, np.ndarray]):
        self._weights = weights

    def __getitem__(self, name: str) -> np.ndarray:
        w = self._weights[name]
        return fp64_weight(w) if w.dtype == np.float32 else np.asarray(w, dtype=np.float64)

    def __iter__(self):
        return iter(self._weights)

    def __len__(self) -> int:
        return len(self._weights)

    def __contains__(self, name) -> bool:
        return name in self._weights


class Fp64Llama:
    def __init__(self, config: LlamaConfig, weights: Mapping[str, np.ndarray]):
        check_weights(config, weights)
        self.config = config
        self.w = _Fp64Weights({name: keyed(a) for name, a in weights.items()})

    def empty(self) -> Fp64State:
        c = self.config
        rows = np.zeros((0, c.kv_dim))
        return Fp64State((rows,) * c.num_hidden_layers, (rows,) * c.num_hidden_layers)

    def _norm(self, x: np.ndarray, gain: str) -> np.ndarray:
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.config.rms_norm_eps) * self.w[gain]

    def _proj(self, h: np.ndarray, prefix: str) -> np.ndarray:
        y = h @ self.w[prefix + ".weight"].T
        return y + self.w[prefix + ".bias"] if prefix + ".bias" in self.w else y

    def forward(self, ids: Sequence[int], state: Fp64State | None = None) -> tuple[np.ndarray, Fp64State]:
        """Logits (n, vocab) of `ids` placed after the state's tokens, and the grown state."""
        c, w = self.config, self.w
        state = state or self.empty()
        n, start, dh = len(ids), state.length, c.head_dim
        cos, sin = rope_tables(c, np.arange(start, start + n))
        cos, sin = cos[:, None, :], sin[:, None, :]

        def rope(t):  # rotate-half on (n, heads, dh)
            return t * cos + np.concatenate([-t[..., dh // 2:], t[..., : dh // 2]], axis=-1) * sin

        visible = np.arange(start + n)[None, :] <= (start + np.arange(n))[:, None]  # (n, total)
        x = w[EMBED][np.asarray(ids, dtype=np.int64)]
        ks, vs = [], []
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            h = self._norm(x, p + "input_layernorm.weight")
            q = self._proj(h, p + "self_attn.q_proj").reshape(n, c.num_attention_heads, dh)
            k = self._proj(h, p + "self_attn.k_proj").reshape(n, c.num_key_value_heads, dh)
            if c.qk_norm:
                q, k = self._norm(q, p + "self_attn.q_norm.weight"), self._norm(k, p + "self_attn.k_norm.weight")
            q, k = rope(q), rope(k)
            k_rows = np.concatenate([state.k[i], k.reshape(n, c.kv_dim)])
            v_rows = np.concatenate([state.v[i], self._proj(h, p + "self_attn.v_proj")])
            ks.append(k_rows)
            vs.append(v_rows)
            total = start + n
            kh = np.repeat(k_rows.reshape(total, c.num_key_value_heads, dh), c.queries_per_kv_head, axis=1)
            vh = np.repeat(v_rows.reshape(total, c.num_key_value_heads, dh), c.queries_per_kv_head, axis=1)
            scores = np.einsum("qhd,khd->hqk", q, kh) / np.sqrt(dh)
            scores = np.where(visible[None], scores, -np.inf)
            probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
            probs /= probs.sum(axis=-1, keepdims=True)
            attn = np.einsum("hqk,khd->qhd", probs, vh).reshape(n, c.num_attention_heads * dh)
            x = x + attn @ w[p + "self_attn.o_proj.weight"].T
            h = self._norm(x, p + "post_attention_layernorm.weight")
            gate = h @ w[p + "mlp.gate_proj.weight"].T
            x = x + (gate / (1.0 + np.exp(-gate)) * (h @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
        logits = self._norm(x, FINAL_NORM) @ w[LM_HEAD if LM_HEAD in w else EMBED].T
        return logits, Fp64State(tuple(ks), tuple(vs))

    def greedy(self, ids: Sequence[int], steps: int, stop: int | None = None) -> tuple[list[int], np.ndarray]:
        """FP64 greedy continuation of `ids` (up to `steps` tokens, ending early at `stop`) and the logits
        (prompt + continuation positions - 1, vocab) that chose each next token."""
        logits, state = self.forward(ids)
        rows, out = [logits], []
        for _ in range(steps):
            token = int(np.argmax(rows[-1][-1]))
            out.append(token)
            if token == stop or len(out) == steps:
                break
            logits, state = self.forward([token], state)
            rows.append(logits)
        return out, np.concatenate(rows)
