"""LLM jobs: a Llama-family model (GGUF file or HF folder), a server workload, real prompts as inputs.

Why the inputs look like this: token-level error only means something at positions both models see
with the same context, so every batch is teacher-forced on the FP64 model's own greedy continuation
(made by the fast FP64 runner): a decode batch is B prompts, each feeding its last prompt token at its
own position with the FP64 KV-cache rows of the tokens before it, so its logits predict FP64's first
greedy token (later steps feed FP64's greedy tokens); a prefill batch is the first SEQ tokens of
prompt + FP64 continuation, so no row is padding.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.resources
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..hlir.store import file_backed, is_file_backed, keyed
from .gemma import ARCH as GEMMA3, GemmaConfig, GemmaModel, build_gemma
from .gemma_fp64 import Fp64Gemma
from .gemma_gguf import gemma3_path, load_gemma_gguf
from .gguf import load_gguf, smollm2_path
from .gguf_header import read_header
from .llama import LlamaConfig, LlamaModel, build_prefill, load_weights
from .reference import Fp64Llama, Fp64State
from .spm import SentencePieceTokenizer
from .tokenizer import ChatTemplate, Tokenizer

CHAT_PREFIX = "chat: "
PROMPT_SETS = ("calibration", "heldout")
# Token-level contract: next-token top-1 agreement with FP64 and KL(FP64 || plan) mean and max, on logits.
LLM_DEFAULT_BUDGET = "atol=inf,rtol=inf,outputs=logits,top1>=0.9,kl<=0.02,kl_max<=0.3"


class WorkloadError(ValueError):
    pass


@dataclass(frozen=True)
class Workload:
    """`prefill:SEQ` / `prefill:BATCHxSEQ` (a batch of prompts, SEQ tokens each) or `decode:BATCH@CONTEXT`."""

    kind: str      # "prefill" | "decode"
    batch: int
    seq: int       # tokens per sequence in one step (1 for decode)
    context: int   # KV-cache rows per sequence

    @classmethod
    def parse(cls, text: str) -> "Workload":
        m = re.fullmatch(r"prefill:(?:(\d+)x)?(\d+)|decode:(\d+)@(\d+)", text.strip())
        if m is None:
            raise WorkloadError(f"bad workload {text!r}: write prefill:SEQ, prefill:BATCHxSEQ or decode:BATCH@CONTEXT")
        if m.group(2):
            w = cls("prefill", int(m.group(1) or 1), int(m.group(2)), int(m.group(2)))
        else:
            w = cls("decode", int(m.group(3)), 1, int(m.group(4)))
        if min(w.batch, w.seq) < 1 or w.context < 2:
            raise WorkloadError(f"bad workload {text!r}: sizes must be >= 1 and the context >= 2")
        return w

    def __str__(self) -> str:
        if self.kind == "decode":
            return f"decode:{self.batch}@{self.context}"
        return f"prefill:{self.batch}x{self.seq}" if self.batch > 1 else f"prefill:{self.seq}"


@dataclass(frozen=True)
class Prompt:
    text: str
    chat: bool  # rendered through the chat template as one user message


def parse_prompts(text: str) -> list[Prompt]:
    """One prompt per line; '#' lines and blanks skipped; 'chat: ' marks a chat-formatted prompt."""
    out = []
    for line in text.splitlines():
        line = line.rstrip("\n")
        if not line.strip() or line.startswith("#"):
            continue
        chat = line.startswith(CHAT_PREFIX)
        out.append(Prompt(line[len(CHAT_PREFIX):] if chat else line, chat))
    return out


def load_prompts(which: str, family: str = "smollm2") -> list[Prompt]:
    """A shipped prompt set, 24 calibration and 12 held-out real prompts: `smollm2`'s (a third of them
    chat messages) or `gemma3`'s (plain text: the base model's file has no chat template)."""
    if which not in PROMPT_SETS:
        raise ValueError(f"unknown prompt set {which!r}; expected one of {PROMPT_SETS}")
    return parse_prompts((importlib.resources.files(__package__) / "data" / f"{family}_{which}.txt").read_text("utf-8"))


@dataclass(frozen=True)
class Architecture:
    """How an LLM family builds its graph and its fast FP64 runner, declared once per config type."""

    build: Callable[..., Any]   # (config, weights, seq, max_cache, batch) -> LlamaModel | GemmaModel
    fp64: Callable[..., Any]    # (config, weights) -> Fp64Llama | Fp64Gemma
    prompts: str                # the shipped prompt sets it is calibrated on by default


ARCHITECTURES = {LlamaConfig: Architecture(build_prefill, Fp64Llama, "smollm2"),
                 GemmaConfig: Architecture(build_gemma, Fp64Gemma, "gemma3")}
# models known by name -> the file each is (installed packages)
NAMED_MODELS: dict[str, Callable[[], Path]] = {"smollm2": smollm2_path, "gemma3": gemma3_path}


@dataclass(frozen=True)
class LlmModel:
    """What an LLM job needs from a checkpoint: config, float weights, tokenizer, optional chat template."""

    name: str
    config: LlamaConfig | GemmaConfig
    weights: Mapping[str, np.ndarray]
    tokenizer: Tokenizer | SentencePieceTokenizer
    chat_template: ChatTemplate | None
    reference: "LlmModel | None" = None  # the model this one is an exact rewrite of (models/residual_rotation.py):
                                         # its FP64 runner, not this one's, makes the inputs and judges the outputs

    @property
    def architecture(self) -> Architecture:
        return ARCHITECTURES[type(self.config)]

    def render(self, prompt: Prompt) -> str:
        if not prompt.chat:
            return prompt.text
        if self.chat_template is None:
            raise ValueError(f"model {self.name} has no chat template for chat prompt {prompt.text!r}")
        return self.chat_template.render([{"role": "user", "content": prompt.text}])

    def encode(self, prompt: Prompt) -> list[int]:
        return self.tokenizer.encode(self.render(prompt))

    @functools.cached_property
    def fp64(self) -> Fp64Llama:
        if self.reference is not None:
            return self.reference.fp64
        return self.architecture.fp64(self.config, self.weights)

    def residual_rotated(self, seed: int = 0) -> "LlmModel":
        """This model with its norms folded and its residual stream rotated (models/residual_rotation.py):
        the same function in real arithmetic, judged against this model's FP64."""
        from .residual_rotation import rotated_weights
        config, weights = rotated_weights(self.config, self.weights, seed)
        return dataclasses.replace(self, name=f"{self.name}+residual-rotation", config=config, weights=weights,
                                   reference=self)


def _hf_model(directory: Path, layers: int | None) -> LlmModel:
    config, weights = load_weights(directory)
    if layers is not None:
        if not 1 <= layers <= config.num_hidden_layers:  # as load_gguf refuses it: never a silent no-op
            raise ValueError(f"layers must lie in [1, {config.num_hidden_layers}], got {layers}")
        config = config.with_layers(layers)
        weights = {k: v for k, v in weights.items() if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers}
    tok_file = directory / "tokenizer.json"
    if not tok_file.is_file():
        raise FileNotFoundError(f"{directory} has no tokenizer.json")
    template = None
    tc = directory / "tokenizer_config.json"
    if tc.is_file():
        template = json.loads(tc.read_text("utf-8")).get("chat_template")
    return LlmModel(directory.name, config, {k: keyed(_as_f32(v)) for k, v in weights.items()},
                    Tokenizer.from_file(tok_file), ChatTemplate(template) if isinstance(template, str) else None)


def _as_f32(values: np.ndarray) -> np.ndarray:
    """A checkpoint weight as FP32 without leaving its file's page cache: an FP32 tensor is its mapped view, a
    narrower one (BF16, F16: how real checkpoints ship) is widened into a mapped scratch file (store.file_backed),
    so the memory plan can stream it like an FP32 checkpoint instead of holding an anonymous FP32 copy of every
    weight (which made a 4B BF16 checkpoint need its whole 15.5 GB of FP32 resident)."""
    if values.dtype == np.float32:
        return values
    return file_backed(values, np.float32) if is_file_backed(values) else np.asarray(values, dtype=np.float32)


class _ArchitectureRead(Exception):
    def __init__(self, value: object):
        self.value = value


def gguf_architecture(path: Path) -> object:
    """A GGUF file's general.architecture, read from the header up to that key (llama.cpp writes it first)."""
    def stop(value: object) -> None:
        raise _ArchitectureRead(value)
    try:
        read_header(path, on_architecture=stop)
    except _ArchitectureRead as found:
        return found.value
    return None


@functools.lru_cache(maxsize=4)
def load_llm(spec: str, layers: int | None = None) -> LlmModel:
    """A model by name (NAMED_MODELS: the installed SmolLM2 and Gemma 3 files), a `.gguf` file (Llama,
    Qwen2/3 or Gemma 3 by its general.architecture), or a Hugging Face folder (config.json + safetensors)."""
    path = NAMED_MODELS[spec]() if spec in NAMED_MODELS else Path(spec)
    if path.is_dir():
        return _hf_model(path, layers)
    if path.suffix != ".gguf":
        raise FileNotFoundError(f"model {spec!r} is neither a known name, a .gguf file nor a folder")
    name = spec if spec in NAMED_MODELS else path.stem
    if path.is_file() and gguf_architecture(path) == GEMMA3:
        g = load_gemma_gguf(path, layers)
    else:
        g = load_gguf(path, layers)
    return LlmModel(name, g.config, g.weights, g.tokenizer, g.chat_template)


# -- teacher-forced inputs -----------------------------------------------------------------------
def _groups(prompts: Sequence[Prompt], batch: int) -> list[list[Prompt]]:
    """Consecutive groups of `batch` prompts; a short last group is filled with its own first prompts."""
    out = []
    for start in range(0, len(prompts), batch):
        group = list(prompts[start:start + batch])
        out.append(group + group[: batch - len(group)])
    return out


class PromptTooLong(ValueError):
    """A prompt of one's own that does not fit the workload's KV cache (shipped prompts are cut instead);
    `prompt_set` names the set it came from ("calibration" or "heldout") once a job knows it."""

    def __init__(self, message: str, prompt_set: str = ""):
        super().__init__(message)
        self.prompt_set = prompt_set


def fitting_ids(model: LlmModel, prompt: Prompt, extra: int, limit: int, cut: bool = False) -> list[int]:
    """The prompt's ids when they and `extra` more tokens fit `limit` cache rows; with `cut`, its first
    tokens that do; refused otherwise."""
    ids = model.encode(prompt)
    if len(ids) + extra <= limit:
        return ids
    if cut and limit - extra >= 1:
        return ids[:limit - extra]
    more = f": with {extra} more" if extra else ""
    raise PromptTooLong(f"prompt {prompt.text[:40]!r} has {len(ids)} tokens{more}: it does not fit the workload's "
                        f"context of {limit} rows")


def prompts_cut(model: LlmModel, workload: Workload, prompts: Sequence[Prompt]) -> int:
    """How many prompts a decode workload's cache cuts (decode_batches with cut=True): prefill windows
    always take a prompt's first SEQ tokens, so they cut nothing they were not meant to."""
    if workload.kind != "decode":
        return 0
    return sum(len(model.encode(p)) > workload.context for p in prompts)


def stacked_caches(states: Sequence[Fp64State], graph: LlamaModel | GemmaModel) -> dict[str, np.ndarray]:
    """The sequences' FP64 cache rows in the graph's layout, as the previous step's cache outputs:
    position j of sequence i in row i * rows + j % rows (a ring of `rows` keeps the last `rows`)."""
    out = {}
    for layer in range(graph.config.num_hidden_layers):
        ctx = graph.cache_rows(layer)
        for kind in ("k", "v"):
            cache = np.zeros((graph.batch * ctx, graph.config.kv_dim))
            for i, state in enumerate(states):
                rows = getattr(state, kind)[layer]
                kept = np.arange(max(0, len(rows) - ctx), len(rows))
                cache[i * ctx + kept % ctx] = rows[kept]
            out[f"{kind}_cache_out.{layer}"] = cache
    return out


def prefix_caches(k: Sequence[np.ndarray], v: Sequence[np.ndarray], length: int,
                  graph: LlamaModel | GemmaModel) -> dict[str, np.ndarray]:
    """stacked_caches of sequences that all hold `length` rows, given as each layer's K and V rows of every
    sequence stacked, (batch, rows >= length, kv_dim): one copy per layer and kind, not one per sequence (a
    teacher-forced step of 32 windows at 30 layers made 1,920 row copies)."""
    out = {}
    for layer in range(graph.config.num_hidden_layers):
        ctx = graph.cache_rows(layer)
        start = max(0, length - ctx)
        for kind, rows in (("k", k[layer]), ("v", v[layer])):
            if rows.shape[0] != graph.batch or rows.shape[1] < length:
                raise ValueError(f"layer {layer}'s {kind} rows {rows.shape} hold no {length} rows of {graph.batch} sequences")
            cache = np.zeros((graph.batch, ctx, graph.config.kv_dim))
            if start == 0:  # no ring wrap: row j of each sequence at its row j
                cache[:, :length] = rows[:, :length]
            else:
                kept = np.arange(start, length)
                cache[:, kept % ctx] = rows[:, kept]
            out[f"{kind}_cache_out.{layer}"] = cache.reshape(graph.batch * ctx, graph.config.kv_dim)
    return out


def decode_batches(model: LlmModel, graph: LlamaModel, prompts: Sequence[Prompt], steps: int = 1,
                   cut: bool = False) -> list[dict]:
    """Decode inputs: per group of `batch` prompts and per step t < steps, each sequence at position
    len(prompt) - 1 + t, feeding the prompt's last token (t = 0) or FP64's greedy token, with FP64's
    cache rows before it. Step t's logits thus predict FP64's (t+1)-th generated token (`cut`: a prompt
    longer than the cache is cut to its first tokens that fit, else refused). Every prompt
    goes through the FP64 model in one pass per step (Fp64Llama.forward_many: each layer's weights
    converted once, whatever the number of prompts)."""
    groups = _groups(prompts, graph.batch)
    ids = [fitting_ids(model, p, steps - 1, graph.max_cache, cut) for group in groups for p in group]
    fp64 = model.fp64
    states = [fp64.empty() for _ in ids]
    prefixes = [j for j, row in enumerate(ids) if len(row) > 1]
    for j, (_, state) in zip(prefixes, fp64.forward_many([ids[j][:-1] for j in prefixes], logits=False)):
        states[j] = state
    tokens = [row[-1] for row in ids]
    per_step = []
    for step in range(steps):
        per_step.append((list(tokens), list(states)))
        if step + 1 < steps:
            advanced = fp64.forward_many([[tok] for tok in tokens], states)
            tokens = [int(np.argmax(logits[-1])) for logits, _ in advanced]
            states = [state for _, state in advanced]
    out = []
    for g in range(len(groups)):
        rows = slice(g * graph.batch, (g + 1) * graph.batch)
        for step_tokens, step_states in per_step:
            group_states = step_states[rows]
            positions = [state.length for state in group_states]
            out.append(graph.make_batch_inputs(np.array(step_tokens[rows])[:, None], np.array(positions)[:, None],
                                               stacked_caches(group_states, graph), positions))
    return out


def prefill_batches(model: LlmModel, graph: LlamaModel, prompts: Sequence[Prompt]) -> list[dict]:
    """Prefill inputs: the first SEQ tokens of prompt + FP64 greedy continuation, `batch` prompts a step
    (the continuations of all prompts generated together: Fp64Llama.greedy_many)."""
    b, s = graph.batch, graph.seq
    groups = _groups(prompts, b)
    ids = [model.encode(p)[:s] for group in groups for p in group]
    short = [j for j, row in enumerate(ids) if len(row) < s]
    rows = [list(row) for row in ids]
    by_need: dict[int, list[int]] = {}  # sequences needing as many tokens generate together
    for j in short:
        by_need.setdefault(s - len(ids[j]), []).append(j)
    for need, js in sorted(by_need.items()):
        for j, (cont, _) in zip(js, model.fp64.greedy_many([ids[j] for j in js], need)):
            rows[j] = ids[j] + cont
    return [graph.make_batch_inputs(np.array(rows[g * b:(g + 1) * b]), np.tile(np.arange(s), (b, 1)))
            for g in range(len(groups))]


def build_workload(model: LlmModel, workload: Workload) -> LlamaModel | GemmaModel:
    return model.architecture.build(model.config, model.weights, workload.seq, workload.context, workload.batch)


def workload_batches(model: LlmModel, graph: LlamaModel, workload: Workload, prompts: Sequence[Prompt],
                     cut: bool = False) -> list[dict]:
    if not prompts:
        raise ValueError("an LLM job needs at least one prompt")
    if workload.kind == "decode":
        return decode_batches(model, graph, prompts, cut=cut)
    return prefill_batches(model, graph, prompts)
