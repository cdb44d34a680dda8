"""`audit --check-invariance` (issue 37): each held-out input run alone and inside batches of other inputs,
its outputs compared bit for bit.

A plan's graph has a fixed batch size, so the job's graph is rebuilt at each batch size (1, 2, 4, 8) and
the plan's genome lowered on it: the groups and their e-classes do not depend on the batch size (the
same knobs), and the lowered kernels are checked to be the plan's own (kind, precision, dtype, in order)
before anything runs. An input is one slice of every graph input along its first axis (the batch axis,
or batch x context rows of a KV cache); an output is compared in the same slice.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence

import numpy as np
import pandas as pd

from ..codegen.llir import Program
from ..codegen.serialize import program_from_data
from ..hlir.graph import Graph
from ..runtime.cpu import CpuRuntime
from ..search.space import SearchSpace
from .files import atomic_files

INVARIANCE_FILE = "invariance.csv"
BATCH_SIZES = (2, 4, 8)


class InvarianceError(ValueError):
    """The check cannot run for this job (one line)."""


@dataclass(frozen=True)
class InvarianceResult:
    rows: pd.DataFrame  # item, batch, slot, output, identical, max_abs_diff
    batch_invariant: bool  # what the plan requires

    @property
    def positions(self) -> int:
        return len(self.rows.groupby(["item", "batch", "slot"])) if len(self.rows) else 0

    @property
    def identical_positions(self) -> int:
        if not len(self.rows):
            return 0
        return int(self.rows.groupby(["item", "batch", "slot"])["identical"].all().sum())

    @property
    def invariant(self) -> bool:
        return self.identical_positions == self.positions

    @property
    def passed(self) -> bool:
        """A plan that requires invariance fails without it; any other plan only reports."""
        return self.invariant or not self.batch_invariant

    def verdict(self) -> str:
        """INVARIANT, NOT INVARIANT (exit 1: the plan requires it), or NOT INVARIANT with why that is no failure."""
        if self.invariant:
            return "INVARIANT"
        return "NOT INVARIANT" if self.batch_invariant else \
            "NOT INVARIANT (not required by this plan: compile with --batch-invariant to require it)"

    def summary(self) -> str:
        sizes = ", ".join(str(b) for b in sorted(set(self.rows["batch"]))) if len(self.rows) else "-"
        worst = float(self.rows["max_abs_diff"].max()) if len(self.rows) else 0.0
        return (f"invariance: {self.identical_positions}/{self.positions} positions bit-identical alone vs in "
                f"batches of {sizes} (max |difference| {worst:.3g}); the plan "
                f"{'requires' if self.batch_invariant else 'does not require'} batch invariance")


def split_items(batches: Sequence[Mapping[str, np.ndarray]], batch: int,
                offsets: Mapping[str, int] | None = None) -> list[dict[str, np.ndarray]]:
    """Every input of each batch cut into `batch` equal slices along its first axis: one dict per input.
    `offsets`: inputs holding row indices into per-sequence blocks of that many rows (an LLM's flat KV-cache
    rows, b * context + position): an item keeps them relative to its own block (join_items adds its slot's)."""
    offsets = offsets or {}
    items = []
    for feed in batches:
        for name, a in feed.items():
            if np.ndim(a) == 0 or np.shape(a)[0] % batch:
                raise InvarianceError(f"input {name!r} of shape {np.shape(a)} has no batch axis of {batch} first: "
                                      "cannot run its inputs one by one")
        for i in range(batch):
            item = {n: np.asarray(a)[i * (len(a) // batch):(i + 1) * (len(a) // batch)] for n, a in feed.items()}
            items.append({n: a - i * offsets[n] if n in offsets else a for n, a in item.items()})
    return items


def join_items(items: Sequence[Mapping[str, np.ndarray]], offsets: Mapping[str, int] | None = None
               ) -> dict[str, np.ndarray]:
    """The items as one batch, item j in slot j (its `offsets` inputs moved to slot j's block)."""
    offsets = offsets or {}
    return {name: np.concatenate([it[name] + j * offsets[name] if name in offsets else it[name]
                                  for j, it in enumerate(items)], axis=0) for name in items[0]}


def _signature(program: Program) -> list[tuple]:
    return [(k.kind.value, k.precision, k.dtype.name, k.storage) for k in program.kernels]


def program_at(plan, graph: Graph) -> Program:
    """The plan's genome lowered on `graph` (the job at another batch size), refused unless its kernels are
    the plan's."""
    space = SearchSpace.build(graph).with_batch_invariance(plan.batch_invariant)
    program = space.program(plan.genome(space))
    own = program_from_data(plan.data["llir"])
    if _signature(program) != _signature(own):
        raise InvarianceError("the plan's genome lowers to other kernels at another batch size: cannot compare")
    return program


def plan_runtimes(plan, graph_at: Callable[[int], Graph]) -> Callable[[int], CpuRuntime]:
    """Batch size -> a CPU runtime of the plan's genome on the job's graph at that size (with the plan's
    weights file)."""
    def runtime(b: int) -> CpuRuntime:
        graph = graph_at(b)
        return CpuRuntime(program_at(plan, graph), graph.weights, None, plan.stored_weights)
    return runtime


def check_invariance(runtime_at: Callable[[int], CpuRuntime], items: Sequence[Mapping[str, np.ndarray]],
                     batch_invariant: bool, sizes: Sequence[int] = BATCH_SIZES,
                     offsets: Mapping[str, int] | None = None) -> InvarianceResult:
    """Each item alone (a batch-1 runtime), then inside batches of `sizes` (item i at slot i mod b among the
    items after it, cyclically): per output, whether its slice is bit-identical to the alone run."""
    if not items:
        raise InvarianceError("no inputs to check")
    alone_rt = runtime_at(1)
    alone = [alone_rt.run(join_items([it], offsets)).outputs for it in items]
    del alone_rt  # its prepared weights are not kept beside each batch size's runtime
    rows = []
    for b in sizes:
        rt = runtime_at(b)
        for start in range(0, len(items), b):  # windows of b items, wrapping: every item at one slot per size
            window = [(start + j) % len(items) for j in range(b)]
            outs = rt.run(join_items([items[i] for i in window], offsets)).outputs
            for slot, i in enumerate(window):
                if start + slot >= len(items):
                    continue  # a wrapped filler: its own window already checked it
                for name, ref in alone[i].items():
                    n = len(ref)
                    got = outs[name][slot * n:(slot + 1) * n]
                    same = got.shape == ref.shape and np.array_equal(got.view(np.uint64), ref.view(np.uint64))
                    diff = float(np.max(np.abs(got - ref), initial=0.0)) if got.shape == ref.shape else float("inf")
                    rows.append({"item": i, "batch": b, "slot": slot, "output": name, "identical": bool(same),
                                 "max_abs_diff": diff})
    return InvarianceResult(pd.DataFrame(rows, columns=["item", "batch", "slot", "output", "identical", "max_abs_diff"]),
                            batch_invariant)


def job_graph_at(job) -> Callable[[int], Graph]:
    """The job's graph rebuilt at another batch size: an LLM's workload or MiniLM's encoder."""
    if job.llm is not None:
        from ..models.llm import build_workload

        def llm(b: int) -> Graph:
            return build_workload(job.llm.model, dataclasses.replace(job.llm.workload, batch=b)).graph
        return llm
    if job.name == "minilm":
        from ..models.bert import load_minilm
        seq = int(job.graph.inputs["ids"].shape[1])
        return lambda b: load_minilm(b, seq).graph
    raise InvarianceError(f"--check-invariance rebuilds the job at batch sizes 1, 2, 4, 8: MiniLM and LLMs can be, "
                          f"{job.name!r} cannot")


def job_batch(job) -> int:
    return job.llm.workload.batch if job.llm is not None else int(job.graph.inputs["ids"].shape[0])


def job_offsets(job) -> dict[str, int]:
    """An LLM's `positions` are flat cache rows, b * max_cache + position (models/llama.py)."""
    return {"positions": int(job.llm.built.max_cache)} if job.llm is not None else {}


def write_invariance(result: InvarianceResult, out_dir: str | Path) -> Path:
    out_dir = Path(out_dir)
    with atomic_files(out_dir) as staging:
        (staging / INVARIANCE_FILE).write_text(result.rows.to_csv(index=False), encoding="utf-8")
    return out_dir / INVARIANCE_FILE
