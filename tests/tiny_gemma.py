"""Write a tiny Gemma 3 GGUF the way llama.cpp's converter does (norm weights stored as 1 + w, Q/K rows
not permuted), random weights, real gemma3 metadata keys: head_dim 32 (not hidden / heads = 12), one KV
head, 7 layers (layer 5 global, the others sliding-window), a window of 3 positions."""
from __future__ import annotations

import gguf
import numpy as np

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FF, LAYERS, WINDOW = 48, 4, 1, 32, 96, 7, 3
# a SentencePiece vocabulary as Gemma's: control tokens, printable ASCII (' ' as '▁'), a few merged
# pieces (score falls with the id), then the 256 byte tokens
TOKENS = (["<pad>", "<eos>", "<bos>", "<unk>"] + ["\u2581" if c == " " else c for c in map(chr, range(32, 127))]
          + ["\u2581t", "he", "\u2581the", "in", "er", "\u2581a"] + [f"<0x{b:02X}>" for b in range(256)])
TYPES = [3] * 4 + [1] * (len(TOKENS) - 260) + [6] * 256
VOCAB = len(TOKENS)


def write_tiny_gemma(path, seed: int = 0, extra_keys: dict | None = None, extra_tensors: dict | None = None) -> None:
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_context_length(64)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FF)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1e6)
    w.add_sliding_window(WINDOW)
    for key, value in (extra_keys or {}).items():
        w.add_float32(key, value)
    w.add_tokenizer_model("llama")
    w.add_token_list(TOKENS)
    w.add_token_scores([-float(i) if kind == 1 else 0.0 for i, kind in enumerate(TYPES)])
    w.add_token_types(TYPES)
    w.add_eos_token_id(1)
    w.add_add_space_prefix(False)
    w.add_bos_token_id(2)
    w.add_add_bos_token(True)

    def linear(out, inp):
        return (rng.standard_normal((out, inp)) / np.sqrt(inp)).astype(np.float32)

    def norm(n):  # HF's w ~ N(0, 0.3), stored as 1 + w
        return (1.0 + 0.3 * rng.standard_normal(n)).astype(np.float32)
    w.add_tensor("token_embd.weight", (rng.standard_normal((VOCAB, HIDDEN)) * 0.2).astype(np.float32))
    w.add_tensor("output_norm.weight", norm(HIDDEN))
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    for i in range(LAYERS):
        tensors = {"attn_norm": norm(HIDDEN), "attn_q": linear(q, HIDDEN), "attn_k": linear(kv, HIDDEN),
                   "attn_v": linear(kv, HIDDEN), "attn_output": linear(HIDDEN, q), "attn_q_norm": norm(HEAD_DIM),
                   "attn_k_norm": norm(HEAD_DIM), "post_attention_norm": norm(HIDDEN), "ffn_norm": norm(HIDDEN),
                   "ffn_gate": linear(FF, HIDDEN), "ffn_up": linear(FF, HIDDEN), "ffn_down": linear(HIDDEN, FF),
                   "post_ffw_norm": norm(HIDDEN)}
        for name, array in tensors.items():
            w.add_tensor(f"blk.{i}.{name}.weight", array)
    for name, array in (extra_tensors or {}).items():
        w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
