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


def add_tokenizer(w) -> None:
    """The tiny SPM vocabulary (TOKENS / TYPES) and its BOS/EOS handling, as a Gemma 3 file carries them."""
    w.add_tokenizer_model("llama")
    w.add_token_list(TOKENS)
    w.add_token_scores([-float(i) if kind == 1 else 0.0 for i, kind in enumerate(TYPES)])
    w.add_token_types(TYPES)
    w.add_eos_token_id(1)
    w.add_add_space_prefix(False)
    w.add_bos_token_id(2)
    w.add_add_bos_token(True)


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
    add_tokenizer(w)

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


# -- a tiny Gemma 3 in llama.cpp's Q4_K_M mix ------------------------------------------------------------
KQ_HIDDEN, KQ_HEADS, KQ_HEAD_DIM, KQ_FF = 256, 2, 128, 512  # every K a whole number of 256-wide K-quant blocks
# per layer, as llama.cpp's Q4_K_M writes Gemma 3 270M: attn_v and ffn_down take more bits in some layers
KQ_MIX = ({"attn_v": "Q8_0", "ffn_down": "Q6_K"}, {"attn_v": "Q5_0", "ffn_down": "Q4_K"})
KQ_FIXED = {"attn_q": "Q5_0", "attn_k": "Q5_0", "attn_output": "Q4_K", "ffn_gate": "Q5_0", "ffn_up": "Q5_1"}


def kquant_layer_types(layer: int) -> dict[str, str]:
    """The GGML type of each matrix of `layer`: layers 0, 2, 4 ... Q8_0 / Q6_K, the others Q5_0 / Q4_K."""
    return {**KQ_FIXED, **KQ_MIX[layer % 2]}


def write_kquant_gemma(path, layers: int = 3, seed: int = 0) -> None:
    """A tiny gemma3 file whose matrices are random valid blocks of the Q4_K_M mix (quant/gguf_blocks.py
    random_blocks; Q8_0 by gguf.quants), the token table Q8_0: `layers` sliding-window layers, so one
    structural group whose layers hold attn_v and ffn_down in different block types."""
    from luminal_num.quant.gguf_blocks import BLOCK_TYPES, random_blocks
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "gemma3")
    for add, value in ((w.add_context_length, 64), (w.add_embedding_length, KQ_HIDDEN), (w.add_block_count, layers),
                       (w.add_feed_forward_length, KQ_FF), (w.add_head_count, KQ_HEADS), (w.add_head_count_kv, 1),
                       (w.add_key_length, KQ_HEAD_DIM), (w.add_value_length, KQ_HEAD_DIM),
                       (w.add_layer_norm_rms_eps, 1e-6), (w.add_rope_freq_base, 1e6), (w.add_sliding_window, WINDOW)):
        add(value)
    add_tokenizer(w)

    def blocks(ggml: str, rows: int, k: int):
        if ggml == "Q8_0":
            x = (rng.standard_normal((rows, k)) / np.sqrt(k)).astype(np.float32)
            return gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q8_0)
        return random_blocks(BLOCK_TYPES[ggml], rows, k, rng)

    def norm(n):
        return (1.0 + 0.3 * rng.standard_normal(n)).astype(np.float32)

    def add(name, raw, ggml):
        w.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType[ggml])

    add("token_embd.weight", blocks("Q8_0", VOCAB, KQ_HIDDEN), "Q8_0")
    w.add_tensor("output_norm.weight", norm(KQ_HIDDEN))
    q = KQ_HEADS * KQ_HEAD_DIM
    shapes = {"attn_q": (q, KQ_HIDDEN), "attn_k": (KQ_HEAD_DIM, KQ_HIDDEN), "attn_v": (KQ_HEAD_DIM, KQ_HIDDEN),
              "attn_output": (KQ_HIDDEN, q), "ffn_gate": (KQ_FF, KQ_HIDDEN), "ffn_up": (KQ_FF, KQ_HIDDEN),
              "ffn_down": (KQ_HIDDEN, KQ_FF)}
    for i in range(layers):
        for name in ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"):
            w.add_tensor(f"blk.{i}.{name}.weight", norm(KQ_HIDDEN))
        for name in ("attn_q_norm", "attn_k_norm"):
            w.add_tensor(f"blk.{i}.{name}.weight", norm(KQ_HEAD_DIM))
        for name, ggml in kquant_layer_types(i).items():
            add(f"blk.{i}.{name}.weight", blocks(ggml, *shapes[name]), ggml)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
