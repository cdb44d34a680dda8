"""Report files (the front they mark is the rows' own: the search's, tested in test_search.py), and
all-or-nothing writes."""
import base64
import csv
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import matplotlib.image
import numpy as np
import pandas as pd
import pytest

from luminal_num.dtypes.formats import BF16, F32
from luminal_num.report import atomic_dir, atomic_write_text, write_op_table, write_pareto_report
from luminal_num.report import pareto as pareto_module

LABELS = ["FP32 everywhere", "TF32 flag", "BF16 autocast", "FP8 everywhere", "chosen"]


def brute_force_front(points):
    """O(n^2): on the front iff no other point dominates it and no earlier point equals it; NaN never."""
    def has_nan(p):
        return math.isnan(p[0]) or math.isnan(p[1])
    result = []
    for i, p in enumerate(points):
        if has_nan(p):
            result.append(False)
            continue
        dominated = any(not has_nan(q) and q[0] <= p[0] and q[1] <= p[1] and (q != p or j < i)
                        for j, q in enumerate(points) if j != i)
        result.append(not dominated)
    return result


def passing_front(rows):
    """The front of passing rows only (brute force): a failing plan is never on it and dominates nothing."""
    points = [(e, lat) if ok else (math.nan, math.nan)
              for e, lat, ok in zip(rows["budget_share"], rows["latency_s"], rows["passes"])]
    return brute_force_front(points)


def sample_rows(n=12, seed=0):
    rng = np.random.default_rng(seed)
    rows = pd.DataFrame({
        "candidate": [f"cand{i:03d}" for i in range(n)],
        "budget_share": rng.lognormal(-9, 3, n),
        "latency_s": rng.lognormal(-8, 1, n),
        "latency_source": ["modelled"] * n,
        "verdict_source": rng.choice(["cache", "static", "measured"], n),
        "passes": [bool(v) for v in rng.random(n) < 0.6],
        "label": [""] * n,
    })
    rows.loc[: len(LABELS) - 1, "label"] = LABELS
    rows.loc[n - 1, "latency_s"] = np.nan  # rejected before profiling: no latency
    rows["on_front"] = passing_front(rows)  # a strict front of the passing rows stands in for the search's
    return rows


def test_report_files(tmp_path):
    rows = sample_rows()
    files = write_pareto_report(tmp_path / "rep", rows, budget_error=1e-3, title="toy <model>",
                                error_label="max |y - ref|")
    assert sorted(p.name for p in (tmp_path / "rep").iterdir()) == ["pareto.csv", "pareto.html", "pareto.png"]
    image = matplotlib.image.imread(files.png)
    height, width = image.shape[:2]
    assert 400 <= width <= 3000 and 300 <= height <= 3000
    assert image.std() > 0.01  # not a blank canvas

    page = files.html.read_text()
    embedded = re.search(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert embedded and base64.b64decode(embedded.group(1)) == files.png.read_bytes()
    body = page.split("<tbody>")[1].split("</tbody>")[0]
    assert body.count("<tr") == len(rows)
    for candidate in rows["candidate"]:
        assert f"<td>{candidate}</td>" in body
    expected_front = passing_front(rows)
    assert len(re.findall(r'<tr class="front[ "]', body)) == sum(expected_front)
    assert "toy &lt;model&gt;" in page and "<script" in page and "http" not in page  # self-contained

    with files.csv.open(newline="") as stream:
        records = list(csv.DictReader(stream))
    assert [r["candidate"] for r in records] == list(rows["candidate"])
    assert [r["on_front"] == "True" for r in records] == expected_front
    assert [r["label"] for r in records] == list(rows["label"])


def test_csv_round_trips_floats_exactly(tmp_path):
    rows = sample_rows()
    hard = [0.1 + 0.2, 1 / 3, 5e-324, 2.2250738585072014e-308, 1e200, 123456789.12345678,
            float.fromhex("0x1.fffffffffffffp-1"), 0.0, 3e-17, 6.02214076e23, 1e-300, 0.5]
    rows["budget_share"] = hard
    files = write_pareto_report(tmp_path, rows, budget_error=1e-3, title="t", error_label="err")
    with files.csv.open(newline="") as stream:
        records = list(csv.DictReader(stream))
    assert [float(r["budget_share"]).hex() for r in records] == [x.hex() for x in hard]
    latencies = [float(r["latency_s"]) if r["latency_s"] else math.nan for r in records]
    np.testing.assert_array_equal(np.array(latencies), rows["latency_s"].to_numpy())


def test_baselines_mapping_overrides_labels(tmp_path):
    rows = sample_rows().assign(label="")
    files = write_pareto_report(tmp_path, rows, 1e-3, "t", "err", baselines={"chosen": "cand004", "BF16 autocast": "cand001"})
    table = pd.read_csv(files.csv, keep_default_na=False)
    assert dict(zip(table["candidate"], table["label"]))["cand004"] == "chosen"
    assert len(re.findall(r'<tr class="(front )?chosen"><td>cand004</td>', files.html.read_text())) == 1
    with pytest.raises(ValueError, match="not in the rows"):
        write_pareto_report(tmp_path / "x", rows, 1e-3, "t", "err", baselines={"chosen": "nope"})


def listing(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_failure_mid_write_leaves_nothing(tmp_path, monkeypatch):
    report_dir = tmp_path / "reports" / "toy"
    before = listing(tmp_path)

    def broken_html(*args, **kwargs):
        raise RuntimeError("renderer crashed")
    monkeypatch.setattr(pareto_module, "_render_html", broken_html)  # csv and png are already staged by then
    with pytest.raises(RuntimeError, match="renderer crashed"):
        write_pareto_report(report_dir, sample_rows(), 1e-3, "t", "err")
    assert not report_dir.exists()
    assert listing(tmp_path) == before  # the folders made for it are gone too


def test_failure_keeps_the_previous_report_and_sibling_files(tmp_path, monkeypatch):
    first = write_pareto_report(tmp_path, sample_rows(seed=1), 1e-3, "t", "err")
    (tmp_path / "plan.json").write_text("{}")
    old = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    bad = sample_rows(seed=2)
    bad["budget_share"] = [*bad["budget_share"][:3], "not a number", *bad["budget_share"][4:]]
    with pytest.raises(ValueError):
        write_pareto_report(tmp_path, bad, 1e-3, "t", "err")

    def broken_png(*args, **kwargs):
        raise OSError("disk full")
    monkeypatch.setattr(pareto_module, "_render_png", broken_png)
    with pytest.raises(OSError):
        write_pareto_report(tmp_path, sample_rows(seed=3), 1e-3, "t", "err")
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == old
    assert first.csv.exists()


@pytest.mark.parametrize("mutate, message", [
    (lambda r: r.drop(columns="verdict_source"), "lack columns"),
    (lambda r: r.assign(passes="yes"), "booleans"),
    (lambda r: r.assign(candidate="same"), "duplicate"),
    (lambda r: r.assign(label="chosen"), "more than one"),
    (lambda r: r.assign(budget_share=-1.0), "negative"),
])
def test_malformed_rows_are_rejected(tmp_path, mutate, message):
    with pytest.raises(ValueError, match=message):
        write_pareto_report(tmp_path / "r", mutate(sample_rows()), 1e-3, "t", "err")
    assert not (tmp_path / "r").exists()


def test_atomic_write_text_failure_leaves_old_file(tmp_path, monkeypatch):
    path = tmp_path / "a.txt"
    atomic_write_text(path, "old")

    def failing_fsync(fd):
        raise OSError("device gone")
    monkeypatch.setattr(os, "fsync", failing_fsync)  # fails after the new text reached the temp file
    with pytest.raises(OSError, match="device gone"):
        atomic_write_text(path, "new")
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["a.txt"]


def test_atomic_dir_replaces_on_success_only(tmp_path):
    target = tmp_path / "out"
    with atomic_dir(target) as staging:
        (staging / "one.txt").write_text("1")
    assert listing(target) == ["one.txt"]
    with pytest.raises(KeyError):
        with atomic_dir(target) as staging:
            (staging / "two.txt").write_text("2")
            raise KeyError("boom")
    assert listing(target) == ["one.txt"]
    with atomic_dir(target) as staging:
        (staging / "three.txt").write_text("3")
    assert listing(target) == ["three.txt"]
    assert listing(tmp_path) == ["out", "out/three.txt"]


@dataclass(frozen=True)
class OpRow:
    op: str
    dtype: object
    accumulator: object
    scale: float


def test_write_op_table(tmp_path):
    scale = 1 / 3
    path = write_op_table(tmp_path / "plan_ops.csv",
                          [OpRow("gemm0", BF16, F32, scale), OpRow("softmax1", F32, F32, 1.0)])
    table = pd.read_csv(path)
    assert list(table["dtype"]) == ["bf16", "f32"] and list(table["accumulator"]) == ["f32", "f32"]
    assert table["scale"][0] == scale
    with pytest.raises(ValueError, match="fields"):
        write_op_table(tmp_path / "bad.csv", [{"op": "a", "dtype": "f32"}, {"op": "b"}])
    assert not (tmp_path / "bad.csv").exists()
    frame = pd.DataFrame({"op": ["x"], "dtype": ["f8e4m3"]})
    assert write_op_table(tmp_path / "f.csv", frame).read_text() == "op,dtype\nx,f8e4m3\n"


def _page_text(page: str) -> str:
    """The page without its embedded PNG (base64 holds long digit runs by chance)."""
    return re.sub(r"base64,[A-Za-z0-9+/=]+", "base64,", page)


def assert_page_is_for_people(page: str) -> None:
    """No reprs (np.float64(...)), no 'nan', no 10+ digit runs (a 17-digit float printed whole)."""
    text = _page_text(page)
    assert "np.float64(" not in text and "np.float32(" not in text
    assert not re.search(r"\bnan\b", text, flags=re.IGNORECASE)
    assert not re.search(r"\d{10,}", text), re.search(r".{40}\d{10,}.{10}", text)


def test_html_numbers_are_for_people_and_show_threshold_and_chosen(tmp_path):
    rows = sample_rows()
    rows["budget_share"] = [np.float64(x) for x in rows["budget_share"]]  # what the search hands in
    rows["max_abs"] = [np.float64(0.034234567890123456)] * len(rows)
    chosen = rows.index[rows["label"] == "chosen"][0]
    rows.loc[chosen, ["budget_share", "latency_s", "passes"]] = [0.0342345678901234, 1.23456789e-4, True]
    files = write_pareto_report(tmp_path, rows, 1.0, "t", "allclose ratio", threshold=0.5)
    page = files.html.read_text()
    assert_page_is_for_people(page)
    assert "threshold 0.5 (headroom 0.5 x budget)" in page and "error &le; 1" in page
    assert "chosen plan: candidate cand004 (error 0.0342, latency 123 us)" in page
    assert "<th>latency</th>" in page and "<th>allclose ratio</th>" in page
    # the CSV stays the exact record
    table = pd.read_csv(files.csv)
    assert table.loc[chosen, "budget_share"] == 0.0342345678901234


def test_the_rows_front_is_written_as_given_and_last(tmp_path):
    """The report marks the front its rows carry (not one of its own): a front that is not the strict
    Pareto front of the rows (the search's merges ties) is written as is, as the last column."""
    rows = sample_rows()
    passing = rows.index[rows["passes"]]
    rows["on_front"] = False
    rows.loc[passing[-1], "on_front"] = True  # one passing row, whichever it is
    files = write_pareto_report(tmp_path, rows, 1.0, "t", "err")
    table = pd.read_csv(files.csv)
    assert list(table.columns)[-1] == "on_front" and list(table["on_front"]) == list(rows["on_front"])


@pytest.mark.parametrize("bad", ["failing", "not_bool", "missing"])
def test_a_front_with_a_failing_plan_or_not_booleans_is_refused(tmp_path, bad):
    rows = sample_rows()
    if bad == "failing":
        rows.loc[rows.index[~rows["passes"]][0], "on_front"] = True
    elif bad == "not_bool":
        rows["on_front"] = rows["on_front"].astype(int)
    else:
        rows = rows.drop(columns="on_front")
    with pytest.raises(ValueError, match="fail the budget|must hold booleans|lack columns"):
        write_pareto_report(tmp_path / "r", rows, 1.0, "t", "err")
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("threshold", [0.0, 2.0, -1.0])
def test_threshold_outside_the_budget_is_refused(tmp_path, threshold):
    with pytest.raises(ValueError, match="threshold"):
        write_pareto_report(tmp_path / "r", sample_rows(), 1.0, "t", "err", threshold=threshold)
    assert not (tmp_path / "r").exists()


def test_atomic_files_rolls_back_when_a_move_fails(tmp_path, monkeypatch):
    """plan.json cannot be replaced: the pareto files moved in before it are taken out again and the
    old ones put back (the issue's mixed folder)."""
    from luminal_num.report import files as files_module
    out = tmp_path / "out"
    out.mkdir()
    for name in ("pareto.csv", "plan.json", "other.txt"):
        (out / name).write_text(f"old {name}")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    real_replace = os.replace

    def failing_replace(src, dst):
        if Path(dst) == out / "plan.json" and Path(src).read_text() == "new plan.json":
            raise PermissionError("cannot replace plan.json")
        return real_replace(src, dst)
    monkeypatch.setattr(files_module.os, "replace", failing_replace)
    with pytest.raises(PermissionError):
        with files_module.atomic_files(out) as staging:
            for name in ("pareto.csv", "pareto.html", "plan.json"):
                (staging / name).write_text(f"new {name}")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert listing(tmp_path) == ["out", "out/other.txt", "out/pareto.csv", "out/plan.json"]


@pytest.mark.parametrize("value, shown", [(0.034234567890123456, "0.0342"), (np.float64(1.23456e-5), "1.23e-05"),
                                          (1234.5, "1.23e+03"), (0.0, "0"), (math.inf, "inf"),
                                          (math.nan, "-"), (None, "-")])
def test_fmt_num(value, shown):
    from luminal_num.report.numbers import fmt_num
    assert fmt_num(value) == shown


@pytest.mark.parametrize("seconds, shown", [(7.603759e-05, "76 us"), (1.23456e-3, "1.23 ms"), (2.5, "2.5 s"),
                                            (4e-9, "4 ns"), (0.0, "0 ns"), (math.nan, "-")])
def test_fmt_latency(seconds, shown):
    from luminal_num.report.numbers import fmt_latency
    assert fmt_latency(seconds) == shown
