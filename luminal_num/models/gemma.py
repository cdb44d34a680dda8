"""Gemma 3 decoder (text) from a GGUF file, in the GraphTensor frontend, reusing the Llama graph's pieces.

What differs from Llama, each taken from the file or from Gemma 3's definition (HF Gemma3TextModel,
llama.cpp's gemma3 graph), never approximated:
- head_dim from `gemma3.attention.key_length` (256 in the 270M file, not hidden / heads), GQA over
  `head_count_kv` KV heads (one in 270M);
- QK-norm: RMSNorm of each head's q and k over head_dim before RoPE; attention scaled by
  1/sqrt(head_dim) (query_pre_attn_scalar = head_dim; llama.cpp: 1/sqrt(hidden / heads) for the 62-layer 27B);
- RMSNorm gains are (1 + w): llama.cpp's converter stores 1 + w in the file, so the graph multiplies
  by the stored gain as is (no rounding of ours); four norms per layer (attn_norm, post_attention_norm,
  ffn_norm, post_ffw_norm), residuals after the post-norms;
- GeGLU: down(gelu_tanh(gate(h)) * up(h));
- embeddings times sqrt(hidden) rounded to the embedding's dtype (float32 here: the dequantized table),
  as HF casts embed_scale and llama.cpp scales in FP32;
- local (sliding-window) and global layers: layer i is global iff (i + 1) % 6 == 0 (Gemma 3's pattern;
  the file has no key for it, llama.cpp hard-codes 6), local layers see the last `sliding_window`
  positions (key j visible from query position p iff j <= p and p - j < window) with RoPE base 10000
  (rope_local_base_freq; llama.cpp hard-codes it too), global layers the causal past with the file's
  `rope.freq_base`; the window is a masked window over the KV cache (no ring);
- the LM head is the embedding (tied); the file's BOS id is kept with its add_bos flag.
Metadata this graph does not build (logit softcapping, experts, RoPE scaling, any unknown gemma3.* key)
is refused with one line naming it.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace

import numpy as np

from ..hlir import Graph, GraphTensor, index_input
from .llama import (CACHE_KINDS, MASKED_BIAS, _linear, _rotate_half, cache_input_name, cache_output_name,
                    checked_batch)

ARCH = "gemma3"
GLOBAL_EVERY = 6            # Gemma 3: five local layers, then one global
LOCAL_ROPE_BASE = 10000.0   # Gemma 3's rope_local_base_freq
_KNOWN_KEYS = {"context_length", "embedding_length", "block_count", "feed_forward_length", "attention.head_count",
               "attention.head_count_kv", "attention.layer_norm_rms_epsilon", "attention.key_length",
               "attention.value_length", "rope.freq_base", "attention.sliding_window", "rope.dimension_count"}
_LAYER_TENSORS = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm",
                  "post_attention_norm", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down", "post_ffw_norm")
EMBED, FINAL_NORM = "token_embd.weight", "output_norm.weight"


@dataclass(frozen=True)
class GemmaConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float                 # global layers
    sliding_window: int
    max_position_embeddings: int
    rope_local_theta: float = LOCAL_ROPE_BASE
    query_pre_attn_scalar: float = 0.0  # 0: head_dim
    bos_id: int | None = None
    add_bos: bool = True

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"{self.num_attention_heads} query heads cannot share {self.num_key_value_heads} KV heads")
        if self.head_dim % 2:
            raise ValueError(f"rotate-half RoPE needs an even head_dim, got {self.head_dim}")

    @property
    def kv_dim(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def attention_scale(self) -> float:
        return 1.0 / math.sqrt(self.query_pre_attn_scalar or self.head_dim)

    @property
    def embed_scale(self) -> float:
        """sqrt(hidden) in the embedding's dtype (float32)."""
        return float(np.float32(math.sqrt(self.hidden_size)))

    def is_global(self, layer: int) -> bool:
        return (layer + 1) % GLOBAL_EVERY == 0

    def with_layers(self, layers: int) -> "GemmaConfig":
        return replace(self, num_hidden_layers=layers)


def config_from_metadata(meta: Mapping[str, object], vocab_size: int) -> GemmaConfig:
    """GemmaConfig from a gemma3 GGUF's scalar metadata; whatever it does not build raises GGUFError."""
    from .gguf_header import GGUFError
    if meta.get("general.architecture") != ARCH:
        raise GGUFError(f"GGUF architecture {meta.get('general.architecture')!r} is not {ARCH}")
    unknown = sorted(k for k in meta if k.startswith(f"{ARCH}.") and k[len(ARCH) + 1:] not in _KNOWN_KEYS)
    if unknown:
        raise GGUFError(f"GGUF {unknown[0]} is not supported by the Gemma 3 graph ({len(unknown)} such keys)")

    def key(name, default=None):
        value = meta.get(f"{ARCH}.{name}", default)
        if value is None:
            raise GGUFError(f"GGUF metadata lacks {ARCH}.{name}")
        return value
    head_dim = int(key("attention.key_length"))
    for name in ("attention.value_length", "rope.dimension_count"):
        if int(key(name, head_dim)) != head_dim:
            raise GGUFError(f"GGUF {ARCH}.{name}={key(name)} differs from key_length={head_dim}: not supported")
    hidden, heads, layers = int(key("embedding_length")), int(key("attention.head_count")), int(key("block_count"))
    return GemmaConfig(
        hidden_size=hidden, intermediate_size=int(key("feed_forward_length")), num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=int(key("attention.head_count_kv", heads)),
        head_dim=head_dim, vocab_size=int(vocab_size),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")), rope_theta=float(key("rope.freq_base")),
        sliding_window=int(key("attention.sliding_window")), max_position_embeddings=int(key("context_length")),
        query_pre_attn_scalar=float(hidden // heads) if layers == 62 else 0.0,  # llama.cpp: the 27B
        bos_id=meta.get("tokenizer.ggml.bos_token_id"), add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", True)))


def weight_shapes(c: GemmaConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the graph reads, by GGUF name (numpy shapes: Linear weights (out, in))."""
    d, q, kv, ff = c.hidden_size, c.num_attention_heads * c.head_dim, c.kv_dim, c.intermediate_size
    per_layer = {"attn_norm": (d,), "attn_q": (q, d), "attn_k": (kv, d), "attn_v": (kv, d), "attn_output": (d, q),
                 "attn_q_norm": (c.head_dim,), "attn_k_norm": (c.head_dim,), "post_attention_norm": (d,),
                 "ffn_norm": (d,), "ffn_gate": (ff, d), "ffn_up": (ff, d), "ffn_down": (d, ff), "post_ffw_norm": (d,)}
    shapes = {EMBED: (c.vocab_size, d), FINAL_NORM: (d,)}
    for i in range(c.num_hidden_layers):
        shapes.update({f"blk.{i}.{n}.weight": s for n, s in per_layer.items()})
    return shapes


# -- position inputs (FP64, fed to the graph) ----------------------------------------------------
def rope_tables(c: GemmaConfig, positions, base: float) -> tuple[np.ndarray, np.ndarray]:
    inv_freq = 1.0 / base ** (np.arange(0, c.head_dim, 2, dtype=np.float64) / c.head_dim)
    angles = np.asarray(positions, dtype=np.float64)[:, None] * inv_freq[None, :]
    angles = np.concatenate([angles, angles], axis=-1)
    return np.cos(angles), np.sin(angles)


def attention_bias(positions, max_cache: int, cached_rows: int, window: int | None) -> np.ndarray:
    """(seq, max_cache): 0 where key row j is written and visible from query position p (j <= p, and
    p - j < window for a local layer), else -1e9."""
    rows, positions = np.arange(max_cache), np.asarray(positions)
    written = (rows < cached_rows) | np.isin(rows, positions)
    visible = (rows[None, :] <= positions[:, None]) & written[None, :]
    if window is not None:
        visible &= positions[:, None] - rows[None, :] < window
    return np.where(visible, 0.0, MASKED_BIAS)


_KINDS = ("global", "local")


def ring_rows(c: GemmaConfig, seq: int, max_cache: int) -> int | None:
    """A decode step's local layers keep a ring of `window` cache rows (position p in row p % window)
    when the context is longer than the window, so they read only those rows; None: every row."""
    return c.sliding_window if seq == 1 and max_cache > c.sliding_window else None


def ring_bias(position: int, rows: int, cached_rows: int) -> np.ndarray:
    """(1, rows): 0 where ring row r holds a written position visible from `position` (the latest
    q <= position with q % rows == r, written before this step or by it), else -1e9."""
    held = position - (position - np.arange(rows)) % rows
    return np.where((held >= 0) & ((held < cached_rows) | (held == position)), 0.0, MASKED_BIAS)[None, :]


@dataclass(frozen=True)
class GemmaModel:
    """A built Gemma 3 graph: `batch` sequences of `seq` tokens, each against its own `max_cache`-row KV
    cache block per layer (token rows sequence-major, cache rows b*max_cache + j), as LlamaModel."""

    config: GemmaConfig
    graph: Graph
    seq: int
    max_cache: int
    batch: int = 1

    def cache_rows(self, layer: int) -> int:
        """KV-cache rows per sequence of a layer (a local layer's ring, or the whole context)."""
        ring = ring_rows(self.config, self.seq, self.max_cache)
        return self.max_cache if ring is None or self.config.is_global(layer) else ring

    def make_inputs(self, ids, positions, previous: Mapping[str, np.ndarray] | None = None,
                    cached_rows: int | None = None) -> dict[str, np.ndarray]:
        """One step of a single sequence (batch 1); see make_batch_inputs."""
        if self.batch != 1:
            raise ValueError(f"make_inputs is for batch 1; this graph has batch {self.batch}: use make_batch_inputs")
        return self.make_batch_inputs(np.asarray(ids)[None], np.asarray(positions)[None], previous,
                                      None if cached_rows is None else [cached_rows])

    def make_batch_inputs(self, ids, positions, previous: Mapping[str, np.ndarray] | None = None,
                          cached_rows=None) -> dict[str, np.ndarray]:
        """ids and positions (batch, seq); `previous`: the step before's outputs (its caches are read
        back), None for empty caches; `cached_rows[b]`: rows of sequence b already written (default 0
        for empty caches, else min(positions[b]))."""
        c = self.config
        ids, positions, cached_rows = checked_batch(ids, positions, cached_rows, previous is None, self.batch,
                                                    self.seq, c.vocab_size, self.max_cache)
        rows = (np.arange(self.batch)[:, None] * self.max_cache + positions).reshape(-1)
        inputs = {"ids": ids.reshape(-1), "positions": rows}
        ring = ring_rows(c, self.seq, self.max_cache)
        for kind, base, window in (("global", c.rope_theta, None), ("local", c.rope_local_theta, c.sliding_window)):
            inputs[f"rope_cos_{kind}"], inputs[f"rope_sin_{kind}"] = rope_tables(c, positions.reshape(-1), base)
            inputs[f"attn_bias_{kind}"] = np.concatenate([
                ring_bias(int(row[0]), ring, int(n)) if kind == "local" and ring else
                attention_bias(row, self.max_cache, int(n), window) for row, n in zip(positions, cached_rows)])
        if ring:
            inputs["positions_local"] = (np.arange(self.batch)[:, None] * ring + positions % ring).reshape(-1)
        for layer in range(c.num_hidden_layers):
            shape = (self.batch * self.cache_rows(layer), c.kv_dim)
            for kind in CACHE_KINDS:
                inputs[cache_input_name(kind, layer)] = (np.zeros(shape) if previous is None
                                                         else np.asarray(previous[cache_output_name(kind, layer)]))
        return inputs

    def sequence_logits(self, outputs: Mapping[str, np.ndarray]) -> np.ndarray:
        """The logits output as (batch, seq, vocab)."""
        return np.asarray(outputs["logits"]).reshape(self.batch, self.seq, -1)


@dataclass(frozen=True)
class _Tables:
    cos: GraphTensor
    sin: GraphTensor
    bias: GraphTensor


def _rope(x: GraphTensor, t: _Tables) -> GraphTensor:
    return x * t.cos.unsqueeze(1) + _rotate_half(x) * t.sin.unsqueeze(1)


def _attention(g: Graph, c: GemmaConfig, layer: int, h: GraphTensor, weight, t: _Tables, positions: GraphTensor,
               batch: int, max_cache: int) -> GraphTensor:
    """`positions`: the cache rows this step writes; `max_cache`: this layer's rows per sequence."""
    tokens, heads, kv_heads, dh = h.shape[0], c.num_attention_heads, c.num_key_value_heads, c.head_dim
    group, seq = heads // kv_heads, h.shape[0] // batch
    q = _linear(h, weight("attn_q")).reshape(tokens, heads, dh).rms_norm(weight("attn_q_norm"), c.rms_norm_eps)
    k = _linear(h, weight("attn_k")).reshape(tokens, kv_heads, dh).rms_norm(weight("attn_k_norm"), c.rms_norm_eps)
    q, k = _rope(q, t), _rope(k, t)
    cached = {}
    for kind, rows in zip(CACHE_KINDS, (k.reshape(tokens, c.kv_dim), _linear(h, weight("attn_v")))):
        cache = g.input(cache_input_name(kind, layer), (batch * max_cache, c.kv_dim))
        cached[kind] = cache.scatter(rows, positions)
        g.output(cached[kind], cache_output_name(kind, layer))
    q = q.reshape(batch, seq, kv_heads, group, dh).permute(0, 2, 3, 1, 4)       # (b, kv, group, seq, dh)
    k_all, v_all = (cached[kind].reshape(batch, max_cache, kv_heads, dh).permute(0, 2, 1, 3).unsqueeze(2)
                    for kind in CACHE_KINDS)                                      # (b, kv, 1, cache, dh)
    bias = t.bias.reshape(batch, seq, max_cache).unsqueeze(1).unsqueeze(1)
    scores = (q @ k_all.transpose(-1, -2)) * c.attention_scale + bias
    out = scores.softmax(-1) @ v_all                                              # (b, kv, group, seq, dh)
    return _linear(out.permute(0, 3, 1, 2, 4).reshape(tokens, heads * dh), weight("attn_output"))


def build_gemma(config: GemmaConfig, weights: Mapping[str, np.ndarray], seq: int, max_cache: int,
                batch: int = 1) -> GemmaModel:
    """Logits (batch*seq, vocab) and every updated KV cache for `batch` sequences of `seq` tokens at
    given cache rows.

    Chunks: the embedding, one per layer (local and global layers differ in their inputs, so they form
    two structural groups, each layer with its own precision), the final norm and tied LM head.
    """
    shapes = weight_shapes(config)
    for name, shape in shapes.items():
        if name not in weights or tuple(weights[name].shape) != shape:
            raise ValueError(f"weight {name!r} is missing or not of shape {shape}")
    if not 1 <= seq <= max_cache <= config.max_position_embeddings:
        raise ValueError(f"need 1 <= seq <= max_cache <= {config.max_position_embeddings}, got {seq}, {max_cache}")
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    g, tokens = Graph(), batch * seq
    ids, positions = index_input(g, "ids", (tokens,)), index_input(g, "positions", (tokens,))
    ring = ring_rows(config, seq, max_cache)
    rows = {"global": max_cache, "local": ring or max_cache}
    tables = {kind: _Tables(g.input(f"rope_cos_{kind}", (tokens, config.head_dim), value_range=(-1.0, 1.0)),
                            g.input(f"rope_sin_{kind}", (tokens, config.head_dim), value_range=(-1.0, 1.0)),
                            g.input(f"attn_bias_{kind}", (tokens, rows[kind]), value_range=(MASKED_BIAS, 0.0)))
              for kind in _KINDS}
    writes = {"global": positions, "local": index_input(g, "positions_local", (tokens,)) if ring else positions}
    embed = g.weight(EMBED, weights[EMBED])
    x = embed.gather(ids) * config.embed_scale
    g.graph_break()
    eps = config.rms_norm_eps
    for layer in range(config.num_hidden_layers):
        def weight(name: str, layer=layer) -> GraphTensor:
            full = f"blk.{layer}.{name}.weight"
            return g.weight(full, weights[full])
        kind = "global" if config.is_global(layer) else "local"
        attn = _attention(g, config, layer, x.rms_norm(weight("attn_norm"), eps), weight, tables[kind], writes[kind],
                          batch, rows[kind])
        x = x + attn.rms_norm(weight("post_attention_norm"), eps)
        h = x.rms_norm(weight("ffn_norm"), eps)
        ffn = _linear(_linear(h, weight("ffn_gate")).gelu("tanh") * _linear(h, weight("ffn_up")), weight("ffn_down"))
        x = x + ffn.rms_norm(weight("post_ffw_norm"), eps)
        g.graph_break()
    x = x.rms_norm(g.weight(FINAL_NORM, weights[FINAL_NORM]), eps)
    g.output(_linear(x, embed), "logits")
    return GemmaModel(config, g, seq, max_cache, batch)
