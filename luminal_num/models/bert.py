"""A BERT encoder (all-MiniLM-L6-v2) written in the GraphTensor frontend, with mean pooling + L2 norm.

The graph follows the Hugging Face BERT layout and tensor names, so a safetensors file maps onto it
one to one: every weight enters as `g.weight(<HF name>, array)` in its stored layout (Linear weights
are (out, in) and are read through a transposed view, never transposed in numpy), so the compiler sees
the bytes the file holds. Chunks: the embeddings, one per encoder layer, then the pooling head; the
layer chunks are structurally identical, so later stages search one layer and reuse it.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields

import numpy as np

from ..dtypes.formats import INT32
from ..hlir import Graph, GraphTensor
from .assets import Encoded, load_config, minilm_files
from .weights import load_safetensors

# Bias added to the attention scores of padded keys. exp(-1e4) underflows to exactly 0 in FP64
# (below e^-745) and in every narrower format, so padded keys get zero weight as with -inf; yet the
# value is finite (static analysis needs finite ranges) and fits FP16 (max 65504), so the mask alone
# does not force the scores into FP32.
MASKED_KEY_BIAS = -1.0e4

IDS_INPUT = "ids"                    # int token ids, (batch, seq)
MASK_BIAS_INPUT = "mask_bias"        # (batch, 1, 1, seq): 0 for real tokens, MASKED_KEY_BIAS for padding
POOL_WEIGHTS_INPUT = "pool_weights"  # (batch, seq): mask / token count, so pooling is one batched matmul
EMBEDDING_OUTPUT = "embedding"       # (batch, hidden), unit L2 norm

# HF `hidden_act` -> GraphTensor.gelu's `approximate` argument. HF's "gelu" is the exact erf form.
_GELU_FORMS = {"gelu": "none"}


@dataclass(frozen=True)
class BertConfig:
    """The fields of a Hugging Face BERT config.json that determine the encoder's graph."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    hidden_act: str

    def __post_init__(self) -> None:
        if self.hidden_act not in _GELU_FORMS:
            raise NotImplementedError(f"hidden_act {self.hidden_act!r} is not supported; known: {sorted(_GELU_FORMS)}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not a multiple of "
                             f"num_attention_heads {self.num_attention_heads}")

    @classmethod
    def from_dict(cls, config: Mapping) -> BertConfig:
        """Pick the graph-relevant fields out of a full config.json; reject variants we do not build."""
        if config.get("position_embedding_type", "absolute") != "absolute":
            raise NotImplementedError("only absolute position embeddings are supported, got "
                                      f"{config['position_embedding_type']!r}")
        missing = [f.name for f in fields(cls) if f.name not in config]
        if missing:
            raise KeyError(f"BERT config lacks {missing}")
        return cls(**{f.name: config[f.name] for f in fields(cls)})

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


@dataclass(frozen=True)
class BertModel:
    """The encoder graph for a fixed (batch, seq) and how to feed it a tokenized batch."""

    graph: Graph
    config: BertConfig
    batch: int
    seq: int

    def make_inputs(self, encoded: Encoded, pad_id: int = 0) -> dict[str, np.ndarray]:
        """Graph inputs for a tokenized batch; rows shorter than `seq` are right-padded with `pad_id`.

        Padded positions are invisible to the output (zero attention weight as keys, zero pooling
        weight), so their id only has to be a valid row of the embedding table.
        """
        ids, mask = np.asarray(encoded.ids), np.asarray(encoded.attention_mask)
        if ids.shape != mask.shape or ids.ndim != 2:
            raise ValueError(f"ids {ids.shape} and attention_mask {mask.shape} must be equal 2-D shapes")
        if ids.shape[0] != self.batch or ids.shape[1] > self.seq:
            raise ValueError(f"batch of shape {ids.shape} does not fit a model built for ({self.batch}, {self.seq})")
        extra = ((0, 0), (0, self.seq - ids.shape[1]))
        ids = np.pad(ids, extra, constant_values=pad_id).astype(np.int64)
        valid = np.pad(mask, extra) > 0
        counts = np.maximum(valid.sum(axis=1, keepdims=True), 1)
        return {
            IDS_INPUT: ids,
            MASK_BIAS_INPUT: np.where(valid, 0.0, MASKED_KEY_BIAS)[:, None, None, :],
            POOL_WEIGHTS_INPUT: valid / counts,
        }


@dataclass(frozen=True)
class _Builder:
    """Shared state of one graph build: the graph, the weights by HF name, the config and shapes."""

    graph: Graph
    weights: Mapping[str, np.ndarray]
    config: BertConfig
    batch: int
    seq: int

    def weight(self, name: str) -> GraphTensor:
        if name not in self.weights:
            raise KeyError(f"weights lack {name!r}")
        return self.graph.weight(name, self.weights[name])

    def linear(self, prefix: str, x: GraphTensor) -> GraphTensor:
        """torch.nn.Linear: x W^T + b, W read in its stored (out, in) layout through a transposed view."""
        return x @ self.weight(f"{prefix}.weight").transpose() + self.weight(f"{prefix}.bias")

    def layer_norm(self, prefix: str, x: GraphTensor) -> GraphTensor:
        return x.layer_norm(self.weight(f"{prefix}.weight"), self.weight(f"{prefix}.bias"),
                            eps=self.config.layer_norm_eps)

    def embeddings(self, ids: GraphTensor) -> GraphTensor:
        """word[ids] + position[:seq] + token_type[0], LayerNorm; returned as (batch*seq, hidden)."""
        words = self.weight("embeddings.word_embeddings.weight").gather(ids)  # (batch, seq, hidden)
        positions = self.weight("embeddings.position_embeddings.weight").slice((0, self.seq))
        token_type = self.weight("embeddings.token_type_embeddings.weight").slice((0, 1))
        summed = (words + positions + token_type).reshape(self.batch * self.seq, self.config.hidden_size)
        return self.layer_norm("embeddings.LayerNorm", summed)

    def self_attention(self, prefix: str, x: GraphTensor, mask_bias: GraphTensor) -> GraphTensor:
        c = self.config

        def split_heads(y: GraphTensor) -> GraphTensor:  # (B*S, H*D) -> (B, H, S, D)
            return y.reshape(self.batch, self.seq, c.num_attention_heads, c.head_dim).permute(0, 2, 1, 3)

        query, key, value = (split_heads(self.linear(f"{prefix}.{name}", x)) for name in ("query", "key", "value"))
        scores = (query @ key.transpose()) * (1.0 / math.sqrt(c.head_dim)) + mask_bias
        context = scores.softmax(-1) @ value  # (B, H, S, D)
        return context.permute(0, 2, 1, 3).reshape(self.batch * self.seq, c.hidden_size)

    def encoder_layer(self, index: int, x: GraphTensor, mask_bias: GraphTensor) -> GraphTensor:
        prefix = f"encoder.layer.{index}"
        attended = self.self_attention(f"{prefix}.attention.self", x, mask_bias)
        x = self.layer_norm(f"{prefix}.attention.output.LayerNorm",
                            self.linear(f"{prefix}.attention.output.dense", attended) + x)
        intermediate = self.linear(f"{prefix}.intermediate.dense", x).gelu(_GELU_FORMS[self.config.hidden_act])
        return self.layer_norm(f"{prefix}.output.LayerNorm", self.linear(f"{prefix}.output.dense", intermediate) + x)

    def mean_pool_normalize(self, x: GraphTensor, pool_weights: GraphTensor) -> GraphTensor:
        """Masked mean over tokens as a batched (1, seq) @ (seq, hidden) matmul, then x / ||x||_2."""
        hidden = self.config.hidden_size
        # sentence-transformers computes these as torch.sum(x * mask, 1) / count and F.normalize: the
        # op scopes say so, for peer recipes that follow PyTorch's op lists (search/recipes.py)
        with x.graph.op_scope("sum"):
            pooled = (pool_weights.reshape(self.batch, 1, self.seq) @ x.reshape(self.batch, self.seq, hidden))
        pooled = pooled.reshape(self.batch, hidden)
        with x.graph.op_scope("normalize"):
            return pooled * pooled.square().sum(-1, keepdim=True).rsqrt()


def build_bert(config: BertConfig, weights: Mapping[str, np.ndarray], batch: int, seq: int) -> BertModel:
    """The encoder + mean pooling + L2 normalisation graph, output "embedding" (batch, hidden).

    Chunks: 0 = embeddings, 1..L = encoder layers (structurally identical), L+1 = pooling head.
    """
    if batch < 1 or not 1 <= seq <= config.max_position_embeddings:
        raise ValueError(f"need batch >= 1 and 1 <= seq <= {config.max_position_embeddings}, got ({batch}, {seq})")
    g = Graph()
    build = _Builder(g, weights, config, batch, seq)
    ids = g.input(IDS_INPUT, (batch, seq), INT32, value_range=(0, config.vocab_size - 1))
    mask_bias = g.input(MASK_BIAS_INPUT, (batch, 1, 1, seq), value_range=(MASKED_KEY_BIAS, 0.0))
    pool_weights = g.input(POOL_WEIGHTS_INPUT, (batch, seq), value_range=(0.0, 1.0))
    x = build.embeddings(ids)
    g.graph_break()
    for index in range(config.num_hidden_layers):
        x = build.encoder_layer(index, x, mask_bias)
        g.graph_break()
    g.output(build.mean_pool_normalize(x, pool_weights), EMBEDDING_OUTPUT)
    return BertModel(g, config, batch, seq)


def load_minilm(batch: int, seq: int) -> BertModel:
    """all-MiniLM-L6-v2 from the installed model package (see assets.minilm_files)."""
    files = minilm_files()
    return build_bert(BertConfig.from_dict(load_config(files.config)), load_safetensors(files.safetensors), batch, seq)
