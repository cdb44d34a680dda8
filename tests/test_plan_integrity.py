"""plan.json's integrity (issue 36): a hand-edited plan ran silently (a widened budget audited PASSED against
the edit, a changed LLIR precision ran as if compiled) and a mistyped field crashed `inspect` with a
traceback. Each is now one `error:` line naming the field, exit 2, nothing written; formatting is not
content, so a re-indented plan still loads."""
from __future__ import annotations

import json
import shutil

import pytest

from luminal_num.cli import EXIT_INPUT, EXIT_OK, main
from luminal_num.search.plan_file import PlanError, check_digest, check_fields, with_digest
from test_cli import cli
from test_cli_faults import _one_line_refusal

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """A compiled plan of the test transformer (in process: the refusals below are checked in process too,
    one as a user runs it)."""
    out = tmp_path_factory.mktemp("plan_integrity") / "report"
    assert main(["compile", "--model", "transformer", "--candidates", "2", "--quiet", "--out", str(out)]) == EXIT_OK
    return out


def _refused(capsys, argv, *words):
    """main(argv) exits 2 with one `error:` line on stderr holding `words`."""
    capsys.readouterr()
    assert main(argv) == EXIT_INPUT
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    for w in words:
        assert w in err, (w, err)


def _edited(compiled, tmp_path, edit):
    """A copy of the compiled report whose plan.json went through `edit(data)` and was written back."""
    folder = tmp_path / "edited"
    shutil.copytree(compiled, folder, ignore=shutil.ignore_patterns("verdicts"))
    path = folder / "plan.json"
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data, indent=1, sort_keys=True))
    return folder


def _widen_budget(d):
    d["budget"]["atol"] = "100"


def _softmax_in_bf16(d):
    kernel = next(k for k in d["llir"]["kernels"] if k["kind"] == "softmax")
    kernel["precision"] = "bf16"


def test_a_widened_budget_is_refused_on_the_command_line(compiled, tmp_path):
    """As the issue ran it: atol=100 written into plan.json, then audit (it printed PASSED within atol=100)."""
    folder = _edited(compiled, tmp_path, _widen_budget)
    proc = cli("audit", "--plan", str(folder / "plan.json"), cwd=tmp_path)
    _one_line_refusal(proc, "plan.json", "does not match its digest", "budget changed")
    assert not (folder / "audit.csv").exists()


@pytest.mark.parametrize("edit, words", [
    (_softmax_in_bf16, ("llir changed",)),
    (lambda d: d.pop("search"), ("search removed",)),
    (lambda d: d.update(note="mine"), ("note added",)),
    (lambda d: d.pop("digest"), ("has no digest",)),
], ids=["llir-precision", "removed", "added", "no-digest"])
def test_an_edited_plan_is_refused_naming_what_changed(compiled, tmp_path, capsys, edit, words):
    folder = _edited(compiled, tmp_path, edit)
    _refused(capsys, ["audit", "--plan", str(folder / "plan.json")], "plan.json", *words)
    assert not (folder / "audit.csv").exists()


@pytest.mark.parametrize("edit, words", [
    (lambda d: d.update(budget="atol=1,rtol=1"), ("field 'budget' must be an object", '"atol=1,rtol=1"')),
    (lambda d: d["budget"].update(rtol="abc"), ("field 'budget' is not a budget", "abc")),
    (lambda d: d["budget"].update(atol="-1"), ("field 'budget' is not a budget", "atol must be >= 0")),
    (lambda d: d["verdict"].update(error="small"), ("verdict.error must be a number",)),
    (lambda d: d["latency"].pop("source"), ("latency.source is missing",)),
    (lambda d: d.update(headroom=2), ("'headroom' must be a number in (0, 1]",)),
    (lambda d: d["job"].update(layers="2"), ("job.layers must be an integer or null",)),
], ids=["budget-string", "rtol-text", "atol-negative", "verdict-error", "latency-source", "headroom", "job-layers"])
def test_a_mistyped_field_is_one_line_not_a_traceback(compiled, tmp_path, capsys, edit, words):
    folder = _edited(compiled, tmp_path, edit)
    _refused(capsys, ["inspect", "--plan", str(folder / "plan.json")], *words)


def test_formatting_is_not_content(compiled, tmp_path, capsys):
    """Re-indented, keys in another order: the same plan (the digest is over each field's canonical JSON)."""
    def reformat(d):
        items = sorted(d.items(), reverse=True)
        d.clear()
        d.update(items)
    folder = _edited(compiled, tmp_path, reformat)
    (folder / "plan.json").write_text(json.dumps(json.loads((folder / "plan.json").read_text())))
    capsys.readouterr()
    assert main(["inspect", "--plan", str(folder / "plan.json")]) == EXIT_OK
    assert capsys.readouterr().out.startswith("plan v2")


def test_the_digest_names_each_field_and_round_trips():
    """Unit level: what save writes, load accepts unchanged; one changed value names exactly its field."""
    data = {"budget": {"atol": "0.1", "rtol": "0", "outputs": None, "metrics": []}, "ranges": {3: (1.0, float("nan"))},
            "seed": 0}
    written = with_digest(data)
    assert set(written["digest"]["fields"]) == {"budget", "ranges", "seed"}
    assert with_digest(json.loads(json.dumps(written))) == written  # digesting is idempotent
    back = check_digest(json.loads(json.dumps(written)), "p")
    assert back == json.loads(json.dumps(data))
    written["seed"] = 1
    with pytest.raises(PlanError, match=r"^p does not match its digest: field\(s\) seed changed since it was written"):
        check_digest(written, "p")


def test_typed_checks_accept_what_compile_writes(compiled):
    data = json.loads((compiled / "plan.json").read_text())
    check_fields(data, "plan.json")  # no error: every field of a compiled plan has its type
    data["verdict"]["bound"] = "inf"
    check_fields(data, "plan.json")  # non-finite numbers are held as their repr
