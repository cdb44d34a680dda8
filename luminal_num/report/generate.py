"""Greedy generation with a saved LLM plan (CUDA backend where a device is present, else the CPU
emulation backend), beside the FP64 model's own continuation: a checking tool, not a server.

Why it runs the plan's own graph: a plan is compiled for one workload, so generation steps through that
graph exactly as a server would: a decode plan feeds one token per step into its KV cache (the prompt
token by token, then its own greedy tokens), every batch slot carrying the same sequence; a prefill
plan reruns its SEQ-token window, right-padded, and reads the last real row. So one prompt costs the
whole batch's work per step (and the FP64 run beside it): the rates it prints (plan steps/s and tokens/s,
FP64 tokens/s) say how fast this check ran, not how fast a server would decode.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from ..models.llm import LlmModel, Prompt, Workload, build_workload, load_llm
from ..models.llama import LlamaModel
from ..runtime.cpu import CpuRuntime
from ..runtime.cost import LaunchForm
from ..runtime.cuda import CudaRuntime
from ..runtime.cuda_megakernel import MegakernelCudaRuntime
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
    workload: str = ""    # the plan's compiled workload (its batch: every slot carries the prompt)
    plan_steps: int = 0   # runs of the plan's graph (decode: one per prompt token and generated token)
    plan_s: float = 0.0   # wall time of those runs
    fp64_s: float = 0.0   # wall time of the FP64 model's greedy continuation

    @property
    def speed(self) -> str:
        """One line: the plan's steps/s and tokens/s on its backend and FP64's tokens/s (wall time, this run)."""
        n = len(self.plan)
        return (f"speed (a check, not a server: every step runs all slots of {self.workload}): plan {self.plan_steps} "
                f"steps in {self.plan_s:.2f} s on the {self.backend} backend ({_rate(self.plan_steps, self.plan_s)} "
                f"steps/s, {_rate(n, self.plan_s)} generated tokens/s); FP64 reference {len(self.fp64)} tokens in "
                f"{self.fp64_s:.2f} s ({_rate(len(self.fp64), self.fp64_s)} tokens/s)")

    @property
    def agreement(self) -> int:
        """Tokens the plan reproduces before the first that differs from FP64's."""
        n = 0
        for a, b in zip(self.fp64, self.plan):
            if a != b:
                break
            n += 1
        return n


def _rate(count: int, seconds: float) -> str:
    return f"{count / seconds:.3g}" if seconds > 0 else "-"


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
        return CpuRuntime(program, built.graph.weights, plan.scales), "cpu"  # the same bodies in either form
    if plan.latency.form == LaunchForm.MEGAKERNEL.value:  # the launch form the search chose
        return MegakernelCudaRuntime(program, built.graph.weights), "cuda megakernel"
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
    t0 = time.perf_counter()
    fp64, _ = m.fp64.greedy(ids, tokens)
    t1 = time.perf_counter()
    pad = m.tokenizer.eos_id if m.tokenizer.eos_id is not None else 0
    mine = _decode_steps(rt, built, ids, tokens) if w.kind == "decode" else _prefill_steps(rt, built, ids, tokens, pad)
    t2 = time.perf_counter()
    steps = len(ids) + tokens - 1 if w.kind == "decode" else tokens
    return Generation(m, tuple(ids), tuple(fp64), tuple(mine), ran_on, str(w), steps, t2 - t1, t1 - t0)


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
    print(g.speed)
