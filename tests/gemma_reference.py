"""An independent FP64 Gemma 3 text decoder, written from Hugging Face's Gemma3TextModel definition and
read straight from a GGUF file with `gguf.GGUFReader` (nothing of luminal_num is used).

HF's definition, as implemented here: h = embed[ids] * sqrt(hidden) (embed_scale in the weights'
dtype, float32); per layer: x + post_attn_norm(attn(input_norm(x))), then x + post_ffn_norm(mlp(
pre_ffn_norm(x))); Gemma3RMSNorm(x) = x / sqrt(mean(x^2) + eps) * (1 + w); attention per head with
q_norm / k_norm over head_dim, rotate-half RoPE (base rope_local_base_freq = 10000 on sliding layers,
rope_theta on full layers), scores * query_pre_attn_scalar^-0.5, a causal mask and on sliding layers
also kv_idx > q_idx - sliding_window, softmax with -inf; mlp = down(gelu_tanh(gate x) * up x); layer
types: full attention every 6th layer (layer_types[i] = full iff (i + 1) % 6 == 0); tied LM head.
llama.cpp's converter stores 1 + w for every norm weight: w = stored - 1 (exact in FP64).
"""
from __future__ import annotations

import functools
import math

import gguf
import numpy as np


@functools.lru_cache(maxsize=2)
def _read(path: str):
    reader = gguf.GGUFReader(path)
    meta = {k: f.contents() for k, f in reader.fields.items() if k.startswith("gemma3.")}
    vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    return meta, {t.name: t for t in reader.tensors}, vocab


def _tensor(tensors, name) -> np.ndarray:
    t = tensors[name]
    shape = tuple(int(d) for d in t.shape[::-1])
    return np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float64).reshape(shape)


def gemma_logits(path, ids, layers: int | None = None) -> np.ndarray:
    """Causal next-token logits (n, vocab) of tokens at positions 0..n-1, in FP64."""
    meta, tensors, _ = _read(str(path))
    hidden = meta["gemma3.embedding_length"]
    heads, kv_heads = meta["gemma3.attention.head_count"], meta["gemma3.attention.head_count_kv"]
    dh, eps = meta["gemma3.attention.key_length"], meta["gemma3.attention.layer_norm_rms_epsilon"]
    window, theta = meta["gemma3.attention.sliding_window"], meta["gemma3.rope.freq_base"]
    n_layers = meta["gemma3.block_count"] if layers is None else layers
    w = functools.partial(_tensor, tensors)

    def rms(t, stored_gain):
        weight = stored_gain - 1.0
        return t / np.sqrt((t * t).mean(axis=-1, keepdims=True) + eps) * (1.0 + weight)

    def rope(t, base):  # t (n, dh), rotate_half: pairs (i, i + dh/2)
        inv = base ** (-np.arange(0, dh, 2) / dh)
        ang = np.arange(len(t))[:, None] * inv[None, :]
        cos, sin = np.cos(np.concatenate([ang, ang], 1)), np.sin(np.concatenate([ang, ang], 1))
        rot = np.concatenate([-t[:, dh // 2:], t[:, :dh // 2]], axis=1)
        return t * cos + rot * sin

    def gelu_tanh(v):
        return 0.5 * v * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (v + 0.044715 * v ** 3)))

    embed = w("token_embd.weight")
    x = embed[np.asarray(ids)] * float(np.float32(hidden ** 0.5))
    n = len(ids)
    qi, kj = np.arange(n)[:, None], np.arange(n)[None, :]
    for layer in range(n_layers):
        p = f"blk.{layer}."
        full = (layer + 1) % 6 == 0
        mask = (kj <= qi) if full else (kj <= qi) & (kj > qi - window)
        base = theta if full else 10000.0
        h = rms(x, w(p + "attn_norm.weight"))
        q, k, v = h @ w(p + "attn_q.weight").T, h @ w(p + "attn_k.weight").T, h @ w(p + "attn_v.weight").T
        outs = []
        for head in range(heads):
            kv = head // (heads // kv_heads)
            qh = rope(rms(q[:, head * dh:(head + 1) * dh], w(p + "attn_q_norm.weight")), base)
            kh = rope(rms(k[:, kv * dh:(kv + 1) * dh], w(p + "attn_k_norm.weight")), base)
            scores = np.where(mask, qh @ kh.T * dh ** -0.5, -np.inf)
            e = np.exp(scores - scores.max(axis=1, keepdims=True))
            outs.append(e / e.sum(axis=1, keepdims=True) @ v[:, kv * dh:(kv + 1) * dh])
        x = x + rms(np.concatenate(outs, axis=1) @ w(p + "attn_output.weight").T, w(p + "post_attention_norm.weight"))
        h = rms(x, w(p + "ffn_norm.weight"))
        mlp = (gelu_tanh(h @ w(p + "ffn_gate.weight").T) * (h @ w(p + "ffn_up.weight").T)) @ w(p + "ffn_down.weight").T
        x = x + rms(mlp, w(p + "post_ffw_norm.weight"))
    return rms(x, w("output_norm.weight")) @ embed.T
