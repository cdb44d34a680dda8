"""An independent FP64 numpy implementation of all-MiniLM-L6-v2 (BERT encoder + mean pooling + L2).

Written straight from the Hugging Face BERT layout (safetensors tensor names, config.json) and the
sentence-transformers pipeline of this model (modules.json: Transformer -> mean Pooling -> Normalize),
without using any of luminal_num's graph code, so tests can judge the compiler's MiniLM against it.
Every weight is upcast to float64 before use, so the only rounding is FP64's.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from scipy.special import erf

# sentence-transformers' Normalize is torch.nn.functional.normalize(p=2, eps=1e-12).
_NORMALIZE_EPS = 1e-12
# sentence-transformers' mean pooling clamps the token count at 1e-9.
_POOLING_COUNT_EPS = 1e-9


def _f64(weights: Mapping[str, np.ndarray], name: str) -> np.ndarray:
    return np.asarray(weights[name], dtype=np.float64)


def _linear(weights: Mapping[str, np.ndarray], prefix: str, x: np.ndarray) -> np.ndarray:
    """torch.nn.Linear: weight is (out, in), y = x W^T + b."""
    return x @ _f64(weights, f"{prefix}.weight").T + _f64(weights, f"{prefix}.bias")


def _layer_norm(weights: Mapping[str, np.ndarray], prefix: str, x: np.ndarray, eps: float) -> np.ndarray:
    mean = x.mean(axis=-1, keepdims=True)
    variance = ((x - mean) ** 2).mean(axis=-1, keepdims=True)  # biased, as torch LayerNorm
    normalized = (x - mean) / np.sqrt(variance + eps)
    return normalized * _f64(weights, f"{prefix}.weight") + _f64(weights, f"{prefix}.bias")


def _gelu_erf(x: np.ndarray) -> np.ndarray:
    """HF BERT's hidden_act "gelu": the exact erf form, not the tanh approximation."""
    return 0.5 * x * (1.0 + erf(x / np.sqrt(2.0)))


def _self_attention(
    weights: Mapping[str, np.ndarray], prefix: str, x: np.ndarray, key_bias: np.ndarray, heads: int
) -> np.ndarray:
    batch, seq, hidden = x.shape
    head_dim = hidden // heads

    def split_heads(y: np.ndarray) -> np.ndarray:  # (B, S, H*D) -> (B, H, S, D)
        return y.reshape(batch, seq, heads, head_dim).transpose(0, 2, 1, 3)

    query = split_heads(_linear(weights, f"{prefix}.query", x))
    key = split_heads(_linear(weights, f"{prefix}.key", x))
    value = split_heads(_linear(weights, f"{prefix}.value", x))
    scores = query @ key.transpose(0, 1, 3, 2) / np.sqrt(head_dim) + key_bias
    scores -= scores.max(axis=-1, keepdims=True)
    probabilities = np.exp(scores)
    probabilities /= probabilities.sum(axis=-1, keepdims=True)
    context = probabilities @ value  # (B, H, S, D)
    return context.transpose(0, 2, 1, 3).reshape(batch, seq, hidden)


def _encoder_layer(
    weights: Mapping[str, np.ndarray], index: int, x: np.ndarray, key_bias: np.ndarray, config: Mapping
) -> np.ndarray:
    prefix = f"encoder.layer.{index}"
    eps = config["layer_norm_eps"]
    attended = _self_attention(weights, f"{prefix}.attention.self", x, key_bias, config["num_attention_heads"])
    x = _layer_norm(weights, f"{prefix}.attention.output.LayerNorm",
                    _linear(weights, f"{prefix}.attention.output.dense", attended) + x, eps)
    intermediate = _gelu_erf(_linear(weights, f"{prefix}.intermediate.dense", x))
    return _layer_norm(weights, f"{prefix}.output.LayerNorm",
                       _linear(weights, f"{prefix}.output.dense", intermediate) + x, eps)


def _check_supported(config: Mapping) -> None:
    if config.get("hidden_act") != "gelu":
        raise NotImplementedError(f"reference implements hidden_act 'gelu' only, got {config.get('hidden_act')!r}")
    if config.get("position_embedding_type", "absolute") != "absolute":
        raise NotImplementedError("reference implements absolute position embeddings only")


def minilm_token_states_fp64(
    weights: Mapping[str, np.ndarray], config: Mapping, ids: np.ndarray, mask: np.ndarray
) -> np.ndarray:
    """Last hidden states (B, S, hidden) in float64; padded positions hold don't-care values."""
    _check_supported(config)
    ids = np.asarray(ids)
    valid = np.asarray(mask) > 0
    seq = ids.shape[1]
    # Gather the rows first, then upcast: converting all 30522 rows to float64 would be waste.
    embeddings = np.asarray(weights["embeddings.word_embeddings.weight"][ids], dtype=np.float64)
    embeddings = embeddings + _f64(weights, "embeddings.position_embeddings.weight")[:seq][None, :, :]
    embeddings = embeddings + _f64(weights, "embeddings.token_type_embeddings.weight")[0][None, None, :]
    x = _layer_norm(weights, "embeddings.LayerNorm", embeddings, config["layer_norm_eps"])
    # Padded keys get exactly zero attention weight (every row keeps its [CLS] key, so no row is empty).
    key_bias = np.where(valid, 0.0, -np.inf)[:, None, None, :]
    for index in range(config["num_hidden_layers"]):
        x = _encoder_layer(weights, index, x, key_bias, config)
    return x


def minilm_embed_fp64(
    weights: Mapping[str, np.ndarray], config: Mapping, ids: np.ndarray, mask: np.ndarray
) -> np.ndarray:
    """Sentence embeddings (B, hidden) in float64: encoder, mean over unmasked tokens, L2-normalized."""
    states = minilm_token_states_fp64(weights, config, ids, mask)
    weight = (np.asarray(mask) > 0).astype(np.float64)[:, :, None]
    pooled = (states * weight).sum(axis=1) / np.maximum(weight.sum(axis=1), _POOLING_COUNT_EPS)
    norms = np.linalg.norm(pooled, axis=1, keepdims=True)
    return pooled / np.maximum(norms, _NORMALIZE_EPS)
