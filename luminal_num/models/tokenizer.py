"""Byte-level BPE tokenizer and chat template rebuilt from a GGUF file's metadata.

Why rebuilt, not loaded: a GGUF file carries the vocabulary, the merges and the template string, not a
tokenizer.json. `tokenizers.models.BPE(vocab, merges)` with a byte-level pre-tokenizer and decoder is
the same algorithm as llama.cpp's `gpt2` tokenizer model; the pre-tokenizer's splitting regex depends
on `tokenizer.ggml.pre`, and a pre-tokenizer we have not written is refused, not approximated.
Control tokens (`<|im_start|>`, ...) are added as special tokens so they encode as one id and decode
back verbatim: decode(encode(s)) == s for every string.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import jinja2
import jinja2.sandbox
import tokenizers
from tokenizers import decoders, models, pre_tokenizers

# tokenizer.ggml.pre -> the pre-tokenizer the model was trained with.
_PRE_TOKENIZERS = {
    # SmolLM (StarCoder style): every digit is its own piece, then GPT-2's byte-level regex.
    "smollm": lambda: pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                               pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]),
    "gpt-2": lambda: pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    "default": lambda: pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
}
_SPECIAL_TOKEN_TYPES = (3, 4)  # llama.cpp token types CONTROL and USER_DEFINED: matched verbatim


class TokenizerError(ValueError):
    """Tokenizer metadata this module cannot reproduce exactly."""


class Tokenizer:
    """encode(text) -> ids and decode(ids) -> text, exactly as the GGUF file's byte-level BPE."""

    def __init__(self, tokens: Sequence[str], merges: Sequence[str], pre: str, special: Sequence[str],
                 bos_id: int | None, eos_id: int | None, add_bos: bool):
        if pre not in _PRE_TOKENIZERS:
            raise TokenizerError(f"tokenizer.ggml.pre={pre!r} is not supported (supported: {', '.join(_PRE_TOKENIZERS)})")
        vocab = {token: i for i, token in enumerate(tokens)}
        if len(vocab) != len(tokens):
            raise TokenizerError("the GGUF vocabulary has duplicate tokens")
        pairs = [tuple(m.split(" ", 1)) for m in merges]
        tok = tokenizers.Tokenizer(models.BPE(vocab, pairs, ignore_merges=False))
        tok.pre_tokenizer = _PRE_TOKENIZERS[pre]()
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens([tokenizers.AddedToken(s, special=True, normalized=False) for s in special])
        self._tok, self.vocab_size = tok, len(tokens)
        self.bos_id, self.eos_id, self.add_bos = bos_id, eos_id, add_bos

    @staticmethod
    def special_strings(meta: Mapping[str, object]) -> list[str]:
        tokens, types = meta["tokenizer.ggml.tokens"], meta.get("tokenizer.ggml.token_type") or ()
        return [t for t, kind in zip(tokens, types) if kind in _SPECIAL_TOKEN_TYPES]

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, object]) -> "Tokenizer":
        model = meta.get("tokenizer.ggml.model")
        if model != "gpt2":
            raise TokenizerError(f"tokenizer.ggml.model={model!r} is not supported (only byte-level BPE 'gpt2')")
        if "tokenizer.ggml.merges" not in meta:
            raise TokenizerError("the GGUF file has no tokenizer.ggml.merges")
        return cls(meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.merges"], meta.get("tokenizer.ggml.pre", "default"),
                   cls.special_strings(meta), meta.get("tokenizer.ggml.bos_token_id"),
                   meta.get("tokenizer.ggml.eos_token_id"), bool(meta.get("tokenizer.ggml.add_bos_token", False)))

    @classmethod
    def from_file(cls, tokenizer_json: str | Path) -> "Tokenizer":
        """A Hugging Face tokenizer.json (its own pre-tokenizer and decoder), no special tokens added."""
        self = cls.__new__(cls)
        self._tok = tokenizers.Tokenizer.from_file(str(tokenizer_json))
        self._tok.no_padding()
        self._tok.no_truncation()
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.bos_id, self.eos_id, self.add_bos = None, None, False
        return self

    def encode(self, text: str) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return [self.bos_id, *ids] if self.add_bos and self.bos_id is not None else ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def save(self, path: str | Path) -> None:
        """Write it as a Hugging Face tokenizer.json (the same pre-tokenizer, vocabulary, merges, specials)."""
        self._tok.save(str(path))

    def token(self, token_id: int) -> str:
        """The vocabulary string of one id (byte-level alphabet: 'Ġ' is a space)."""
        return self._tok.id_to_token(int(token_id))


@dataclass(frozen=True)
class ChatTemplate:
    """The model's Jinja chat template, rendered in a sandbox the way Hugging Face renders it."""

    source: str

    def render(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True) -> str:
        for m in messages:
            if set(m) - {"role", "content"} or not isinstance(m.get("content"), str):
                raise ValueError(f"a chat message needs a 'role' and a string 'content', got {dict(m)!r}")
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

        def raise_exception(message):
            raise ValueError(f"chat template: {message}")
        env.globals["raise_exception"] = raise_exception
        return env.from_string(self.source).render(messages=list(messages), add_generation_prompt=add_generation_prompt)
