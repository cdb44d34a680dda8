"""A config-driven Llama-style decoder (RMSNorm, RoPE, GQA, SwiGLU, KV cache) in the GraphTensor frontend.

Why the graph looks the way it does:
- Weights keep Hugging Face names and layouts, so a real checkpoint loads unchanged; Linear weights
  are stored (out, in) and read through a transposed view, never copied.
- Position-dependent values (RoPE cos/sin tables, the attention bias) are computed in numpy FP64 and
  fed as inputs: the graph holds no transcendental position math, and every input has a finite range
  (the bias uses -1e9, not -inf) so static error analysis can bound it.
- GQA shares each KV head among its query heads through a broadcast view (a size-1 batch dim in the
  batched matmul), not a repeated copy of K and V.
- One chunk per layer (`graph_break` around each), so identical layers share one search.
"""
from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..hlir import Graph, GraphTensor, concat, index_input
from .weights import load_safetensors

# Attention bias where a key is hidden: finite (static analysis needs finite ranges) and far enough
# below any score that its softmax weight is exactly 0 in FP32 and FP64.
MASKED_BIAS = -1e9

EMBED = "model.embed_tokens.weight"
FINAL_NORM = "model.norm.weight"
LM_HEAD = "lm_head.weight"
CACHE_KINDS = ("k", "v")


def cache_input_name(kind: str, layer: int) -> str:
    return f"{kind}_cache.{layer}"


def cache_output_name(kind: str, layer: int) -> str:
    return f"{kind}_cache_out.{layer}"


@dataclass(frozen=True)
class LlamaConfig:
    """The architecture hyper-parameters, named as in Hugging Face's LlamaConfig (config.json)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2: q/k/v projections carry biases (o_proj and the MLP do not)
    qk_norm: bool = False   # Qwen3: RMSNorm of each head's q and k over head_dim before RoPE
    attention_head_dim: int = 0  # head size when not hidden / heads (Qwen3: 128 for hidden 1024, 16 heads)

    def __post_init__(self) -> None:
        if not self.attention_head_dim and self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not a multiple of {self.num_attention_heads} heads")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"{self.num_attention_heads} query heads cannot be shared evenly by "
                             f"{self.num_key_value_heads} KV heads")
        if self.head_dim % 2:
            raise ValueError(f"rotate-half RoPE needs an even head_dim, got {self.head_dim}")

    @property
    def head_dim(self) -> int:
        return self.attention_head_dim or self.hidden_size // self.num_attention_heads

    @property
    def kv_dim(self) -> int:
        """Width of one K (or V) cache row: all KV heads side by side."""
        return self.num_key_value_heads * self.head_dim

    @property
    def queries_per_kv_head(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def with_layers(self, num_hidden_layers: int) -> "LlamaConfig":
        return dataclasses.replace(self, num_hidden_layers=num_hidden_layers)

    @classmethod
    def from_dict(cls, hf: Mapping[str, Any]) -> "LlamaConfig":
        """From a Hugging Face config.json dict; settings this graph does not implement are refused."""
        hf = dict(hf)
        model_type = hf.get("model_type", "llama")
        if model_type not in MODEL_TYPES:
            raise ValueError(f"config.json model_type={model_type!r} is not supported (supported: {', '.join(MODEL_TYPES)})")
        hf["qkv_bias"] = MODEL_TYPES[model_type]
        for key, supported in _SUPPORTED_SETTINGS.items():
            if key in hf and not supported(hf[key], hf):
                raise ValueError(f"config.json {key}={hf[key]!r} is not supported by this Llama graph")
        values = {}
        for f in dataclasses.fields(cls):
            if f.name in hf and hf[f.name] is not None:
                values[f.name] = _FIELD_TYPES[f.type](hf[f.name])
            elif f.name == "num_key_value_heads":  # HF: absent means plain multi-head attention
                values[f.name] = hf["num_attention_heads"]
            elif f.default is dataclasses.MISSING:
                raise KeyError(f"config.json lacks required key {f.name!r}")
        if hf.get("head_dim") not in (None, hf["hidden_size"] // hf["num_attention_heads"]):
            values["attention_head_dim"] = int(hf["head_dim"])  # transformers' q/k/v width per head (Gemma-like shapes)
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        """A Hugging Face config.json dict for this architecture (Qwen2 when q/k/v carry biases)."""
        fields = dataclasses.asdict(self)
        if fields.pop("qk_norm"):
            raise ValueError("a Qwen3-style config (QK-norm) has no Llama/Qwen2 config.json form")
        head_dim = fields.pop("attention_head_dim")
        qwen2 = fields.pop("qkv_bias")
        return {"architectures": [ARCHITECTURES[qwen2]], "model_type": "qwen2" if qwen2 else "llama",
                "hidden_act": "silu", **fields, **({"head_dim": head_dim} if head_dim else {})}


_FIELD_TYPES = {"int": int, "float": float, "bool": bool}  # LlamaConfig's annotations, as strings

# Hugging Face model types this graph computes exactly -> whether q/k/v carry biases.
MODEL_TYPES = {"llama": False, "qwen2": True}
ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM")

# config.json settings that change the function computed; each must have the value this graph implements.
_SUPPORTED_SETTINGS = {
    "architectures": lambda v, hf: v is None or (len(v) == 1 and v[0] in ARCHITECTURES),
    "hidden_act": lambda v, hf: v == "silu",
    "use_sliding_window": lambda v, hf: not v,
    "rope_scaling": lambda v, hf: v is None,
    "attention_bias": lambda v, hf: not v,
    "mlp_bias": lambda v, hf: not v,
    "head_dim": lambda v, hf: v is None or (isinstance(v, int) and v > 0),  # its own width: attention_head_dim
}

LLAMA_TINY = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, rms_norm_eps=1e-5, max_position_embeddings=64)
LLAMA_SMALL = LlamaConfig(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
                          num_key_value_heads=2, vocab_size=4096, rms_norm_eps=1e-5, max_position_embeddings=1024)
# The shapes of TinyLlama-1.1B (a plain Llama-2 architecture with GQA and no RoPE scaling).
TINYLLAMA_1B = LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                           num_key_value_heads=4, vocab_size=32000, rms_norm_eps=1e-5, max_position_embeddings=2048)
PRESETS: dict[str, LlamaConfig] = {"tiny": LLAMA_TINY, "small": LLAMA_SMALL, "tinyllama-1.1b": TINYLLAMA_1B}


# -- weights -------------------------------------------------------------------------------------
def _layer_weight_shapes(c: LlamaConfig) -> dict[str, tuple[int, ...]]:
    d, q, kv, ff = c.hidden_size, c.num_attention_heads * c.head_dim, c.kv_dim, c.intermediate_size
    return {"input_layernorm.weight": (d,), "self_attn.q_proj.weight": (q, d), "self_attn.k_proj.weight": (kv, d),
            "self_attn.v_proj.weight": (kv, d), "self_attn.o_proj.weight": (d, q),
            "post_attention_layernorm.weight": (d,), "mlp.gate_proj.weight": (ff, d),
            "mlp.up_proj.weight": (ff, d), "mlp.down_proj.weight": (d, ff),
            **({"self_attn.q_norm.weight": (c.head_dim,), "self_attn.k_norm.weight": (c.head_dim,)} if c.qk_norm else {}),
            **({"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,)}
               if c.qkv_bias else {})}


def weight_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the model reads, by Hugging Face name (Linear weights as (out, in))."""
    shapes = {EMBED: (config.vocab_size, config.hidden_size)}
    for i in range(config.num_hidden_layers):
        shapes.update({f"model.layers.{i}.{name}": s for name, s in _layer_weight_shapes(config).items()})
    shapes[FINAL_NORM] = (config.hidden_size,)
    if not config.tie_word_embeddings:
        shapes[LM_HEAD] = (config.vocab_size, config.hidden_size)
    return shapes


def random_weights(config: LlamaConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded float32 weights: Linear ~ N(0, 1/fan_in), embeddings ~ N(0, 1), norm gains ~ 1 + N(0, 0.01).

    float32 so the same values are exact in every evaluation precision and in a safetensors file.
    """
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in weight_shapes(config).items():
        if len(shape) == 1:
            value = 1.0 + 0.1 * rng.standard_normal(shape)
        elif name == EMBED:
            value = rng.standard_normal(shape)
        else:
            value = rng.standard_normal(shape) / math.sqrt(shape[1])
        out[name] = value.astype(np.float32)
    return out


def check_weights(config: LlamaConfig, weights: Mapping[str, np.ndarray]) -> None:
    """Every tensor present with its shape; any tensor the graph would not read is refused, never dropped."""
    shapes = weight_shapes(config)
    unread = sorted(set(weights) - set(shapes))
    if unread:
        raise ValueError(f"tensor {unread[0]!r} is not read by the Llama graph ({len(unread)} unread): "
                         f"refusing to drop it")
    for name, shape in shapes.items():
        if name not in weights:
            raise KeyError(f"weight {name!r} is missing")
        if tuple(weights[name].shape) != shape:
            raise ValueError(f"weight {name!r} has shape {tuple(weights[name].shape)}, expected {shape}")


def load_weights(directory: str | Path) -> tuple[LlamaConfig, dict[str, np.ndarray]]:
    """config.json + every *.safetensors shard of a checkpoint folder, in their stored dtypes.

    Old `rotary_emb.inv_freq` buffers (values the graph recomputes) are skipped; any other tensor the
    graph does not read (a bias, an extra norm) is refused.
    """
    directory = Path(directory)
    with open(directory / "config.json", encoding="utf-8") as f:
        config = LlamaConfig.from_dict(json.load(f))
    shards = sorted(directory.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"no *.safetensors files in {directory}")
    merged: dict[str, np.ndarray] = {}
    for shard in shards:
        for name, array in load_safetensors(shard).items():
            if name in merged:
                raise ValueError(f"tensor {name!r} appears in more than one shard of {directory}")
            if not name.endswith(_RECOMPUTED_BUFFER):
                merged[name] = array
    check_weights(config, merged)
    return config, {name: merged[name] for name in weight_shapes(config)}


_RECOMPUTED_BUFFER = "rotary_emb.inv_freq"


# -- position inputs -----------------------------------------------------------------------------
def rope_tables(config: LlamaConfig, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rotate-half RoPE cos/sin tables (seq, head_dim) in FP64: angle pos * theta^(-2k/d), k repeated."""
    dh = config.head_dim
    inv_freq = 1.0 / config.rope_theta ** (np.arange(0, dh, 2, dtype=np.float64) / dh)
    angles = np.asarray(positions, dtype=np.float64)[:, None] * inv_freq[None, :]
    angles = np.concatenate([angles, angles], axis=-1)
    return np.cos(angles), np.sin(angles)


def attention_bias(positions: np.ndarray, max_cache: int, cached_rows: int) -> np.ndarray:
    """(seq, max_cache): 0 where key row j is visible to query i (j <= pos_i and j written), else -1e9.

    Written rows: the first `cached_rows` rows (filled by earlier steps) and this step's `positions`.
    """
    rows = np.arange(max_cache)
    positions = np.asarray(positions)
    written = (rows < cached_rows) | np.isin(rows, positions)
    visible = (rows[None, :] <= positions[:, None]) & written[None, :]
    return np.where(visible, 0.0, MASKED_BIAS)


def checked_batch(ids, positions, cached_rows, empty_caches: bool, batch: int, seq: int, vocab: int,
                  max_cache: int) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """A decoder step's (ids, positions, cached_rows) as int64 arrays and counts, refused in one line
    when a shape, a token, a cache row or a count is out of range (every LLM graph's make_batch_inputs)."""
    ids, positions = np.asarray(ids, dtype=np.int64), np.asarray(positions, dtype=np.int64)
    for what, arr, limit in (("ids", ids, vocab), ("positions", positions, max_cache)):
        if arr.shape != (batch, seq):
            raise ValueError(f"{what} must have shape ({batch}, {seq}), got {arr.shape}")
        if arr.min() < 0 or arr.max() >= limit:
            raise IndexError(f"{what} must lie in [0, {limit})")
    if any(len(np.unique(row)) != seq for row in positions):
        raise ValueError(f"each sequence's positions must be distinct cache rows, got {positions.tolist()}")
    if cached_rows is None:
        cached_rows = [0 if empty_caches else int(row.min()) for row in positions]
    if len(cached_rows) != batch:
        raise ValueError(f"cached_rows needs one count per sequence ({batch}), got {len(cached_rows)}")
    return ids, positions, cached_rows


# -- graph ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LlamaModel:
    """A built graph plus the static sizes its inputs must have.

    A batch of `batch` sequences of `seq` tokens each; token rows are flattened sequence-major
    (row b*seq + i), and the KV caches stack one `max_cache`-row block per sequence (row b*max_cache + j).
    """

    config: LlamaConfig
    graph: Graph
    seq: int
    max_cache: int
    batch: int = 1

    def cache_rows(self, layer: int) -> int:
        """KV-cache rows per sequence of a layer: the whole context in every layer."""
        return self.max_cache

    def make_inputs(self, ids, positions, previous: Mapping[str, np.ndarray] | None = None,
                    cached_rows: int | None = None) -> dict[str, np.ndarray]:
        """Activation inputs for one step of a single sequence (batch 1).

        `previous`: the outputs of the step before (its updated caches are read back), or None for
        empty caches. `cached_rows`: rows already in the cache; defaults to 0 for empty caches and to
        min(positions) otherwise (contiguous generation).
        """
        if self.batch != 1:
            raise ValueError(f"make_inputs is for batch 1; this graph has batch {self.batch}: use make_batch_inputs")
        return self.make_batch_inputs(np.asarray(ids)[None], np.asarray(positions)[None], previous,
                                      None if cached_rows is None else [cached_rows])

    def make_batch_inputs(self, ids, positions, previous: Mapping[str, np.ndarray] | None = None,
                          cached_rows=None) -> dict[str, np.ndarray]:
        """Inputs for one step of `batch` sequences: ids and positions (batch, seq), each row at its own positions.

        A shorter prompt is right-padded (any token at the next positions): its padded rows write cache
        rows past its length, which later steps never see (they count only `cached_rows[b]` rows as
        written). `cached_rows[b]`: rows of sequence b already in the cache (default: 0 for empty
        caches, else min(positions[b])).
        """
        c = self.config
        ids, positions, cached_rows = checked_batch(ids, positions, cached_rows, previous is None, self.batch,
                                                    self.seq, c.vocab_size, self.max_cache)
        cos, sin = rope_tables(c, positions.reshape(-1))
        bias = np.concatenate([attention_bias(row, self.max_cache, int(n)) for row, n in zip(positions, cached_rows)])
        rows = (np.arange(self.batch)[:, None] * self.max_cache + positions).reshape(-1)
        inputs = {"ids": ids.reshape(-1), "positions": rows, "rope_cos": cos, "rope_sin": sin, "attn_bias": bias}
        shape = (self.batch * self.max_cache, c.kv_dim)
        for layer in range(c.num_hidden_layers):
            for kind in CACHE_KINDS:
                inputs[cache_input_name(kind, layer)] = (np.zeros(shape) if previous is None
                                                         else np.asarray(previous[cache_output_name(kind, layer)]))
        return inputs

    def sequence_logits(self, outputs: Mapping[str, np.ndarray]) -> np.ndarray:
        """The logits output as (batch, seq, vocab)."""
        return np.asarray(outputs["logits"]).reshape(self.batch, self.seq, -1)


@dataclass(frozen=True)
class _StepInputs:
    """The per-step inputs every layer reads (created once, in the embedding chunk)."""

    positions: GraphTensor   # flat cache rows the new K/V rows are written to
    rope_cos: GraphTensor
    rope_sin: GraphTensor
    attn_bias: GraphTensor
    batch: int
    seq: int


def _linear(x: GraphTensor, weight: GraphTensor, bias: GraphTensor | None = None) -> GraphTensor:
    """torch Linear: weight stored (out, in), read through a transposed view; optional bias (out,)."""
    y = x @ weight.transpose()
    return y if bias is None else y + bias


def _rotate_half(x: GraphTensor) -> GraphTensor:
    """(x1, x2) -> (-x2, x1) on the last axis, built from slice views and a concat."""
    half = x.shape[-1] // 2
    whole = [(0, d) for d in x.shape[:-1]]
    first, second = x.slice(*whole, (0, half)), x.slice(*whole, (half, x.shape[-1]))
    return concat([-second, first], axis=-1)


def _apply_rope(x: GraphTensor, step: _StepInputs) -> GraphTensor:
    """x: (tokens, heads, head_dim); the (tokens, head_dim) tables broadcast over heads."""
    cos, sin = step.rope_cos.unsqueeze(1), step.rope_sin.unsqueeze(1)
    return x * cos + _rotate_half(x) * sin


def _projection(c: LlamaConfig, h: GraphTensor, weight, name: str) -> GraphTensor:
    bias = weight(f"self_attn.{name}.bias") if c.qkv_bias and name != "o_proj" else None
    return _linear(h, weight(f"self_attn.{name}.weight"), bias)


def _attention(g: Graph, c: LlamaConfig, layer: int, h: GraphTensor, weight, step: _StepInputs,
               max_cache: int) -> GraphTensor:
    tokens, kv_heads, group, dh = h.shape[0], c.num_key_value_heads, c.queries_per_kv_head, c.head_dim
    b, s = step.batch, step.seq
    q = _projection(c, h, weight, "q_proj").reshape(tokens, c.num_attention_heads, dh)
    k = _projection(c, h, weight, "k_proj").reshape(tokens, kv_heads, dh)
    if c.qk_norm:  # Qwen3: per-head RMSNorm over head_dim, before RoPE
        q, k = q.rms_norm(weight("self_attn.q_norm.weight"), c.rms_norm_eps), k.rms_norm(weight("self_attn.k_norm.weight"), c.rms_norm_eps)
    q, k = _apply_rope(q, step), _apply_rope(k, step)
    v = _projection(c, h, weight, "v_proj")
    cached = {}
    for kind, new_rows in zip(CACHE_KINDS, (k.reshape(tokens, c.kv_dim), v)):
        cache = g.input(cache_input_name(kind, layer), (b * max_cache, c.kv_dim))
        cached[kind] = cache.scatter(new_rows, step.positions)
        g.output(cached[kind], cache_output_name(kind, layer))
    # Query head kv*group + j uses KV head kv: queries as (batch, kv, group, seq, dh), keys/values as
    # (batch, kv, 1, max_cache, dh) so the batched matmul broadcasts each KV head over its group.
    q = q.reshape(b, s, kv_heads, group, dh).permute(0, 2, 3, 1, 4)
    k_all, v_all = (cached[kind].reshape(b, max_cache, kv_heads, dh).permute(0, 2, 1, 3).unsqueeze(2)
                    for kind in CACHE_KINDS)
    bias = step.attn_bias.reshape(b, s, max_cache).unsqueeze(1).unsqueeze(1)
    scores = (q @ k_all.transpose(-1, -2)) * (1.0 / math.sqrt(dh)) + bias
    out = scores.softmax(-1) @ v_all  # (batch, kv, group, seq, dh)
    return _linear(out.permute(0, 3, 1, 2, 4).reshape(tokens, c.num_attention_heads * dh),
                   weight("self_attn.o_proj.weight"))


def _decoder_layer(g: Graph, c: LlamaConfig, weights: Mapping[str, np.ndarray], layer: int, x: GraphTensor,
                   step: _StepInputs, max_cache: int) -> GraphTensor:
    def weight(name: str) -> GraphTensor:
        full = f"model.layers.{layer}.{name}"
        return g.weight(full, weights[full])

    h = x.rms_norm(weight("input_layernorm.weight"), c.rms_norm_eps)
    x = x + _attention(g, c, layer, h, weight, step, max_cache)
    h = x.rms_norm(weight("post_attention_layernorm.weight"), c.rms_norm_eps)
    gate = _linear(h, weight("mlp.gate_proj.weight")).silu()
    return x + _linear(gate * _linear(h, weight("mlp.up_proj.weight")), weight("mlp.down_proj.weight"))


def build_prefill(config: LlamaConfig, weights: Mapping[str, np.ndarray], seq: int, max_cache: int,
                  batch: int = 1) -> LlamaModel:
    """Process `batch` sequences of `seq` tokens at given cache rows; outputs logits (batch*seq, vocab)
    and every updated cache (batch*max_cache, kv_dim).

    Chunks: 0 = embedding and shared inputs, 1..L = the layers, L+1 = final norm and LM head.
    """
    check_weights(config, weights)
    if not 1 <= seq <= max_cache:
        raise ValueError(f"need 1 <= seq <= max_cache, got seq={seq}, max_cache={max_cache}")
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    if max_cache > config.max_position_embeddings:
        raise ValueError(f"max_cache {max_cache} exceeds max_position_embeddings {config.max_position_embeddings}")
    g = Graph()
    tokens = batch * seq
    embed = g.weight(EMBED, weights[EMBED])
    ids = index_input(g, "ids", (tokens,))
    step = _StepInputs(positions=index_input(g, "positions", (tokens,)),
                       rope_cos=g.input("rope_cos", (tokens, config.head_dim), value_range=(-1.0, 1.0)),
                       rope_sin=g.input("rope_sin", (tokens, config.head_dim), value_range=(-1.0, 1.0)),
                       attn_bias=g.input("attn_bias", (tokens, max_cache), value_range=(MASKED_BIAS, 0.0)),
                       batch=batch, seq=seq)
    x = embed.gather(ids)
    g.graph_break()
    for layer in range(config.num_hidden_layers):
        x = _decoder_layer(g, config, weights, layer, x, step, max_cache)
        g.graph_break()
    x = x.rms_norm(g.weight(FINAL_NORM, weights[FINAL_NORM]), config.rms_norm_eps)
    head = embed if config.tie_word_embeddings else g.weight(LM_HEAD, weights[LM_HEAD])
    g.output(_linear(x, head), "logits")
    return LlamaModel(config, g, seq, max_cache, batch)


def build_decode(config: LlamaConfig, weights: Mapping[str, np.ndarray], max_cache: int,
                 batch: int = 1) -> LlamaModel:
    """One new token per sequence against the KV cache: the prefill graph with seq = 1."""
    return build_prefill(config, weights, 1, max_cache, batch)
