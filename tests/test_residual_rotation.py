"""Residual-stream rotation (models/residual_rotation.py): Q is orthogonal and mixes every channel; the
rotated model computes the source model's function in FP64 (to 1e-12, graph evaluator and the fast FP64
runner); the FP32 rotated model's only change is its weights' rounding; its FP64 judge is the source's."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import scipy.linalg
from tests.test_llama import reference_logits

from luminal_num.hlir import evaluate
from luminal_num.models.llama import (EMBED, FINAL_NORM, LLAMA_TINY, LM_HEAD, build_decode,
                                      build_prefill, random_weights)
from luminal_num.models.llm import LlmModel
from luminal_num.models.residual_rotation import residual_rotation, rotate_residual, rotated_weights

TOKENS = np.array([17, 3, 250, 42, 99, 5])
MAX_CACHE = 16
# hidden 64 (Q a full Hadamard), 48 = 3 x 16 (DCT-3 kron H_16), tied and untied heads, Qwen's biases and q/k norms
CONFIGS = {"tiny": LLAMA_TINY,
           "tied-48": dataclasses.replace(LLAMA_TINY, hidden_size=48, tie_word_embeddings=True),
           "qwen-like": dataclasses.replace(LLAMA_TINY, qkv_bias=True, qk_norm=True, tie_word_embeddings=True)}


def rel(y, ref) -> float:
    return float(np.linalg.norm(np.asarray(y) - ref) / np.linalg.norm(ref))


@pytest.mark.parametrize("hidden", [64, 48, 576, 2048])
def test_q_is_orthogonal_and_mixes_every_channel(hidden):
    q = residual_rotation(hidden, seed=3)
    assert np.abs(q @ q.T - np.eye(hidden)).max() < 1e-13
    b = hidden & -hidden
    m = hidden // b
    bound = np.sqrt(2.0 / m) / np.sqrt(b) if m > 1 else 1 / np.sqrt(b)  # DCT entry bound times H_b's
    assert np.abs(q).max() <= bound * (1 + 1e-12)
    assert (np.abs(q) > 0).mean() > 0.9  # dense: no channel stays alone
    h = scipy.linalg.hadamard(b) / np.sqrt(b)  # Q = diag(s) (C_m kron H_b): each b x b block a signed, scaled H_b
    block = q[:b, :b] / q[:b, :b][:, :1] * h[:, :1]  # row signs and the DCT entry divided out
    assert np.allclose(block, h, rtol=0, atol=1e-14)
    assert np.array_equal(q, residual_rotation(hidden, seed=3))  # seeded: the same bytes twice
    assert not np.array_equal(q, residual_rotation(hidden, seed=4))


def test_an_outlier_channel_is_spread():
    x = np.ones(576)
    x[7] = 100.0  # one outlier channel, as LLM residuals have
    y = x @ residual_rotation(576)
    assert np.abs(x).max() / np.sqrt(np.mean(x * x)) > 20
    assert np.abs(y).max() / np.sqrt(np.mean(y * y)) < 3  # after Q: no channel far above the RMS


@pytest.mark.parametrize("name", list(CONFIGS))
def test_rotated_model_computes_the_same_function_in_fp64(name):
    config = CONFIGS[name]
    weights = random_weights(config, seed=1)
    if config.qkv_bias:
        rng = np.random.default_rng(2)
        weights = {k: (v + 0.1 * rng.standard_normal(v.shape)).astype(np.float32) if k.endswith("bias") else v
                   for k, v in weights.items()}
    rotated, values = rotate_residual(config, weights, residual_rotation(config.hidden_size, seed=0))
    assert not rotated.tie_word_embeddings and LM_HEAD in values
    assert np.array_equal(values[FINAL_NORM], np.ones(config.hidden_size))
    # a prefill step then a decode step reading its cache, both through the FP64 graph evaluator
    src, rot = (build_prefill(c, w, 5, MAX_CACHE) for c, w in ((config, weights), (rotated, values)))
    ref = evaluate(src.graph, src.make_inputs(TOKENS[:5], np.arange(5)))
    got = evaluate(rot.graph, rot.make_inputs(TOKENS[:5], np.arange(5)))
    assert set(ref) == set(got)
    for out in ref:  # logits and every KV cache: the cache rows are not rotated
        assert rel(got[out], ref[out]) < 1e-12, out
    src1, rot1 = (build_decode(c, w, MAX_CACHE) for c, w in ((config, weights), (rotated, values)))
    ref1 = evaluate(src1.graph, src1.make_inputs(TOKENS[5:], np.arange(5, 6), ref))
    got1 = evaluate(rot1.graph, rot1.make_inputs(TOKENS[5:], np.arange(5, 6), ref))  # the source's cache rows
    assert rel(got1["logits"], ref1["logits"]) < 1e-12
    # an FP64 Llama written independently of the graph (tests/test_llama.py) agrees
    assert rel(reference_logits(rotated, values, TOKENS), reference_logits(config, weights, TOKENS)) < 1e-12


def test_the_fold_and_rotation_are_what_the_docstring_says():
    """Independently: q_proj' = W diag(g) Q, o_proj' = Q^T W, E' = E Q, head' = E diag(g_final) Q."""
    config = CONFIGS["tied-48"]
    w = random_weights(config, seed=5)
    q = residual_rotation(config.hidden_size, seed=9)
    _, v = rotate_residual(config, w, q)
    f = {k: np.asarray(a, np.float64) for k, a in w.items()}
    p = "model.layers.1."
    assert np.allclose(v[p + "self_attn.q_proj.weight"], f[p + "self_attn.q_proj.weight"] @ np.diag(f[p + "input_layernorm.weight"]) @ q, rtol=0, atol=1e-14)
    assert np.allclose(v[p + "mlp.up_proj.weight"], f[p + "mlp.up_proj.weight"] @ np.diag(f[p + "post_attention_layernorm.weight"]) @ q, rtol=0, atol=1e-14)
    assert np.allclose(v[p + "mlp.down_proj.weight"], q.T @ f[p + "mlp.down_proj.weight"], rtol=0, atol=1e-14)
    assert np.allclose(v[EMBED], f[EMBED] @ q, rtol=0, atol=1e-13)
    assert np.allclose(v[LM_HEAD], f[EMBED] @ np.diag(f[FINAL_NORM]) @ q, rtol=0, atol=1e-13)


def test_fp32_rotated_model_differs_by_its_weights_rounding_and_keeps_the_source_judge():
    config = CONFIGS["tied-48"]
    weights = random_weights(config, seed=1)
    model = LlmModel("tiny", config, weights, tokenizer=None, chat_template=None)
    rotated = model.residual_rotated()
    assert rotated.reference is model and rotated.fp64 is model.fp64  # inputs and FP64 judge: the source model's
    assert all(v.dtype == np.float32 for v in rotated.weights.values())
    _, exact = rotate_residual(config, weights, residual_rotation(config.hidden_size, seed=0))
    for k, v in rotated.weights.items():  # each rotated weight rounded once from FP64
        assert np.array_equal(v, exact[k].astype(np.float32)), k
    src, rot = build_prefill(config, weights, 5, MAX_CACHE), build_prefill(rotated.config, rotated.weights, 5, MAX_CACHE)
    ref = evaluate(src.graph, src.make_inputs(TOKENS[:5], np.arange(5)))["logits"]
    got = evaluate(rot.graph, rot.make_inputs(TOKENS[:5], np.arange(5)))["logits"]
    err = rel(got, ref)
    assert 0 < err < 1e-6  # FP32 rounding of the weights (u = 6e-8), amplified by a few layers: not exact, small


def test_a_model_that_is_not_llama_is_refused_in_one_line():
    with pytest.raises(TypeError, match="residual rotation is built for the Llama graph"):
        rotated_weights(object(), {}, 0)
    with pytest.raises(ValueError, match="does not match hidden size"):
        rotate_residual(LLAMA_TINY, random_weights(LLAMA_TINY), np.eye(8))
