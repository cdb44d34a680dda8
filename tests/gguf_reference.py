"""An independent FP64 Llama written straight from a GGUF file's dequantized tensors, in llama.cpp's layout.

Nothing of luminal_num is used: the tensors are read with `gguf.GGUFReader` under their GGUF names,
Q and K stay in the converter's permuted row order and RoPE is llama.cpp's interleaved form (pairs
2i, 2i+1 of each head), attention loops over heads with a causal mask and no cache. Agreement with
the graph therefore checks our name mapping, our un-permutation and the rotate-half RoPE at once.
"""
from __future__ import annotations

import functools

import gguf
import numpy as np


@functools.lru_cache(maxsize=2)
def read_gguf(path: str) -> tuple[dict, dict]:
    reader = gguf.GGUFReader(path)
    meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("tokenizer.")}
    return meta, _Dequantized({t.name: t for t in reader.tensors})


class _Dequantized(dict):
    """GGUF name -> FP64 array (numpy shape = GGUF dims reversed), dequantized on first use."""

    def __init__(self, raw):
        super().__init__()
        self.raw = raw

    def __missing__(self, name):
        t = self.raw[name]
        shape = tuple(int(d) for d in t.shape[::-1])
        self[name] = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float64).reshape(shape)
        return self[name]

    def get(self, name, default=None):
        return self[name] if name in self.raw else default


def gguf_logits(path: str, ids, layers: int | None = None) -> np.ndarray:
    """Causal next-token logits (n, vocab) of one token sequence at positions 0..n-1, in FP64."""
    meta, w = read_gguf(str(path))
    arch = meta["general.architecture"]
    heads, kv_heads = meta[f"{arch}.attention.head_count"], meta[f"{arch}.attention.head_count_kv"]
    eps, base = meta[f"{arch}.attention.layer_norm_rms_epsilon"], meta[f"{arch}.rope.freq_base"]
    n_layers = meta[f"{arch}.block_count"] if layers is None else layers
    x = w["token_embd.weight"][np.asarray(ids)]
    n, d = x.shape
    dh = d // heads
    pos = np.arange(n, dtype=np.float64)

    def rope_interleaved(t):  # t (n, dh): rotate (t[2i], t[2i+1]) by pos * base^(-2i/dh)
        out = t.copy()
        for i in range(dh // 2):
            angle = pos * base ** (-2.0 * i / dh)
            a, b = t[:, 2 * i], t[:, 2 * i + 1]
            out[:, 2 * i] = a * np.cos(angle) - b * np.sin(angle)
            out[:, 2 * i + 1] = a * np.sin(angle) + b * np.cos(angle)
        return out

    def norm(t, gain):
        return t / np.sqrt((t ** 2).mean(axis=1, keepdims=True) + eps) * gain

    for layer in range(n_layers):
        p = f"blk.{layer}."
        h = norm(x, w[p + "attn_norm.weight"])
        q, k, v = (h @ w[p + f"attn_{name}.weight"].T for name in "qkv")
        heads_out = []
        for head in range(heads):
            kvh = head * kv_heads // heads
            qh = rope_interleaved(q[:, head * dh:(head + 1) * dh])
            kh = rope_interleaved(k[:, kvh * dh:(kvh + 1) * dh])
            scores = qh @ kh.T / np.sqrt(dh)
            scores = scores + np.where(np.tril(np.ones((n, n))) > 0, 0.0, -np.inf)
            e = np.exp(scores - scores.max(axis=1, keepdims=True))
            heads_out.append((e / e.sum(axis=1, keepdims=True)) @ v[:, kvh * dh:(kvh + 1) * dh])
        x = x + np.concatenate(heads_out, axis=1) @ w[p + "attn_output.weight"].T
        h = norm(x, w[p + "ffn_norm.weight"])
        g = h @ w[p + "ffn_gate.weight"].T
        x = x + ((g * (1 / (1 + np.exp(-g)))) * (h @ w[p + "ffn_up.weight"].T)) @ w[p + "ffn_down.weight"].T
    x = norm(x, w["output_norm.weight"])
    return x @ w.get("output.weight", w["token_embd.weight"]).T
