"""An independent FP64 Qwen2 / Qwen3 decoder read straight from a GGUF file (GGUF names, nothing of
luminal_num), from Hugging Face's Qwen2Model / Qwen3Model definitions: RMSNorm x / sqrt(mean x^2 + eps) * w;
q/k/v projections (+ biases in Qwen2); Qwen3 RMS-normalises each head's q and k over head_dim (its own
head_dim, from attention.key_length) before RoPE; rotate-half RoPE (pairs i, i + d/2) with rope.freq_base;
causal softmax attention with GQA, scale head_dim^-0.5; SwiGLU MLP; output.weight as the head."""
from __future__ import annotations

import gguf
import numpy as np


def qwen_logits(path, ids) -> np.ndarray:
    reader = gguf.GGUFReader(str(path))
    meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("tokenizer.")}
    w = {t.name: np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float64).reshape(
        tuple(int(d) for d in t.shape[::-1])) for t in reader.tensors}
    arch = meta["general.architecture"]
    heads, kv_heads = meta[f"{arch}.attention.head_count"], meta[f"{arch}.attention.head_count_kv"]
    hidden, eps = meta[f"{arch}.embedding_length"], meta[f"{arch}.attention.layer_norm_rms_epsilon"]
    dh = meta.get(f"{arch}.attention.key_length", hidden // heads)
    base = meta[f"{arch}.rope.freq_base"]
    n = len(ids)

    def norm(t, gain):
        return t / np.sqrt((t ** 2).mean(axis=-1, keepdims=True) + eps) * gain

    def rope(t):  # (n, dh)
        half = dh // 2
        ang = np.arange(n)[:, None] * base ** (-np.arange(half) / half)[None, :]
        a, b = t[:, :half], t[:, half:]
        return np.concatenate([a * np.cos(ang) - b * np.sin(ang), b * np.cos(ang) + a * np.sin(ang)], axis=1)

    x = w["token_embd.weight"][np.asarray(ids)]
    for layer in range(meta[f"{arch}.block_count"]):
        p = f"blk.{layer}."
        h = norm(x, w[p + "attn_norm.weight"])
        q, k, v = (h @ w[p + f"attn_{s}.weight"].T + w.get(p + f"attn_{s}.bias", 0.0) for s in "qkv")
        outs = []
        for head in range(heads):
            g = head // (heads // kv_heads)
            qh, kh = q[:, head * dh:(head + 1) * dh], k[:, g * dh:(g + 1) * dh]
            if p + "attn_q_norm.weight" in w:
                qh, kh = norm(qh, w[p + "attn_q_norm.weight"]), norm(kh, w[p + "attn_k_norm.weight"])
            s = np.where(np.tril(np.ones((n, n))) > 0, rope(qh) @ rope(kh).T / np.sqrt(dh), -np.inf)
            e = np.exp(s - s.max(axis=1, keepdims=True))
            outs.append(e / e.sum(axis=1, keepdims=True) @ v[:, g * dh:(g + 1) * dh])
        x = x + np.concatenate(outs, axis=1) @ w[p + "attn_output.weight"].T
        h = norm(x, w[p + "ffn_norm.weight"])
        gate = h @ w[p + "ffn_gate.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * (h @ w[p + "ffn_up.weight"].T)) @ w[p + "ffn_down.weight"].T
    return norm(x, w["output_norm.weight"]) @ w["output.weight"].T
