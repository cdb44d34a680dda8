"""`luminal-num`: compile, pareto, audit, inspect, demo.

Every command validates its input first and writes its files only when the work succeeded (atomic
writes), so a failure never leaves half a report behind. Exit codes: 0 ok, 1 contract broken /
budget unreachable, 2 bad input.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import warnings
from pathlib import Path

import numpy as np

EXIT_OK, EXIT_CONTRACT, EXIT_INPUT = 0, 1, 2


class InputError(Exception):
    pass


def _budget(text: str):
    from .error.budget import Budget, BudgetSyntaxError
    try:
        return Budget.parse(text)
    except BudgetSyntaxError as exc:
        raise InputError(f"bad --budget {text!r}: {exc}") from None


def _job(name: str, args=None):
    """A registry job by name; with the command's args, also an LLM (name, .gguf, HF folder) under
    --workload, and --calibration replacing the calibration inputs."""
    from .models.registry import JOBS, load_job
    if args is not None and _is_llm(name):
        return _llm_job(args)
    if args is not None and getattr(args, "workload", None):
        raise InputError(f"--workload applies to LLMs (smollm2, a .gguf file, a HF folder), not {name!r}")
    try:
        job = load_job(name)
    except KeyError:
        raise InputError(f"unknown model {name!r}; known: {', '.join(JOBS)}, or a .gguf file or "
                         f"Hugging Face folder of a Llama-family model") from None
    calibration = getattr(args, "calibration", None) if args is not None else None
    if calibration is not None:
        if Path(calibration).suffix != ".npz":
            raise InputError(f"--calibration {calibration}: a prompt file applies to LLMs; give {name!r} an .npz")
        job = dataclasses.replace(job, calibration=tuple(_inputs(calibration, job)))
    return job


LLM_WORKLOAD = "decode:8@64"
LLM_CANDIDATES = 6  # an LLM candidate is judged on every calibration batch through all layers


def _is_llm(name: str) -> bool:
    from .models.registry import JOBS
    return name == "smollm2" or (name not in JOBS and (name.endswith(".gguf") or Path(name).is_dir()))


_LLM_JOBS: dict = {}


def _llm_job(args):
    """The LLM job of --model/--workload/--layers, calibrated on --calibration prompts (or an npz batch)."""
    from .models.gguf import GGUFError
    from .models.llm import parse_prompts
    from .models.registry import llm_job
    from .models.tokenizer import TokenizerError
    workload = getattr(args, "workload", None) or LLM_WORKLOAD
    calibration = getattr(args, "calibration", None)
    layers = getattr(args, "layers", None)
    key = (args.model, workload, calibration, layers)
    if key in _LLM_JOBS:
        return _LLM_JOBS[key]
    prompts = None
    if calibration is not None and Path(calibration).suffix != ".npz":
        p = Path(calibration)
        if not p.is_file():
            raise InputError(f"calibration file {p} does not exist")
        prompts = parse_prompts(p.read_text("utf-8"))
        if not prompts:
            raise InputError(f"calibration file {p} holds no prompts (one per line; '#' lines are comments)")
    try:
        job = llm_job(args.model, workload, calibration=prompts, layers=layers)
    except (GGUFError, TokenizerError, FileNotFoundError, KeyError, ValueError) as exc:
        raise InputError(f"model {args.model!r}: {exc}") from None
    if calibration is not None and prompts is None:
        job = dataclasses.replace(job, calibration=tuple(_inputs(calibration, job)))
    _LLM_JOBS[key] = job
    return job


def _record_llm_job(plan, job, args) -> None:
    """An LLM plan remembers its model and workload, so audit and generate rebuild the same graph."""
    if job.llm is not None:
        plan.data["job"] = {"model": args.model, "workload": str(job.llm.workload),
                            "layers": getattr(args, "layers", None)}


def _plan_job_args(args, plan) -> None:
    """Fill --model/--workload/--layers left unset from the plan's recorded job (minilm otherwise)."""
    recorded = plan.data.get("job") or {}
    if args.model is None:
        args.model = recorded.get("model", "minilm")
        if getattr(args, "workload", None) is None:
            args.workload = recorded.get("workload")
        if getattr(args, "layers", None) is None:
            args.layers = recorded.get("layers")


def _inputs(path: str | None, job) -> list[dict]:
    """Held-out batches of the job, or one batch from an .npz file (arrays named like the inputs)."""
    if path is None:
        return list(job.heldout)
    p = Path(path)
    if not p.exists():
        raise InputError(f"inputs file {p} does not exist")
    try:
        with np.load(p) as data:
            batch = {k: data[k] for k in data.files}
    except Exception as exc:  # noqa: BLE001 - any unreadable file is the user's input error
        raise InputError(f"cannot read inputs file {p}: {exc}") from None
    for name, arr in batch.items():
        if arr.dtype.kind == "f" and not np.all(np.isfinite(arr)):
            raise InputError(f"input {name!r} in {p} contains NaN or Inf")
    return [batch]


def _print_table(df, columns, n=12):
    print(df[columns].head(n).to_string(index=False))


def cmd_compile(args) -> int:
    from .compiler import BudgetUnreachable, compile
    from .report.compile_report import candidate_rows, write_compile_report
    from .search.search import SearchOptions
    job = _job(args.model, args)
    if args.candidates is None:
        args.candidates = LLM_CANDIDATES if job.llm is not None else args.default_candidates
    budget = _budget(args.budget or job.default_budget)
    out = Path(args.out or f"reports/{job.name}")
    print(f"[luminal-num] {job.description}")
    print(f"[luminal-num] budget {budget} on target {args.target}; {len(job.graph)} HLIR nodes")
    opts = SearchOptions(seed=args.seed, max_candidates=args.candidates, time_limit_s=args.time_limit,
                         target=args.target, progress=not args.quiet)
    try:
        result = compile(job.graph, budget, args.target, job.calibration, opts)
    except BudgetUnreachable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_CONTRACT
    except KeyError as exc:  # unknown target
        raise InputError(str(exc.args[0])) from None
    except ValueError as exc:  # budget outputs the model lacks, bad options, bad inputs
        raise InputError(str(exc)) from None
    _record_llm_job(result.plan, job, args)
    files = write_compile_report(result, out, f"{job.name}: error vs latency ({args.target})")
    rows = candidate_rows(result)
    front = _front(rows[rows.passes & rows.latency_s.notna()])
    print(f"[luminal-num] {result.search.stats['candidates']} candidates; gate: "
          + ", ".join(f"{k}={v}" for k, v in result.search.stats.items() if k in ("cache", "static", "measured", "pruned")))
    print("\nPareto front within budget (fastest first):")
    _print_table(front, ["candidate", "error", "latency_s", "verdict_source", "variants"])
    print("\nBaselines:")
    _print_table(rows[rows.stage == "baseline"], ["label", "error", "latency_s", "passes"])
    plan = result.plan.data
    print(f"\nChosen plan: error {plan['verdict']['error']} ({plan['verdict']['source']}), "
          f"latency {plan['latency']['total_s']} s ({plan['latency']['source']})")
    _summary(plan)
    print("\nwrote " + ", ".join(str(p) for p in files.values()))
    return EXIT_OK


def _front(rows):
    """Rows not dominated in (latency, error), fastest first."""
    from .search.search import LATENCY_TIE
    rows = rows.sort_values(["latency_s", "error", "candidate"])
    keep, best, last_latency = [], float("inf"), None
    for i, r in rows.iterrows():
        if r.error < best:
            if keep and r.latency_s <= last_latency * (1 + LATENCY_TIE):
                keep[-1] = i  # a tie in latency: the more accurate one stands for it
            else:
                keep.append(i)
                last_latency = r.latency_s
            best = r.error
    return rows.loc[keep]


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _summary(plan: dict) -> None:
    import collections
    kinds = collections.Counter((k["kind"], k["dtype"], k["precision"] or "-") for k in plan["kernels"])
    print("Per-op summary (kind, storage dtype, precision: count):")
    for (kind, dt, prec), n in sorted(kinds.items()):
        print(f"  {kind:16s} {dt:8s} {prec:24s} {n}")


def cmd_audit(args) -> int:
    from .report.audit import audit, write_audit_report
    from .search.plan import Plan, PlanError
    try:
        plan = Plan.load(args.plan)
    except PlanError as exc:
        raise InputError(str(exc)) from None
    _plan_job_args(args, plan)
    if args.inputs and args.calibration:
        raise InputError("give --inputs or --calibration, not both")
    if args.calibration and _is_llm(args.model):
        job = _llm_job(args)
        batches = list(job.calibration)  # audit on the given prompts
    else:
        job = _job(args.model, args if _is_llm(args.model) else None)
        batches = _inputs(args.inputs or args.calibration, job)
    try:
        result = audit(plan, job.graph, batches)
    except PlanError as exc:
        raise InputError(str(exc)) from None
    except (KeyError, ValueError) as exc:
        raise InputError(f"inputs do not fit the model: {exc}") from None
    out = Path(args.out or Path(args.plan).parent)
    files = write_audit_report(result, out)
    print(result.outputs.to_string(index=False))
    print(f"\naudit: {'PASSED' if result.passed else 'CONTRACT BROKEN'}: {result.reason}")
    print(f"{result.outside_range} exported values left the calibration range; wrote "
          + ", ".join(str(p) for p in files.values()))
    return EXIT_OK if result.passed else EXIT_CONTRACT


def cmd_inspect(args) -> int:
    import pandas as pd
    from .search.plan import Plan, PlanError
    try:
        plan = Plan.load(args.plan)
    except PlanError as exc:
        raise InputError(str(exc)) from None
    d = plan.data
    print(f"plan v{d['version']} (compiler {d['compiler_version']}), target {d['target']}, seed {d['seed']}")
    print(f"budget {plan.budget}; verdict {d['verdict']['source']}: {d['verdict']['reason']}")
    print(f"latency {d['latency']['total_s']} s ({d['latency']['source']})\n")
    print(pd.DataFrame(d["kernels"]).to_string(index=False))
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
    if "on_front" not in df.columns:
        raise InputError(f"{p} is not a luminal_num Pareto table")
    front = df[df.on_front].sort_values("latency_s")
    print(front[["candidate", "error", "latency_s", "latency_source", "verdict_source", "label"]].to_string(index=False))
    return EXIT_OK


def cmd_demo(args) -> int:
    args.out = args.out or f"reports/{Path(args.model).stem if _is_llm(args.model) else args.model}"
    rc = cmd_compile(args)
    if rc != EXIT_OK:
        return rc
    args.plan, args.inputs, args.calibration = str(Path(args.out) / "plan.json"), None, None
    print("\n[luminal-num] auditing the plan on the held-out inputs")
    return cmd_audit(args)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="luminal-num", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)

    def compile_args(p, default_model, default_candidates):
        p.add_argument("--model", default=default_model,
                       help="minilm | llama-tiny | transformer | smollm2 | PATH (.gguf file or HF folder of a Llama-family model)")
        llm_args(p)
        p.add_argument("--calibration", help="prompts (one per line, 'chat: ' for chat-formatted) or an .npz of inputs")
        p.set_defaults(default_candidates=default_candidates)
        p.add_argument("--budget", help='e.g. "atol=1e-3,rtol=0,cosine>=0.9999" (default: the model\'s)')
        p.add_argument("--target", default="h200", help="h200 | h100 | a100 | cpu (cpu is measured)")
        p.add_argument("--candidates", type=_positive, default=None,
                       help=f"candidates to evaluate (default {default_candidates}; {LLM_CANDIDATES} for LLMs)")
        p.add_argument("--time-limit", type=float, default=None, help="seconds (makes the result timing-dependent)")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--out", help="report folder (default reports/<model>)")
        p.add_argument("--quiet", action="store_true", help="no progress bar")

    def llm_args(p):
        p.add_argument("--workload", help=f"LLMs: prefill:SEQ | prefill:BATCHxSEQ | decode:BATCH@CONTEXT (default {LLM_WORKLOAD})")
        p.add_argument("--layers", type=_positive, help="LLMs: keep only the first N decoder layers (quick runs)")

    compile_args(sub.add_parser("compile", help="search the fastest plan within a budget; write plan + reports"),
                 "minilm", 120)
    demo = sub.add_parser("demo", help="compile the bundled model, print the Pareto table, audit on held-out data")
    compile_args(demo, "minilm", 60)
    au = sub.add_parser("audit", help="re-check a saved plan against FP64 on new inputs (exit 1 if broken)")
    au.add_argument("--plan", required=True)
    au.add_argument("--model", default=None, help="default: the model recorded in the plan, else minilm")
    llm_args(au)
    au.add_argument("--inputs", help=".npz with one input batch (default: the model's held-out set)")
    au.add_argument("--calibration", help="prompts to audit on (one per line) or an .npz batch")
    au.add_argument("--out", help="report folder (default: the plan's folder)")
    ins = sub.add_parser("inspect", help="print a plan's per-op table")
    ins.add_argument("--plan", required=True)
    par = sub.add_parser("pareto", help="print the Pareto front of a compile report folder")
    par.add_argument("report", help="folder holding pareto.csv")
    gen = sub.add_parser("generate", help="run an LLM plan on a prompt; print its continuation beside FP64's")
    gen.add_argument("--plan", required=True)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true", help="render the prompt with the model's chat template")
    gen.add_argument("--tokens", type=_positive, default=16, help="tokens to generate")
    gen.add_argument("--model", default=None, help="default: the model recorded in the plan")
    llm_args(gen)
    return ap


def cmd_generate(args) -> int:
    from .report.generate import generate, print_generation
    from .search.plan import Plan, PlanError
    try:
        plan = Plan.load(args.plan)
    except PlanError as exc:
        raise InputError(str(exc)) from None
    _plan_job_args(args, plan)
    if not _is_llm(args.model):
        raise InputError(f"generate runs LLM plans; {args.model!r} is not an LLM (smollm2, .gguf, HF folder)")
    try:
        print_generation(generate(plan, args.model, args.workload, args.layers, args.prompt, args.chat, args.tokens))
    except (PlanError, ValueError, FileNotFoundError) as exc:
        raise InputError(str(exc)) from None
    return EXIT_OK


COMMANDS = {"compile": cmd_compile, "audit": cmd_audit, "inspect": cmd_inspect, "pareto": cmd_pareto, "demo": cmd_demo,
            "generate": cmd_generate}


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    warnings.filterwarnings("ignore", category=RuntimeWarning)  # overflow in bound arithmetic is handled
    try:
        return COMMANDS[args.command](args)
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_INPUT


if __name__ == "__main__":
    sys.exit(main())
