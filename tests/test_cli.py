"""The `luminal-num` command line, run as a user runs it: a subprocess in a scratch folder.

Exit codes: 0 ok, 1 contract broken or budget unreachable, 2 bad input. A bad input must cost one
line on stderr (`error: ...`) and write nothing.
"""
import os
import signal
import subprocess
import sys
import time
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
    run = cli(*COMPILE, "-v", "--out", "OUT", cwd=workdir)
    assert run.returncode == 0, run.stderr
    (workdir / "compile.stdout").write_text(run.stdout)
    return workdir / "OUT"


def test_verbose_compile_prints_each_stage_with_its_time_in_order(report, workdir):
    from luminal_num.compiler import STAGES
    lines = [ln for ln in (workdir / "compile.stdout").read_text().splitlines() if ln.startswith("[luminal-num] stage ")]
    names = [ln.split()[2].rstrip(":") for ln in lines]
    # "positions" runs for LLM decode jobs only (teacher-forced positions): not for this model
    assert list(STAGES) == ["partition", "saturate", "reference", "headroom", "search", "confirm", "positions", "plan"]
    assert names == [s for s in STAGES if s != "positions"]
    assert all(ln.endswith(" s") and float(ln.split()[3]) >= 0 for ln in lines)


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
    assert all(col in table[0] for col in ("kernel", "kind", "implementation", "dtype", "accumulator", "precision", "quant",
                                          "scales"))
    assert len(table) == 1 + len(kernels)
    for line, kernel in zip(table[1:], kernels):  # one line per launched kernel, in plan order
        assert kernel["op"] in line and f" {kernel['kernel']} " in f" {line} ", (line, kernel)


def test_pareto_prints_the_front(report, workdir):
    run = cli("pareto", str(report), cwd=workdir)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.strip().splitlines()
    assert lines[0].split()[:3] == ["candidate", "budget_share", "latency"]
    table = pd.read_csv(report / "pareto.csv")
    assert not (table["on_front"] & ~table["passes"]).any()  # the front is over passing plans only
    front = table[table["on_front"]].sort_values("latency_s", kind="stable")
    assert [int(line.split()[0]) for line in lines[1:]] == front["candidate"].tolist()
    assert all(line.split()[3] in ("us", "ms", "s", "ns") for line in lines[1:])  # latency with its unit


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
    # no report is written; only the verdict cache keeps the measurements made (a rerun resumes from them)
    assert {p.relative_to(tmp_path / "NEW").parts[0] for p in files_under(tmp_path / "NEW")} <= {"verdicts"}


HELP = {
    (): ("compile", "demo", "audit", "inspect", "pareto"),
    ("compile",): ("--model", "--budget", "--target", "--candidates", "--time-limit", "--seed", "--out", "--quiet",
                   "--verdict-cache", "--no-verdict-cache"),
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


# ---- fault contracts (issue 17): exit code, one line, and --out exactly as it was -------------------

def snapshot(root: Path) -> dict[str, tuple[int, bytes | None]]:
    """Every entry under root (relative path -> mode and bytes): what 'holds exactly what it held' means."""
    return {str(p.relative_to(root)): (p.stat().st_mode, p.read_bytes() if p.is_file() else None)
            for p in sorted(root.rglob("*"))}


def one_line(err: str, prefix: str = "error: ") -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(prefix), err
    return lines[0]


def _old_out(tmp_path: Path) -> Path:
    out = tmp_path / "OUT"
    out.mkdir()
    (out / "plan.json").write_text("old plan")
    (out / "pareto.csv").write_text("old csv")
    return out


OUTPUT_FAULTS = {
    "under-a-file": (lambda t: (t / "AFILE").write_text("x"), "AFILE/sub", "AFILE is a file, not a folder"),
    "out-is-a-file": (lambda t: (t / "AFILE").write_text("x"), "AFILE", "it is a file, not a folder"),
    "plan-json-is-a-folder": (lambda t: (_old_out(t) / "pareto.png").mkdir(), "OUT",
                              "cannot replace OUT/pareto.png: it is a folder"),
}


@pytest.mark.parametrize("prepare, out, message", list(OUTPUT_FAULTS.values()), ids=list(OUTPUT_FAULTS))
def test_bad_output_folder_is_refused_before_any_work(tmp_path, monkeypatch, capsys, prepare, out, message):
    monkeypatch.chdir(tmp_path)
    prepare(tmp_path)
    before = snapshot(tmp_path)
    searched = []
    monkeypatch.setattr("luminal_num.compiler.compile", lambda *a, **k: searched.append(1))
    assert main([*COMPILE, "--out", out]) == 2
    assert message in one_line(capsys.readouterr().err)
    assert not searched and snapshot(tmp_path) == before


def test_read_only_output_folder_is_refused_before_any_work(tmp_path, monkeypatch, capsys):
    """Root may write anywhere, so the read-only answer is given by os.access (as for a normal user)."""
    monkeypatch.chdir(tmp_path)
    out = _old_out(tmp_path)
    before = snapshot(tmp_path)
    real_access = os.access
    monkeypatch.setattr("luminal_num.report.files.os.access",
                        lambda p, mode: False if Path(p).resolve() == out.resolve() else real_access(p, mode))
    assert main([*COMPILE, "--out", "OUT"]) == 2
    assert "output folder OUT is not writable" in one_line(capsys.readouterr().err)
    assert snapshot(tmp_path) == before


def test_failed_replace_of_plan_json_leaves_out_as_it_was(tmp_path, monkeypatch, capsys):
    """The issue's mixed folder: plan.json cannot be replaced after pareto.* were moved in."""
    monkeypatch.chdir(tmp_path)
    out = _old_out(tmp_path)
    before = snapshot(tmp_path)
    real_replace = os.replace

    def failing(src, dst):
        if Path(dst).name == "plan.json" and Path(dst).parent.name == "OUT" and b"old" not in Path(src).read_bytes():
            raise PermissionError(13, "Permission denied")
        return real_replace(src, dst)
    monkeypatch.setattr("luminal_num.report.files.os.replace", failing)
    assert main([*COMPILE, "--out", "OUT"]) == 2
    assert "could not write into OUT (Permission denied); it holds what it held before" in one_line(capsys.readouterr().err)
    # the reports are as they were; the verdict cache keeps the measurements made (a rerun resumes)
    assert {k: v for k, v in snapshot(tmp_path).items() if not k.startswith("OUT/verdicts")} == before
    assert (out / "plan.json").read_text() == "old plan"


BAD_BUDGETS = {"cosine>=2": "cosine lies in [-1, 1]", "top1>=1.5": "top1_agreement lies in [0, 1]",
               "kl<=-1": "kl_logits lies in [0, inf]"}


@pytest.mark.parametrize("limit", list(BAD_BUDGETS), ids=list(BAD_BUDGETS))
def test_metric_limits_outside_the_metric_range_are_refused(tmp_path, monkeypatch, capsys, limit):
    monkeypatch.chdir(tmp_path)
    assert main([*COMPILE, "--budget", f"atol=1,rtol=1,{limit}", "--out", "NEW"]) == 2
    assert BAD_BUDGETS[limit] in one_line(capsys.readouterr().err)
    assert not any(tmp_path.iterdir())


def test_empty_budget_is_refused_not_defaulted(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main([*COMPILE, "--budget", "", "--out", "NEW"]) == 2
    assert "the budget is empty" in one_line(capsys.readouterr().err)
    assert not any(tmp_path.iterdir())


def _llama_batch(**changes) -> dict:
    from luminal_num.models.registry import load_job
    batch = {k: np.asarray(v) for k, v in load_job("llama-tiny").heldout[0].items()}
    batch.update(changes)
    return batch


AUDIT_INPUT_FAULTS = {
    "id-out-of-range": (lambda: _llama_batch(ids=np.full(16, 256, np.int32)),
                        "input 'ids' in bad.npz has values in [256, 256], outside its declared range [0, 255]"),
    "negative-id": (lambda: _llama_batch(ids=np.full(16, -1, np.int32)), "outside its declared range [0, 255]"),
    "float-ids": (lambda: _llama_batch(ids=np.zeros(16)), "holds integer ids (int32); got float64 values"),
    "unknown-array": (lambda: _llama_batch(extra=np.zeros(3)), "holds arrays the model does not take: ['extra']"),
    "rope-outside-declared-range": (lambda: _llama_batch(rope_cos=np.full((16, 16), 2.0)),
                                    "input 'rope_cos' in bad.npz has values in [2, 2], outside its declared range [-1, 1]"),
}


@pytest.mark.parametrize("make, message", list(AUDIT_INPUT_FAULTS.values()), ids=list(AUDIT_INPUT_FAULTS))
def test_audit_inputs_are_checked_against_the_model(report, tmp_path, monkeypatch, capsys, make, message):
    monkeypatch.chdir(tmp_path)
    np.savez(tmp_path / "bad.npz", **make())
    before = snapshot(tmp_path), snapshot(report)
    assert main(["audit", "--plan", str(report / "plan.json"), "--model", "llama-tiny", "--inputs", "bad.npz",
                 "--out", "AUD"]) == 2
    assert message in one_line(capsys.readouterr().err)
    assert (snapshot(tmp_path), snapshot(report)) == before


def test_ctrl_c_during_the_search_writes_the_best_plan_marked_partial(tmp_path, monkeypatch, capsys):
    from luminal_num.search.search import Searcher
    monkeypatch.chdir(tmp_path)

    def interrupted(self, *args):
        raise KeyboardInterrupt
    monkeypatch.setattr(Searcher, "greedy", interrupted)  # after the baselines and the sensitivity phase
    assert main([*COMPILE, "--out", "OUT"]) == 130
    line = one_line(capsys.readouterr().err, "interrupted: ")
    assert "best plan so far written to OUT/plan.json (marked partial)" in line
    plan = Plan.load(tmp_path / "OUT" / "plan.json")
    assert plan.data["interrupted"].startswith("search interrupted after") and plan.data["search"]["interrupted"]
    assert plan.data["verdict"]["passed"]
    assert "[PARTIAL: search interrupted" in (tmp_path / "OUT" / "pareto.html").read_text()


def test_ctrl_c_before_any_plan_passes_writes_nothing(tmp_path, monkeypatch, capsys):
    from luminal_num.search.space import SearchSpace
    monkeypatch.chdir(tmp_path)
    out = _old_out(tmp_path)
    before = snapshot(tmp_path)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(SearchSpace, "saturated", interrupted)
    assert main([*COMPILE, "--out", "OUT"]) == 130
    assert "nothing written" in one_line(capsys.readouterr().err, "interrupted: ")
    assert snapshot(tmp_path) == before and (out / "plan.json").read_text() == "old plan"


def _as_from_a_terminal() -> None:
    """The child's signal state as a shell in a terminal starts it (SIGINT deliverable, default action),
    not as this test process may have it: a blocked mask and SIG_IGN are inherited through exec, and a
    pytest-xdist worker's may differ from a terminal's."""
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_sigint_to_a_running_compile_exits_130_with_one_line(tmp_path):
    """A real Ctrl-C (SIGINT) at an arbitrary moment: one line, exit 130, no traceback; --out holds
    either nothing or a plan marked partial."""
    env = {**os.environ, "PYTHONHASHSEED": HASH_SEED, "MPLBACKEND": "Agg"}
    proc = subprocess.Popen([sys.executable, "-m", "luminal_num.cli", "compile", "--model", "transformer",
                             "--candidates", "200", "--quiet", "--out", "OUT"], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_as_from_a_terminal)
    t0 = time.monotonic()
    for _ in range(300):  # the first output line comes once the job is loaded and the search starts
        if proc.stdout.readline().startswith("[luminal-num] budget"):
            break
    seen = time.monotonic() - t0
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, (f"budget line after {seen:.1f} s, SIGINT 1 s later, ended after "
                                    f"{time.monotonic() - t0:.1f} s; stderr {err!r}; stdout tail {out[-300:]!r}")
    one_line(err, "interrupted: ")
    if (tmp_path / "OUT").exists() and {p.name for p in (tmp_path / "OUT").iterdir()} != {"verdicts"}:
        assert Plan.load(tmp_path / "OUT" / "plan.json").data["interrupted"]


def test_second_compile_into_the_same_out_is_refused(tmp_path):
    env = {**os.environ, "PYTHONHASHSEED": HASH_SEED, "MPLBACKEND": "Agg"}
    first = subprocess.Popen([sys.executable, "-m", "luminal_num.cli", *COMPILE, "--out", "OUT"], cwd=tmp_path,
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob(".luminal-num-*.lock")) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert first.poll() is None, "the first compile ended before the second could start"
    second = cli(*COMPILE, "--out", "OUT", cwd=tmp_path)
    assert second.returncode == 3
    assert "another luminal-num command is writing into OUT" in one_line(second.stderr)
    _, err = first.communicate(timeout=600)
    assert first.returncode == 0, err
    assert not list(tmp_path.glob(".luminal-num-*.lock"))  # released
    assert Plan.load(tmp_path / "OUT" / "plan.json").data["verdict"]["passed"]


def test_closed_stdout_exits_quietly(report, tmp_path):
    """`luminal-num inspect ... | head`: the reader goes away; no BrokenPipeError traceback."""
    env = {**os.environ, "PYTHONHASHSEED": HASH_SEED}
    proc = subprocess.Popen([sys.executable, "-m", "luminal_num.cli", "inspect", "--plan", str(report / "plan.json")],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # before the child has printed anything
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141 and err == ""


def test_version(capsys):
    from luminal_num import __version__
    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0 and capsys.readouterr().out.strip() == f"luminal-num {__version__}"


def test_help_shows_defaults(tmp_path):
    run = cli("compile", "--help", cwd=tmp_path)
    text = " ".join(run.stdout.split())
    assert "(default: h200)" in text and "(default: 120)" in text and "(default: minilm)" in text
    assert "(default: None)" not in text


def test_compile_report_html_is_for_people(report):
    """The real compile's pages: no reprs, nan or 17-digit numbers; threshold and chosen plan shown."""
    from test_report import assert_page_is_for_people
    page = (report / "pareto.html").read_text()
    assert_page_is_for_people(page)
    plan = Plan.load(report / "plan.json").data
    assert f"threshold {plan['headroom']:g} (headroom {plan['headroom']:g} x budget)" in page
    assert "chosen plan: candidate " in page and "<th>latency</th>" in page
    assert "allclose ratio" in page


def test_audit_html_is_for_people(report, tmp_path):
    from test_report import assert_page_is_for_people
    run = cli("audit", "--plan", str(report / "plan.json"), "--model", "transformer", "--out", "AUD", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    page = (tmp_path / "AUD" / "audit.html").read_text()
    assert_page_is_for_people(page)
    assert "Audit: PASSED" in page and "<td>y</td>" in page


def _stored_and_plan(out: Path) -> tuple[int, dict]:
    data = Plan.load(out / "plan.json").data
    return data["search"]["stored"], {k: v for k, v in data.items() if k != "search"}


def test_a_second_compile_reuses_the_verdict_cache_and_returns_the_same_plan(tmp_path, monkeypatch, capsys):
    """The default cache is <out>/verdicts: the second compile reads measurements from it (stored > 0,
    fewer measured) and returns the same plan, kernel for kernel, with the same verdict."""
    monkeypatch.chdir(tmp_path)
    assert main([*COMPILE, "--out", "OUT"]) == 0
    first_out = capsys.readouterr().out
    stored1, plan1 = _stored_and_plan(tmp_path / "OUT")
    assert stored1 == 0 and list((tmp_path / "OUT" / "verdicts").glob("verdicts-*.json"))
    assert main([*COMPILE, "--out", "OUT"]) == 0
    second_out = capsys.readouterr().out
    stored2, plan2 = _stored_and_plan(tmp_path / "OUT")
    assert stored2 > 0 and plan2 == plan1
    measured = [int(line.split(", ")[1].split()[0]) for line in (first_out, second_out)
                for line in line.splitlines() if "verdict cache" in line]
    assert measured[1] < measured[0], (first_out, second_out)


def test_an_explicit_verdict_cache_is_shared_and_no_verdict_cache_writes_none(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main([*COMPILE, "--out", "A", "--verdict-cache", "CACHE"]) == 0
    assert main([*COMPILE, "--out", "B", "--verdict-cache", "CACHE"]) == 0
    assert _stored_and_plan(tmp_path / "B")[0] > 0 and not (tmp_path / "A" / "verdicts").exists()
    assert main([*COMPILE, "--out", "C", "--no-verdict-cache"]) == 0
    assert _stored_and_plan(tmp_path / "C")[0] == 0 and not (tmp_path / "C" / "verdicts").exists()


def test_a_verdict_cache_that_is_a_file_is_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "cache").write_text("not a folder")
    assert main([*COMPILE, "--out", "OUT", "--verdict-cache", "cache"]) == 2
    assert "--verdict-cache cache exists and is not a folder" in one_line(capsys.readouterr().err)
    assert not (tmp_path / "OUT").exists()
