"""The Llama graph against an independent FP64 numpy decoder, and its KV cache against plain prefill.

The reference below is written straight from the Hugging Face weight dict (no graph code, no
helpers of luminal_num.models.llama): its RoPE rotates (x_k, x_{k+d/2}) pairs by explicit angles,
its attention loops over heads with a triangular causal mask and no cache.
"""
import dataclasses
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from luminal_num.hlir import Op, evaluate
from luminal_num.models.llama import (LLAMA_TINY, LlamaConfig, MASKED_BIAS, attention_bias, build_decode,
                                      build_prefill, load_weights, random_weights, weight_shapes)
from luminal_num.models.weights import save_safetensors

TOKENS = np.array([17, 3, 250, 42, 99])
MAX_CACHE = 16


def reference_logits(config: LlamaConfig, weights, ids) -> np.ndarray:
    """Causal Llama forward over the whole token sequence in FP64 (positions 0..n-1)."""
    c = config
    w = {name: np.asarray(a, dtype=np.float64) for name, a in weights.items()}
    n, heads, kv_heads = len(ids), c.num_attention_heads, c.num_key_value_heads
    dh = c.attention_head_dim or c.hidden_size // heads  # config.json's head_dim when it has its own
    angles = np.arange(n)[:, None] * c.rope_theta ** (-2.0 * np.arange(dh // 2) / dh)[None, :]
    cos, sin = np.cos(angles)[:, None, :], np.sin(angles)[:, None, :]

    def rope(t):  # (n, heads, dh)
        a, b = t[..., : dh // 2], t[..., dh // 2:]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)

    def rms_norm(t, gain):
        return t / np.sqrt(np.mean(t * t, axis=-1, keepdims=True) + c.rms_norm_eps) * gain

    x = w["model.embed_tokens.weight"][np.asarray(ids)]
    future = np.triu(np.ones((n, n), dtype=bool), k=1)
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        h = rms_norm(x, w[p + "input_layernorm.weight"])
        def project(name):  # Qwen2 checkpoints carry q/k/v biases
            return h @ w[p + name + ".weight"].T + w.get(p + name + ".bias", 0.0)
        q = rope(project("self_attn.q_proj").reshape(n, heads, dh))
        k = rope(project("self_attn.k_proj").reshape(n, kv_heads, dh))
        v = project("self_attn.v_proj").reshape(n, kv_heads, dh)
        attn = np.empty((n, heads, dh))
        for head in range(heads):
            shared = head // (heads // kv_heads)
            scores = q[:, head] @ k[:, shared].T / np.sqrt(dh)
            scores[future] = -np.inf
            probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
            attn[:, head] = (probs / probs.sum(axis=-1, keepdims=True)) @ v[:, shared]
        x = x + attn.reshape(n, heads * dh) @ w[p + "self_attn.o_proj.weight"].T
        h = rms_norm(x, w[p + "post_attention_layernorm.weight"])
        gate = h @ w[p + "mlp.gate_proj.weight"].T
        x = x + (gate / (1.0 + np.exp(-gate)) * (h @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
    x = rms_norm(x, w["model.norm.weight"])
    return x @ w.get("lm_head.weight", w["model.embed_tokens.weight"]).T


def rel_err(y, ref) -> float:
    return float(np.linalg.norm(np.asarray(y) - ref) / np.linalg.norm(ref))


def run_steps(config, weights, tokens, split: int, max_cache: int = MAX_CACHE) -> dict[str, np.ndarray]:
    """Prefill tokens[:split] (if any), then the rest as a second step reading the first step's caches."""
    previous = None
    if split:
        first = build_prefill(config, weights, split, max_cache)
        previous = evaluate(first.graph, first.make_inputs(tokens[:split], np.arange(split)))
    rest = len(tokens) - split
    second = build_decode(config, weights, max_cache) if rest == 1 else build_prefill(config, weights, rest, max_cache)
    return evaluate(second.graph, second.make_inputs(tokens[split:], np.arange(split, len(tokens)), previous))


@pytest.fixture(scope="module")
def tiny_weights():
    return random_weights(LLAMA_TINY, seed=0)


def test_tiny_preset_uses_gqa():
    assert LLAMA_TINY.num_key_value_heads < LLAMA_TINY.num_attention_heads


def test_prefill_matches_independent_numpy(tiny_weights):
    model = build_prefill(LLAMA_TINY, tiny_weights, len(TOKENS), MAX_CACHE)
    logits = evaluate(model.graph, model.make_inputs(TOKENS, np.arange(len(TOKENS))))["logits"]
    assert logits.shape == (len(TOKENS), LLAMA_TINY.vocab_size)
    assert rel_err(logits, reference_logits(LLAMA_TINY, tiny_weights, TOKENS)) <= 1e-10


def test_decode_with_cache_equals_prefill(tiny_weights):
    full_model = build_prefill(LLAMA_TINY, tiny_weights, len(TOKENS), MAX_CACHE)
    full = evaluate(full_model.graph, full_model.make_inputs(TOKENS, np.arange(len(TOKENS))))
    stepped = run_steps(LLAMA_TINY, tiny_weights, TOKENS, split=len(TOKENS) - 1)
    assert stepped["logits"].shape == (1, LLAMA_TINY.vocab_size)
    assert rel_err(stepped["logits"][0], full["logits"][-1]) <= 1e-10
    for name in (f"{kind}_cache_out.{i}" for kind in "kv" for i in range(LLAMA_TINY.num_hidden_layers)):
        assert rel_err(stepped[name], full[name]) <= 1e-10
        assert not stepped[name][len(TOKENS):].any()  # rows past the last position were never written


def test_a_head_dim_of_its_own_comes_from_config_json_and_computes_the_reference(tmp_path):
    """transformers' `head_dim` (q/k/v width per head, not hidden / heads: Gemma-3-4B's 256 for hidden 2560
    and 8 heads) round-trips through config.json and builds the graph the FP64 reference computes."""
    config = dataclasses.replace(LLAMA_TINY, attention_head_dim=32)  # hidden 64 / 4 heads would be 16
    assert LlamaConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    assert config.to_dict()["head_dim"] == 32 and "head_dim" not in LLAMA_TINY.to_dict()
    weights = random_weights(config, seed=11)
    assert weights["model.layers.0.self_attn.q_proj.weight"].shape == (4 * 32, 64)
    _save_checkpoint(tmp_path, config.to_dict(), weights)
    loaded, read = load_weights(tmp_path)
    assert loaded == config
    tokens = np.array([3, 41, 7, 200, 9])
    assert rel_err(run_steps(loaded, read, tokens, 2)["logits"], reference_logits(config, weights, tokens)[2:]) <= 1e-10


@settings(max_examples=12, deadline=None)
@given(kv_heads=st.sampled_from([1, 2, 4]), tied=st.booleans(), layers=st.integers(1, 2),
       length=st.integers(2, 6), data=st.data())
def test_chunked_prefill_matches_reference(kv_heads, tied, layers, length, data):
    """MQA / GQA / MHA, tied or not: splitting the sequence at any point gives the reference logits."""
    config = dataclasses.replace(LLAMA_TINY.with_layers(layers), num_key_value_heads=kv_heads,
                                 tie_word_embeddings=tied, rope_theta=500.0)
    weights = random_weights(config, seed=data.draw(st.integers(0, 2**16)))
    tokens = np.array(data.draw(st.lists(st.integers(0, config.vocab_size - 1), min_size=length, max_size=length)))
    split = data.draw(st.integers(0, length - 1))
    logits = run_steps(config, weights, tokens, split)["logits"]
    assert rel_err(logits, reference_logits(config, weights, tokens)[split:]) <= 1e-10


def test_gqa_shares_kv_heads_through_views(tiny_weights):
    """Fewer KV heads change only weight shapes and views: the same node count and op mix as MHA."""
    mha = dataclasses.replace(LLAMA_TINY, num_key_value_heads=LLAMA_TINY.num_attention_heads)
    graphs = [build_prefill(c, random_weights(c, 0), 4, MAX_CACHE).graph for c in (LLAMA_TINY, mha)]
    assert [[g.count(op) for op in Op] for g in graphs][0] == [[g.count(op) for op in Op] for g in graphs][1]


def test_layer_chunks_are_structurally_identical():
    config = LLAMA_TINY.with_layers(3)
    graph = build_prefill(config, random_weights(config, 1), 4, MAX_CACHE).graph
    chunks: dict[int, list[int]] = {}
    for node in graph.nodes:
        chunks.setdefault(node.chunk, []).append(node.id)
    assert sorted(chunks) == list(range(config.num_hidden_layers + 2))  # embedding, layers, head
    keys = [graph.structural_key(chunks[c]) for c in sorted(chunks)]
    assert len(set(keys[1:-1])) == 1
    assert keys[0] != keys[1] != keys[-1]
    per_layer = [sum(graph.nodes[n].op is Op.SCATTER for n in chunks[c]) for c in range(1, config.num_hidden_layers + 1)]
    assert per_layer == [2] * config.num_hidden_layers


def test_linear_weights_are_read_through_a_transposed_view(tiny_weights):
    graph = build_prefill(LLAMA_TINY, tiny_weights, 2, MAX_CACHE).graph
    name = "model.layers.0.mlp.down_proj.weight"
    node = graph.inputs[name].node
    assert graph.nodes[node].shape == tiny_weights[name].shape  # stored (out, in)
    readers = [s for n in graph.nodes for s in n.srcs if s.node == node]
    assert readers and all(not s.view.is_contiguous for s in readers)


def test_load_weights_from_safetensors_directory(tmp_path, tiny_weights):
    half = len(tiny_weights) // 2  # two shards, as large checkpoints are stored
    names = sorted(tiny_weights)
    save_safetensors(tmp_path / "model-00001-of-00002.safetensors", {n: tiny_weights[n] for n in names[:half]})
    save_safetensors(tmp_path / "model-00002-of-00002.safetensors", {n: tiny_weights[n] for n in names[half:]})
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_TINY.to_dict()))
    config, loaded = load_weights(tmp_path)
    assert config == LLAMA_TINY
    results = []
    for weights in (tiny_weights, loaded):
        model = build_prefill(config, weights, 3, MAX_CACHE)
        results.append(evaluate(model.graph, model.make_inputs(TOKENS[:3], np.arange(3)))["logits"])
    np.testing.assert_array_equal(results[0], results[1])


def test_load_weights_rejects_a_wrong_shape(tmp_path, tiny_weights):
    broken = dict(tiny_weights, **{"model.norm.weight": np.ones(3, np.float32)})
    save_safetensors(tmp_path / "model.safetensors", broken)
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_TINY.to_dict()))
    with pytest.raises(ValueError, match="model.norm.weight"):
        load_weights(tmp_path)


def test_config_from_hf_dict():
    hf = {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22, "num_attention_heads": 32,
          "num_key_value_heads": 4, "vocab_size": 32000, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
          "max_position_embeddings": 2048, "tie_word_embeddings": False, "hidden_act": "silu",
          "rope_scaling": None, "torch_dtype": "bfloat16", "model_type": "llama"}
    config = LlamaConfig.from_dict(hf)
    assert (config.head_dim, config.kv_dim, config.queries_per_kv_head) == (64, 256, 8)
    assert LlamaConfig.from_dict(config.to_dict()) == config
    no_kv = {k: v for k, v in hf.items() if k != "num_key_value_heads"}
    assert LlamaConfig.from_dict(no_kv).num_key_value_heads == 32
    with pytest.raises(ValueError, match="rope_scaling"):
        LlamaConfig.from_dict(dict(hf, rope_scaling={"type": "linear", "factor": 2.0}))
    assert LLAMA_TINY.with_layers(32).num_hidden_layers == 32


def test_random_weights_are_seeded_and_shaped():
    a, b, other = (random_weights(LLAMA_TINY, s) for s in (3, 3, 4))
    assert {n: w.shape for n, w in a.items()} == weight_shapes(LLAMA_TINY)
    assert all(np.array_equal(a[n], b[n]) for n in a) and not np.array_equal(a["lm_head.weight"], other["lm_head.weight"])
    assert abs(float(a["model.norm.weight"].mean()) - 1.0) < 0.1
    tied = random_weights(dataclasses.replace(LLAMA_TINY, tie_word_embeddings=True), 0)
    assert "lm_head.weight" not in tied


def test_attention_bias_hand_derived():
    # rows 0-1 already cached, this step writes rows 2-3; row 5 holds stale data and must stay hidden
    bias = attention_bias(np.array([2, 3]), max_cache=6, cached_rows=2)
    visible = np.array([[1, 1, 1, 0, 0, 0],
                        [1, 1, 1, 1, 0, 0]], dtype=bool)
    np.testing.assert_array_equal(bias, np.where(visible, 0.0, MASKED_BIAS))
    # a gap: writing row 4 with only rows 0-1 cached leaves rows 2-3 hidden
    np.testing.assert_array_equal(attention_bias(np.array([4]), 6, 2) == 0.0, [[1, 1, 0, 0, 1, 0]])


def test_f32_evaluation_is_close_to_f64(tiny_weights):
    pytest.importorskip("luminal_num.dtypes.rounding")  # the evaluator's FP32 mode rounds through it
    model = build_prefill(LLAMA_TINY, tiny_weights, len(TOKENS), MAX_CACHE)
    inputs = model.make_inputs(TOKENS, np.arange(len(TOKENS)))
    ref, f32 = (evaluate(model.graph, inputs, precision=p)["logits"] for p in ("f64", "f32"))
    assert 0.0 < rel_err(f32, ref) <= 1e-4  # FP32 rounds (u = 2^-24) but a few layers stay far from 1e-4


def _save_checkpoint(directory, config_dict, weights):
    save_safetensors(directory / "model.safetensors", weights)
    (directory / "config.json").write_text(json.dumps(config_dict))


def test_qwen2_checkpoint_compiles_exactly_with_its_biases(tmp_path):
    """A Qwen2 folder (q/k/v biases) loads with its biases and matches the reference that adds them."""
    qwen = dataclasses.replace(LLAMA_TINY, qkv_bias=True)
    weights = random_weights(qwen, seed=5)
    assert "model.layers.1.self_attn.k_proj.bias" in weights
    _save_checkpoint(tmp_path, qwen.to_dict(), weights)
    config, loaded = load_weights(tmp_path)
    assert config.qkv_bias and json.loads((tmp_path / "config.json").read_text())["model_type"] == "qwen2"
    model = build_prefill(config, loaded, len(TOKENS), MAX_CACHE)
    logits = evaluate(model.graph, model.make_inputs(TOKENS, np.arange(len(TOKENS))))["logits"]
    ref = reference_logits(config, loaded, TOKENS)
    assert rel_err(logits, ref) <= 1e-10
    no_bias = {k: v for k, v in loaded.items() if not k.endswith(".bias")}
    assert rel_err(ref, reference_logits(LLAMA_TINY, no_bias, TOKENS)) > 1e-3  # the biases matter


def test_biases_under_a_llama_config_are_refused_not_dropped(tmp_path):
    weights = random_weights(dataclasses.replace(LLAMA_TINY, qkv_bias=True), seed=5)
    _save_checkpoint(tmp_path, LLAMA_TINY.to_dict(), weights)  # says llama: no biases in the graph
    with pytest.raises(ValueError, match=r"_proj.bias. is not read by the Llama graph"):
        load_weights(tmp_path)


@pytest.mark.parametrize("change, match", [
    ({"model_type": "mistral"}, "model_type='mistral'"),
    ({"architectures": ["GemmaForCausalLM"]}, "architectures"),
    ({"attention_bias": True}, "attention_bias"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"head_dim": 31}, "head_dim"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"model_type": "qwen2", "use_sliding_window": True}, "use_sliding_window"),
])
def test_unimplemented_settings_are_refused_one_line_each(change, match):
    with pytest.raises(ValueError, match=match) as info:
        LlamaConfig.from_dict({**LLAMA_TINY.to_dict(), **change})
    assert "\n" not in str(info.value)
