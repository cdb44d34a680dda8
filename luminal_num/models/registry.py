"""The models the CLI and the benchmarks know by name, with calibration and held-out inputs.

Each job fixes the graph's static sizes and ships its data: MiniLM on real sentences (the text files
in models/data), the Llama config on seeded random tokens, the test transformer on seeded noise, and
SmolLM2-135M (or any Llama-family GGUF / HF folder) under a server workload on real prompts.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np

from ..hlir.graph import Graph

if TYPE_CHECKING:  # the model modules load lazily: a job pulls in only its own model's dependencies
    from .llama import LlamaModel
    from .llm import LlmModel, Workload
    from .llm_positions import TeacherForcedWindows

DEFAULT_POSITIONS = 2000  # teacher-forced positions an LLM's chosen plan is judged on by default (issue 32)


@dataclass(frozen=True)
class ModelJob:
    name: str
    graph: Graph
    calibration: tuple[dict, ...]   # input batches the contract is judged on
    heldout: tuple[dict, ...]       # input batches audit re-checks the plan on
    default_budget: str
    description: str
    llm: "LlmJob | None" = None     # LLM jobs: the model, its workload and the built graph's sizes
    notes: tuple["JobNote", ...] = ()  # what was adapted to fit the job (shipped prompts cut to the context)


@dataclass(frozen=True)
class JobNote:
    """One line a command shows about its inputs; `inputs` names the set it concerns."""
    inputs: str  # "calibration" | "heldout"
    text: str


@dataclass(frozen=True)
class LlmJob:
    model: "LlmModel"
    workload: "Workload"
    built: "LlamaModel"
    # the calibration prompts' teacher-forced windows (decode workloads; windows made when first read), or None
    positions: "TeacherForcedWindows | None" = None
    # the held-out prompts' windows, which audit judges a plan's row metrics on (pooled), or None
    heldout_positions: "TeacherForcedWindows | None" = None


def _batches(items, size):
    return [items[i:i + size] for i in range(0, len(items), size)]


def minilm_job(batch: int = 12) -> ModelJob:
    from .assets import Tokenizer, load_sentences, minilm_files
    from .bert import load_minilm
    tok = Tokenizer.from_files(minilm_files())
    cal, held = load_sentences("calibration"), load_sentences("heldout")
    seq = int(max(tok.encode_batch(cal).ids.shape[1], tok.encode_batch(held).ids.shape[1]))
    model = load_minilm(batch, seq)

    def feed(sentences):
        out = []
        for chunk in _batches(sentences, batch):
            chunk = chunk + chunk[: batch - len(chunk)] if len(chunk) < batch else chunk  # fill a short batch
            out.append(model.make_inputs(tok.encode_batch(chunk)))
        return tuple(out)
    return ModelJob("minilm", model.graph, feed(cal), feed(held),
                    "atol=4e-3,rtol=0,cosine>=0.999",
                    f"all-MiniLM-L6-v2 sentence embeddings, batch {batch} x {seq} tokens, real sentences")


def llama_tiny_job(seq: int = 16, layers: int | None = None) -> ModelJob:
    from .llama import LLAMA_TINY, build_prefill, random_weights
    cfg = LLAMA_TINY if layers is None else LLAMA_TINY.with_layers(layers)
    model = build_prefill(cfg, random_weights(cfg, seed=0), seq=seq, max_cache=2 * seq)

    def feed(seeds):
        return tuple(model.make_inputs(np.random.default_rng(s).integers(0, cfg.vocab_size, seq), np.arange(seq))
                     for s in seeds)
    return ModelJob("llama-tiny", model.graph, feed([1, 2]), feed([101, 102]), "atol=5e-2,rtol=5e-2,outputs=logits",
                    f"Llama-style decoder ({cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, GQA), "
                    f"random weights, prefill of {seq} tokens")


def transformer_job(layers: int = 2) -> ModelJob:
    from .testnets import transformer
    m = transformer(layers)
    return ModelJob("transformer", m.graph, (m.make_inputs(1),), (m.make_inputs(101), m.make_inputs(102)),
                    "atol=1e-2,rtol=1e-2", f"test transformer, {layers} layers, seeded weights")


SMOLLM2_WORKLOAD = "decode:8@64"


def llm_job(model: str = "smollm2", workload: str = SMOLLM2_WORKLOAD, calibration: Sequence | None = None,
            heldout: Sequence | None = None, layers: int | None = None,
            positions_minimum: int = DEFAULT_POSITIONS, residual_rotation: bool = False) -> ModelJob:
    """A Llama-family LLM (bundled name, .gguf file or HF folder) under a server workload, judged on
    real prompts teacher-forced on the FP64 continuation (default: the shipped 24 + 12 prompts). Shipped
    prompts longer than a decode workload's context are cut to its first tokens (and a note says so); a
    caller's own prompts are refused instead (PromptTooLong names the set). A decode workload also has
    `positions_minimum` teacher-forced positions over the calibration prompts (0: none), on which compile
    judges the chosen plan again (models/llm_positions.py), and as many over the held-out prompts, on which
    audit re-checks it. `residual_rotation`: the model's residual stream rotated (models/residual_rotation.py),
    judged against the source model's FP64."""
    from .llm import (LLM_DEFAULT_BUDGET, PromptTooLong, Workload, build_workload, load_llm, load_prompts, prompts_cut,
                      workload_batches)
    from .llm_positions import TeacherForcedWindows
    m = load_llm(model, layers)
    if residual_rotation:
        m = m.residual_rotated()
    w = Workload.parse(workload)
    built = build_workload(m, w)
    family = m.architecture.prompts
    notes = []

    def batches(which: str, given: Sequence | None) -> list[dict]:
        shipped = given is None
        prompts = load_prompts(which, family) if shipped else given
        label = "held-out" if which == "heldout" else which
        cut = prompts_cut(m, w, prompts) if shipped else 0
        if cut:
            notes.append(JobNote(which, f"{cut} of the {len(prompts)} shipped {label} prompts cut to their first "
                                        f"{w.context} tokens (the context of {w})"))
        try:
            return workload_batches(m, built, w, prompts, cut=shipped)
        except PromptTooLong as exc:
            raise PromptTooLong(f"{label} {exc}", which) from None

    cal, held = batches("calibration", calibration), batches("heldout", heldout)
    def windows(which: str, given: Sequence | None) -> TeacherForcedWindows | None:
        if w.kind != "decode" or positions_minimum <= 0:  # a prefill step already judges every position of its windows
            return None
        prompts = tuple(given if given is not None else load_prompts(which, family))
        return TeacherForcedWindows(m, built, prompts, positions_minimum, cut=given is None)
    c = m.config
    return ModelJob(m.name if layers is None else f"{m.name}-{layers}l", built.graph, tuple(cal), tuple(held),
                    LLM_DEFAULT_BUDGET,
                    f"{m.name} ({c.num_hidden_layers} layers, hidden {c.hidden_size}, {c.num_attention_heads}/"
                    f"{c.num_key_value_heads} heads, vocab {c.vocab_size}), workload {w}, real prompts",
                    LlmJob(m, w, built, windows("calibration", calibration), windows("heldout", heldout)),
                    tuple(notes))


LLM_NAMES = ("smollm2", "gemma3")  # LLMs known by name: the installed files of models.llm.NAMED_MODELS
JOBS: dict[str, Callable[[], ModelJob]] = {"minilm": minilm_job, "llama-tiny": llama_tiny_job,
                                           "transformer": transformer_job,
                                           **{name: functools.partial(llm_job, name) for name in LLM_NAMES}}


def load_job(name: str) -> ModelJob:
    if name not in JOBS:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(JOBS)}")
    return JOBS[name]()
