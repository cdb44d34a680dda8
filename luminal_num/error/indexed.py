"""Gather and scatter rows by index intervals (error/static.py's GATHER and SCATTER kernels).

An index whose interval is one integer picks (or writes) exactly one row: a gathered row is that table
row's interval and error, a KV-cache row written at a known position holds exactly the written row, and
every other cache row keeps its own value. Only an index that may take several values widens: a gathered
row becomes the hull of the rows it may pick, a cache row it may write the hull of its old value and
every row that may land there. Without this, one decode step merged every cache row into one range
(scores over [-1e9, 1.4e4] where the real ones are below 10) and no LLM step had a finite bound.

Soundness: the executed index is the executed value truncated to an integer (runtime/cpu.py's
`astype(np.int64)`), which lies in [floor(lo - err), ceil(hi + err)]; an index the run would refuse (out
of range) only narrows what is possible, since that run has no output to bound.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Rows:
    """Per-row arrays of a value along axis 0: exact-value interval and error bound (same shape)."""

    lo: np.ndarray
    hi: np.ndarray
    err: np.ndarray


def index_range(lo: np.ndarray, hi: np.ndarray, err: np.ndarray, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """The integer rows each index may select, as inclusive [first, last], clipped to [0, rows)."""
    with np.errstate(invalid="ignore", over="ignore"):
        first = np.floor(np.where(np.isfinite(err), lo - err, -np.inf))
        last = np.ceil(np.where(np.isfinite(err), hi + err, np.inf))
    first = np.clip(np.nan_to_num(first, nan=0.0, neginf=0.0, posinf=rows - 1), 0, max(rows - 1, 0))
    last = np.clip(np.nan_to_num(last, nan=rows - 1.0, neginf=0.0, posinf=rows - 1), 0, max(rows - 1, 0))
    return first.astype(np.int64).reshape(-1), last.astype(np.int64).reshape(-1)


def _hull_rows(t: Rows, first: int, last: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return t.lo[first:last + 1].min(axis=0), t.hi[first:last + 1].max(axis=0), t.err[first:last + 1].max(axis=0)


def gather_rows(table: Rows, first: np.ndarray, last: np.ndarray) -> Rows:
    """table[idx] for indices in [first, last] (flattened): exact rows where first == last."""
    if table.lo.shape[0] == 0:
        empty = np.zeros((first.size,) + table.lo.shape[1:])
        return Rows(empty, empty, empty)
    lo, hi, err = table.lo[first], table.hi[first], table.err[first]
    for i in np.flatnonzero(first != last):
        lo[i], hi[i], err[i] = _hull_rows(table, int(first[i]), int(last[i]))
    return Rows(lo, hi, err)


def scatter_rows(dest: Rows, src: Rows, first: np.ndarray, last: np.ndarray) -> Rows:
    """dest with row idx_i := src row i, for indices in [first, last]: a row only a point index writes
    (once) is that source row; a row written twice, or that a ranged index may write, is the hull of its
    possible writers, and of its old value unless a point index certainly writes it."""
    lo, hi, err = dest.lo.copy(), dest.hi.copy(), dest.err.copy()
    n_rows = dest.lo.shape[0]
    if n_rows == 0 or first.size == 0:
        return Rows(lo, hi, err)
    point = first == last
    writes = np.bincount(first[point], minlength=n_rows)
    ranged = np.zeros(n_rows, bool)
    for i in np.flatnonzero(~point):
        ranged[first[i]:last[i] + 1] = True
    single = (writes == 1) & ~ranged
    writer = np.full(n_rows, -1)
    writer[first[point]] = np.flatnonzero(point)
    rows = np.flatnonzero(single)
    lo[rows], hi[rows], err[rows] = src.lo[writer[rows]], src.hi[writer[rows]], src.err[writer[rows]]
    for r in np.flatnonzero((writes > 1) | ranged):
        who = np.flatnonzero((first <= r) & (r <= last))
        parts = [(src.lo[who].min(axis=0), src.hi[who].max(axis=0), src.err[who].max(axis=0))]
        if writes[r] == 0:  # perhaps not written: the old value stays possible
            parts.append((dest.lo[r], dest.hi[r], dest.err[r]))
        lo[r] = np.minimum.reduce([p[0] for p in parts])
        hi[r] = np.maximum.reduce([p[1] for p in parts])
        err[r] = np.maximum.reduce([p[2] for p in parts])
    return Rows(lo, hi, err)
