"""LLM jobs: a Llama-family model (GGUF file or HF folder), a server workload, real prompts as inputs.

Why the inputs look like this: token-level error only means something at positions both models see
with the same context, so every batch is teacher-forced on the FP64 model's own greedy continuation
(made once by the fast FP64 runner): a decode batch is B prompts, each at its next position, with its
FP64 KV-cache rows and the FP64 greedy token as input; a prefill batch is the first SEQ tokens of
prompt + FP64 continuation, so no row is padding.
"""
from __future__ import annotations

import functools
import importlib.resources
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .gguf import load_gguf, smollm2_path
from .llama import LlamaConfig, LlamaModel, build_prefill, load_weights
from .reference import Fp64Llama, Fp64State
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


def load_prompts(which: str) -> list[Prompt]:
    """The shipped SmolLM2 prompt sets: 24 calibration and 12 held-out real prompts."""
    if which not in PROMPT_SETS:
        raise ValueError(f"unknown prompt set {which!r}; expected one of {PROMPT_SETS}")
    return parse_prompts((importlib.resources.files(__package__) / "data" / f"smollm2_{which}.txt").read_text("utf-8"))


@dataclass(frozen=True)
class LlmModel:
    """What an LLM job needs from a checkpoint: config, float weights, tokenizer, optional chat template."""

    name: str
    config: LlamaConfig
    weights: Mapping[str, np.ndarray]
    tokenizer: Tokenizer
    chat_template: ChatTemplate | None

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
        return Fp64Llama(self.config, self.weights)


def _hf_model(directory: Path, layers: int | None) -> LlmModel:
    config, weights = load_weights(directory)
    if layers is not None:
        config = config.with_layers(layers)
        weights = {k: v for k, v in weights.items() if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers}
    tok_file = directory / "tokenizer.json"
    if not tok_file.is_file():
        raise FileNotFoundError(f"{directory} has no tokenizer.json")
    template = None
    tc = directory / "tokenizer_config.json"
    if tc.is_file():
        template = json.loads(tc.read_text("utf-8")).get("chat_template")
    return LlmModel(directory.name, config, {k: np.asarray(v, dtype=np.float32) for k, v in weights.items()},
                    Tokenizer.from_file(tok_file), ChatTemplate(template) if isinstance(template, str) else None)


@functools.lru_cache(maxsize=4)
def load_llm(spec: str, layers: int | None = None) -> LlmModel:
    """`smollm2` (the bundled GGUF), a `.gguf` file, or a Hugging Face folder (config.json + safetensors)."""
    path = smollm2_path() if spec == "smollm2" else Path(spec)
    if path.is_dir():
        return _hf_model(path, layers)
    if path.suffix != ".gguf":
        raise FileNotFoundError(f"model {spec!r} is neither a known name, a .gguf file nor a folder")
    g = load_gguf(path, layers)
    return LlmModel("smollm2" if spec == "smollm2" else path.stem, g.config, g.weights, g.tokenizer, g.chat_template)


# -- teacher-forced inputs -----------------------------------------------------------------------
@dataclass(frozen=True)
class Teacher:
    """One prompt's FP64 greedy continuation and the FP64 cache state after each of its tokens."""

    prompt_ids: tuple[int, ...]
    continuation: tuple[int, ...]


def teacher(model: LlmModel, prompt: Prompt, tokens: int, limit: int) -> Teacher:
    """The prompt's ids and `tokens` FP64 greedy tokens after it; a prompt that leaves no room is refused."""
    ids = model.encode(prompt)
    if len(ids) + tokens > limit:
        raise ValueError(f"prompt {prompt.text[:40]!r} has {len(ids)} tokens: with {tokens} more it does not fit "
                         f"the workload's context of {limit} rows")
    cont, _ = model.fp64.greedy(ids, tokens)
    return Teacher(tuple(ids), tuple(cont))


def decode_batches(model: LlmModel, graph: LlamaModel, prompts: Sequence[Prompt], steps: int = 1) -> list[dict]:
    """Decode inputs: per group of `batch` prompts and per step t < steps, each sequence at position
    len(prompt) + t - 1 feeding FP64's greedy token, its cache holding FP64's rows before it."""
    b, ctx, kv = graph.batch, graph.max_cache, graph.config.kv_dim
    layers = graph.config.num_hidden_layers
    out = []
    for start in range(0, len(prompts), b):
        group = list(prompts[start:start + b])
        group += group[: b - len(group)] if len(group) < b else []  # fill a short batch
        teachers = [teacher(model, p, steps, ctx) for p in group]
        states: list[Fp64State] = []
        for t in teachers:
            _, state = model.fp64.forward(t.prompt_ids[:-1]) if len(t.prompt_ids) > 1 else (None, model.fp64.empty())
            states.append(state)
        for step in range(steps):
            tokens = [([*t.prompt_ids, *t.continuation])[len(t.prompt_ids) - 1 + step] for t in teachers]
            positions = [s.length for s in states]
            prev = {}
            for layer in range(layers):
                for kind in ("k", "v"):
                    cache = np.zeros((b * ctx, kv))
                    for i, s in enumerate(states):
                        rows = getattr(s, kind)[layer]
                        cache[i * ctx: i * ctx + len(rows)] = rows
                    prev[f"{kind}_cache_out.{layer}"] = cache
            out.append(graph.make_batch_inputs(np.array(tokens)[:, None], np.array(positions)[:, None], prev,
                                               positions))
            states = [model.fp64.forward([tok], s)[1] for tok, s in zip(tokens, states)]
    return out


def prefill_batches(model: LlmModel, graph: LlamaModel, prompts: Sequence[Prompt]) -> list[dict]:
    """Prefill inputs: the first SEQ tokens of prompt + FP64 greedy continuation, `batch` prompts a step."""
    b, s = graph.batch, graph.seq
    out = []
    for start in range(0, len(prompts), b):
        group = list(prompts[start:start + b])
        group += group[: b - len(group)] if len(group) < b else []
        rows = []
        for p in group:
            ids = model.encode(p)[:s]
            rows.append(ids + (model.fp64.greedy(ids, s - len(ids))[0] if len(ids) < s else []))
        ids = np.array(rows)
        out.append(graph.make_batch_inputs(ids, np.tile(np.arange(s), (b, 1))))
    return out


def build_workload(model: LlmModel, workload: Workload) -> LlamaModel:
    return build_prefill(model.config, model.weights, workload.seq, workload.context, workload.batch)


def workload_batches(model: LlmModel, graph: LlamaModel, workload: Workload, prompts: Sequence[Prompt]) -> list[dict]:
    if not prompts:
        raise ValueError("an LLM job needs at least one prompt")
    if workload.kind == "decode":
        return decode_batches(model, graph, prompts)
    return prefill_batches(model, graph, prompts)
