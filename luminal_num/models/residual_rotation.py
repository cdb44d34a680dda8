"""QuaRot-style rotation of a Llama model's residual stream (issue 32): the same function, no outlier channel.

Why: a few residual channels of an LLM carry values 10-100x the others; every Gemm reading the residual
(after its RMSNorm) sees them, so a per-token FP8 scale or a W4 group is set by those channels and the
rest round coarsely. Rotating the whole residual stream by an orthogonal Q spreads every channel over all
of them. It is exact in real arithmetic, and folded into the weights offline (no kernel runs it):

1. RMSNorm's weight g folds into the Gemms that read the norm (W -> W diag(g), the norm's weight -> 1):
   n(x) diag(g) W^T = n(x) (W diag(g))^T. The final norm's folds into the LM head, so a tied head is
   untied (the embedding keeps its own rotation, E Q, without g).
2. With a scale-free norm n(x) = x / sqrt(mean(x^2) + eps), n(x Q) = n(x) Q, since |x Q| = |x| for an
   orthogonal Q. So the residual stream x is carried as x Q: the embedding rows E -> E Q, every Gemm
   reading the (normed) residual W -> W Q (after the fold: W diag(g) Q), every Gemm writing it (o_proj,
   down_proj) W -> Q^T W, the head H -> H diag(g_final) Q. Everything else (attention, the KV cache, RoPE,
   the biases of q/k/v, Qwen3's per-head q/k norms) sees the same values as before.

Q = diag(s) (C_m kron H_b) for hidden = m b: H_b the normalized Sylvester-Hadamard matrix of the largest
power-of-two block b dividing the hidden size, C_m the orthonormal DCT-II of the odd rest (SmolLM2's 576 =
9 x 64), s random signs (seeded): every entry of Q is at most sqrt(2/m)/sqrt(b), so each rotated channel is
a mix of all of them. The rotated weights are computed in FP64 and rounded once to FP32: that rounding is
the rewrite's only change to the FP32 model, and the judge's FP64 reference stays the source model's
(`LlmModel.reference`). This is a choice for a whole model, not per layer: it changes every layer's weights
and the residual stream between them.
"""
from __future__ import annotations

import dataclasses
from typing import Iterator, Mapping

import numpy as np

from ..hlir.store import file_backed, keyed
from .llama import EMBED, FINAL_NORM, LM_HEAD, LlamaConfig, check_weights

READS_RESIDUAL = {"input_layernorm.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                             "self_attn.v_proj.weight"),
                  "post_attention_layernorm.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight")}
WRITES_RESIDUAL = ("self_attn.o_proj.weight", "mlp.down_proj.weight")


def _dct(m: int) -> np.ndarray:
    """The orthonormal DCT-II matrix of order m (C C^T = I)."""
    k, n = np.arange(m)[:, None], np.arange(m)[None, :]
    c = np.sqrt(2.0 / m) * np.cos(np.pi * (n + 0.5) * k / m)
    c[0] /= np.sqrt(2.0)
    return c


def residual_rotation(hidden: int, seed: int = 0) -> np.ndarray:
    """Q (hidden, hidden), float64, orthogonal: diag(s) (C_m kron H_b), b the largest power of two dividing
    `hidden`, m = hidden / b. Q is folded into weights offline, so b need not be one of the online rotation's
    blocks (hlir/rotation.py)."""
    if hidden < 1:
        raise ValueError(f"hidden size must be >= 1, got {hidden}")
    b = hidden & -hidden  # the largest power of two dividing hidden
    s = np.ones((1, 1))
    while s.shape[0] < b:  # Sylvester's construction (hlir.rotation.hadamard offers powers of 4 only)
        s = np.block([[s, s], [s, -s]])
    h = s / np.sqrt(float(b))
    signs = np.where(np.random.default_rng(seed).random(hidden) < 0.5, -1.0, 1.0)
    return signs[:, None] * np.kron(_dct(hidden // b), h)


def rotate_residual(config: LlamaConfig, weights: Mapping[str, np.ndarray],
                    q: np.ndarray) -> tuple[LlamaConfig, dict[str, np.ndarray]]:
    """The model with its norms folded and its residual stream rotated by `q`, in float64 (the values are
    not rounded: the caller rounds them once to its storage dtype). The head is untied."""
    return _untied(config), dict(_rotated(config, weights, q))


def rotated_weights(config: LlamaConfig, weights: Mapping[str, np.ndarray],
                    seed: int = 0) -> tuple[LlamaConfig, dict[str, np.ndarray]]:
    """rotate_residual by residual_rotation(hidden, seed), each weight rounded once to FP32 as it is made
    (one float64 weight at a time) and held in an unlinked file, as load-time weights are (hlir.store)."""
    untied = _untied(config)
    q = residual_rotation(config.hidden_size, seed)
    return untied, {name: keyed(file_backed(v.astype(np.float32))) for name, v in _rotated(config, weights, q)}


def _untied(config: LlamaConfig) -> LlamaConfig:
    if not isinstance(config, LlamaConfig):
        raise TypeError(f"residual rotation is built for the Llama graph (models/llama.py), not {type(config).__name__}")
    return dataclasses.replace(config, tie_word_embeddings=False)


def _rotated(config: LlamaConfig, weights: Mapping[str, np.ndarray], q: np.ndarray) -> Iterator[tuple[str, np.ndarray]]:
    """(name, float64 value) of every weight of the rotated model, one at a time."""
    _untied(config)
    check_weights(config, weights)
    if q.shape != (config.hidden_size, config.hidden_size):
        raise ValueError(f"rotation {q.shape} does not match hidden size {config.hidden_size}")

    def f64(name: str) -> np.ndarray:
        return np.asarray(weights[name], dtype=np.float64)
    ones = np.ones(config.hidden_size)
    done = set()
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        for norm, readers in READS_RESIDUAL.items():
            g = f64(p + norm)
            for r in readers:  # W diag(g) Q: the norm's weight folded, then the rotated input
                yield p + r, (f64(p + r) * g[None, :]) @ q
            yield p + norm, ones
            done.update((p + norm, *(p + r for r in readers)))
        for writer in WRITES_RESIDUAL:  # Q^T W: the output rotated into the stream
            yield p + writer, q.T @ f64(p + writer)
            done.add(p + writer)
    head = EMBED if config.tie_word_embeddings else LM_HEAD
    yield LM_HEAD, (f64(head) * f64(FINAL_NORM)[None, :]) @ q
    yield FINAL_NORM, ones
    yield EMBED, f64(EMBED) @ q
    done.update((LM_HEAD, FINAL_NORM, EMBED))
    for name in sorted(set(weights) - done):  # every other weight reads no residual: unchanged (qk norms, biases)
        yield name, f64(name)
