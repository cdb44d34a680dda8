"""Held-out sets at a short context (issue 36): a user's --calibration also had to fit the shipped held-out
prompts (a 38-token shipped prompt refused a context-32 workload), and no option named a held-out set of
one's own. Shipped prompts are now cut to the context with a note; one's own are refused naming the file;
compile --heldout FILE is recorded in plan.json and is what audit re-checks by default."""
from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from luminal_num.cli import EXIT_INPUT, EXIT_OK, main
from luminal_num.models.llm import Prompt, load_llm, load_prompts
from tiny_gguf import tiny_config, write_tiny_gguf

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
WORKLOAD = "decode:2@32"
LONG = "the cat sat on the mat and then it went to sleep for a very long time indeed, the end"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("heldout")
    model = root / "tiny.gguf"
    write_tiny_gguf(model, tiny_config(max_position_embeddings=256))
    (root / "short.txt").write_text("the cat sat on\n", encoding="utf-8")
    (root / "mine.txt").write_text("a dog ran\n", encoding="utf-8")
    (root / "long.txt").write_text(LONG + "\n", encoding="utf-8")
    return root, model


def _compile(root, model, out, *extra):
    return main(["compile", "--model", str(model), "--workload", WORKLOAD, "--candidates", "1", "--quiet",
                 "--out", str(root / out), *extra])


def test_shipped_prompts_longer_than_the_context_are_cut_with_a_note(tiny, capsys):
    root, model = tiny
    m = load_llm(str(model))
    shipped = load_prompts("heldout")
    too_long = sum(len(m.encode(p)) > 32 for p in shipped)
    assert too_long > 0  # the shipped set really does not fit context 32: the case the issue hit
    assert _compile(root, model, "cut", "--calibration", str(root / "short.txt")) == EXIT_OK
    out = capsys.readouterr().out
    assert f"note: {too_long} of the {len(shipped)} shipped held-out prompts cut to their first 32 tokens" in out
    assert main(["audit", "--plan", str(root / "cut" / "plan.json")]) == EXIT_OK
    assert "shipped held-out prompts cut" in capsys.readouterr().out


@pytest.mark.parametrize("option", ["--calibration", "--heldout"])
def test_prompts_of_ones_own_that_do_not_fit_are_refused_naming_the_file(tiny, capsys, option):
    root, model = tiny
    long_tokens = len(load_llm(str(model)).encode(Prompt(LONG, False)))
    assert long_tokens > 32
    extra = ["--calibration", str(root / "short.txt")] if option == "--heldout" else []
    capsys.readouterr()
    assert _compile(root, model, f"never{option}", *extra, option, str(root / "long.txt")) == EXIT_INPUT
    err = capsys.readouterr().err.strip()
    which = "held-out" if option == "--heldout" else "calibration"
    assert err.startswith(f"error: {option} {root / 'long.txt'}: {which} prompt 'the cat sat") and "\n" not in err, err
    assert f"has {long_tokens} tokens" in err and "context of 32 rows" in err
    assert not (root / f"never{option}").exists()


def test_a_heldout_set_of_ones_own_is_recorded_and_audited_by_default(tiny, capsys):
    root, model = tiny
    assert _compile(root, model, "mine", "--calibration", str(root / "short.txt"),
                    "--heldout", str(root / "mine.txt")) == EXIT_OK
    out = capsys.readouterr().out
    assert "shipped held-out" not in out  # the shipped set was not used, so nothing of it was cut
    plan = json.loads((root / "mine" / "plan.json").read_text())
    assert plan["job"]["heldout"] == str(root / "mine.txt")
    assert main(["audit", "--plan", str(root / "mine" / "plan.json")]) == EXIT_OK
    audited = pd.read_csv(root / "mine" / "audit.csv")
    assert sorted(audited["batch"].unique()) == [0]  # one prompt (two slots): one batch, not the shipped six
    (root / "mine.txt").rename(root / "gone.txt")
    try:
        capsys.readouterr()
        assert main(["audit", "--plan", str(root / "mine" / "plan.json")]) == EXIT_INPUT
        err = capsys.readouterr().err.strip()
        assert "held-out set" in err and "does not exist here" in err and "\n" not in err, err
    finally:
        (root / "gone.txt").rename(root / "mine.txt")


def test_a_prompt_file_as_heldout_of_a_non_llm_is_one_line(tmp_path, capsys):
    (tmp_path / "p.txt").write_text("hello\n", encoding="utf-8")
    assert main(["compile", "--model", "transformer", "--heldout", str(tmp_path / "p.txt"), "--quiet",
                 "--out", str(tmp_path / "never")]) == EXIT_INPUT
    err = capsys.readouterr().err.strip()
    assert "--heldout" in err and "prompt file applies to LLMs" in err and "\n" not in err
    assert not (tmp_path / "never").exists()


def test_a_heldout_npz_of_a_non_llm_is_audited_by_default(tmp_path, capsys):
    from luminal_num.models.registry import transformer_job
    job = transformer_job()
    batch = {k: np.asarray(v) for k, v in job.heldout[1].items()}
    np.savez(tmp_path / "held.npz", **batch)
    assert main(["compile", "--model", "transformer", "--candidates", "2", "--heldout", str(tmp_path / "held.npz"),
                 "--quiet", "--out", str(tmp_path / "report")]) == EXIT_OK
    assert main(["audit", "--plan", str(tmp_path / "report" / "plan.json")]) == EXIT_OK
    assert sorted(pd.read_csv(tmp_path / "report" / "audit.csv")["batch"].unique()) == [0]  # the shipped set has 2
