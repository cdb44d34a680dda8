"""A fast FP64 numpy Llama with a growing KV cache: makes FP64 continuations and cache contents.

Why a second implementation: the graph's FP64 evaluator is the judge, but it interprets thousands of
nodes per step, far too slow to generate a continuation token by token for every prompt. This one
computes the same function (tests hold it to the FP64 graph at 1e-10) with one numpy matmul per
projection, so a job can build its teacher-forced inputs (FP64 greedy tokens, FP64 cache rows) fast.
Its cache rows are laid out as the graph's: K after RoPE and V, all KV heads side by side.

Why layer by layer: a model whose FP64 weights do not fit the weight cache (a 1B model's are 10 GB)
would convert every weight again for every prompt. `forward_many` runs all sequences through one
layer before the next, so each layer's weights are converted once per call and dropped after it
(`_Fp64Weights.layer`); the embedding is read by rows and the head in row blocks, never as an FP64
table. Each sequence is still computed alone (the same matmuls as `forward`), so batching changes
no value.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from ..hlir.evaluate import fp64_weight
from ..hlir.store import keyed, release_pages
from ..hlir.weightcache import WEIGHTS
from ..blas_threads import threads_for_rows
from .llama import EMBED, FINAL_NORM, LM_HEAD, LlamaConfig, check_weights, rope_tables

HEAD_BLOCK_BYTES = 2 << 20  # FP64 rows of a streamed head converted at a time (kept in cache)


@dataclass(frozen=True)
class Fp64State:
    """Cache rows of one sequence: k[layer], v[layer] are (positions so far, kv_dim)."""

    k: tuple[np.ndarray, ...]
    v: tuple[np.ndarray, ...]

    @property
    def length(self) -> int:
        return int(self.k[0].shape[0]) if self.k else 0


class _Fp64Weights(Mapping[str, np.ndarray]):
    """The weights' float64 values, each converted when read, so the model holds no FP64 copy of every
    weight (1B parameters would be 8 GB). When every weight's FP64 copy fits half the process's weight
    cache (hlir.weightcache, shared with the FP64 graph), they are cached there; otherwise (`streaming`)
    a weight is converted for the current `layer()` block only, and tables are read by rows or blocks."""

    def __init__(self, weights: Mapping[str, np.ndarray]):
        self._weights = weights
        self._held: dict[str, np.ndarray] | None = None  # this layer's conversions (streaming)
        fp64_bytes = sum(8 * int(np.size(w)) for w in weights.values())
        self.streaming = fp64_bytes > WEIGHTS.budget_bytes // 2

    def __getitem__(self, name: str) -> np.ndarray:
        w = self._weights[name]
        if not self.streaming:
            return fp64_weight(w) if w.dtype == np.float32 else np.asarray(w, dtype=np.float64)
        if self._held is None:
            return np.asarray(w, dtype=np.float64)
        if name not in self._held:
            self._held[name] = np.asarray(w, dtype=np.float64)
        return self._held[name]

    @contextmanager
    def layer(self) -> Iterator[None]:
        """Weights read in the block are converted once and dropped at its end (when streaming), and
        so are the file pages they were read from (a memory-mapped checkpoint: the process then holds
        one layer, not every layer it has streamed through)."""
        self._held = {}
        try:
            yield
        finally:
            for name in self._held:
                release_pages(self._weights[name])
            self._held = None

    def rows(self, name: str, ids: np.ndarray) -> np.ndarray:
        """Rows `ids` of a table in float64 (an embedding lookup converts the rows it reads, not the table)."""
        if not self.streaming:
            return self[name][ids]
        return np.asarray(self._weights[name][ids], dtype=np.float64)

    def times_transposed(self, x: np.ndarray, name: str) -> np.ndarray:
        """x @ W.T in float64; streaming, W's rows are converted a block at a time (the LM head: 2 GB in FP64
        for a 1B model), each block's columns computed as the whole product computes them."""
        with threads_for_rows(int(np.prod(x.shape[:-1], dtype=np.int64))):
            if not self.streaming:
                return x @ self[name].T
            w = self._weights[name]
            out = np.empty((*x.shape[:-1], w.shape[0]))
            step = max(1, HEAD_BLOCK_BYTES // (8 * w.shape[1]))
            for s in range(0, w.shape[0], step):
                out[..., s:s + step] = x @ np.asarray(w[s:s + step], dtype=np.float64).T
            return out

    def __iter__(self):
        return iter(self._weights)

    def __len__(self) -> int:
        return len(self._weights)

    def __contains__(self, name) -> bool:
        return name in self._weights


@dataclass
class _Sequence:
    """One sequence's pass through the layers: its hidden rows and what its layers read."""
    x: np.ndarray                 # (n, hidden) after the layers run so far
    start: int                    # positions before this call (the state's length)
    state: Fp64State
    extra: dict                   # per-architecture tables (RoPE, masks)
    k: list
    v: list


def _stacked(runs: Sequence[_Sequence]) -> tuple[np.ndarray, list[slice]]:
    """Every sequence's hidden rows, one above the other, and each sequence's rows among them."""
    ends = np.cumsum([r.x.shape[0] for r in runs])
    return np.concatenate([r.x for r in runs]), [slice(int(e - r.x.shape[0]), int(e)) for r, e in zip(runs, ends)]


def _rope(t: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate-half RoPE on (n, heads, head_dim)."""
    half = t.shape[-1] // 2
    return t * cos + np.concatenate([-t[..., half:], t[..., :half]], axis=-1) * sin


def _attend(r: _Sequence, layer: int, q: np.ndarray, k: np.ndarray, v: np.ndarray, kv_heads: int, group: int,
            scaled: Callable[[np.ndarray], np.ndarray], mask: np.ndarray) -> np.ndarray:
    """One sequence's attention at a layer: its new K/V rows appended to its cache rows (kept in `r`),
    queries (n, heads, dh) over every row the mask lets them see, scores scaled by `scaled`; (n, heads * dh)."""
    n, heads, dh = q.shape
    k_rows = np.concatenate([r.state.k[layer], k.reshape(n, kv_heads * dh)])
    v_rows = np.concatenate([r.state.v[layer], v])
    r.k.append(k_rows)
    r.v.append(v_rows)
    total = k_rows.shape[0]
    kh = np.repeat(k_rows.reshape(total, kv_heads, dh), group, axis=1)
    vh = np.repeat(v_rows.reshape(total, kv_heads, dh), group, axis=1)
    scores = scaled(np.einsum("qhd,khd->hqk", q, kh))
    scores = np.where(mask[None], scores, -np.inf)
    probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", probs, vh).reshape(n, heads * dh)


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
        return self.forward_many([ids], None if state is None else [state])[0]

    def forward_many(self, seqs: Sequence[Sequence[int]], states: Sequence[Fp64State] | None = None,
                     logits: bool = True) -> list[tuple[np.ndarray | None, Fp64State]]:
        """forward() of each sequence (after its state), all of them through one layer before the next:
        each layer's weights are converted once per call. `logits=False` skips the head (cache rows only)."""
        ran = self.hidden_many(seqs, states)
        with self.w.layer():
            return [(self._head(x) if logits else None, state) for x, state in ran]

    def hidden_many(self, seqs: Sequence[Sequence[int]],
                    states: Sequence[Fp64State] | None = None) -> list[tuple[np.ndarray, Fp64State]]:
        """forward_many without the head: each sequence's hidden rows after the last layer (n, hidden) and its
        grown state; head() turns any rows of them into logits (a few positions' logits, not every one's)."""
        states = [self.empty() for _ in seqs] if states is None else list(states)
        if len(states) != len(seqs):
            raise ValueError(f"forward_many: {len(seqs)} sequences but {len(states)} states")
        runs = [self._start(np.asarray(ids, dtype=np.int64), st) for ids, st in zip(seqs, states)]
        for i in range(self.config.num_hidden_layers):
            with self.w.layer():
                if runs:
                    self._layer(i, runs)
        return [(r.x, Fp64State(tuple(r.k), tuple(r.v))) for r in runs]

    def head(self, x: np.ndarray) -> np.ndarray:
        """Logits of hidden rows hidden_many returned (the final norm and the LM head)."""
        with self.w.layer():
            return self._head(x)

    def _start(self, ids: np.ndarray, state: Fp64State) -> _Sequence:
        c, n, start = self.config, len(ids), state.length  # noqa: F841
        cos, sin = rope_tables(c, np.arange(start, start + n))
        visible = np.arange(start + n)[None, :] <= (start + np.arange(n))[:, None]  # (n, total)
        return _Sequence(self.w.rows(EMBED, ids), start, state,
                         {"cos": cos[:, None, :], "sin": sin[:, None, :], "visible": visible}, [], [])

    def _head(self, x: np.ndarray) -> np.ndarray:
        return self.w.times_transposed(self._norm(x, FINAL_NORM), LM_HEAD if LM_HEAD in self.w else EMBED)

    def _layer(self, i: int, runs: Sequence[_Sequence]) -> None:
        """Layer i for every sequence: the projections on all sequences' rows stacked (one pass over each
        weight, not one per sequence), attention per sequence over its own cache rows."""
        c, w = self.config, self.w
        dh, p = c.head_dim, f"model.layers.{i}."
        x, parts = _stacked(runs)
        h = self._norm(x, p + "input_layernorm.weight")
        q_all = self._proj(h, p + "self_attn.q_proj")
        k_all = self._proj(h, p + "self_attn.k_proj")
        v_all = self._proj(h, p + "self_attn.v_proj")
        attn = []
        for r, rows in zip(runs, parts):
            n = rows.stop - rows.start
            q = q_all[rows].reshape(n, c.num_attention_heads, dh)
            k = k_all[rows].reshape(n, c.num_key_value_heads, dh)
            if c.qk_norm:
                q, k = self._norm(q, p + "self_attn.q_norm.weight"), self._norm(k, p + "self_attn.k_norm.weight")
            cos, sin = r.extra["cos"], r.extra["sin"]
            q, k = _rope(q, cos, sin), _rope(k, cos, sin)
            attn.append(_attend(r, i, q, k, v_all[rows], c.num_key_value_heads, c.queries_per_kv_head,
                                lambda s: s / np.sqrt(dh), r.extra["visible"]))
        x = x + np.concatenate(attn) @ w[p + "self_attn.o_proj.weight"].T
        h = self._norm(x, p + "post_attention_layernorm.weight")
        gate = h @ w[p + "mlp.gate_proj.weight"].T
        x = x + (gate / (1.0 + np.exp(-gate)) * (h @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
        for r, rows in zip(runs, parts):
            r.x = x[rows]

    def greedy(self, ids: Sequence[int], steps: int, stop: int | None = None) -> tuple[list[int], np.ndarray]:
        """FP64 greedy continuation of `ids` (up to `steps` tokens, ending early at `stop`) and the logits
        (prompt + continuation positions - 1, vocab) that chose each next token."""
        return self.greedy_many([ids], steps, stop)[0]

    def greedy_many(self, seqs: Sequence[Sequence[int]], steps: int,
                    stop: int | None = None) -> list[tuple[list[int], np.ndarray]]:
        """greedy() of each sequence, all of them a step at a time (one pass over the weights per step)."""
        first = self.forward_many(seqs)
        rows = [[logits] for logits, _ in first]
        states = [state for _, state in first]
        outs: list[list[int]] = [[] for _ in seqs]
        live = list(range(len(seqs)))
        for _ in range(steps):
            for j in live:
                outs[j].append(int(np.argmax(rows[j][-1][-1])))
            live = [j for j in live if outs[j][-1] != stop and len(outs[j]) < steps]
            if not live:
                break
            for j, (logits, state) in zip(live, self.forward_many([[outs[j][-1]] for j in live],
                                                                  [states[j] for j in live])):
                rows[j].append(logits)
                states[j] = state
        return [(out, np.concatenate(r)) for out, r in zip(outs, rows)]
