"""Random-weight checkpoints of real model shapes, written to disk in pieces: the large-model test bed.

Why: the compile must be shown on the shapes users ship (1B-70B parameters) without their files, and
a model that large must never be built in memory to be saved. `write_checkpoint` writes a Hugging
Face folder (config.json, model.safetensors, tokenizer.json) whose tensors are generated row block by
row block (a few MB at a time) straight into the file; loading it (llama.load_weights) memory-maps
the file, so the weights cost page cache, not process memory. Values are seeded, so the same config
and seed give the same file byte for byte. The tokenizer is byte-level with no merges (256 ids), so
prompts encode without a trained vocabulary; the model's vocabulary must have at least 256 rows.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from .llama import EMBED, LlamaConfig, weight_shapes
from .tokenizer import Tokenizer
from .weights import save_safetensors_streamed

BLOCK_BYTES = 16 << 20  # rows generated at a time (memory of the writer, whatever the model)


def byte_alphabet() -> list[str]:
    """GPT-2's byte-to-character map (printable bytes stand for themselves), one string per byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out, extra = [], 0
    for b in range(256):
        if b in keep:
            out.append(chr(b))
        else:
            out.append(chr(256 + extra))
            extra += 1
    return out


EMBED_STD = 0.02  # Llama's initializer_range
# what a folder's values depend on beyond the config and seed: a folder written by another init is rewritten
INIT = "embed-std-0.02"


def _scale(name: str, shape: tuple[int, ...]) -> tuple[float, float]:
    """(mean, std) of a tensor: norm gains near 1, matrices ~ N(0, 1/fan_in) as an initialised model, the
    embedding N(0, EMBED_STD^2). Why not N(0, 1) there: tied as the LM head, it gave logits of std ~sqrt(hidden)
    (45 at hidden 2048, the top logit ~900 above the next), a one-hot softmax whose KL underflows for every plan,
    so every budget passed and the compile's measurements were of noise; at 0.02 the logits' std is ~0.02
    sqrt(hidden) (~1), and a plan's rounding can flip a top-1 or move the KL, as in a real model."""
    if len(shape) == 1:
        return 1.0, 0.1
    return 0.0, (EMBED_STD if name == EMBED else 1.0 / np.sqrt(shape[1]))


def _blocks(name: str, shape: tuple[int, ...], seed: int):
    """The tensor's values in row blocks, from a generator seeded by (seed, name): any block order, one file."""
    rng = np.random.default_rng([seed, *name.encode()])
    mean, std = _scale(name, shape)
    cols = int(np.prod(shape[1:], dtype=np.int64)) if len(shape) > 1 else shape[0]
    rows = shape[0] if len(shape) > 1 else 1
    step = max(1, BLOCK_BYTES // (4 * cols))
    for start in range(0, rows, step):
        n = min(step, rows - start)
        yield (mean + std * rng.standard_normal((n, cols), dtype=np.float32)).astype(np.float32)


def write_checkpoint(directory: str | Path, config: LlamaConfig, seed: int = 0) -> Path:
    """A Hugging Face Llama folder of random FP32 weights for `config` (skipped when the folder already
    holds this config and seed: the files are deterministic)."""
    if config.vocab_size < 256:
        raise ValueError(f"a synthetic checkpoint needs a vocabulary of at least 256 (bytes), got {config.vocab_size}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    stamp = {**config.to_dict(), "synthetic_seed": seed, "synthetic_init": INIT}
    config_file = directory / "config.json"
    if config_file.is_file() and json.loads(config_file.read_text()) == stamp and (directory / "model.safetensors").is_file():
        return directory
    config_file.unlink(missing_ok=True)  # written last: its presence says the folder is complete
    shapes = {name: (shape, np.float32) for name, shape in weight_shapes(config).items()}
    save_safetensors_streamed(directory / "model.safetensors", shapes,
                              lambda name: _blocks(name, shapes[name][0], seed))
    Tokenizer(byte_alphabet(), [], "default", [], None, None, False).save(directory / "tokenizer.json")
    config_file.write_text(json.dumps(stamp))
    return directory
