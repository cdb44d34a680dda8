"""compile(graph, budget, target, calibration) -> Plan: the whole pipeline as a straight line of stages.

partition -> saturate -> reference -> headroom -> search -> confirm -> positions -> plan: each stage reads
what the ones before it returned (one typed result each) and the one CompileContext, created once the
headroom is known (budget, gate, headroom, target, the task pool); `on_stage` hears each stage's name and
time. An LLM decode job's measurements are judged on its teacher-forced positions (PositionsJudge).
"""
from __future__ import annotations

import dataclasses
import gc
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Sequence

import numpy as np

from . import interrupts
from .codegen.invariance import row_coupled_kernels
from .codegen.llir import Program
from .error.budget import Budget
from .error.chunks import ChunkEffects, Propagation
from .error.headroom import HeadroomEstimate, estimate_headroom
from .error.held import HeldArrays
from .quant.stored import CONVERTED
from .error.hessians import HessianCollector, positions_hessians
from .error import pooled
from .error.judge import Judge
from .error.metrics import METRICS
from .error.pooled import PositionSource
from .error.reference import Fp64Reference, reference_bytes, references
from .error.executors import Executor, ExecutorKind, ExecutorSpec
from .error.ray_pool import RayPool
from .error.tasks import TaskPool, TaskProgress, TaskTimes
from .error.verdict import Verdict, program_key
from .error.verdict_store import VerdictStore, context_key
from .hlir.graph import Graph
from .hlir.partition import Partition, partition
from .memory import MemoryPlan, plan_memory
from .quant.calibration import CALIBRATION, NO_HESSIANS, Hessians
from .blas_threads import one_blas_thread
from .runtime.heap import trim_heap
from .search.outcome import InvariancePrice, PositionsRecord
from .search.plan import Plan
from .search.recipes import baseline_genomes
from .search.search import Exploration, SearchOptions, SearchResult, confirm, explore
from .search.space import ChunkSite, Offers, SearchSpace
from .runtime.launch_form import program_latency
from .runtime.targets import get_target

STAGES = ("partition", "saturate", "reference", "headroom", "search", "confirm", "positions", "plan")


class BudgetUnreachable(RuntimeError):
    """No candidate meets the budget; carries the best error reachable."""

    def __init__(self, budget: Budget, best_error: float, best_label: str, result: SearchResult,
                 headroom: float = 1.0):
        super().__init__(f"no plan meets the budget {budget}: the best error reachable is an allclose ratio of "
                         f"{best_error!r} ({best_label}); a plan may use {headroom!r} of the budget on the "
                         f"calibration set (ratio <= {headroom!r}). Loosen the budget or check the model's "
                         f"FP32 error.")
        self.best_error, self.result = best_error, result


@dataclass(frozen=True)
class CompileResult:
    plan: Plan
    program: Program
    space: SearchSpace
    search: SearchResult
    # what the executor's verdict tasks cost (never in plan.json: the plan is the same wherever they ran)
    tasks: TaskTimes = field(default_factory=TaskTimes)


@dataclass(frozen=True)
class References:
    """The reference stage: the one FP64 pass per calibration batch, chunk boundaries kept, and the weights'
    calibration Hessians (when the space offers calibrated roundings)."""
    batches: tuple[Fp64Reference, ...]
    hessians: Hessians = NO_HESSIANS


def reference_stage(graph: Graph, calibration, space: SearchSpace,
                    positions: PositionSource | None = None) -> References:
    """The FP64 references; the Hessians GPTQ fills under come from the teacher-forced `positions` where an LLM
    has them (thousands of rows, POSITION_ROWS a step: error/hessians.positions_hessians), else from the
    calibration batches in the same pass (a few dozen rows for an LLM, which GPTQ over-fits)."""
    calibrated = space.offers_calibrated()
    collector = HessianCollector(graph) if calibrated and positions is None else None
    batches = tuple(references(graph, calibration, space.part, collector))
    if collector is not None:
        return References(batches, collector.result())
    return References(batches, positions_hessians(positions, POSITION_ROWS) if calibrated else NO_HESSIANS)


@dataclass(frozen=True)
class CompileContext:
    """What every stage after the headroom reads, created once: the user's budget, the gate candidates are
    judged against (the budget with the headroom's share of every allowance), the target, the options, the
    task pool chunk verdicts run on (None: one chunk, or one worker) and the verdict store."""
    graph: Graph
    calibration: tuple
    budget: Budget
    headroom: HeadroomEstimate
    gate: Budget
    target: str
    options: SearchOptions
    use_static: bool | str
    pool: Executor | None
    store: VerdictStore | None


StageListener = Callable[[str, float], None]  # (stage name, seconds), called as each stage finishes


def compile(graph: Graph, budget: Budget, target: str = "h200",
            calibration: Sequence[Mapping[str, np.ndarray]] = (), options: SearchOptions | None = None,
            space: SearchSpace | None = None, use_static: bool | str = "auto",
            cache_dir: str | Path | None = None, memory: MemoryPlan | None = None,
            on_stage: StageListener | None = None, positions: PositionSource | None = None) -> CompileResult:
    """The fastest plan found whose error vs FP64 on `calibration` is within `budget` on `target`
    (`target` wins over `options.target`). `cache_dir`: measured verdicts persist there (keyed by graph,
    weights, inputs and budget), so a second or interrupted compile of the same job reuses them.
    `memory`: the worker count and cache sizes (memory.py; default: planned for 80% of the available
    memory and `options.workers`). `space`: an already saturated space (partition and saturate skipped).
    `positions`: teacher-forced positions (an LLM's, models/llm_positions.py) the chosen plan is judged on
    again, pooled, before it is returned (error/pooled.py)."""
    options = options or SearchOptions(target=target)
    memory = memory or plan_memory(graph.weights, workers=options.workers,
                                   rotation=options.offers.rotation or options.offers.smoothing)
    with memory.applied(), CONVERTED.on_disk(Path(cache_dir) / "converted" if cache_dir else None):
        return _compile(graph, budget, target, calibration, options, space, use_static, cache_dir, memory,
                        on_stage or (lambda name, seconds: None), positions)


def _compile(graph: Graph, budget: Budget, target: str, calibration, options: SearchOptions,
             space: SearchSpace | None, use_static, cache_dir, memory: MemoryPlan,
             on_stage: StageListener, positions: PositionSource | None = None) -> CompileResult:
    _check_job(graph, budget, target, calibration, options)

    def stage(name: str, run: Callable[[], object], need: int = 0):
        interrupts.check()  # a Ctrl-C a finalizer swallowed during the last stage stops the compile here
        memory.check(name, need)  # stops with one line, before the stage, when it cannot fit (memory.py)
        t0 = time.perf_counter()
        out = run()
        on_stage(name, time.perf_counter() - t0)
        return out

    if space is None:
        part = stage("partition", lambda: partition(graph))
        space = stage("saturate", lambda: SearchSpace.saturated(graph, part, **vars(options.offers)))
    space = space.with_batch_invariance(options.batch_invariant)
    # one BLAS thread for the FP64 reference too: its products are small-M (a decode step's rows), where a second
    # OpenBLAS thread gains nothing on a quiet machine and, beside any other busy process, makes each call
    # wait on a descheduled thread (a 1B decode step's 8 x 8192 by 8192 x 32 blocks: 69 ms on one thread,
    # 19 s on two at load 3; the 1B reference stage took 8 s or 168 s depending on the machine's load)
    with one_blas_thread():
        refs = stage("reference", lambda: reference_stage(graph, calibration, space, positions),
                     min(reference_bytes(graph, space.part, calibration), memory.boundary))
    with ExitStack() as stack:
        # every verdict run from here on, here or in a worker, on one BLAS thread: the same bits wherever it runs
        stack.enter_context(one_blas_thread())
        stack.enter_context(CALIBRATION.installed(refs.hessians))  # what GPTQ-filled weights are filled under
        pool = chunks = exact = held = None
        if len(space.part.chunks) > 1:
            pool = stack.enter_context(open_executor(options.executor, graph.weights, memory.workers,
                                                     memory.worker_cache, refs.hessians, options.progress))
            held = HeldArrays(memory.judging)  # what both keep past the plan's share goes to a scratch file
            chunks, exact = (ChunkEffects(graph, space.part, list(refs.batches), space.lower_chunk,
                                          space.candidates(frozenset()), mode, pool=pool, changes_of=space.knobs_of,
                                          outputs=budget.outputs, held=held)
                             for mode in (Propagation.SCALED, Propagation.EXACT))
        # an LLM decode job's measurements are judged on its teacher-forced positions, when row statistics can
        # judge the budget (else on the calibration batches, and the positions stage says why it skipped): their
        # wider step is built now, so the caches are sized beside it
        wide = WidenedPositions(space, positions, POSITION_ROWS, options.offers) \
            if positions is not None and pooled.refusal(budget, positions.output) is None else None
        if wide is not None:
            wide.prepare()
        # the caches sized to what the budget leaves now, less what the judging store and the positions' FP64
        # passes will still hold; or one line
        memory.fit("search", growing=(0 if held is None else held.budget_bytes - held.in_memory)
                   + (positions.held_bytes if wide is not None else 0))
        ran: dict[str, list] = {}  # the headroom probes' outputs: the same programs are baselines of the search
        head = stage("headroom", lambda: choose_headroom(graph, budget, calibration, refs.batches, space,
                                                         options.headroom, ran, pool))
        gate = budget.gate(head.headroom)
        on_positions = PositionsJudge(wide, gate, budget, options.progress) if wide is not None else None
        ctx = CompileContext(graph, tuple(calibration), budget, head, gate, target, options, use_static, pool,
                             VerdictStore.open(cache_dir, context_key(graph, calibration, gate, budget,
                                                                      on_positions.positions if on_positions else 0))
                             if cache_dir else None)
        judge = Judge(graph, budget, list(calibration), use_static=use_static, headroom=head.headroom, gate=gate,
                      references=refs.batches, chunks=chunks, exact_chunks=exact, store=ctx.store, outputs_cache=ran,
                      positions=on_positions)
        explored = stage("search", lambda: explore(space, judge, options, latency_inputs=calibration[0],
                                                   target=target))
        result = stage("confirm", lambda: confirm(explored))
        if positions is not None:
            result = stage("positions", lambda: positions_stage(ctx, explored, result, positions, on_positions))
        planned = stage("plan", lambda: plan_stage(ctx, space, refs, judge, result))
        return planned if pool is None else dataclasses.replace(planned, tasks=dataclasses.replace(pool.times))


POSITIONS_JUDGED = 4  # plans the positions stage judges at most (each a pass over every position)
POSITION_ROWS = 32    # decode rows per run on the positions (fewer runs of a wider step; see positions_stage)


class PositionsJudge:
    """A program judged on every teacher-forced position, pooled (error/pooled.py): each end-to-end measurement
    of an LLM decode search (error/judge.EndToEnd) and the positions stage's. A decode step's rows are
    independent sequences, so the positions run POSITION_ROWS rows a step: the genome lowered on the step rebuilt
    with that many rows, used only when it launches the program's own kernels (kind, precision, dtype, storage,
    in order) and none of them couples rows (a scale taken over the batch, codegen/invariance.py); otherwise
    the program itself runs at the workload's rows. One pass per program: the same kernels on the same weights
    and positions compute the same bits, so another genome lowering to it takes its verdict."""

    def __init__(self, wide: "WidenedPositions", gate: Budget, budget: Budget, progress: bool = False):
        self.wide: WidenedPositions | None = wide
        self.source, self.gate, self.budget, self.progress = wide.source, gate, budget, progress
        self.judged: dict[tuple[int, str], tuple[Verdict, pooled.RowStats]] = {}  # (rows, program key) ->

    @property
    def positions(self) -> int:
        return self.source.positions

    @property
    def passes(self) -> int:
        """Programs judged on the positions so far (each one pass over every position)."""
        return len(self.judged)

    def judge(self, program: Program, genome) -> tuple[Verdict, pooled.RowStats, bool]:
        """The program's pooled verdict and row statistics, and whether a pass ran for it now."""
        if self.wide is None:
            raise RuntimeError("the positions were released (the positions stage ended)")
        run, on = self.wide.program(genome, program)
        key = (on.rows, program_key(run))
        ran = key not in self.judged
        if ran:
            self.judged[key] = pooled.judge_positions(run, on.graph.weights, on, self.gate, self.budget,
                                                      progress=self.progress)
            trim_heap()  # the pass's freed steps (~180 MB of FP64 caches each) back to the system
        verdict, stats = self.judged[key]
        return verdict, stats, ran

    def verdict(self, program: Program, genome) -> Verdict:
        """What the judge's measurements read (error/pooled.PooledJudge)."""
        return self.judge(program, genome)[0]

    def release(self) -> int:
        """Drop the wider step's space and graph (before the plan stage's memory check, issue 29); returns the
        widest rows a step the positions ran at."""
        rows = self.wide.rows_used
        self.wide = None
        self.source.release()  # its FP64 passes: every pass of the compile is done
        gc.collect()
        trim_heap()
        return rows


def positions_stage(ctx: CompileContext, explored: Exploration, result: SearchResult,
                    source: PositionSource, on_positions: PositionsJudge | None) -> SearchResult:
    """The chosen plan's verdict on every teacher-forced position pooled (thousands, where the search's
    calibration batches hold a few dozen): the search measured on them already (PositionsJudge), so this is
    the chosen plan's own pass unless its verdict was taken without a measurement; a rejected plan fails, and
    the next choice is confirmed and judged (at most POSITIONS_JUDGED passes here). An interrupted search, or a
    budget that row statistics cannot judge, skips the stage and says why. The record counts every program
    judged on the positions over the compile."""
    why = "the search was interrupted" if explored.interrupted else pooled.refusal(ctx.gate, source.output)
    if why is not None or result.chosen is None:  # no PositionsJudge only where row statistics cannot judge
        record = PositionsRecord(0, 0, {}, why) if on_positions is None else \
            PositionsRecord(on_positions.positions, on_positions.passes, {}, why or "no plan passed",
                            rows=on_positions.release())
        return dataclasses.replace(result, stats=dataclasses.replace(result.stats, positions=record))
    space = explored.searcher.space
    kept: dict[int, pooled.RowStats] = {}

    def judge(e):
        program = e.program if e.program is not None else space.program(e.genome)
        verdict, kept[e.id], ran = on_positions.judge(program, e.genome)
        return verdict, ran
    chosen, _ = explored.searcher.judged_again(judge, POSITIONS_JUDGED)  # on one BLAS thread, as every verdict
    rows_used = on_positions.release()
    stats = kept[chosen.id] if chosen is not None else None
    values = {} if stats is None else {n: float(m.of(pooled.PooledRows(stats))) for n, m in METRICS.items() if m.rows}
    record = PositionsRecord(on_positions.positions, on_positions.passes, values, rows=rows_used)
    return dataclasses.replace(result, chosen=chosen, evaluated=list(explored.searcher.evaluated),
                               stats=dataclasses.replace(result.stats, positions=record))


class WidenedPositions:
    """The positions `rows` rows a step, and a genome lowered there (saturated once, when first needed)."""

    def __init__(self, space: SearchSpace, source: PositionSource, rows: int, offers: Offers = Offers()):
        self.own, self.source, self.rows, self.offers = space, source, rows, offers
        self.wide: tuple[SearchSpace, PositionSource] | None = None
        self.rows_used = 0

    def prepare(self) -> None:
        """Build the wider step's space now (a compile does it before sizing its caches, so they leave room)."""
        if self.rows > self.source.rows and self.wide is None:
            source = self.source.widened(self.rows)
            self.wide = (SearchSpace.saturated(source.graph, partition(source.graph), **vars(self.offers))
                         .with_batch_invariance(self.own.batch_invariant), source)

    def program(self, genome, program: Program) -> tuple[Program, PositionSource]:
        """What runs on the positions: the genome at `rows` rows if it is the same program row by row, else
        the program itself on the workload's own rows."""
        own_rows = self.source.rows
        if self.rows > own_rows:
            self.prepare()
            space, source = self.wide
            widened = _genome_on(genome, self.own, space)
            if widened is not None:
                wide = space.program(widened)
                if _kernels(wide) == _kernels(program) and not row_coupled_kernels(wide):
                    self.rows_used = max(self.rows_used, self.rows)
                    return wide, source
        self.rows_used = max(self.rows_used, own_rows)
        return program, self.source


def _kernels(program: Program) -> list[tuple]:
    return [(k.kind.value, k.precision, k.dtype.name, k.acc.name if k.acc else None, k.storage, k.fill)
            for k in program.kernels]


def _genome_on(genome, space: SearchSpace, other: SearchSpace):
    """The genome's choices on another build of the same model (its groups in the same order, e-classes
    numbered alike), or None where the partitions differ."""
    keys, others = [g.key for g in space.part.groups], [g.key for g in other.part.groups]
    if len(keys) != len(others):
        return None
    at = dict(zip(keys, others))
    return frozenset((ChunkSite(at[site.group], site.chunk) if isinstance(site, ChunkSite) else at[site], cls, tag)
                     for site, cls, tag in genome)


def plan_stage(ctx: CompileContext, space: SearchSpace, refs: References, judge: Judge,
               result: SearchResult) -> CompileResult:
    """The chosen candidate as a Plan (or BudgetUnreachable naming the best error any candidate reached)."""
    result = dataclasses.replace(result, stats=dataclasses.replace(result.stats, headroom=ctx.headroom))
    if result.chosen is None:
        tried = [e for e in result.evaluated if np.isfinite(e.verdict.share.allclose)]
        best = min(tried, key=lambda e: e.verdict.share.allclose) if tried else result.evaluated[0]
        raise BudgetUnreachable(ctx.budget, best.verdict.share.user_allclose, best.label or f"candidate {best.id}",
                                result, ctx.headroom.headroom)
    chosen = result.chosen
    plan = Plan.create(space, chosen.genome, chosen.program, ctx.budget, ctx.target, ctx.options.seed, chosen.verdict,
                       chosen.latency, judge.latency_bindings, result.stats.record(with_seconds=False),
                       calibration_ranges(ctx.graph, space.part, refs.batches), ctx.graph.weights,
                       headroom=ctx.headroom.headroom)
    if space.batch_invariant:
        plan = plan.with_invariance_price(invariance_price(ctx, space, chosen.genome, chosen.latency,
                                                           judge.latency_bindings))
    return CompileResult(plan, chosen.program, space, result)


def invariance_price(ctx: CompileContext, space: SearchSpace, genome, latency, bindings) -> InvariancePrice:
    """The chosen genome's latency next to the same genome lowered without invariance, priced the way the
    search priced the chosen one (the target's model, or the CPU measured)."""
    plain = space.with_batch_invariance(False).program(genome)
    calibration = ctx.calibration[0] if ctx.calibration else None
    plain_latency = program_latency(plain, ctx.target, bindings, ctx.graph.weights, calibration,
                                    ctx.options.megakernel)
    return InvariancePrice(latency.target, latency.source, latency.total_s, plain_latency.total_s)


def open_executor(spec: ExecutorSpec, weights: Mapping[str, np.ndarray], local_workers: int,
                  cache_bytes: int | None, hessians: Hessians = NO_HESSIANS, progress: bool = False) -> Executor:
    """The executor `spec` names: the local pool of `local_workers` processes (memory.py plans how many fit),
    or Ray actors (ray itself is imported only then). `cache_bytes`: each worker's budget for each weight
    cache; `hessians`: what GPTQ-filled weights are converted under, installed in every worker."""
    if spec.kind is ExecutorKind.RAY:
        return RayPool(weights, spec.address, spec.workers, cache_bytes, TaskProgress(progress), hessians)
    return TaskPool(weights, local_workers, cache_bytes, hessians, TaskProgress(progress))


def calibration_ranges(graph: Graph, part: Partition, refs: Sequence[Fp64Reference]) -> dict:
    """FP64 value ranges of every output and chunk export on the calibration set (audit compares)."""
    out: dict[str, tuple[float, float]] = {}
    names = {nid: name for name, nid in graph.outputs.items()}
    for ref in refs:
        vals = ref.values
        for chunk in part.chunks:
            for nid in chunk.exported:
                key = names.get(nid, f"chunk{chunk.index}:%{nid}")
                v = vals[nid]
                lo, hi = (float(np.min(v)), float(np.max(v))) if v.size else (0.0, 0.0)
                old = out.get(key, (lo, hi))
                out[key] = (min(old[0], lo), max(old[1], hi))
    return out


PROBES = ("FP32 everywhere", "TF32 flag", "BF16 autocast", "FP16 autocast")  # the headroom's probe programs


def choose_headroom(graph: Graph, budget: Budget, calibration, refs, space: SearchSpace,
                    override: float | None, ran: dict[str, list] | None = None,
                    pool: Executor | None = None) -> HeadroomEstimate:
    """The override when given, else the margin measured on split calibration batches (error/headroom.py)
    with the peer baselines as probes (their outputs are kept in `ran`, by program key; run on `pool`)."""
    if override is not None:
        return HeadroomEstimate(override, "override")
    if len(calibration) < 2:
        return estimate_headroom([])
    probe = Judge(graph, budget, list(calibration), use_static=False, references=list(refs), use_prediction=False,
                  outputs_cache=ran)
    genomes = baseline_genomes(space)
    return estimate_headroom(probe.batch_ratios([space.program(genomes[n]) for n in PROBES if n in genomes], pool))


def _check_job(graph: Graph, budget: Budget, target: str, calibration, options: SearchOptions) -> None:
    """Everything a compile can refuse before any work, each as one line."""
    if not calibration:
        raise ValueError("compile needs calibration inputs (a list of input dicts)")
    get_target(target)  # an unknown target fails now, not after the first candidate
    unknown = [o for o in budget.outputs or () if o not in graph.outputs]
    if unknown:
        raise ValueError(f"the budget names outputs {unknown} that the graph does not have "
                         f"(outputs: {', '.join(graph.outputs)})")
    if options.max_candidates < 1:
        raise ValueError(f"max_candidates must be >= 1, got {options.max_candidates}")
    _check_inputs(graph, calibration)


def _check_inputs(graph: Graph, batches) -> None:
    for i, inp in enumerate(batches):
        missing = [n for n, info in graph.inputs.items() if not info.is_weight and n not in inp]
        if missing:
            raise ValueError(f"calibration batch {i} is missing inputs {missing}")
        for name, arr in inp.items():
            a = np.asarray(arr)
            if a.dtype.kind == "f" and not np.all(np.isfinite(a)):
                raise ValueError(f"calibration batch {i}: input {name!r} contains NaN or Inf")
