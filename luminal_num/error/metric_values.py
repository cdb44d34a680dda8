"""MetricValues: the value of every budget metric a verdict was judged on (KL mean, KL max, top-1 ...).

Why: a verdict's budget share sums the metrics up in one number; a user (and `audit`, which re-measures them
on held-out inputs) needs the values themselves. A verdict holds the worst value of each metric the budget
limits, over the calibration batches and the outputs it judges, in the metric's own direction (the largest
KL, the smallest top-1 agreement): the value its pass or reject was decided on. A metric a verdict did not
measure or predict is absent, never 0 or NaN. Generic over the metric registry (error/metrics.py): any
metric a budget names is recorded with no code of its own.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

from .budget import BudgetVerdict
from .metrics import METRICS, Direction


def _worse(name: str, a: float, b: float) -> float:
    """The worse of two values of one metric (NaN, which never passes, is the worst)."""
    if math.isnan(a) or math.isnan(b):
        return math.nan
    return max(a, b) if METRICS[name].direction is Direction.LOWER else min(a, b)


@dataclass(frozen=True)
class MetricValues(Mapping[str, float]):
    """metric name -> value, read as a mapping; `entries` are sorted by name, so equal values compare equal
    whatever order they were gathered in."""

    entries: tuple[tuple[str, float], ...] = ()

    def __post_init__(self):
        names = [name for name, _ in self.entries]
        if len(set(names)) != len(names):
            raise ValueError(f"a metric is given twice: {names}")
        for name in names:
            if name not in METRICS:
                raise KeyError(f"unknown metric {name!r}")
        object.__setattr__(self, "entries", tuple(sorted((str(n), float(v)) for n, v in self.entries)))

    def __getitem__(self, name: str) -> float:
        for n, v in self.entries:
            if n == name:
                return v
        raise KeyError(name)

    def __iter__(self) -> Iterator[str]:
        return (n for n, _ in self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    @staticmethod
    def of(values: Mapping[str, float]) -> "MetricValues":
        return MetricValues(tuple(values.items()))

    @staticmethod
    def worst_of(verdicts: Iterable[BudgetVerdict]) -> "MetricValues":
        """The worst value of each metric over budget checks (one per calibration batch) and their outputs."""
        worst: dict[str, float] = {}
        for verdict in verdicts:
            for out in verdict.outputs:
                for name, value in out.metric_values:
                    worst[name] = value if name not in worst else _worse(name, worst[name], value)
        return MetricValues.of(worst)

    def worse(self, other: "MetricValues") -> "MetricValues":
        """Metric by metric, the worse of the two (a metric in one only keeps its value)."""
        merged = dict(self.entries)
        for name, value in other.entries:
            merged[name] = value if name not in merged else _worse(name, merged[name], value)
        return MetricValues.of(merged)

    def record(self) -> dict[str, float | str]:
        """As JSON (plan.json, the verdict cache): non-finite values as their repr ("inf"); JSON has none."""
        return {n: v if math.isfinite(v) else repr(v) for n, v in self.entries}

    @staticmethod
    def from_record(record: Mapping) -> "MetricValues":
        """A record() read back; a value that is not a number raises ValueError or TypeError."""
        if not isinstance(record, Mapping):
            raise TypeError(f"metric values must be an object of numbers, got {type(record).__name__}")
        values = {}
        for name, value in record.items():
            if isinstance(value, bool) or not isinstance(value, (int, float, str)):
                raise TypeError(f"metric {name!r} holds {value!r}, not a number")
            values[name] = float(value)  # "inf" / "-inf" / "nan" parse; any other text raises ValueError
        return MetricValues.of(values)

    def describe(self, names: Iterable[str] | None = None, fmt=None) -> str:
        """'kl_logits 0.00123, top1_agreement 0.875' in `names`' order (those absent are left out)."""
        shown = fmt or (lambda v: repr(v))
        order = list(names) if names is not None else list(self)
        return ", ".join(f"{n} {shown(self[n])}" for n in order if n in self)
