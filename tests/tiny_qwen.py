"""Write tiny Qwen2 (q/k/v biases) and Qwen3 (QK-norm, head_dim 16 != hidden / heads = 8, no biases) GGUF
files the way llama.cpp's converter writes them: GGUF names, `qwen2.*` / `qwen3.*` metadata keys, Q/K
rows as Hugging Face stores them (no permutation: llama.cpp runs these with rotate-half RoPE)."""
from __future__ import annotations

import gguf
import numpy as np

from tiny_gguf import MERGES, SPECIAL, TEMPLATE, tokens

HIDDEN, HEADS, KV_HEADS, FF, LAYERS = 32, 4, 2, 64, 2
HEAD_DIM = {"qwen2": HIDDEN // HEADS, "qwen3": 16}


def write_tiny_qwen(path, arch: str, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    dh = HEAD_DIM[arch]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(LAYERS)
    w.add_context_length(64)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FF)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6)
    if arch == "qwen3":
        w.add_key_length(dh)
        w.add_value_length(dh)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens())
    w.add_token_types([3] * len(SPECIAL) + [1] * (len(tokens()) - len(SPECIAL)))
    w.add_token_merges(MERGES)
    w.add_eos_token_id(2)
    w.add_chat_template(TEMPLATE)

    def linear(out, inp):
        return (rng.standard_normal((out, inp)) / np.sqrt(inp)).astype(np.float32)

    def vec(n, centre=1.0, spread=0.1):
        return (centre + spread * rng.standard_normal(n)).astype(np.float32)
    vocab = len(tokens())
    w.add_tensor("token_embd.weight", rng.standard_normal((vocab, HIDDEN)).astype(np.float32))
    w.add_tensor("output_norm.weight", vec(HIDDEN))
    w.add_tensor("output.weight", linear(vocab, HIDDEN))
    q, kv = HEADS * dh, KV_HEADS * dh
    for i in range(LAYERS):
        t = {"attn_norm.weight": vec(HIDDEN), "attn_q.weight": linear(q, HIDDEN), "attn_k.weight": linear(kv, HIDDEN),
             "attn_v.weight": linear(kv, HIDDEN), "attn_output.weight": linear(HIDDEN, q),
             "ffn_norm.weight": vec(HIDDEN), "ffn_gate.weight": linear(FF, HIDDEN), "ffn_up.weight": linear(FF, HIDDEN),
             "ffn_down.weight": linear(HIDDEN, FF)}
        if arch == "qwen2":
            t.update({"attn_q.bias": vec(q, 0.0, 0.5), "attn_k.bias": vec(kv, 0.0, 0.5), "attn_v.bias": vec(kv, 0.0, 0.5)})
        else:
            t.update({"attn_q_norm.weight": vec(dh, 1.0, 0.3), "attn_k_norm.weight": vec(dh, 1.0, 0.3)})
        for name, array in t.items():
            w.add_tensor(f"blk.{i}.{name}", array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
