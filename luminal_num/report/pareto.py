"""Pareto report: every evaluated plan as error vs latency, the front marked, as CSV + PNG + HTML.

The front is the search's (search/front.py, an epsilon-Pareto front whose members were confirmed end to
end): the rows carry it, so the report, `luminal-num pareto` and `compile` show the same one.

Why three files: the CSV is the record (full-precision floats, diffable, read back by tools), the PNG is
the picture of the trade-off, and the HTML puts both on one self-contained page (no external assets,
so it opens from an archive or a CI artifact as is).
"""
from __future__ import annotations

import base64
import dataclasses
import html
import io
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from string import Template

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from luminal_num.report.files import atomic_files, atomic_write_text
from luminal_num.report.numbers import fmt_latency, fmt_num, fmt_numbers_in

# the error a plan is judged by: the share of the user's budget it uses, over allclose (max |y - ref| /
# (atol + rtol |ref|)) and every metric limit (1 - cosine, KL, 1 - top-1 ... over their limits); <= 1 fits.
# With atol=inf (an LLM budget of KL and top-1 limits) allclose alone would put every plan at 0.
ERROR_COLUMN = "budget_share"
ALLCLOSE_COLUMN = "allclose_ratio"  # allclose alone, kept beside it
FRONT_COLUMN = "on_front"  # the search's front (search/front.py), marked by the caller: one front everywhere
REQUIRED_COLUMNS = ("candidate", ERROR_COLUMN, "latency_s", "latency_source", "verdict_source", "passes", "label",
                    FRONT_COLUMN)
NUMERIC_COLUMNS = (ERROR_COLUMN, "latency_s")
CHOSEN_LABEL = "chosen"
CHOSEN_COLUMN = "chosen"  # the plan the search returned; rows without this column mark it by the label "chosen"
CSV_NAME, PNG_NAME, HTML_NAME = "pareto.csv", "pareto.png", "pareto.html"


@dataclass(frozen=True)
class ReportFiles:
    csv: Path
    png: Path
    html: Path


def _checked_table(rows: pd.DataFrame, baselines: Mapping[str, object] | None) -> pd.DataFrame:
    """Validate the report rows (`on_front` last); raises ValueError on anything malformed."""
    missing = [column for column in REQUIRED_COLUMNS if column not in rows.columns]
    if missing:
        raise ValueError(f"report rows lack columns {missing}; required: {list(REQUIRED_COLUMNS)}")
    if rows.empty:
        raise ValueError("report rows are empty: nothing was evaluated")
    table = rows.reset_index(drop=True).copy()
    for column in NUMERIC_COLUMNS:
        table[column] = pd.to_numeric(table[column], errors="raise").astype(np.float64)
        if (table[column] < 0).any():
            raise ValueError(f"column {column!r} has negative values")
    for column in ("passes", FRONT_COLUMN):
        if not all(isinstance(value, (bool, np.bool_)) for value in table[column]):
            raise ValueError(f"column {column!r} must hold booleans")
        table[column] = table[column].astype(bool)
    if (table[FRONT_COLUMN] & ~table["passes"]).any():
        raise ValueError(f"rows {list(table['candidate'][table[FRONT_COLUMN] & ~table['passes']])} are on the front "
                         f"but fail the budget: the front is of passing plans")
    if table["candidate"].duplicated().any():
        raise ValueError(f"duplicate candidate ids: {sorted(set(table['candidate'][table['candidate'].duplicated()]))}")
    table["label"] = table["label"].fillna("").astype(str)
    for label, candidate in (baselines or {}).items():
        match = table["candidate"] == candidate
        if not match.any():
            raise ValueError(f"baseline {label!r} names candidate {candidate!r}, which is not in the rows")
        table.loc[match, "label"] = label
    if CHOSEN_COLUMN in table.columns:
        if not all(isinstance(value, (bool, np.bool_)) for value in table[CHOSEN_COLUMN]):
            raise ValueError(f"column {CHOSEN_COLUMN!r} must hold booleans")
        table[CHOSEN_COLUMN] = table[CHOSEN_COLUMN].astype(bool)
        if table[CHOSEN_COLUMN].sum() > 1:
            raise ValueError(f"more than one row is marked {CHOSEN_COLUMN!r}")
    elif (table["label"] == CHOSEN_LABEL).sum() > 1:
        raise ValueError(f"more than one row is labelled {CHOSEN_LABEL!r}")
    table[FRONT_COLUMN] = table.pop(FRONT_COLUMN)  # the last column, as the record has always had it
    return table


def chosen_rows(table: pd.DataFrame) -> pd.Series:
    """Which row is the chosen plan: the `chosen` column (a baseline keeps its recipe's name as its label),
    else the row labelled "chosen"."""
    if CHOSEN_COLUMN in table.columns:
        return table[CHOSEN_COLUMN].astype(bool)
    return table["label"] == CHOSEN_LABEL


def _csv_text(table: pd.DataFrame) -> str:
    """CSV with floats in shortest round-trip form (pandas' default repr), never fixed decimals."""
    return table.to_csv(index=False, lineterminator="\n", float_format=None)


def _render_png(table: pd.DataFrame, budget_error: float, threshold: float | None, title: str,
                error_label: str) -> bytes:
    """Error vs latency on log axes: front as a step line, the budget and the threshold plans were judged
    against (headroom x budget) as lines, baselines and the chosen plan marked."""
    figure = Figure(figsize=(8.0, 5.5), dpi=120)
    axes = figure.subplots()
    plottable = table[np.isfinite(table[ERROR_COLUMN]) & np.isfinite(table["latency_s"])
                      & (table[ERROR_COLUMN] > 0) & (table["latency_s"] > 0)]
    for passes, style in ((True, dict(color="tab:blue")), (False, dict(facecolors="none", edgecolors="tab:gray"))):
        group = plottable[plottable["passes"] == passes]
        if not group.empty:
            axes.scatter(group["latency_s"], group[ERROR_COLUMN], s=28, zorder=3,
                         label=f"{'passes' if passes else 'fails'} the gate ({len(group)})", **style)
    front = plottable[plottable[FRONT_COLUMN]].sort_values("latency_s")
    if not front.empty:
        axes.step(front["latency_s"], front[ERROR_COLUMN], where="post", color="tab:orange", zorder=2)
        axes.scatter(front["latency_s"], front[ERROR_COLUMN], s=90, facecolors="none", edgecolors="tab:orange",
                     linewidths=1.5, zorder=4, label=f"Pareto front ({len(front)})")
    if math.isfinite(budget_error):
        axes.axhline(budget_error, color="tab:red", linestyle="--", label=f"budget {fmt_num(budget_error)}")
    if threshold is not None and math.isfinite(threshold) and threshold != budget_error:
        axes.axhline(threshold, color="tab:green", linestyle=":",
                     label=f"threshold judged against {fmt_num(threshold)} (headroom x budget)")
    labelled = plottable[plottable["label"] != ""]
    for label, latency, error in zip(labelled["label"], labelled["latency_s"], labelled[ERROR_COLUMN]):
        axes.annotate(label, (latency, error), xytext=(8, 8), textcoords="offset points",
                      fontsize=8, arrowprops=dict(arrowstyle="-", color="0.4"))
    chosen = plottable[chosen_rows(plottable)]
    if not chosen.empty:
        axes.scatter(chosen["latency_s"], chosen[ERROR_COLUMN], marker="*", s=280, color="gold",
                     edgecolors="black", zorder=5, label="chosen plan")
    axes.set_xscale("log")
    axes.set_yscale("log")
    axes.set_xlabel("latency (s)")
    axes.set_ylabel(error_label)
    axes.set_title(title)
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize=8, loc="best")
    hidden = len(table) - len(plottable)
    if hidden:
        figure.text(0.01, 0.01, f"{hidden} candidate(s) not plotted: no latency or zero error", fontsize=8)
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", metadata={"Software": None})
    return buffer.getvalue()


PAGE = Template("""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>$title</title>
<style>
body { font-family: sans-serif; margin: 1.5em; }
table { border-collapse: collapse; font-size: 0.85em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.5em; text-align: left; }
th { cursor: pointer; background: #eee; user-select: none; }
tr.front { background: #fff3e0; }
tr.chosen { background: #fff59d; font-weight: bold; }
</style></head><body>
<h1>$title</h1>
<p>$summary</p>
<img alt="error vs latency" src="data:image/png;base64,$png">
$figures
<p>Rows on the Pareto front of passing plans are shaded; click a column header to sort.</p>
<table class="sortable"><thead><tr>$header</tr></thead>
<tbody>
$body
</tbody></table>
<script>
document.querySelectorAll("table.sortable th").forEach(function (th, column) {
  th.addEventListener("click", function () {
    var body = th.closest("table").tBodies[0];
    var ascending = th.dataset.order !== "asc";
    th.dataset.order = ascending ? "asc" : "desc";
    var key = function (row) { var cell = row.cells[column]; return cell.dataset.sort !== undefined ? cell.dataset.sort : cell.textContent; };
    Array.from(body.rows).sort(function (a, b) {
      var x = key(a), y = key(b);
      if (x === "" || y === "") { return (x === "") - (y === ""); }
      var nx = Number(x), ny = Number(y);
      var order = (!isNaN(nx) && !isNaN(ny)) ? nx - ny : x.localeCompare(y);
      return ascending ? order : -order;
    }).forEach(function (row) { body.appendChild(row); });
  });
});
</script>
</body></html>
""")


def _cell(value: object, column: str = "") -> str:
    """One table cell for people (3 significant digits, latency with its unit); the sort key is the
    number in 7 significant digits, and NaN (never profiled) sorts last as an empty key."""
    if isinstance(value, (float, np.floating)) and not isinstance(value, bool):
        number = float(value)
        key = "" if math.isnan(number) else f"{number:.6e}"
        shown = fmt_latency(number) if column == "latency_s" else fmt_num(number)
        return f'<td data-sort="{key}">{html.escape(shown)}</td>'
    return f"<td>{html.escape(fmt_numbers_in(str(value)))}</td>"  # reasons: limits scaled by the headroom


HEADERS = {"latency_s": "latency", FRONT_COLUMN: "on front (of passing plans)", ALLCLOSE_COLUMN: "allclose ratio"}


def _figure(caption: str, png: bytes) -> str:
    return (f'<figure><img alt="{html.escape(caption)}" src="data:image/png;base64,{base64.b64encode(png).decode("ascii")}">'
            f"<figcaption>{html.escape(caption)}</figcaption></figure>")


def _render_html(table: pd.DataFrame, png: bytes, budget_error: float, threshold: float | None, title: str,
                 error_label: str, figures: Sequence[tuple[str, bytes]] = (), notes: Sequence[str] = ()) -> str:
    header = "".join(f"<th>{html.escape(error_label if column == ERROR_COLUMN else HEADERS.get(column, column))}</th>"
                     for column in table.columns)
    is_chosen = chosen_rows(table)
    body_rows = []
    for values, front, chosen in zip(table.itertuples(index=False, name=None), table[FRONT_COLUMN], is_chosen):
        classes = " ".join(name for name, flag in (("front", front), ("chosen", chosen)) if flag)
        cells = "".join(_cell(value, column) for value, column in zip(values, table.columns))
        body_rows.append(f'<tr class="{classes}">{cells}</tr>')
    picked = table[is_chosen]
    chosen_text = ("no plan chosen" if picked.empty else
                   f"chosen plan: candidate {picked['candidate'].iloc[0]} (error "
                   f"{fmt_num(picked[ERROR_COLUMN].iloc[0])}, latency {fmt_latency(picked['latency_s'].iloc[0])})")
    judged = budget_error if threshold is None else threshold
    limit = (f"the budget is an error &le; {fmt_num(budget_error)}" if threshold is None else
             f"the budget is an error &le; {fmt_num(budget_error)}; plans were judged against the "
             f"threshold {fmt_num(threshold)} (headroom {fmt_num(threshold / budget_error)} x budget) on the "
             f"calibration inputs, keeping the rest for unseen inputs")
    summary = (f"{len(table)} candidates, {int(table['passes'].sum())} pass the gate (judged against "
               f"{fmt_num(judged)}), {int(table[FRONT_COLUMN].sum())} on the Pareto front of passing plans; "
               f"{limit}. {html.escape(chosen_text)}." + "".join(f"<br>{html.escape(note)}" for note in notes))
    return PAGE.substitute(title=html.escape(title), summary=summary, png=base64.b64encode(png).decode("ascii"),
                           figures="\n".join(_figure(caption, data) for caption, data in figures),
                           header=header, body="\n".join(body_rows))


def write_pareto_report(out_dir: str | os.PathLike, rows: pd.DataFrame, budget_error: float, title: str,
                        error_label: str, baselines: Mapping[str, object] | None = None,
                        threshold: float | None = None, figures: Sequence[tuple[str, bytes]] = (),
                        notes: Sequence[str] = ()) -> ReportFiles:
    """Write pareto.csv, pareto.png and pareto.html into `out_dir`, all or nothing.

    `rows` holds one row per evaluated candidate (REQUIRED_COLUMNS at least); baseline names come from
    its `label` column, or from `baselines` ({label: candidate id}), which overrides it. The chosen plan
    (the one the search returned) is the row whose `chosen` column is true, or the row labelled "chosen". `threshold`: the error plans were judged
    against, when it is not the budget (headroom x budget); `figures`: (caption, PNG bytes) shown on the page
    below the plot (the compile's layer map); `notes`: lines shown under the summary (a batch-invariant plan's
    price of invariance). Other files in `out_dir` are left alone.
    """
    if not budget_error > 0:
        raise ValueError(f"budget_error must be > 0 (log axis), got {budget_error!r}")
    if threshold is not None and not 0 < threshold <= budget_error:
        raise ValueError(f"threshold must be in (0, budget_error], got {threshold!r}")
    table = _checked_table(rows, baselines)
    target = Path(out_dir)
    with atomic_files(target) as staging:
        (staging / CSV_NAME).write_text(_csv_text(table), encoding="utf-8")
        png = _render_png(table, budget_error, threshold, title, error_label)
        (staging / PNG_NAME).write_bytes(png)
        (staging / HTML_NAME).write_text(_render_html(table, png, budget_error, threshold, title, error_label,
                                                      figures, notes), encoding="utf-8")
    return ReportFiles(csv=target / CSV_NAME, png=target / PNG_NAME, html=target / HTML_NAME)


def _record(row: object) -> dict[str, object]:
    if dataclasses.is_dataclass(row) and not isinstance(row, type):
        return {field.name: getattr(row, field.name) for field in dataclasses.fields(row)}
    if isinstance(row, Mapping):
        return dict(row)
    raise TypeError(f"op table rows must be mappings or dataclass instances, got {type(row).__name__}")


def write_op_table(path: str | os.PathLike, rows: pd.DataFrame | Sequence[object]) -> Path:
    """Write plan_ops.csv (one row per executed op: dtype, accumulator, scales...) atomically.

    Rows are a DataFrame, mappings or dataclass instances; every row must have the same fields, since a
    silently empty cell in "what actually runs" would hide a precision choice. Values that are not
    plain scalars (formats, tuples) are written with str().
    """
    if isinstance(rows, pd.DataFrame):
        table = rows.reset_index(drop=True)
    else:
        records = [_record(row) for row in rows]
        if not records:
            raise ValueError("op table is empty")
        columns = list(records[0])
        for index, record in enumerate(records):
            if list(record) != columns:
                raise ValueError(f"op table row {index} has fields {list(record)}, expected {columns}")
        table = pd.DataFrame.from_records(records, columns=columns)
    plain = (str, int, float, bool, np.generic, type(None))
    table = table.apply(lambda column: column.map(lambda v: v if isinstance(v, plain) else str(v))
                        if column.dtype == object else column)
    return atomic_write_text(path, _csv_text(table))
