"""Greedy generation with a saved LLM plan (CUDA backend where a device is present, else the CPU
emulation backend), beside the FP64 model's own continuation.

Why it runs the plan's own graph: a plan is compiled for one workload, so generation steps through that
graph exactly as a server would: a decode plan feeds one token per step into its KV cache (the prompt
token by token, then its own greedy tokens), every batch slot carrying the same sequence; a prefill
plan reruns its SEQ-token window, right-padded, and reads the last real row.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..models.llm import LlmModel, Prompt, Workload, build_workload, load_llm
from ..models.llama import LlamaModel
from ..runtime.cpu import CpuRuntime
from ..runtime.cuda import CudaRuntime
from ..runtime.cuda_device import cuda_available
from ..search.plan import Plan


BACKENDS = ("auto", "cpu", "cuda")  # auto: CUDA when a device is usable, else the CPU backend
Runtime = CpuRuntime | CudaRuntime


@dataclass(frozen=True)
class Generation:
    model: LlmModel
    prompt_ids: tuple[int, ...]
    fp64: tuple[int, ...]
    plan: tuple[int, ...]
    backend: str = "cpu"  # the backend the plan ran on

    @property
    def agreement(self) -> int:
        """Tokens the plan reproduces before the first that differs from FP64's."""
        n = 0
        for a, b in zip(self.fp64, self.plan):
            if a != b:
                break
            n += 1
        return n


def _decode_steps(rt: Runtime, built: LlamaModel, ids: list[int], tokens: int) -> list[int]:
    b, out, prev = built.batch, [], None
    sequence = list(ids)
    for pos in range(len(ids) + tokens - 1):
        token = sequence[pos]
        inputs = built.make_batch_inputs([[token]] * b, [[pos]] * b, prev, [pos] * b)
        result = rt.run(inputs).outputs
        prev = {k: np.asarray(v, dtype=np.float64) for k, v in result.items() if k != "logits"}
        if pos >= len(ids) - 1:
            out.append(int(np.argmax(np.asarray(result["logits"])[0])))
            sequence.append(out[-1])
    return out


def _prefill_steps(rt: Runtime, built: LlamaModel, ids: list[int], tokens: int, pad: int) -> list[int]:
    b, s, out, sequence = built.batch, built.seq, [], list(ids)
    for _ in range(tokens):
        row = sequence + [pad] * (s - len(sequence))
        result = rt.run(built.make_batch_inputs([row] * b, [list(range(s))] * b)).outputs
        out.append(int(np.argmax(np.asarray(result["logits"])[len(sequence) - 1])))
        sequence.append(out[-1])
    return out


def _runtime(program, built: LlamaModel, plan: Plan, backend: str) -> tuple[Runtime, str]:
    """The backend that runs the plan; an explicit "cuda" without a device raises CudaUnavailableError."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "cpu" or (backend == "auto" and not cuda_available()):
        return CpuRuntime(program, built.graph.weights, plan.scales), "cpu"
    return CudaRuntime(program, built.graph.weights), "cuda"


def generate(plan: Plan, model: str, workload: str | None, layers: int | None, prompt: str, chat: bool,
             tokens: int, backend: str = "auto") -> Generation:
    """Up to `tokens` greedy tokens from the plan and from FP64 (fewer when the workload's window is full)."""
    if workload is None:
        raise ValueError("the plan records no workload: pass --workload")
    m = load_llm(model, layers)
    w = Workload.parse(workload)
    built = build_workload(m, w)
    program, _ = plan.program(built.graph)
    rt, ran_on = _runtime(program, built, plan, backend)
    ids = m.encode(Prompt(prompt, chat))
    room = w.context - len(ids) + (1 if w.kind == "decode" else 0)
    if room < 1:
        raise ValueError(f"the prompt has {len(ids)} tokens: no room left in the workload {w}")
    tokens = min(tokens, room)
    fp64, _ = m.fp64.greedy(ids, tokens)
    pad = m.tokenizer.eos_id if m.tokenizer.eos_id is not None else 0
    mine = _decode_steps(rt, built, ids, tokens) if w.kind == "decode" else _prefill_steps(rt, built, ids, tokens, pad)
    return Generation(m, tuple(ids), tuple(fp64), tuple(mine), ran_on)


def _show(tok, ids, mark: int | None) -> str:
    pieces = [tok.decode([i]) for i in ids]
    if mark is not None and mark < len(pieces):
        pieces[mark] = f"[[{pieces[mark]}]]"
    return "".join(pieces)


def print_generation(g: Generation) -> None:
    tok = g.model.tokenizer
    differ = None if g.agreement == min(len(g.fp64), len(g.plan)) else g.agreement
    print(f"prompt ({len(g.prompt_ids)} tokens): {tok.decode(g.prompt_ids)!r}")
    print(f"FP64: {_show(tok, g.fp64, differ)!r}")
    print(f"plan: {_show(tok, g.plan, differ)!r}")
    if differ is None:
        print(f"the plan reproduces all {len(g.plan)} FP64 tokens")
    else:
        print(f"the plan agrees with FP64 for {g.agreement} tokens; [[...]] marks the first token that differs")
    print(f"the plan ran on the {g.backend} backend")
