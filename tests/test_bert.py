"""The GraphTensor BERT encoder against the independent numpy FP64 reference (tests/minilm_reference.py).

Truths: minilm_embed_fp64 on the real all-MiniLM-L6-v2 weights and on tiny random BERTs (property
test over shapes, padding and depth), hand-derived input encodings, the HF tensor-name layout of the
safetensors file, and structural identity of the layer chunks.

The reference evaluator runs matmuls through BLAS, so the full 6-layer model on 4 real sentences is
part of the default run (a few seconds per precision).
"""
from __future__ import annotations

import collections
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from minilm_reference import minilm_embed_fp64

from luminal_num.hlir import Op, evaluate
from luminal_num.models.assets import Encoded, load_sentences
from luminal_num.models.bert import (
    EMBEDDING_OUTPUT,
    IDS_INPUT,
    MASK_BIAS_INPUT,
    MASKED_KEY_BIAS,
    POOL_WEIGHTS_INPUT,
    BertConfig,
    build_bert,
    load_minilm,
)

# Tensors of the MiniLM file that the sentence encoder does not read (HF buffers and the unused pooler).
UNUSED_FILE_TENSORS = {"embeddings.position_ids", "pooler.dense.weight", "pooler.dense.bias"}
LAYER_LINEARS = ("attention.self.query", "attention.self.key", "attention.self.value",
                 "attention.output.dense", "intermediate.dense", "output.dense")
LAYER_NORMS = ("attention.output.LayerNorm", "output.LayerNorm")


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def chunk_nodes(graph) -> dict[int, list[int]]:
    out: dict[int, list[int]] = collections.defaultdict(list)
    for node in graph.nodes:
        out[node.chunk].append(node.id)
    return dict(out)


# ---- tiny random BERTs: fast, full depth --------------------------------------------------------------
def tiny_config(layers: int, hidden: int = 16, heads: int = 2) -> dict:
    return {"vocab_size": 40, "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
            "intermediate_size": 3 * hidden, "max_position_embeddings": 12, "type_vocab_size": 2,
            "layer_norm_eps": 1e-12, "hidden_act": "gelu", "position_embedding_type": "absolute"}


def random_weights(config: dict, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """float32 tensors with the HF names and (out, in) Linear layout of a BERT checkpoint."""
    h, i = config["hidden_size"], config["intermediate_size"]

    def normal(*shape, scale=1.0):
        return (scale * rng.standard_normal(shape)).astype(np.float32)

    weights = {"embeddings.word_embeddings.weight": normal(config["vocab_size"], h),
               "embeddings.position_embeddings.weight": normal(config["max_position_embeddings"], h),
               "embeddings.token_type_embeddings.weight": normal(config["type_vocab_size"], h),
               "embeddings.LayerNorm.weight": 1 + normal(h, scale=0.1), "embeddings.LayerNorm.bias": normal(h, scale=0.1)}
    shapes = dict(zip(LAYER_LINEARS, [(h, h)] * 4 + [(i, h), (h, i)]))
    for layer in range(config["num_hidden_layers"]):
        p = f"encoder.layer.{layer}"
        for name, (out, inp) in shapes.items():
            weights[f"{p}.{name}.weight"] = normal(out, inp, scale=1 / math.sqrt(inp))
            weights[f"{p}.{name}.bias"] = normal(out, scale=0.1)
        for name in LAYER_NORMS:
            weights[f"{p}.{name}.weight"] = 1 + normal(h, scale=0.1)
            weights[f"{p}.{name}.bias"] = normal(h, scale=0.1)
    return weights


def encoded_batch(ids_rows: list[list[int]]) -> Encoded:
    lengths = np.array([len(r) for r in ids_rows], dtype=np.int64)
    ids = np.zeros((len(ids_rows), int(lengths.max())), dtype=np.int64)
    for row, r in enumerate(ids_rows):
        ids[row, :len(r)] = r
    return Encoded(ids, (np.arange(ids.shape[1])[None, :] < lengths[:, None]).astype(np.int64), lengths)


@settings(deadline=None, max_examples=30)
@given(seed=st.integers(0, 2**32 - 1), layers=st.integers(1, 3), heads=st.sampled_from([1, 2, 4]),
       lengths=st.lists(st.integers(1, 6), min_size=1, max_size=3), extra_padding=st.integers(0, 3))
def test_random_bert_fp64_equals_reference(seed, layers, heads, lengths, extra_padding):
    """Any depth/heads/batch; padding beyond the longest row (make_inputs) changes nothing."""
    rng = np.random.default_rng(seed)
    config = tiny_config(layers, heads=heads)
    weights = random_weights(config, rng)
    encoded = encoded_batch([list(rng.integers(1, config["vocab_size"], n)) for n in lengths])
    model = build_bert(BertConfig.from_dict(config), weights, len(lengths), max(lengths) + extra_padding)
    got = evaluate(model.graph, model.make_inputs(encoded))[EMBEDDING_OUTPUT]
    want = minilm_embed_fp64(weights, config, encoded.ids, encoded.attention_mask)
    assert np.max(np.abs(got - want)) <= 1e-12


def test_make_inputs_hand_derived():
    model = build_bert(BertConfig.from_dict(tiny_config(1)), random_weights(tiny_config(1), np.random.default_rng(0)),
                       batch=2, seq=4)
    inputs = model.make_inputs(encoded_batch([[5, 6, 7], [8, 9]]))
    np.testing.assert_array_equal(inputs[IDS_INPUT], [[5, 6, 7, 0], [8, 9, 0, 0]])
    b = MASKED_KEY_BIAS
    np.testing.assert_array_equal(inputs[MASK_BIAS_INPUT], np.array([[0, 0, 0, b], [0, 0, b, b]]).reshape(2, 1, 1, 4))
    np.testing.assert_array_equal(inputs[POOL_WEIGHTS_INPUT], [[1 / 3, 1 / 3, 1 / 3, 0], [0.5, 0.5, 0, 0]])
    with pytest.raises(ValueError, match="does not fit"):
        model.make_inputs(encoded_batch([[5, 6, 7, 8, 9]] * 2))
    with pytest.raises(ValueError, match="does not fit"):
        model.make_inputs(encoded_batch([[5]]))


def test_config_rejects_what_the_graph_does_not_build():
    with pytest.raises(NotImplementedError, match="hidden_act"):
        BertConfig.from_dict({**tiny_config(1), "hidden_act": "relu"})
    with pytest.raises(NotImplementedError, match="position"):
        BertConfig.from_dict({**tiny_config(1), "position_embedding_type": "relative_key"})
    with pytest.raises(ValueError, match="multiple"):
        BertConfig.from_dict({**tiny_config(1), "num_attention_heads": 3})
    with pytest.raises(KeyError, match="layer_norm_eps"):
        BertConfig.from_dict({k: v for k, v in tiny_config(1).items() if k != "layer_norm_eps"})
    config = BertConfig.from_dict(tiny_config(1))
    with pytest.raises(ValueError, match="seq"):
        build_bert(config, random_weights(tiny_config(1), np.random.default_rng(0)), 1, 13)
    with pytest.raises(KeyError, match="encoder.layer.1"):
        build_bert(BertConfig.from_dict(tiny_config(2)),
                   random_weights(tiny_config(1), np.random.default_rng(0)), 1, 4)


# ---- the real all-MiniLM-L6-v2 -------------------------------------------------------------------------
def test_config_from_minilm(config_dict):
    assert BertConfig.from_dict(config_dict) == BertConfig(
        vocab_size=30522, hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536,
        max_position_embeddings=512, type_vocab_size=2, layer_norm_eps=1e-12, hidden_act="gelu")


def test_minilm_chunks_are_one_per_layer_and_identical():
    model = load_minilm(batch=4, seq=11)
    graph, layers = model.graph, model.config.num_hidden_layers
    chunks = chunk_nodes(graph)
    assert sorted(chunks) == list(range(layers + 2))  # embeddings, one per layer, pooling head
    keys = {c: graph.structural_key(ids) for c, ids in chunks.items()}
    layer_keys = {keys[c] for c in range(1, layers + 1)}
    assert len(layer_keys) == 1
    assert keys[0] not in layer_keys and keys[layers + 1] not in layer_keys
    for layer in range(layers):  # each layer chunk reads exactly its own 16 weights
        names = {graph.nodes[i].attr("name") for i in chunks[layer + 1] if graph.nodes[i].op is Op.INPUT}
        want = {f"encoder.layer.{layer}.{m}.{p}" for m in LAYER_LINEARS + LAYER_NORMS for p in ("weight", "bias")}
        assert names == want


def test_minilm_reads_every_weight_in_its_stored_layout(config_dict, weights):
    graph = build_bert(BertConfig.from_dict(config_dict), weights, 1, 8).graph
    assert set(graph.weights) == set(weights) - UNUSED_FILE_TENSORS
    for name, array in graph.weights.items():
        assert np.shares_memory(array, weights[name])  # not copied, not transposed
        assert graph.inputs[name].shape == weights[name].shape


MINILM_CASES = [pytest.param((4, 6), id="4sentences-6layers")]


@pytest.fixture(scope="module", params=MINILM_CASES)
def minilm_fp64(request, config_dict, weights, tokenizer):
    """(model, inputs, FP64 graph embedding, reference embedding) on the first calibration sentences."""
    sentences, layers = request.param
    config = {**config_dict, "num_hidden_layers": layers}
    encoded = tokenizer.encode_batch(load_sentences("calibration")[:sentences])
    assert len(set(encoded.lengths)) > 1  # rows of different lengths: padding is exercised
    model = build_bert(BertConfig.from_dict(config), weights, sentences, encoded.ids.shape[1])
    inputs = model.make_inputs(encoded)
    got = evaluate(model.graph, inputs)[EMBEDDING_OUTPUT]
    want = minilm_embed_fp64(weights, config, encoded.ids, encoded.attention_mask)
    return model, inputs, got, want


def test_minilm_fp64_equals_reference(minilm_fp64):
    _, _, got, want = minilm_fp64
    assert np.all(cosines(got, want) >= 0.99999)
    assert np.max(np.abs(got - want)) <= 1e-9


def test_minilm_fp32_close_to_fp64(minilm_fp64):
    model, inputs, fp64, _ = minilm_fp64
    fp32 = evaluate(model.graph, inputs, precision="f32")[EMBEDDING_OUTPUT]
    assert np.all(cosines(fp32, fp64) >= 0.9999)
    assert np.max(np.abs(fp32 - fp64)) > 0  # FP32 rounding did take place
