"""The `luminal-num` command line, run as a user runs it: a subprocess in a scratch folder.

Exit codes: 0 ok, 1 contract broken or budget unreachable, 2 bad input. A bad input must cost one
line on stderr (`error: ...`) and write nothing.
"""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from luminal_num.cli import main
from luminal_num.search.plan import Plan

COMPILE = ("compile", "--model", "transformer", "--candidates", "20", "--quiet")
# Runs pin the string hashing seed; the portability test at the end uses another value on purpose
# (plans must mean the same thing whatever PYTHONHASHSEED is).
HASH_SEED = "0"


def cli(*args: str, cwd: Path, hash_seed: str = HASH_SEED) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONHASHSEED": hash_seed, "MPLBACKEND": "Agg"}
    return subprocess.run([sys.executable, "-m", "luminal_num.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)


def files_under(*roots: Path) -> dict[Path, int]:
    return {p: p.stat().st_mtime_ns for root in roots for p in root.rglob("*")}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cli")


@pytest.fixture(scope="module")
def report(workdir) -> Path:
    run = cli(*COMPILE, "--out", "OUT", cwd=workdir)
    assert run.returncode == 0, run.stderr
    return workdir / "OUT"


def test_compile_writes_plan_and_reports(report):
    names = {p.name for p in report.iterdir()}
    assert {"pareto.csv", "pareto.html", "pareto.png", "plan_ops.csv", "plan.json"} <= names
    plan = Plan.load(report / "plan.json")
    assert plan.data["target"] == "h200" and plan.data["verdict"]["passed"]
    assert len(pd.read_csv(report / "pareto.csv")) == plan.data["search"]["candidates"]
    assert len(pd.read_csv(report / "plan_ops.csv")) == len(plan.data["kernels"])


def test_inspect_prints_the_op_table(report, workdir):
    run = cli("inspect", "--plan", str(report / "plan.json"), cwd=workdir)
    assert run.returncode == 0, run.stderr
    kernels = Plan.load(report / "plan.json").data["kernels"]
    table = run.stdout.split("\n\n", 1)[1].strip().splitlines()
    assert all(col in table[0] for col in ("kernel", "kind", "dtype", "accumulator", "precision", "quant", "scales"))
    assert len(table) == 1 + len(kernels)
    for line, kernel in zip(table[1:], kernels):  # one line per launched kernel, in plan order
        assert kernel["op"] in line and f" {kernel['kernel']} " in f" {line} ", (line, kernel)


def test_pareto_prints_the_front(report, workdir):
    run = cli("pareto", str(report), cwd=workdir)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.strip().splitlines()
    assert lines[0].split()[:3] == ["candidate", "error", "latency_s"]
    table = pd.read_csv(report / "pareto.csv")
    front = table[table["on_front"]].sort_values("latency_s", kind="stable")
    assert [int(line.split()[0]) for line in lines[1:]] == front["candidate"].tolist()


def test_audit_passes_on_heldout_inputs(report, workdir):
    run = cli("audit", "--plan", str(report / "plan.json"), "--model", "transformer", cwd=workdir)
    assert run.returncode == 0, run.stderr
    assert "audit: PASSED" in run.stdout
    assert {"audit.csv", "audit_drift.csv", "audit.html"} <= {p.name for p in report.iterdir()}


def test_demo_compiles_and_audits(workdir):
    run = cli("demo", "--model", "transformer", "--candidates", "20", "--quiet", "--out", "DEMO", cwd=workdir)
    assert run.returncode == 0, run.stderr
    assert "audit: PASSED" in run.stdout
    assert {"plan.json", "pareto.png", "audit.csv"} <= {p.name for p in (workdir / "DEMO").iterdir()}


def _corrupt(cwd: Path) -> None:
    (cwd / "corrupt.json").write_text("{ this is not json")


def _nan_inputs(cwd: Path) -> None:
    x = np.random.default_rng(0).standard_normal((8, 32))  # the transformer job's input shape
    x[3, 5] = np.nan
    np.savez(cwd / "nan.npz", x=x)


def _short_inputs(cwd: Path) -> None:
    np.savez(cwd / "short.npz", x=np.zeros((4, 32)))


BAD_INPUTS = {
    "missing-plan": (("audit", "--plan", "missing.json", "--model", "transformer"), None, "does not exist"),
    "corrupt-plan": (("audit", "--plan", "corrupt.json", "--model", "transformer"), _corrupt, "not valid JSON"),
    "graph-mismatch": (("audit", "--plan", "{plan}", "--model", "llama-tiny"), None, "graph hash mismatch"),
    "bad-budget": ((*COMPILE, "--budget", "atol=abc", "--out", "NEW"), None, "'abc' is not a number"),
    "nan-inputs": (("audit", "--plan", "{plan}", "--model", "transformer", "--inputs", "nan.npz"), _nan_inputs,
                   "NaN"),
    "wrong-shape-inputs": (("audit", "--plan", "{plan}", "--model", "transformer", "--inputs", "short.npz"),
                           _short_inputs, "expected shape (8, 32)"),
    "unknown-model": ((*COMPILE[:2], "nope", "--out", "NEW"), None, "unknown model 'nope'"),
    "plan-is-a-directory": (("inspect", "--plan", "."), None, "is not a plan file"),
}


@pytest.mark.parametrize("args, prepare, message", list(BAD_INPUTS.values()), ids=list(BAD_INPUTS))
def test_bad_input_exits_2_with_one_line_and_writes_nothing(report, tmp_path, args, prepare, message):
    if prepare:
        prepare(tmp_path)
    before = files_under(tmp_path, report)
    run = cli(*(a.format(plan=report / "plan.json") for a in args), cwd=tmp_path)
    assert run.returncode == 2, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], run.stderr
    assert files_under(tmp_path, report) == before


# Run in process (cli.main) to keep the suite fast: each is exit 2 with one line, nothing written.
MORE_BAD_INPUTS = {
    "budget-names-unknown-output": (*COMPILE, "--budget", "atol=1e-2,rtol=1e-2,outputs=nope", "--out", "NEW"),
    "unknown-target": (*COMPILE, "--target", "bogus", "--out", "NEW"),
}


@pytest.mark.parametrize("args", list(MORE_BAD_INPUTS.values()), ids=list(MORE_BAD_INPUTS))
def test_more_bad_inputs_exit_2(args, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(list(args)) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ")
    assert not any(tmp_path.iterdir())


def test_unreachable_budget_exits_1(report, tmp_path):
    unreachable = ("compile", "--model", "transformer", "--candidates", "2", "--quiet", "--budget", "atol=1e-12,rtol=0")
    run = cli(*unreachable, "--out", "NEW", cwd=tmp_path)
    assert run.returncode == 1, run.stderr
    assert run.stderr.startswith("error: no plan meets the budget") and "best error reachable" in run.stderr
    assert not (tmp_path / "NEW").exists()


HELP = {
    (): ("compile", "demo", "audit", "inspect", "pareto"),
    ("compile",): ("--model", "--budget", "--target", "--candidates", "--time-limit", "--seed", "--out", "--quiet"),
    ("demo",): ("--model", "--budget", "--target", "--candidates", "--seed", "--out", "--quiet"),
    ("audit",): ("--plan", "--model", "--inputs", "--out"),
    ("inspect",): ("--plan",),
    ("pareto",): ("report",),
}


@pytest.mark.parametrize("command", list(HELP), ids=lambda c: " ".join(c) or "top")
def test_help_exits_0_and_lists_options(command, tmp_path):
    run = cli(*command, "--help", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert all(option in run.stdout for option in HELP[command]), run.stdout
    assert not any(tmp_path.iterdir())


def test_plans_are_portable_between_processes(report, tmp_path):
    """E-class ids in a plan mean the same in a process with another PYTHONHASHSEED (op groups are
    declared in a fixed order), and the same seed gives the same plan bytes there."""
    run = cli("audit", "--plan", str(report / "plan.json"), "--model", "transformer", "--out", str(tmp_path),
              cwd=tmp_path, hash_seed="1")
    assert run.returncode == 0, run.stderr
    run = cli(*COMPILE, "--out", "OTHER", cwd=tmp_path, hash_seed="1")
    assert run.returncode == 0, run.stderr
    assert (tmp_path / "OTHER" / "plan.json").read_bytes() == (report / "plan.json").read_bytes()
