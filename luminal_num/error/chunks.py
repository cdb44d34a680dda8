"""Per-chunk verdicts: a genome's end-to-end outputs composed from its chunks, each judged alone.

One FP64 pass per calibration batch keeps every chunk's exact inputs and outputs (Fp64Reference). A
chunk's candidate runs alone on its exact inputs: its local error is the deviation of its exports from
FP64. Its effect on the final outputs is the FP64 run of the rest of the model with that deviation
injected at the chunk's exports (EXACT), or, cheaper, the injected effect of the chunk's FP32 local
error scaled by the ratio of the two local errors' L2 norms (SCALED: first order, the rest of the model
is linear in a small error and rounding errors of one chunk share a pattern). A genome's predicted
outputs are FP64 plus the sum of its chunks' effects (first-order additivity across chunks); the judge
checks the budget on them and calibrates the composition against end-to-end runs.

Everything is cached by (group structure, chunk index, chunk candidate key, batch), so a genome that
changes one layer costs one chunk run, and per-layer mixtures of known chunk choices cost nothing.
SCALED needs only the ratio of a choice's local error to the FP32 chunk's, so a choice runs on the first
batch only (the basis, injected exactly, covers every batch); and in a group of many structurally equal
chunks (the layers) a choice's ratio, measured on SHARE_SAMPLES chunks spread over the group, is shared by
the others when the samples agree within SHARE_SPREAD (a layer that differs shows up as disagreement,
and then every chunk is run). A chunk choice of several knobs whose single knobs were each run on that chunk is not run at all: its
local deviation is the FP32 chunk's plus the sum of the singles' deviations from it (independent
roundings add, to first order), once LOCAL_CHECKS such compositions matched their own runs within
LOCAL_TOL; every LOCAL_SPOT-th composable choice is still run as a check, and a miss turns it off.

With the memory plan's streaming on, a chunk's weights' file pages go back after the chunk, here or in a
pool worker: its run (CpuRuntime) and its FP64 evaluation (evaluate_chunk_batches) release each weight
after its last reader in the chunk (hlir.store.STREAMING), so judging a layer holds that layer's weights.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable, Mapping, Protocol, Sequence

import numpy as np

from ..codegen.llir import Program
from ..hlir.evaluate import evaluate_chunk_batches
from ..hlir.graph import Graph
from ..hlir.partition import Chunk, Partition, chunk_key
from .reference import Fp64Reference
from .executors import Executor
from .held import HeldArrays, Spilled, load
from .tasks import RunTask, run_task

Outputs = dict[str, np.ndarray]
Devs = list[dict[int, np.ndarray]]  # per batch: export node -> deviation from FP64

LOCAL_CHECKS = 3   # composed local errors checked against their runs before the composition decides
LOCAL_TOL = 1.3    # a composed local error further than this factor from its run turns composition off
LOCAL_SPOT = 8     # every LOCAL_SPOT-th composable chunk choice is run anyway, as a check
SHARE_MIN = 4      # groups of at least this many chunks share a choice's local-error ratio across chunks ...
SHARE_SAMPLES = 3  # ... once it was measured on this many of them (spread over the group) ...
SHARE_SPREAD = 2.0  # ... and the samples' ratios agree within this factor (else every chunk is run)


class ChunkChoice(Protocol):
    """What a chunk runs (the search's per-chunk candidate): identified by its key."""

    @property
    def key(self) -> str: ...


class Propagation(enum.Enum):
    EXACT = "exact"    # the FP64 run of the rest of the model with the chunk's own deviation injected
    SCALED = "scaled"  # the FP32 chunk's injected effect, scaled by the local errors' L2 ratio


@dataclass(frozen=True)
class ChunkEffect:
    """`outputs` = `scale` x `basis`: a SCALED effect keeps its basis's arrays (one set per chunk, not one
    per chunk choice: on SmolLM2 each is a batch of 49152-wide logits) and scales them when read."""

    local: float                  # relative L2 of the chunk's exports vs FP64 (all exports together)
    basis: tuple[Mapping[str, np.ndarray | Spilled], ...]  # per batch: deviation of every final output caused
    scale: float = 1.0            # ... by this chunk alone, times this (arrays past a budget held in a file)

    @property
    def outputs(self) -> tuple[Outputs, ...]:
        return tuple({k: self.scale * load(v) if self.scale != 1.0 else load(v) for k, v in out.items()}
                     for out in self.basis)


@dataclass(frozen=True)
class ChunkLayout:
    """Where the chunks are: the graph, its partition, the FP64 references, and what each chunk is."""
    graph: Graph
    part: Partition
    references: tuple[Fp64Reference, ...]
    structure: Mapping[int, str]         # chunk -> its structure key (chunks of one group share it)
    chunks: Mapping[int, Chunk]          # chunk index -> chunk
    group: Mapping[int, object]          # chunk index -> its group
    outputs: Mapping[str, int]           # the final outputs effects are kept for -> their nodes
    # chunks whose exports no later chunk reads (the LM head): their effect is their own deviation, so
    # SCALED's shortcut would only lose its direction (KL and top-1 of 49152 logits depend on it); exact
    # for the price of running them on every batch, with nothing to inject
    terminal: frozenset[int]

    @staticmethod
    def of(graph: Graph, part: Partition, references: Sequence[Fp64Reference],
           outputs: Sequence[str] | None) -> "ChunkLayout":
        return ChunkLayout(graph, part, tuple(references), {c.index: chunk_key(graph, c) for c in part.chunks},
                           {c.index: c for c in part.chunks}, {c.index: g for g in part.groups for c in g.chunks},
                           {k: v for k, v in graph.outputs.items() if outputs is None or k in outputs},
                           frozenset(c.index for c in part.chunks
                                     if not any(n in later.external for later in part.chunks[c.index + 1:]
                                                for n in c.exported)))


class ChunkRunner:
    """Runs chunk programs: on the pool ahead of need (prefetch), else here when an effect needs one."""

    def __init__(self, layout: ChunkLayout, lower_chunk: Callable[[Chunk, ChunkChoice], Program],
                 pool: Executor | None):
        self.layout, self.lower_chunk, self.pool = layout, lower_chunk, pool
        self.ran: dict[tuple[int, str], object] = {}  # (chunk, choice key) -> outputs run on the pool
        self.runs = 0                                 # chunk programs run (each on every batch it needs)

    def task(self, chunk: Chunk, choice: ChunkChoice, refs: Sequence[Fp64Reference]) -> RunTask:
        """The chunk alone on its exact FP64 inputs (the batches `refs`): a pure task (error/tasks.py)."""
        graph = self.layout.graph
        return RunTask(self.lower_chunk(chunk, choice),
                       tuple({f"%{n}": np.asarray(ref.values[n]) for n in chunk.external
                              if graph.weight_name(n) is None} for ref in refs),  # weights: the runtime's
                       tuple(ref.bindings for ref in refs))

    def run_on_pool(self, todo: Mapping[tuple[int, str], RunTask]) -> None:
        results = self.pool.map(list(todo.values()))
        self.runs += len(todo)
        self.ran.update(zip(todo, results))

    def outputs(self, chunk: Chunk, choice: ChunkChoice, task: Callable[[], RunTask], fresh: bool) -> list:
        """The chunk's outputs per batch: run on the pool already (unless `fresh`), else run here."""
        got = None if fresh else self.ran.pop((chunk.index, choice.key), None)
        if got is None:
            self.runs += 1
            got = run_task(task(), self.layout.graph.weights)
        if isinstance(got, Exception):
            raise got
        return got


class LocalComposition:
    """A chunk choice of several knobs whose single knobs were each run on that chunk is not run at all:
    its local deviation is the FP32 chunk's plus the sum of the singles' deviations from it, once
    LOCAL_CHECKS such compositions matched their own runs within LOCAL_TOL (every LOCAL_SPOT-th is still
    run as a check, and a miss turns composition off)."""

    def __init__(self, changes_of: Callable[[ChunkChoice], frozenset | None] | None):
        self.changes_of = changes_of  # the (e-class, tag) knobs a chunk choice sets (None: unknown, always run)
        self.singles: dict[tuple[int, tuple], Devs] = {}  # (chunk, knob) or (chunk, ()) -> deviations run
        self.plan: dict[tuple[int, str], bool] = {}  # (chunk, choice key) -> composed (True) or run
        self.composable = 0
        self.composed = 0             # chunk choices whose local deviation was composed, not run
        self.checks: list = []        # (composed, run) local errors of checked compositions
        self.off = ""                 # why composition was turned off ("" while it is on)

    def knobs(self, choice: ChunkChoice) -> frozenset | None:
        return None if self.changes_of is None else self.changes_of(choice)

    def has_singles(self, i: int, knobs) -> bool:
        return (i, ()) in self.singles and all((i, k) in self.singles for k in knobs)

    def composes(self, i: int, choice: ChunkChoice) -> bool:
        """Whether this chunk choice's deviation is composed from its single knobs (decided once)."""
        key = (i, choice.key)
        if key not in self.plan:
            knobs = self.knobs(choice)
            ok = knobs is not None and len(knobs) >= 2 and self.has_singles(i, knobs)
            if ok:
                self.composable += 1
                ok = not self.off and len(self.checks) >= LOCAL_CHECKS and self.composable % LOCAL_SPOT != 0
            self.plan[key] = ok
        return self.plan[key]

    def devs(self, i: int, knobs: frozenset) -> Devs:
        """The FP32 chunk's deviation plus each single knob's deviation from it (first order)."""
        base = self.singles[(i, ())]
        out = []
        for b, d0 in enumerate(base[:min(len(self.singles[(i, k)]) for k in knobs)]):
            row = {}
            for n, held in d0.items():
                v = load(held)
                row[n] = np.asarray(v, np.float64) + sum(np.asarray(load(self.singles[(i, k)][b][n]), np.float64) - v
                                                         for k in sorted(knobs))
            out.append(row)
        return out

    def check(self, composed: float, run: float) -> None:
        self.checks.append((composed, run))
        if composed > 0 and run > 0 and np.isfinite(composed) and np.isfinite(run):
            q = max(composed / run, run / composed)
        else:
            q = 1.0 if composed == run else np.inf
        if q > LOCAL_TOL and not self.off:
            self.off = (f"a composed local error was {q:.3g}x its run (tolerance {LOCAL_TOL}): "
                        f"chunk choices of several knobs are run")


class SharedRatios:
    """In a group of many structurally equal chunks (the layers) a choice's SCALED ratio, measured on
    SHARE_SAMPLES chunks spread over the group, is shared by the others when the samples agree within
    SHARE_SPREAD (a layer that differs shows up as disagreement, and then every chunk is run)."""

    def __init__(self, layout: ChunkLayout):
        self.layout = layout
        self.ratios: dict[tuple[str, str], dict[int, float]] = {}  # (group, choice key) -> chunk -> ratio
        self.shared = 0  # chunk choices whose local ratio came from the group's samples

    def record(self, i: int, choice: ChunkChoice, ratio: float) -> None:
        self.ratios.setdefault((self.layout.group[i].key, choice.key), {})[i] = ratio

    def sampled(self, group_key: str, choice_key: str) -> int:
        return len(self.ratios.get((group_key, choice_key), {}))

    def ratio(self, i: int, choice: ChunkChoice) -> float | None:
        """The group's shared local-error ratio for this choice (geometric mean of its samples), or None
        when the group is small, the samples are too few, or they disagree."""
        g = self.layout.group[i]
        if len(g.chunks) < SHARE_MIN:
            return None
        got = self.ratios.get((g.key, choice.key), {})
        rs = np.array([r for c, r in got.items() if c != i])
        if len(rs) < SHARE_SAMPLES or not np.all(np.isfinite(rs)) or np.any(rs <= 0) \
                or rs.max() > SHARE_SPREAD * rs.min():
            return None
        return float(np.exp(np.mean(np.log(rs))))


class ChunkEffects:
    """`lower_chunk(chunk, choice)` is the chunk alone as a Program (inputs "%<node>", weights by their
    names, exports as outputs), supplied by the search; `base` is each chunk's FP32 candidate (the
    SCALED basis). `pool` runs the chunk programs a genome needs in parallel; `changes_of` gives the knobs
    a chunk choice sets (enables local composition); `local_batches`: SCALED: batches a non-FP32 choice
    runs on (None: all); `outputs`: the final outputs effects are kept for (None: all); `held`: where the
    kept deviations live (error/held.py; None: all in memory)."""

    def __init__(self, graph: Graph, part: Partition, references: Sequence[Fp64Reference],
                 lower_chunk: Callable[[Chunk, ChunkChoice], Program], base: Mapping[int, ChunkChoice],
                 propagation: Propagation = Propagation.SCALED, pool: Executor | None = None,
                 changes_of: Callable[[ChunkChoice], frozenset | None] | None = None,
                 local_batches: int | None = 1, outputs: Sequence[str] | None = None,
                 held: HeldArrays | None = None):
        if not references:
            raise ValueError("per-chunk verdicts need at least one FP64 reference batch")
        self.layout = ChunkLayout.of(graph, part, references, outputs)
        self.base, self.propagation = base, propagation
        self.runner = ChunkRunner(self.layout, lower_chunk, pool)
        self.local = LocalComposition(changes_of)
        self.ratios = SharedRatios(self.layout)
        self.cache: dict = {}  # (structure, chunk, choice key, propagation) -> ChunkEffect
        self.held = held if held is not None else HeldArrays()
        self.injections = 0    # FP64 runs of the rest of the model
        self._base_total: tuple | None = None  # (refs, compose(base, refs)) for alone()
        self._nb = len(references) if propagation is Propagation.EXACT or local_batches is None \
            else min(local_batches, len(references))

    # what the search's statistics report
    pool = property(lambda self: self.runner.pool)
    runs = property(lambda self: self.runner.runs)
    structure = property(lambda self: self.layout.structure)
    composed = property(lambda self: self.local.composed)
    local_checks = property(lambda self: self.local.checks)
    compose_off = property(lambda self: self.local.off)
    shared = property(lambda self: self.ratios.shared)

    def _key(self, chunk_index: int, choice: ChunkChoice) -> tuple:
        mode = self.propagation
        if mode is Propagation.SCALED and (choice.key == self.base[chunk_index].key
                                           or chunk_index in self.layout.terminal):
            mode = Propagation.EXACT  # the basis itself is injected exactly; a terminal chunk needs no injection
        return (self.layout.structure[chunk_index], chunk_index, choice.key, mode)

    def effect(self, chunk_index: int, choice: ChunkChoice) -> ChunkEffect:
        key = self._key(chunk_index, choice)
        mode = key[3]
        if key not in self.cache:
            self.cache[key] = self._effect(self.layout.chunks[chunk_index], choice, mode)
        return self.cache[key]

    def _effect(self, chunk: Chunk, choice: ChunkChoice, mode: Propagation) -> ChunkEffect:
        refs = self.layout.references
        if mode is Propagation.SCALED:
            r = self.ratios.ratio(chunk.index, choice)
            if r is not None:
                basis = self.effect(chunk.index, self.base[chunk.index])
                self.ratios.shared += 1
                return ChunkEffect(r * basis.local, basis.basis, r * basis.scale)
        try:
            devs = self._devs(chunk, choice)
        except (ValueError, FloatingPointError):  # e.g. a REJECT overflow policy: the chunk cannot run
            return ChunkEffect(float("inf"), tuple({k: np.full(np.shape(ref.values[nid]), np.inf)
                                                    for k, nid in self.layout.outputs.items()} for ref in refs))
        local = _rel(devs[:self._nb], refs[:self._nb], chunk)
        if mode is Propagation.SCALED:
            basis = self.effect(chunk.index, self.base[chunk.index])
            if basis.local > 0 and np.isfinite(local):
                s = local / basis.local
                self.ratios.record(chunk.index, choice, s)
                return ChunkEffect(local, basis.basis, s * basis.scale)
        if len(devs) < len(refs):
            # no scaled shortcut (the FP32 chunk is exact, e.g. an embedding gather, so there is no ratio):
            # the choice was run on the first batches only; its effect needs every batch, injected exactly
            devs = self._local(chunk, choice, every_batch=True)
        # kept in float32 (a deviation to 7 digits of itself): an EXACT effect holds its own arrays, on
        # SmolLM2 3 batches of 8 x 49152 logits per chunk choice
        return ChunkEffect(local, tuple({k: self.held.hold(v.astype(np.float32)) for k, v in outs.items()}
                                        for outs in self._inject(chunk, refs, devs)))

    def _task(self, chunk: Chunk, choice: ChunkChoice, every_batch: bool = False) -> RunTask:
        """The chunk alone on its exact FP64 inputs (every batch the effect needs)."""
        exact = every_batch or self._key(chunk.index, choice)[3] is Propagation.EXACT
        refs = self.layout.references
        return self.runner.task(chunk, choice, refs if exact else refs[:self._nb])

    def _devs(self, chunk: Chunk, choice: ChunkChoice) -> Devs:
        """The chunk choice's deviations: composed from its singles, or run (and then kept when it is
        the FP32 chunk or a single knob, and checked against the composition when one exists)."""
        lc, refs = self.local, self.layout.references
        knobs = lc.knobs(choice)
        if lc.composes(chunk.index, choice):
            lc.composed += 1
            return lc.devs(chunk.index, knobs)
        devs = self._local(chunk, choice)
        if knobs is not None and len(knobs) <= 1:
            lc.singles[(chunk.index, tuple(knobs)[0] if knobs else ())] = \
                [{n: self.held.hold(v.astype(np.float32)) for n, v in d.items()} for d in devs]
        elif knobs is not None and lc.has_singles(chunk.index, knobs):
            composed = lc.devs(chunk.index, knobs)
            lc.check(_rel(composed, refs, chunk), _rel(devs[:len(composed)], refs, chunk))
        return devs

    def prefetch(self, candidates: Mapping[int, ChunkChoice]) -> None:
        """Run, on the pool, every chunk program the candidates' effects still need (and their bases):
        first the samples of choices a large group will share (and the rest of a small group), then the
        chunks whose samples disagree."""
        if self.runner.pool is None:
            return
        group = self.layout.group
        wanted = [(i, ch) for i, choice in candidates.items()
                  for ch in ((choice, self.base[i]) if self.propagation is Propagation.SCALED else (choice,))]
        later = []
        if self.propagation is Propagation.SCALED:
            by_group: dict[tuple[str, str], list[int]] = {}
            for i, ch in wanted:
                if ch.key != self.base[i].key and len(group[i].chunks) >= SHARE_MIN:
                    by_group.setdefault((group[i].key, ch.key), []).append(i)
            for (gk, ck), idx in by_group.items():
                have = self.ratios.sampled(gk, ck)
                idx = sorted(idx)
                need = max(SHARE_SAMPLES - have, 0)
                picks = {idx[round(j * (len(idx) - 1) / max(need - 1, 1))] for j in range(need)} if need else set()
                later += [i for i in idx if i not in picks]
        hold = set(later)
        first = [(i, ch) for i, ch in wanted if not (i in hold and ch.key != self.base[i].key)]
        self._run_on_pool(first)
        if later:
            for i, ch in first:  # the samples' ratios: what the others may share
                if ch.key != self.base[i].key:
                    self.effect(i, ch)
            self._run_on_pool([(i, candidates[i]) for i in sorted(hold)
                               if self.ratios.ratio(i, candidates[i]) is None])

    def _run_on_pool(self, wanted) -> None:
        todo = {}
        for i, ch in wanted:
            if self._key(i, ch) not in self.cache and (i, ch.key) not in self.runner.ran \
                    and not self.local.composes(i, ch):
                todo.setdefault((i, ch.key), (self.layout.chunks[i], ch))
        self.runner.run_on_pool({k: self._task(c, ch) for k, (c, ch) in todo.items()})

    def _local(self, chunk: Chunk, choice: ChunkChoice, every_batch: bool = False) -> list[dict[int, np.ndarray]]:
        """Per batch: the chunk's exports minus FP64, run alone on the exact FP64 inputs (every_batch:
        on all of them, whatever the propagation mode would run)."""
        got = self.runner.outputs(chunk, choice, lambda: self._task(chunk, choice, every_batch), every_batch)
        return [{n: np.asarray(o[f"%{n}"], np.float64) - np.asarray(ref.values[n], np.float64) for n in chunk.exported}
                for o, ref in zip(got, self.layout.references)]

    def _inject(self, chunk: Chunk, refs: Sequence[Fp64Reference], devs: Devs) -> list[Outputs]:
        """Per batch: the final outputs' deviation when its `dev` is added at the chunk's exports and
        everything after runs in FP64 (only the chunks that read a changed value are re-run; the batches
        run together, so a streamed weight is read once for all of them)."""
        refs = refs[:len(devs)]
        self.injections += len(refs)
        graph = self.layout.graph
        changed = [{n: np.asarray(ref.values[n], np.float64) + d for n, d in dev.items()} for ref, dev in zip(refs, devs)]
        touched = set(devs[0]) if devs else set()  # every batch deviates at the same exports
        for c in self.layout.part.chunks[chunk.index + 1:]:
            if not any(n in touched for n in c.external):
                continue
            ext = [{n: ch[n] if n in ch else np.asarray(ref.values[n]) for n in c.external
                    if graph.weight_name(n) is None}  # weights: evaluate_chunk_batches reads the graph's
                   for ch, ref in zip(changed, refs)]
            vals = evaluate_chunk_batches(graph, c.nodes, ext, [ref.bindings for ref in refs])
            for ch, v in zip(changed, vals):
                ch.update({n: np.asarray(v[n], np.float64) for n in c.exported})
            touched.update(c.exported)
        return [{name: (ch[nid] - np.asarray(ref.values[nid], np.float64)) if nid in touched
                 else np.zeros(np.shape(ref.values[nid])) for name, nid in self.layout.outputs.items()}
                for ch, ref in zip(changed, refs)]

    def compose(self, candidates: Mapping[int, ChunkChoice], refs: Sequence[Mapping[str, np.ndarray]],
                only: Sequence[int] | None = None) -> list[Outputs]:
        """Predicted outputs per batch: FP64 plus the sum of the chunks' effects (`only`: those chunks)."""
        idx = sorted(candidates) if only is None else list(only)
        effects = [self.effect(i, candidates[i]) for i in idx]
        return [{k: _accumulate(np.array(r, np.float64), ((e.scale, load(e.basis[b][k])) for e in effects))
                 for k, r in ref.items()} for b, ref in enumerate(refs)]

    def alone(self, i: int, choice: ChunkChoice, refs: Sequence[Mapping[str, np.ndarray]]) -> list[Outputs]:
        """compose() of the FP32 genome with chunk i's choice swapped in, from the FP32 genome's composed
        outputs (kept): one effect read, not one per chunk."""
        if self._base_total is None or self._base_total[0] is not refs:
            self._base_total = (refs, self.compose(self.base, refs))
        e, e0 = self.effect(i, choice), self.effect(i, self.base[i])
        return [{k: _accumulate(np.array(v), ((e.scale, load(e.basis[b][k])), (-e0.scale, load(e0.basis[b][k]))))
                 for k, v in tot.items()} for b, tot in enumerate(self._base_total[1])]


def _accumulate(out: np.ndarray, terms) -> np.ndarray:
    """out += sum of scale x array, in place (no temporaries per term beyond one product)."""
    for scale, arr in terms:
        if scale == 1.0:
            out += arr
        else:
            out += scale * np.asarray(arr, np.float64)
    return out


def _rel(devs: list[dict[int, np.ndarray]], refs: Sequence[Fp64Reference], chunk: Chunk) -> float:
    """Relative L2 of all exports over all batches together (float exports only)."""
    num = den = 0.0
    for dev, ref in zip(devs, refs):
        for n, d in dev.items():
            r = np.asarray(ref.values[n])
            if r.dtype.kind != "f":
                continue
            num += float(np.sum(d * d))
            den += float(np.sum(np.asarray(r, np.float64) ** 2))
    if not np.isfinite(num):
        return float("inf")
    return float(np.sqrt(num / den)) if den > 0 else (0.0 if num == 0 else float("inf"))
