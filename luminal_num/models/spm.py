"""SentencePiece (llama.cpp's `llama` tokenizer model, SPM) rebuilt from a GGUF file's metadata.

Why written out, not loaded: a GGUF file carries the pieces, their scores and token types, not a
tokenizer.model. llama.cpp's llm_tokenizer_spm is sentencepiece's BPE by scores: the text's UTF-8
characters are symbols, and the adjacent pair whose concatenation is the highest-scoring piece merges
first (ties: the leftmost); a character no piece covers falls back to its bytes as `<0xNN>` tokens.
Control and user-defined tokens (`<start_of_turn>`, Gemma's `\\n` runs) are matched verbatim first,
longest first, as llama.cpp's special-token partition and Hugging Face's added tokens do; a space
becomes '▁' (and one is prefixed after a special token and at the start when
`tokenizer.ggml.add_space_prefix`, llama.cpp's default for SPM, is set). decode(encode(s)) == s.
"""
from __future__ import annotations

import heapq
import re
from collections.abc import Mapping, Sequence

import gguf
import numpy as np

from .tokenizer import _SPECIAL_TOKEN_TYPES, Tokenizer, TokenizerError

SPACE = "\u2581"  # '▁', sentencepiece's whitespace mark
NORMAL, BYTE = 1, 6  # llama.cpp token types a piece of plain text may become
_BYTE_PIECE = re.compile(r"<0x([0-9A-F]{2})>")


class SentencePieceTokenizer:
    """encode(text) -> ids and decode(ids) -> text, exactly as llama.cpp's SPM tokenizer."""

    def __init__(self, tokens: Sequence[str], scores: Sequence[float], types: Sequence[int], bos_id: int | None,
                 eos_id: int | None, add_bos: bool, add_space_prefix: bool):
        if not len(tokens) == len(scores) == len(types):
            raise TokenizerError(f"the GGUF vocabulary has {len(tokens)} tokens, {len(scores)} scores and "
                                 f"{len(types)} token types")
        self._tokens, self.vocab_size = list(tokens), len(tokens)
        self._scores = [float(s) for s in scores]
        self._pieces = {t: i for i, t in enumerate(tokens) if types[i] == NORMAL}
        self._bytes: dict[int, int] = {}
        for i, t in enumerate(tokens):
            m = _BYTE_PIECE.fullmatch(t)
            if types[i] == BYTE and m:
                self._bytes[int(m.group(1), 16)] = i
        if types and BYTE in types and len(self._bytes) != 256:
            raise TokenizerError(f"the GGUF vocabulary has {len(self._bytes)} byte tokens <0xNN>, not 256")
        self._byte_of = {i: b for b, i in self._bytes.items()}
        special = {t: i for i, t in enumerate(tokens) if types[i] in _SPECIAL_TOKEN_TYPES and t}
        self._special = special
        self._split = re.compile("|".join(re.escape(t) for t in sorted(special, key=len, reverse=True))) if special else None
        self.bos_id, self.eos_id, self.add_bos, self.add_space_prefix = bos_id, eos_id, add_bos, add_space_prefix

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, object]) -> "SentencePieceTokenizer":
        for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type"):
            if key not in meta:
                raise TokenizerError(f"the GGUF file has no {key} (SentencePiece needs pieces, scores and types)")
        return cls(meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.scores"], meta["tokenizer.ggml.token_type"],
                   meta.get("tokenizer.ggml.bos_token_id"), meta.get("tokenizer.ggml.eos_token_id"),
                   bool(meta.get("tokenizer.ggml.add_bos_token", True)),
                   bool(meta.get("tokenizer.ggml.add_space_prefix", True)))

    def _fragments(self, text: str):
        """(special token id or None, text) in order: specials matched verbatim, leftmost-longest."""
        start = 0
        for m in self._split.finditer(text) if self._split is not None else ():
            if m.start() > start:
                yield None, text[start:m.start()]
            yield self._special[m.group()], m.group()
            start = m.end()
        if start < len(text):
            yield None, text[start:]

    def _pieces_of(self, text: str) -> list[int]:
        """llm_tokenizer_spm on one run of plain text (spaces already '▁')."""
        symbols = list(text)
        prev, nxt = list(range(-1, len(symbols) - 1)), list(range(1, len(symbols) + 1))
        queue: list[tuple[float, int, int]] = []

        def push(left: int) -> None:
            right = nxt[left] if left >= 0 else -1
            if left < 0 or right >= len(symbols):
                return
            piece = self._pieces.get(symbols[left] + symbols[right])
            if piece is not None:  # higher score first, then the leftmost pair
                heapq.heappush(queue, (-self._scores[piece], left, len(symbols[left]) + len(symbols[right])))
        for i in range(len(symbols) - 1):
            push(i)
        while queue:
            _, left, size = heapq.heappop(queue)
            right = nxt[left]
            if not symbols[left] or right >= len(symbols) or len(symbols[left]) + len(symbols[right]) != size:
                continue  # one side changed since this pair was queued
            symbols[left], symbols[right] = symbols[left] + symbols[right], ""
            nxt[left] = nxt[right]
            if nxt[left] < len(symbols):
                prev[nxt[left]] = left
            push(prev[left])
            push(left)
        out = []
        for symbol in symbols:
            if not symbol:
                continue
            piece = self._pieces.get(symbol)
            if piece is not None:
                out.append(piece)
                continue
            for byte in symbol.encode("utf-8"):  # only single characters get here: merges make pieces
                if byte not in self._bytes:
                    raise TokenizerError(f"character {symbol!r} has no piece and the vocabulary no byte token "
                                         f"<0x{byte:02X}>")
                out.append(self._bytes[byte])
        return out

    def encode(self, text: str) -> list[int]:
        ids = [self.bos_id] if self.add_bos and self.bos_id is not None else []
        after_special = True
        for special, fragment in self._fragments(text):
            if special is not None:
                ids.append(special)
                after_special = True
                continue
            plain = (" " if self.add_space_prefix and after_special else "") + fragment
            ids.extend(self._pieces_of(plain.replace(" ", SPACE)))
            after_special = False
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        out = bytearray()
        for i in ids:
            i = int(i)
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"token id {i} is outside the vocabulary [0, {self.vocab_size})")
            out += bytes([self._byte_of[i]]) if i in self._byte_of else self._tokens[i].replace(SPACE, " ").encode()
        text = out.decode("utf-8", errors="replace")
        return text[1:] if self.add_space_prefix and text.startswith(" ") else text

    def token(self, token_id: int) -> str:
        """The vocabulary string of one id ('▁' is a space)."""
        return self._tokens[int(token_id)]


def tokenizer_fields(reader) -> dict[str, object]:
    """The `tokenizer.*` metadata of a gguf.GGUFReader, its arrays read from the mapped parts (the
    reader's contents() takes half a minute on Gemma's 262144 pieces)."""
    out: dict[str, object] = {}
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        if field.types[:1] == [gguf.GGUFValueType.ARRAY] and len(field.types) == 2:
            items = [field.parts[i] for i in field.data]
            out[key] = ([bytes(p).decode("utf-8") for p in items] if field.types[1] == gguf.GGUFValueType.STRING
                        else np.concatenate(items).tolist() if items else [])
        else:
            out[key] = field.contents()
    return out


# tokenizer.ggml.model -> the tokenizer that reproduces it
_GGUF_TOKENIZERS = {"gpt2": Tokenizer.from_gguf_metadata, "llama": SentencePieceTokenizer.from_gguf_metadata}


def gguf_tokenizer(meta: Mapping[str, object]) -> Tokenizer | SentencePieceTokenizer:
    """The tokenizer a GGUF file's `tokenizer.ggml.model` names; another model is refused by name."""
    model = meta.get("tokenizer.ggml.model")
    if model not in _GGUF_TOKENIZERS:
        raise TokenizerError(f"tokenizer.ggml.model={model!r} is not supported (supported: {', '.join(_GGUF_TOKENIZERS)})")
    return _GGUF_TOKENIZERS[model](meta)
