"""GGUF loading of the bundled SmolLM2-135M: config, tensors, tokenizer, chat template, refusals."""
import gguf
import numpy as np
import pytest

from luminal_num.models.gguf import (GGUFError, config_from_metadata, hf_name, load_gguf, smollm2_path,
                                     unpermute_rope_rows)
from luminal_num.models.llm import load_llm, load_prompts
from luminal_num.models.tokenizer import ChatTemplate, Tokenizer, TokenizerError

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def reader():
    return gguf.GGUFReader(smollm2_path())


@pytest.fixture(scope="module")
def meta(reader):
    return {k: f.contents() for k, f in reader.fields.items()}


@pytest.fixture(scope="module")
def small():
    return load_gguf(smollm2_path(), layers=2)


def test_config_from_metadata(small, meta):
    full = config_from_metadata(meta, _tensor_names())
    assert (full.num_hidden_layers, full.hidden_size, full.num_attention_heads, full.num_key_value_heads,
            full.intermediate_size, full.vocab_size, full.rope_theta) == (30, 576, 9, 3, 1536, 49152, 1e5)
    assert full.tie_word_embeddings and not full.qkv_bias and full.head_dim == 64
    assert small.config.num_hidden_layers == 2


_NAMES: set[str] = set()


def _tensor_names() -> set[str]:
    if not _NAMES:
        _NAMES.update(t.name for t in gguf.GGUFReader(smollm2_path()).tensors)
    return set(_NAMES)


def test_tensors_keep_their_source_format(small, reader):
    assert small.sources["model.embed_tokens.weight"].format == "Q8_0"
    assert small.sources["model.layers.1.mlp.down_proj.weight"].format == "Q4_1"
    assert small.sources["model.layers.0.input_layernorm.weight"].format == "F32"
    # Q4_1: 32 weights per 20-byte block (FP16 scale, FP16 min, 16 bytes of nibbles), rows in HF order
    assert small.sources["model.layers.0.self_attn.q_proj.weight"].raw.shape == (576, 576 // 32 * 20)
    t = next(t for t in reader.tensors if t.name == "blk.0.ffn_up.weight")
    block = np.asarray(t.data)[0, :20]
    scale, low = block[:2].view(np.float16)[0], block[2:4].view(np.float16)[0]
    nibbles = np.concatenate([block[4:] & 15, block[4:] >> 4]).astype(np.float32)  # ggml: low nibbles first
    expected = np.float32(scale) * nibbles + np.float32(low)
    np.testing.assert_array_equal(small.weights["model.layers.0.mlp.up_proj.weight"][0, :32], expected)


def test_rope_unpermutation_is_the_inverse_of_llama_cpp_permute():
    """llama.cpp's convert_hf_to_gguf `permute`: reshape(h, 2, d/2, cols).swapaxes(1, 2)."""
    heads, dh, cols = 3, 8, 5
    hf = np.arange(heads * dh * cols, dtype=np.float64).reshape(heads * dh, cols)
    permuted = hf.reshape(heads, 2, dh // 2, cols).swapaxes(1, 2).reshape(hf.shape)
    np.testing.assert_array_equal(unpermute_rope_rows(permuted, heads), hf)


def test_tokenizer_against_hand_checked_ids(small):
    tok = small.tokenizer
    vocab = {tok.token(i): i for i in range(tok.vocab_size)}
    cases = {
        "The capital of France is": ["The", "Ġcapital", "Ġof", "ĠFrance", "Ġis"],
        "In 1969": ["In", "Ġ", "1", "9", "6", "9"],  # SmolLM splits every digit
        "<|im_start|>user\nHi<|im_end|>": ["<|im_start|>", "user", "Ċ", "Hi", "<|im_end|>"],
    }
    for text, pieces in cases.items():
        assert tok.encode(text) == [vocab[p] for p in pieces], text
    assert tok.encode("The capital of France is") == [504, 3575, 282, 4649, 314]
    assert (vocab["<|im_start|>"], vocab["<|im_end|>"], tok.eos_id) == (1, 2, 2)


def test_round_trip_on_every_prompt(small):
    model = load_llm("smollm2", 2)
    for which in ("calibration", "heldout"):
        for prompt in load_prompts(which):
            text = model.render(prompt)
            assert model.tokenizer.decode(model.tokenizer.encode(text)) == text


def test_prompt_sets_are_real_and_disjoint():
    cal, held = load_prompts("calibration"), load_prompts("heldout")
    assert (len(cal), len(held)) == (24, 12)
    assert any(p.chat for p in cal) and any(p.chat for p in held) and any(not p.chat for p in cal)
    assert not {p.text for p in cal} & {p.text for p in held}


def test_chat_template_renders_like_hugging_face(small):
    text = small.chat_template.render([{"role": "user", "content": "Hi there"}])
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                    "<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n")
    with pytest.raises(ValueError, match="role"):
        small.chat_template.render([{"content": "no role", "name": "x"}])
    assert ChatTemplate("{{ raise_exception('nope') }}").source
    with pytest.raises(ValueError, match="nope"):
        ChatTemplate("{{ raise_exception('nope') }}").render([])


# -- refusals: one line naming the setting ---------------------------------------------------------
@pytest.mark.parametrize("change, match", [
    ({"general.architecture": "gemma"}, "architecture 'gemma'"),
    ({"general.architecture": "gemma3"}, "'gemma3' is built by luminal_num.models.gemma"),
    ({"llama.rope.scaling.type": "linear"}, "RoPE scaling"),
    ({"llama.rope.scaling.factor": 4.0}, "RoPE scaling"),
    ({"llama.attention.value_length": 128}, "value_length=128"),
    ({"llama.attention.key_length": 32}, "dimension_count=64 differs from the head size 32"),
    ({"llama.rope.dimension_count": 32}, "dimension_count=32"),
    ({"llama.attention.sliding_window": 4096}, "sliding_window"),
])
def test_refused_metadata(meta, change, match):
    with pytest.raises(GGUFError, match=match):
        config_from_metadata({**meta, **change}, _tensor_names())


@pytest.mark.parametrize("extra", ["blk.0.attn_q.bias", "blk.3.ffn_up.bias", "blk.0.attn_output.bias"])
def test_llama_biases_are_refused(meta, extra):
    with pytest.raises(GGUFError, match="biases"):
        config_from_metadata(meta, _tensor_names() | {extra})


def test_qwen2_qkv_biases_are_accepted_but_not_others(meta):
    qwen = {k.replace("llama.", "qwen2."): v for k, v in meta.items()} | {"general.architecture": "qwen2"}
    names = _tensor_names() | {f"blk.{i}.attn_{p}.bias" for i in range(30) for p in "qkv"}
    assert config_from_metadata(qwen, names).qkv_bias
    with pytest.raises(GGUFError, match="attn_output.bias"):
        config_from_metadata(qwen, names | {"blk.0.attn_output.bias"})


def test_unknown_tensor_is_refused():
    assert hf_name("blk.7.attn_k.weight") == "model.layers.7.self_attn.k_proj.weight"
    for name in ("blk.0.attn_sinks.weight", "rope_freqs.weight", "blk.x.attn_q.weight"):
        with pytest.raises(GGUFError, match="not read by the Llama graph"):
            hf_name(name)


def test_unsupported_tokenizers_are_refused(meta):
    with pytest.raises(TokenizerError, match="'llama'"):
        Tokenizer.from_gguf_metadata({**meta, "tokenizer.ggml.model": "llama"})
    with pytest.raises(TokenizerError, match="pre='qwen2'"):
        Tokenizer.from_gguf_metadata({**meta, "tokenizer.ggml.pre": "qwen2"})


def test_missing_or_bad_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_gguf(tmp_path / "nope.gguf")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(GGUFError, match="not a readable GGUF"):
        load_gguf(bad)
