"""Teacher-forced positions: every position of windows over the calibration prompts, judged through the
decode plan (issue 32: a token-level verdict needs thousands of positions, not one per prompt).

A prompt's text stream is its tokens followed by the FP64 model's greedy continuation; a window is
`context` consecutive tokens of it (the workload's cache), read as a document of its own (positions from
0, as llama-perplexity reads a text in independent contexts). Position p of a window is one decode step,
exactly what decode_batches feeds at a prompt's last token: token p at position p with the FP64 cache rows
of tokens < p, so the plan and FP64 see the same context. Its next token is the window's token p + 1 (the
prompt's own text, then FP64's greedy tokens), and after the last one FP64's own argmax. Windows are taken
prompt by prompt (every prompt's first window, then second windows ...) until `minimum` positions, and
run `batch` at a time as the workload runs them (a short last group repeats its first windows, counted
once). Nothing is held per step: a group's FP64 logits come from one FP64 pass over its windows, and each
step's inputs are cut from that pass's cache rows when the step runs. The pass is the same for every plan
judged on the positions, so it is kept for the next one (within FP64_HELD_BYTES): it was ~10 s of a 30-layer
SmolLM2 pass's 16 s of step building.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from .llm import LlmModel, Prompt, fitting_ids, prefix_caches
from .reference import Fp64State

@dataclass(frozen=True)
class PositionBatch:
    """One step of the workload over real positions (what error/pooled.py judges): its inputs, FP64's logits
    and each row's next token; only the first `rows` rows are positions (a short last group repeats windows)."""
    inputs: dict[str, np.ndarray]
    reference: np.ndarray  # (batch rows, vocab) FP64 logits
    targets: np.ndarray    # (batch rows,) next tokens
    rows: int


@dataclass(frozen=True)
class TeacherForcedWindows:
    """Windows over `prompts` until at least `minimum` positions (`cut`: a prompt longer than the context is
    cut to its first tokens, else refused, as decode_batches does), made when first read (the continuation
    costs FP64 passes), and streamed through the workload's decode graph."""
    model: LlmModel
    built: object                       # a decode workload's built LlamaModel | GemmaModel (batch, max_cache)
    prompts: tuple[Prompt, ...]
    minimum: int
    cut: bool = False
    output: str = "logits"
    _made: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)  # windows, shared by widened()

    def __post_init__(self):
        if not self.prompts:
            raise ValueError("teacher-forced positions need at least one prompt")
        if self.minimum < 1:
            raise ValueError(f"the positions' minimum must be >= 1, got {self.minimum}")

    @property
    def graph(self):
        """The decode step's HLIR graph these positions run through."""
        return self.built.graph

    @property
    def held_bytes(self) -> int:
        """The most this source (and its widened copies, which share its passes) keeps between passes."""
        return FP64_HELD_BYTES

    def release(self) -> None:
        """Drop the FP64 passes kept between passes (the windows stay): the compile's last pass is done."""
        self._made.pop("fp64", None)

    @property
    def rows(self) -> int:
        return self.built.batch

    def widened(self, rows: int) -> "TeacherForcedWindows":
        """The same windows run `rows` at a time: the workload rebuilt with that many sequences per step (a
        decode step's rows are independent; the compile checks the program it runs there is the plan's)."""
        if rows == self.built.batch:
            return self
        built = self.model.architecture.build(self.model.config, self.model.weights, 1, self.built.max_cache, rows)
        return dataclasses.replace(self, built=built)

    @property
    def windows(self) -> tuple[tuple[int, ...], ...]:
        if "windows" not in self._made:
            self._made["windows"] = self._windows()
        return self._made["windows"]

    def _windows(self) -> tuple[tuple[int, ...], ...]:
        ctx, prompts = self.built.max_cache, self.prompts
        count = -(-self.minimum // ctx)  # windows needed
        per_prompt = [count // len(prompts) + (i < count % len(prompts)) for i in range(len(prompts))]
        used = [(fitting_ids(self.model, p, 0, ctx, self.cut), n) for p, n in zip(prompts, per_prompt) if n]
        streams = _continued(self.model, [row for row, _ in used], [n * ctx for _, n in used])
        return tuple(tuple(stream[k * ctx:(k + 1) * ctx]) for k in range(max(n for _, n in used))
                     for stream, (_, n) in zip(streams, used) if k < n)

    @property
    def positions(self) -> int:
        return sum(len(w) for w in self.windows)

    def batches(self) -> Iterator[PositionBatch]:
        """Every step of every group of `batch` windows, group after group."""
        b = self.built.batch
        for start in range(0, len(self.windows), b):
            group = list(self.windows[start:start + b])
            real = len(group)
            group += [group[i % real] for i in range(b - real)]  # a short last group: its own windows again, not counted
            yield from self._group(group, real, self._fp64_pass(group, (start, b)))

    def _group(self, group: list[tuple[int, ...]], real: int, ran: "GroupPass") -> Iterator[PositionBatch]:
        fp64 = self.model.fp64
        for s in range(len(group[0])):
            positions = [s] * len(group)
            inputs = self.built.make_batch_inputs(np.array([w[s] for w in group])[:, None],
                                                  np.array(positions)[:, None], prefix_caches(ran.k, ran.v, s, self.built),
                                                  positions)
            reference = fp64.head(np.ascontiguousarray(ran.hidden[:, s]))
            targets = np.array([w[s + 1] if s + 1 < len(w) else int(np.argmax(reference[j]))
                                for j, w in enumerate(group)])
            yield PositionBatch(inputs, reference, targets, real)

    def _fp64_pass(self, group: list[tuple[int, ...]], key: tuple[int, int]) -> "GroupPass":
        """The FP64 pass over a group's windows (the same for every plan judged on them): made once and kept
        while every pass kept stays within FP64_HELD_BYTES, else made again for every pass over the group."""
        held = self._made.setdefault("fp64", {})
        if key in held:
            return held[key]
        if len({len(w) for w in group}) != 1:
            raise ValueError("a group's windows must be equally long (each is the context's tokens)")
        ran = GroupPass.of(self.model.fp64.hidden_many([list(w) for w in group]))
        if sum(p.nbytes for p in held.values()) + ran.nbytes <= FP64_HELD_BYTES:
            held[key] = ran
        return ran


FP64_HELD_BYTES = 256 << 20  # FP64 passes kept for the next pass over the positions (SmolLM2's 2,048: 198 MB)


@dataclass(frozen=True)
class GroupPass:
    """One FP64 pass over a group of equally long windows: the hidden rows after the last layer and every
    layer's K and V rows, each stacked over the windows, (windows, positions, width)."""
    hidden: np.ndarray
    k: tuple[np.ndarray, ...]
    v: tuple[np.ndarray, ...]

    @staticmethod
    def of(ran: list[tuple[np.ndarray, Fp64State]]) -> "GroupPass":
        """Fp64Llama.hidden_many's result stacked; each sequence's rows are let go as their layer is stacked
        (the pass is held once, not twice)."""
        hidden = np.stack([x for x, _ in ran])
        ks, vs = [list(st.k) for _, st in ran], [list(st.v) for _, st in ran]
        del ran
        return GroupPass(hidden, _stacked_layers(ks), _stacked_layers(vs))

    @property
    def nbytes(self) -> int:
        return self.hidden.nbytes + sum(a.nbytes for a in self.k + self.v)


def _stacked_layers(rows: list[list[np.ndarray]]) -> tuple[np.ndarray, ...]:
    """rows[sequence][layer] -> per layer the sequences' rows stacked, each sequence's array let go once stacked."""
    out = []
    for layer in range(len(rows[0]) if rows else 0):
        out.append(np.stack([seq[layer] for seq in rows]))
        for seq in rows:
            seq[layer] = None
    return tuple(out)


def _continued(model: LlmModel, ids: list[list[int]], lengths: list[int]) -> list[list[int]]:
    """Each prompt's ids followed by FP64's greedy continuation to `lengths` tokens: every sequence that needs
    tokens steps together (one pass over the weights per step), and only each step's next token is kept
    (Fp64Llama.greedy_many keeps every step's logits: a 49152-wide row per token)."""
    fp64 = model.fp64
    out = [list(row[:n]) for row, n in zip(ids, lengths)]
    live = [j for j, (row, n) in enumerate(zip(ids, lengths)) if len(row) < n]
    ran = fp64.hidden_many([ids[j] for j in live]) if live else []
    while live:
        logits = fp64.head(np.stack([x[-1] for x, _ in ran]))
        for j, row in zip(live, logits):
            out[j].append(int(np.argmax(row)))
        more = [i for i, j in enumerate(live) if len(out[j]) < lengths[j]]
        if more:
            ran = fp64.hidden_many([[out[live[i]][-1]] for i in more], [ran[i][1] for i in more])
        live = [live[i] for i in more]
    return out
