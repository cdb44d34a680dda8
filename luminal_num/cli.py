"""`luminal-num`: compile, pareto, audit, inspect, demo.

Every command validates its input and its output folder first, holds a lock on that folder, writes
its files into a temporary folder beside it and moves them in only when all were written, so a
failure leaves --out's reports exactly as they were. The one exception is the verdict cache of a
compile (default <out>/verdicts, rewritten atomically after each end-to-end measurement): a failed or
interrupted compile keeps the measurements it made there, so running it again resumes. Exit codes: 0 ok, 1 contract broken / budget unreachable,
2 bad input, 3 another command is writing into --out, 130 interrupted (Ctrl-C: a compile keeps the
best plan found so far, marked partial), 141 stdout closed early (e.g. piped into head).
"""
from __future__ import annotations

from . import cli_startup  # first: Ctrl-C while the imports below load is one line, exit 130 (not a traceback)

import contextlib
import dataclasses
import os
import sys
import warnings
from pathlib import Path

from .cli_jobs import (LLM_CANDIDATES, InputError, fill_audit_set, fill_job_args, input_batches, is_llm,
                       llm_job_of, onnx_job_of, onnx_peer_rows, parse_budget, record_job, registry_job)
from . import interrupts
from .cli_parser import build_parser
from .error.executors import ExecutorKind, ExecutorSpec, ExecutorUnavailable
from .error.verdict_store import VerdictCacheWarning
from .quant.converted_disk import ConvertedCacheWarning
from .memory import MemoryBudgetError, plan_memory
from .report.files import OutputDirError, OutputLocked, check_output_dir, output_lock
from .report.numbers import fmt_latency, fmt_launch_form, fmt_metric_values, fmt_num, fmt_numbers_in
from .report.pareto import ERROR_COLUMN
from .runtime.targets import get_target

EXIT_OK, EXIT_CONTRACT, EXIT_INPUT, EXIT_BUSY, EXIT_PIPE = 0, 1, 2, 3, 141
EXIT_INTERRUPTED = cli_startup.EXIT_INTERRUPTED  # 130, also while the modules load


class Interrupted(Exception):
    """Ctrl-C, after whatever could be kept was written; the message says what."""


def _print_table(df, columns, n=12):
    """Numbers for people: 3 significant digits, latencies with their unit."""
    table = df[columns].head(n).copy()
    for column in columns:
        if column == "latency_s":
            table[column] = table[column].map(fmt_latency)
        elif table[column].dtype.kind == "f":
            table[column] = table[column].map(fmt_num)
    print(table.rename(columns={"latency_s": "latency"}).to_string(index=False))


@contextlib.contextmanager
def _writing(out: Path):
    """A write that fails after the up-front checks (disk full, a file changed meanwhile) was rolled
    back by atomic_files: say so in one line."""
    try:
        yield
    except OSError as exc:
        raise InputError(f"could not write into {out} ({exc.strerror or exc}); it holds what it held before") from None


def _check_out(out: Path, names) -> None:
    try:
        check_output_dir(out, names)
    except OutputDirError as exc:
        raise InputError(str(exc)) from None



def executor_of(args) -> ExecutorSpec:
    """--executor, --ray-address and --ray-workers as one spec (a Ray option without Ray is refused)."""
    try:
        return ExecutorSpec(ExecutorKind(args.executor), args.ray_address, args.ray_workers)
    except ValueError as exc:
        raise InputError(str(exc)) from None


def cmd_compile(args) -> int:
    from .report.compile_report import COMPILE_FILES
    oj = onnx_job_of(args)
    if oj is not None and args.heldout is not None:
        raise InputError("--heldout applies to built-in models and LLMs; audit an ONNX plan with --inputs FILE.npz")
    job = oj.job if oj is not None else registry_job(args.model, args)
    if args.candidates is None:
        args.candidates = LLM_CANDIDATES if job.llm is not None else args.default_candidates
    budget = parse_budget(args.budget if args.budget is not None else job.default_budget)
    out = Path(args.out or f"reports/{job.name}")
    _check_out(out, COMPILE_FILES)
    args.cache_dir = _verdict_cache(args, out)
    with output_lock(out):
        return _compile_locked(args, job, budget, out, oj)


def _compile_locked(args, job, budget, out: Path, oj=None) -> int:
    from .compiler import BudgetUnreachable, compile
    from .report.compile_report import write_compile_report
    from .search.search import SearchOptions
    from .search.space import Offers
    print(f"[luminal-num] {job.description}")
    _print_notes(job)
    print(f"[luminal-num] budget {budget} on target {args.target}; {len(job.graph)} HLIR nodes")
    try:
        memory = plan_memory(job.graph.weights, args.max_memory,
                             rotation=getattr(args, "rotate", False) or getattr(args, "smooth", False))
    except MemoryBudgetError as exc:
        raise InputError(str(exc)) from None
    print(f"[luminal-num] {memory.describe()}")
    opts = SearchOptions(seed=args.seed, max_candidates=args.candidates, time_limit_s=args.time_limit,
                         target=args.target, progress=not args.quiet,
                         headroom=getattr(args, "headroom", None),
                         offers=Offers(calibrated=getattr(args, "gptq", False), rotation=getattr(args, "rotate", False),
                                       smoothing=getattr(args, "smooth", False)),
                         batch_invariant=getattr(args, "batch_invariant", False), executor=executor_of(args),
                         megakernel=getattr(args, "megakernel", False))
    try:
        get_target(args.target)
    except KeyError as exc:  # unknown target: refused before any work (an internal KeyError is a bug, not bad input)
        raise InputError(str(exc.args[0])) from None
    try:
        result = compile(job.graph, budget, args.target, job.calibration, opts, cache_dir=args.cache_dir,
                         memory=memory, on_stage=_print_stage if getattr(args, "verbose", False) else None,
                         positions=job.llm.positions if job.llm is not None else None)
    except BudgetUnreachable as exc:
        if exc.result.stats.interrupted:
            raise Interrupted("interrupted before any plan passed the budget: nothing written") from None
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_CONTRACT
    except (ValueError, MemoryBudgetError, ExecutorUnavailable) as exc:  # bad options or inputs; a stage the
        # memory budget cannot hold; a Ray cluster that cannot be had
        raise InputError(str(exc)) from None
    stats = result.search.stats
    interrupted = (f"search interrupted after {stats.candidates} candidates: best plan so far"
                   if stats.interrupted else "")
    peers = None
    if oj is not None:
        result = dataclasses.replace(result, plan=result.plan.with_source(oj.source))
        peers = onnx_peer_rows(oj, budget, args.target)
    result = dataclasses.replace(result, plan=record_job(result.plan, job, args))
    with _writing(out):
        files = write_compile_report(result, out, f"{job.name}: error vs latency ({args.target})", interrupted,
                                     extra_rows=peers)
    if interrupted:
        raise Interrupted(f"{interrupted} written to {files['plan']} (marked partial)")
    try:
        _print_compile_summary(result, budget, files, args.cache_dir)
    except KeyboardInterrupt:  # after the files were moved in: they are complete, "nothing written" would be false
        raise Interrupted(f"stopped while printing the summary; the compile had finished: its plan and reports are "
                          f"in {out}") from None
    return EXIT_OK


def _print_positions(record) -> None:
    """The positions stage: the chosen plan's row metrics over every teacher-forced position, or why none."""
    if record.skipped:
        print(f"[luminal-num] teacher-forced positions: not judged ({record.skipped})")
        return
    values = ", ".join(f"{k} {fmt_num(v)}" for k, v in sorted(record.metrics.items()))
    print(f"[luminal-num] chosen plan on {record.positions} teacher-forced positions (pooled; {record.judged} "
          f"plan(s) judged there): {values or 'none passed'}")


def _print_compile_summary(result, budget, files: dict, cache_dir: Path | None) -> None:
    """The front, the baselines, the chosen plan and its per-op summary, once the report is written."""
    from .report.compile_report import candidate_rows, metric_columns
    stats = result.search.stats
    rows = candidate_rows(result)
    front = rows[rows.on_front].sort_values(["latency_s", "candidate"])  # the front the search confirmed
    gate = stats.gate
    print(f"[luminal-num] {stats.candidates} candidates; gate: cache={gate.cache}, static={gate.static}, "
          f"measured={gate.measured}, pruned={gate.pruned}")
    if stats.positions is not None:
        _print_positions(stats.positions)
    if cache_dir is not None:
        print(f"[luminal-num] verdict cache {cache_dir}: {gate.stored} verdicts reused, "
              f"{gate.measured} measured end to end now")
    headroom = stats.headroom_share
    print(f"\nPareto front of passing plans ({ERROR_COLUMN}: the share of the budget used over allclose and "
          f"every metric, <= {fmt_num(headroom)} = headroom x budget; fastest first):")
    metrics = list(metric_columns(budget))  # each budget metric's value (measured or predicted: verdict_source)
    _print_table(front, ["candidate", ERROR_COLUMN, *metrics, "latency_s", "verdict_source", "variants"])
    print("\nBaselines:")
    baselines = rows[rows.stage == "baseline"]
    _print_table(baselines.assign(label=baselines.label.where(~baselines.chosen, baselines.label + " (chosen)")),
                 ["label", ERROR_COLUMN, *metrics, "latency_s", "verdict_source", "passes"])
    plan = result.plan
    chosen = rows[rows.chosen].iloc[0]
    named = f" ({chosen.label})" if chosen.label else ""
    # under atol = rtol = inf (an LLM's top-1/KL budget) allclose is switched off: its ratio (0) says nothing
    allclose = "" if not budget.allclose_applies else f", allclose ratio {fmt_num(plan.verdict.error)}"
    print(f"\nChosen plan{named}: budget share {fmt_num(chosen[ERROR_COLUMN])}{allclose} ({plan.verdict.source}; "
          f"budget 1, judged against {fmt_num(headroom)}), latency {fmt_latency(plan.latency.total_s)} "
          f"({_latency_how(plan)})")
    if plan.verdict.metrics:  # the metric values it was judged on (pooled positions, or the worst batch)
        print(f"  {_metric_line(plan)}")
    elif not budget.allclose_applies:
        print(f"  {fmt_numbers_in(plan.verdict.reason)}")
    if plan.invariance_price is not None:
        print(f"[luminal-num] {plan.invariance_price.describe()}")
    _summary(plan.kernels)
    print("\nwrote " + ", ".join(str(p) for p in files.values()))


def _metric_line(plan) -> str:
    """The plan's metric values (pooled over the teacher-forced positions, else the worst calibration batch's),
    beside the limits they were judged by."""
    pooled = plan.pooled_positions
    over = f"pooled over {pooled} teacher-forced positions" if pooled else "worst over the calibration batches"
    return f"{plan.verdict.source}, {over}: {fmt_metric_values(plan.verdict.metrics, plan.budget, plan.headroom)}"


def _print_notes(job, inputs: tuple[str, ...] = ("calibration", "heldout")) -> None:
    for note in job.notes:  # e.g. shipped prompts cut to a short context
        if note.inputs in inputs:
            print(f"[luminal-num] note: {note.text}")


def _print_stage(name: str, seconds: float) -> None:
    print(f"[luminal-num] stage {name}: {seconds:.2f} s", flush=True)


def _verdict_cache(args, out: Path) -> Path | None:
    """Where measured verdicts persist (error/verdict_store.py): --verdict-cache, else <out>/verdicts;
    None with --no-verdict-cache. A path that exists and is not a folder is refused now, not mid-search."""
    if args.no_verdict_cache:
        if args.verdict_cache is not None:
            raise InputError("give --verdict-cache or --no-verdict-cache, not both")
        return None
    path = Path(args.verdict_cache) if args.verdict_cache is not None else out / VERDICT_CACHE
    if path.exists() and not path.is_dir():
        raise InputError(f"--verdict-cache {path} exists and is not a folder")
    return path


VERDICT_CACHE = "verdicts"  # the default verdict cache folder inside --out


def _summary(kernels: list[dict]) -> None:
    import collections
    kinds = collections.Counter((k["kind"], k["dtype"], k["precision"] or "-") for k in kernels)
    print("Per-op summary (kind, storage dtype, precision: count):")
    for (kind, dt, prec), n in sorted(kinds.items()):
        print(f"  {kind:16s} {dt:8s} {prec:24s} {n}")


def _load_plan(path: str):
    """The plan file (and the files beside it), or a one-line input error."""
    from .search.plan import Plan, PlanError
    try:
        return Plan.load(path)
    except PlanError as exc:
        raise InputError(str(exc)) from None


def cmd_audit(args) -> int:
    from .report.audit import AUDIT_FILES
    from .report.invariance import INVARIANCE_FILE
    plan = _load_plan(args.plan)
    fill_job_args(args, plan)
    fill_audit_set(args, plan)
    if args.inputs and args.calibration:
        raise InputError("give --inputs or --calibration, not both")
    oj = onnx_job_of(args)
    if oj is not None:
        job, batches = oj.job, list(oj.job.calibration)  # the batches of --inputs / --calibration
    elif args.calibration and is_llm(args.model):
        job = llm_job_of(args)
        batches = list(job.calibration)  # audit on the given prompts
    else:
        job = registry_job(args.model, args if is_llm(args.model) else None)
        batches = input_batches(args.inputs or args.calibration, job)
    if oj is None and not (args.inputs or args.calibration):
        _print_notes(job, ("heldout",))  # audited on the job's held-out set
    out = Path(args.out or Path(args.plan).parent)
    check = getattr(args, "check_invariance", False)
    if check and oj is not None:
        raise InputError("--check-invariance rebuilds the job at batch sizes 1, 2, 4, 8: not an ONNX model's")
    _check_out(out, AUDIT_FILES + ((INVARIANCE_FILE,) if check else ()))
    positions = None
    if oj is None and job.llm is not None and not args.inputs:  # LLM prompts: their teacher-forced windows
        positions = job.llm.positions if args.calibration else job.llm.heldout_positions
    with output_lock(out):
        code = _audit_locked(plan, job, batches, out, oj, positions)
        return max(code, _check_invariance(plan, job, batches, out)) if check else code


def _check_invariance(plan, job, batches, out: Path) -> int:
    """Each held-out input alone and inside batches of 2, 4, 8: invariance.csv and one line; exit 1 when
    a batch-invariant plan is not invariant."""
    from .report.invariance import (InvarianceError, check_invariance, job_batch, job_graph_at, job_offsets,
                                    plan_runtimes, split_items, write_invariance)
    from .search.plan import PlanError
    try:
        offsets = job_offsets(job)
        result = check_invariance(plan_runtimes(plan, job_graph_at(job)), split_items(batches, job_batch(job), offsets),
                                  plan.batch_invariant, offsets=offsets)
    except (InvarianceError, PlanError) as exc:
        raise InputError(str(exc)) from None
    with _writing(out):
        path = write_invariance(result, out)
    print(f"{result.summary()}: {result.verdict()}; wrote {path}")
    return EXIT_OK if result.passed else EXIT_CONTRACT


def _audit_locked(plan, job, batches, out: Path, oj=None, positions=None) -> int:
    from .report.audit import audit, write_audit_report
    from .search.plan import PlanError
    if plan.interrupted:
        print(f"[luminal-num] note: this plan is a partial result ({plan.interrupted})")
    try:
        if oj is not None:
            plan.check_source(oj.source)
        result = audit(plan, job.graph, batches, positions=positions)
    except PlanError as exc:
        raise InputError(str(exc)) from None
    except (KeyError, ValueError) as exc:
        raise InputError(f"inputs do not fit the model: {exc}") from None
    with _writing(out):
        files = write_audit_report(result, out)
    try:
        print(result.outputs.to_string(index=False))
        if result.not_pooled:
            print(f"\n[luminal-num] note: judged per batch, not on pooled positions: {result.not_pooled}")
        if len(result.metrics):  # the plan's recorded value of each metric next to the one measured now
            audited = (f"pooled over {result.positions} teacher-forced positions of the audited prompts"
                       if result.positions else "worst over these batches")
            print(f"\nmetrics (plan: as its compile judged it; audit: {audited}):")
            _print_table(result.metrics, list(result.metrics.columns), n=len(result.metrics))
        print(f"\naudit: {'PASSED' if result.passed else 'CONTRACT BROKEN'}: {result.reason}")
        print(f"{result.outside_range} exported values left the calibration range; wrote "
              + ", ".join(str(p) for p in files.values()))
    except KeyboardInterrupt:  # after the files were moved in: say where they are, not "nothing written"
        raise Interrupted(f"stopped while printing the result; the audit had finished "
                          f"({'PASSED' if result.passed else 'CONTRACT BROKEN'}): its files are in {out}") from None
    return EXIT_OK if result.passed else EXIT_CONTRACT


def _latency_how(plan) -> str:
    """Where the latency came from and, when modelled, the launch form the search chose."""
    form = fmt_launch_form(plan.latency)
    return f"{plan.latency.source}, {form}" if form else plan.latency.source


def cmd_inspect(args) -> int:
    import pandas as pd
    plan = _load_plan(args.plan)
    print(plan.describe())
    print(f"budget {plan.budget}; verdict {plan.verdict.source} (budget share {fmt_num(plan.verdict.budget_share)}): "
          f"{fmt_numbers_in(plan.verdict.reason)}")
    if plan.verdict.metrics:
        print(_metric_line(plan))
    if plan.interrupted:
        print(f"PARTIAL RESULT: {plan.interrupted}")
    print(f"latency {fmt_latency(plan.latency.total_s)} ({_latency_how(plan)})\n")
    print(pd.DataFrame(plan.kernels).fillna("").to_string(index=False))  # a kernel without an epilogue: blank
    return EXIT_OK


def cmd_pareto(args) -> int:
    import pandas as pd
    p = Path(args.report) / "pareto.csv"
    if not p.exists():
        raise InputError(f"{p} does not exist: run `luminal-num compile` first")
    try:
        df = pd.read_csv(p)
    except Exception as exc:  # noqa: BLE001
        raise InputError(f"cannot read {p}: {exc}") from None
    columns = ["candidate", ERROR_COLUMN, "latency_s", "latency_source", "verdict_source", "label"]
    if "on_front" not in df.columns or "passes" not in df.columns or not set(columns) <= set(df.columns):
        raise InputError(f"{p} is not a luminal_num Pareto table (of this version)")
    front = df[df.on_front & df.passes].sort_values("latency_s", kind="stable")  # the front of passing plans
    from .error.metrics import METRICS
    metrics = [c for c in df.columns if c in METRICS and c != "max_abs"]  # the budget's metric columns, as compile shows
    _print_table(front.fillna({"label": ""}), columns[:2] + metrics + columns[2:], n=len(front))
    return EXIT_OK


def cmd_demo(args) -> int:
    args.out = args.out or f"reports/{Path(args.model).stem if is_llm(args.model) else args.model}"
    rc = cmd_compile(args)
    if rc != EXIT_OK:
        return rc
    args.plan, args.inputs, args.calibration = str(Path(args.out) / "plan.json"), None, None
    print("\n[luminal-num] auditing the plan on the held-out inputs")
    return cmd_audit(args)


def cmd_generate(args) -> int:
    from .report.generate import generate, print_generation
    from .runtime.cuda_device import CudaUnavailableError, require_cuda
    from .search.plan import PlanError
    if not args.prompt.strip():
        raise InputError("--prompt is empty: give the text the plan should continue")
    plan = _load_plan(args.plan)
    fill_job_args(args, plan)
    if not is_llm(args.model):
        raise InputError(f"generate runs LLM plans; {args.model!r} is not an LLM (smollm2, gemma3, .gguf, HF folder)")
    try:
        if args.backend == "cuda":  # before the model loads (seconds, a GB): the device is checked first
            require_cuda()
        print_generation(generate(plan, args.model, args.workload, args.layers, args.prompt, args.chat, args.tokens,
                                  args.backend))
    except CudaUnavailableError as exc:
        raise InputError(f"--backend cuda: {str(exc).splitlines()[0]}") from None
    except (PlanError, ValueError, FileNotFoundError) as exc:
        raise InputError(str(exc)) from None
    return EXIT_OK


COMMANDS = {"compile": cmd_compile, "audit": cmd_audit, "inspect": cmd_inspect, "pareto": cmd_pareto, "demo": cmd_demo,
            "generate": cmd_generate}


def main(argv=None) -> int:
    try:
        args = build_parser(__doc__).parse_args(argv)
        warnings.filterwarnings("ignore", category=RuntimeWarning)  # overflow in bound arithmetic is handled
        warnings.filterwarnings("always", category=VerdictCacheWarning)  # ... but an ignored cache file is news
        warnings.filterwarnings("always", category=ConvertedCacheWarning)
        warnings.showwarning = _one_line_warning
        with interrupts.noted():  # a Ctrl-C a finalizer swallows is raised at the compile's next stage or candidate
            code = COMMANDS[args.command](args)
            if interrupts.pending():  # dropped after the last check: the output is whole, the exit says Ctrl-C
                raise Interrupted("Ctrl-C arrived as the command finished; its output is complete")
            return code
    except (InputError, OutputDirError) as exc:  # OutputDirError: a folder found unusable only when locking it
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_INPUT
    except OutputLocked as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BUSY
    except Interrupted as exc:
        print(f"interrupted: {exc}", file=sys.stderr)
        return _interrupted_exit()
    except KeyboardInterrupt:
        print("interrupted: stopped before a result; nothing written", file=sys.stderr)
        return _interrupted_exit()
    except BrokenPipeError:
        _quiet_stdout()
        return EXIT_PIPE


def _interrupted_exit() -> int:
    """EXIT_INTERRUPTED, also under `python -m`: CPython 3.12 marks a KeyboardInterrupt that ended a string
    exec (dataclasses, namedtuples and numba build functions that way) as unhandled even after it was caught,
    and `-m` then exits by SIGINT (-2) instead of 130 (run_eval_code_obj sets the mark, Py_RunMain reads it).
    Any later string exec clears it: seen in 1 of 10 SIGINTs 2-5 s into a llama-tiny compile."""
    exec("pass", {})  # noqa: S102 - clears the mark, runs nothing
    return EXIT_INTERRUPTED


_SHOW_WARNING = warnings.showwarning


def _one_line_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """An ignored verdict cache or converted-weight file as one `warning: ...` line on stderr, as errors are shown; others as before."""
    if issubclass(category, (VerdictCacheWarning, ConvertedCacheWarning)):
        print(f"warning: {message}", file=file or sys.stderr)
    else:
        _SHOW_WARNING(message, category, filename, lineno, file, line)


def _quiet_stdout() -> None:
    """The reader went away (`| head`): point stdout at /dev/null so the exit flush cannot raise again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


cli_startup.release()  # imported: Ctrl-C is a KeyboardInterrupt again, which main turns into one line

if __name__ == "__main__":
    sys.exit(main())
