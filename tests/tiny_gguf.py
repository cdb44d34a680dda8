"""Write a tiny Llama GGUF file the way llama.cpp's converter does (Q/K rows permuted for its RoPE),
from Hugging Face-layout weights, with a byte-level vocabulary: a model of our own, by path."""
from __future__ import annotations

import dataclasses

import gguf
import numpy as np

from luminal_num.models.llama import LlamaConfig, random_weights
from luminal_num.models.synthetic import byte_alphabet  # noqa: F401 (tests import it from here too)

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he"]
TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
            "'<|im_end|>\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def tokens() -> list[str]:
    return SPECIAL + byte_alphabet() + ["Ġt", "he", "Ġthe"]


def tiny_config(**changes) -> LlamaConfig:
    base = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=len(tokens()), rms_norm_eps=1e-5, rope_theta=1e4,
                       max_position_embeddings=64)
    return dataclasses.replace(base, **changes)


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: HF rotate-half rows -> interleaved-pair rows."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_GGUF_NAMES = {"input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
               "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
               "self_attn.o_proj.weight": "attn_output.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
               "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
               "mlp.down_proj.weight": "ffn_down.weight"}


def write_tiny_gguf(path, config: LlamaConfig | None = None, seed: int = 0, arch: str = "llama",
                    extra_tensors: dict | None = None, types: dict[str, str] | None = None) -> dict[str, np.ndarray]:
    """Write the file; returns the HF-layout weights it holds (F32, so dequantization is exact). `types`: GGUF
    tensor name -> GGML type ("Q8_0", "Q4_1") it is written in instead, quantized by gguf.quants (llama.cpp's
    own quantizer): the file then holds those blocks, and the returned weights are not its values."""
    c = config or tiny_config()
    weights = random_weights(c, seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(c.rope_theta)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_dimension_count(c.head_dim)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens())
    w.add_token_types([3] * len(SPECIAL) + [1] * (len(tokens()) - len(SPECIAL)))
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(TEMPLATE)
    for name, array in weights.items():
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        elif name == "lm_head.weight":
            gname = "output.weight"
        else:
            layer, rest = name.split(".", 3)[2], name.split(".", 3)[3]
            gname = f"blk.{layer}.{_GGUF_NAMES[rest]}"
            if rest == "self_attn.q_proj.weight":
                array = llama_cpp_permute(array, c.num_attention_heads)
            elif rest == "self_attn.k_proj.weight":
                array = llama_cpp_permute(array, c.num_key_value_heads)
        array = np.ascontiguousarray(array, dtype=np.float32)
        ggml = (types or {}).get(gname)
        if ggml is None:
            w.add_tensor(gname, array)
        else:
            t = gguf.GGMLQuantizationType[ggml]
            w.add_tensor(gname, gguf.quants.quantize(array, t), raw_dtype=t)
    for gname, array in (extra_tensors or {}).items():
        w.add_tensor(gname, np.asarray(array, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return weights
