"""Pareto front vs brute-force dominance, report files, and all-or-nothing writes."""
import base64
import csv
import math
import os
import re
from dataclasses import dataclass

import matplotlib.image
import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from luminal_num.dtypes.formats import BF16, F32
from luminal_num.report import (atomic_dir, atomic_write_text, pareto_front, write_op_table,
                                write_pareto_report)
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


coordinate = st.one_of(st.integers(0, 4).map(float),  # small grid: many ties and duplicates
                       st.floats(0.0, 1e3, allow_nan=False), st.just(math.inf), st.just(math.nan))


@settings(deadline=None, max_examples=300)
@given(st.lists(st.tuples(coordinate, coordinate), max_size=30))
def test_pareto_front_matches_brute_force(points):
    assert pareto_front(points) == brute_force_front(points)


def test_pareto_front_hand_cases():
    assert pareto_front([]) == []
    assert pareto_front([(1.0, 1.0), (1.0, 1.0)]) == [True, False]
    assert pareto_front([(2.0, 1.0), (1.0, 2.0), (2.0, 2.0), (1.0, 3.0)]) == [True, True, False, False]


def sample_rows(n=12, seed=0):
    rng = np.random.default_rng(seed)
    rows = pd.DataFrame({
        "candidate": [f"cand{i:03d}" for i in range(n)],
        "error": rng.lognormal(-9, 3, n),
        "latency_s": rng.lognormal(-8, 1, n),
        "latency_source": ["modelled"] * n,
        "verdict_source": rng.choice(["cache", "static", "measured"], n),
        "passes": [bool(v) for v in rng.random(n) < 0.6],
        "label": [""] * n,
    })
    rows.loc[: len(LABELS) - 1, "label"] = LABELS
    rows.loc[n - 1, "latency_s"] = np.nan  # rejected before profiling: no latency
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
    expected_front = pareto_front(list(zip(rows["error"], rows["latency_s"])))
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
    rows["error"] = hard
    files = write_pareto_report(tmp_path, rows, budget_error=1e-3, title="t", error_label="err")
    with files.csv.open(newline="") as stream:
        records = list(csv.DictReader(stream))
    assert [float(r["error"]).hex() for r in records] == [x.hex() for x in hard]
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
    assert listing(tmp_path) == sorted(before + ["reports"])  # only the (empty) parent remains


def test_failure_keeps_the_previous_report_and_sibling_files(tmp_path, monkeypatch):
    first = write_pareto_report(tmp_path, sample_rows(seed=1), 1e-3, "t", "err")
    (tmp_path / "plan.json").write_text("{}")
    old = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    bad = sample_rows(seed=2)
    bad["error"] = [*bad["error"][:3], "not a number", *bad["error"][4:]]
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
    (lambda r: r.assign(error=-1.0), "negative"),
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
