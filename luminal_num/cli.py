"""`luminal-num`: compile, pareto, audit, inspect, demo.

Every command validates its input first and writes its files only when the work succeeded (atomic
writes), so a failure never leaves half a report behind. Exit codes: 0 ok, 1 contract broken /
budget unreachable, 2 bad input.
"""
from __future__ import annotations

import argparse
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


def _job(name: str):
    from .models.registry import load_job
    try:
        return load_job(name)
    except KeyError as exc:
        raise InputError(str(exc.args[0])) from None


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


def _headroom_arg(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"headroom must be in (0, 1], got {text}")
    return value


def cmd_compile(args) -> int:
    from .compiler import BudgetUnreachable, compile
    from .report.compile_report import candidate_rows, write_compile_report
    from .search.search import SearchOptions
    job = _job(args.model)
    budget = _budget(args.budget or job.default_budget)
    out = Path(args.out or f"reports/{job.name}")
    print(f"[luminal-num] {job.description}")
    print(f"[luminal-num] budget {budget} on target {args.target}; {len(job.graph)} HLIR nodes")
    opts = SearchOptions(seed=args.seed, max_candidates=args.candidates, time_limit_s=args.time_limit,
                         target=args.target, progress=not args.quiet,
                         headroom=getattr(args, "headroom", None))
    try:
        result = compile(job.graph, budget, args.target, job.calibration, opts)
    except BudgetUnreachable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_CONTRACT
    except KeyError as exc:  # unknown target
        raise InputError(str(exc.args[0])) from None
    except ValueError as exc:  # budget outputs the model lacks, bad options, bad inputs
        raise InputError(str(exc)) from None
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
    job = _job(args.model)
    batches = _inputs(args.inputs, job)
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
    args.out = args.out or f"reports/{args.model}"
    rc = cmd_compile(args)
    if rc != EXIT_OK:
        return rc
    args.plan, args.inputs = str(Path(args.out) / "plan.json"), None
    print("\n[luminal-num] auditing the plan on the held-out inputs")
    return cmd_audit(args)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="luminal-num", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)

    def compile_args(p, default_model, default_candidates):
        p.add_argument("--model", default=default_model, help="minilm | llama-tiny | transformer")
        p.add_argument("--budget", help='e.g. "atol=1e-3,rtol=0,cosine>=0.9999" (default: the model\'s)')
        p.add_argument("--target", default="h200", help="h200 | h100 | a100 | cpu (cpu is measured)")
        p.add_argument("--candidates", type=_positive, default=default_candidates, help="candidates to evaluate")
        p.add_argument("--time-limit", type=float, default=None, help="seconds (makes the result timing-dependent)")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--out", help="report folder (default reports/<model>)")
        p.add_argument("--quiet", action="store_true", help="no progress bar")
        p.add_argument("--headroom", type=_headroom_arg, default=None,
                       help="share of the budget a plan may use on calibration (default: measured on split batches)")

    compile_args(sub.add_parser("compile", help="search the fastest plan within a budget; write plan + reports"),
                 "minilm", 120)
    demo = sub.add_parser("demo", help="compile the bundled model, print the Pareto table, audit on held-out data")
    compile_args(demo, "minilm", 60)
    au = sub.add_parser("audit", help="re-check a saved plan against FP64 on new inputs (exit 1 if broken)")
    au.add_argument("--plan", required=True)
    au.add_argument("--model", default="minilm")
    au.add_argument("--inputs", help=".npz with one input batch (default: the model's held-out set)")
    au.add_argument("--out", help="report folder (default: the plan's folder)")
    ins = sub.add_parser("inspect", help="print a plan's per-op table")
    ins.add_argument("--plan", required=True)
    par = sub.add_parser("pareto", help="print the Pareto front of a compile report folder")
    par.add_argument("report", help="folder holding pareto.csv")
    return ap


COMMANDS = {"compile": cmd_compile, "audit": cmd_audit, "inspect": cmd_inspect, "pareto": cmd_pareto, "demo": cmd_demo}


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
