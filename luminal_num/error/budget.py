"""The user's error budget: allclose-style atol/rtol plus optional metric limits, on named outputs.

A budget is data: it parses from the CLI text form, round-trips through JSON plans exactly (floats as
repr strings, never fixed decimals), and judges outputs against FP64 references with `check`.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Mapping

from luminal_num.error.metrics import METRICS, Compared, allclose_of, get_metric


class BudgetSyntaxError(ValueError):
    """A budget string that does not parse; `token` is the offending piece."""

    def __init__(self, message: str, token: str):
        super().__init__(message)
        self.token = token


def _exact(x: float) -> str:
    """A float as the shortest string that parses back to the same double."""
    return repr(float(x))


def _shown(x: float) -> str:
    """A measured value for a person reading a reason: 4 significant digits (limits stay exact)."""
    return repr(float(f"{float(x):.4g}"))


@dataclass(frozen=True)
class MetricLimit:
    """One metric bound, e.g. cosine >= 0.9999; the direction comes from the metric's declaration."""

    name: str
    limit: float

    def __post_init__(self):
        object.__setattr__(self, "name", get_metric(self.name).name)  # canonical name; KeyError if unknown
        object.__setattr__(self, "limit", float(self.limit))
        if math.isnan(self.limit):
            raise ValueError(f"limit of {self.name} is NaN")
        low, high = METRICS[self.name].values
        if not low <= self.limit <= high:  # cosine>=2 or kl<=-1 can never pass: refuse it before any work
            raise ValueError(f"{self.name} lies in [{low:g}, {high:g}]; a limit of {self.limit!r} is outside it")
        metric = METRICS[self.name]
        if metric.better_than_perfect(self.limit):  # ppl_ratio<=0.9: asks for a plan better than FP64 itself
            raise ValueError(f"{self.name} of FP64 itself is {metric.perfect:g}; a limit of {self.limit!r} asks for "
                             f"a plan better than the reference")

    @property
    def operator(self) -> str:
        return METRICS[self.name].direction.operator

    def passes(self, value: float) -> bool:
        return METRICS[self.name].passes(value, self.limit)

    def __str__(self) -> str:
        return f"{self.name}{self.operator}{_exact(self.limit)}"


_TOKEN = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_]*)\s*(>=|<=|=)\s*(.*?)\s*")
_TOLERANCES = ("atol", "rtol")


def _parse_float(text: str, token: str) -> float:
    """Decimal or hex (float.hex) notation; NaN is refused because it passes nothing and fails nothing."""
    parse = float.fromhex if text.strip().lower().lstrip("+-").startswith("0x") else float
    try:
        value = parse(text)
    except ValueError:
        raise BudgetSyntaxError(f"{text!r} is not a number in {token!r}", token) from None
    if math.isnan(value):
        raise BudgetSyntaxError(f"NaN limit in {token!r}", token)
    return value


@dataclass(frozen=True)
class OutputVerdict:
    """How one output fared: its allclose ratio (<= 1 passes), every metric value, what failed."""

    name: str
    allclose_ratio: float
    metric_values: tuple[tuple[str, float], ...]
    failures: tuple[str, ...]

    def to_dict(self) -> dict:
        return {"name": self.name, "allclose_ratio": _exact(self.allclose_ratio),
                "metrics": {k: _exact(v) for k, v in self.metric_values}, "failures": list(self.failures)}


@dataclass(frozen=True)
class BudgetVerdict:
    passed: bool
    outputs: tuple[OutputVerdict, ...]
    worst_allclose: float
    reason: str

    def value(self, output: str, metric: str) -> float:
        """One measured value; `metric` may be 'allclose' or a metric name/alias."""
        verdict = next((v for v in self.outputs if v.name == output), None)
        if verdict is None:
            raise KeyError(f"output {output!r} was not judged (judged: {', '.join(v.name for v in self.outputs)})")
        if metric == "allclose":
            return verdict.allclose_ratio
        return dict(verdict.metric_values)[get_metric(metric).name]

    def to_dict(self) -> dict:
        return {"passed": self.passed, "worst_allclose": _exact(self.worst_allclose), "reason": self.reason,
                "outputs": [v.to_dict() for v in self.outputs]}


@dataclass(frozen=True)
class Budget:
    """|y - ref| <= atol + rtol |ref| on every element of the judged outputs, plus metric limits.

    outputs=None judges every output; atol=inf (or rtol=inf) switches the allclose test off.
    """

    atol: float
    rtol: float
    outputs: tuple[str, ...] | None = None
    metrics: tuple[MetricLimit, ...] = ()

    def __post_init__(self):
        for name in _TOLERANCES:
            value = float(getattr(self, name))
            if not value >= 0:
                raise ValueError(f"{name} must be >= 0, got {value!r}")
            object.__setattr__(self, name, value)
        if self.outputs is not None:
            object.__setattr__(self, "outputs", tuple(self.outputs))
            if not self.outputs or len(set(self.outputs)) != len(self.outputs):
                raise ValueError(f"outputs must be distinct names, got {self.outputs!r}")
        object.__setattr__(self, "metrics", tuple(self.metrics))
        names = [m.name for m in self.metrics]
        if len(set(names)) != len(names):
            raise ValueError(f"a metric is limited twice: {names}")

    def gate(self, headroom: float) -> "Budget":
        """What a candidate is judged against on the calibration set: this budget with `headroom` of every
        allowance (itself at headroom 1)."""
        return self if headroom == 1.0 else self.tightened(headroom)

    def tightened(self, headroom: float) -> "Budget":
        """The budget scaled to use only `headroom` (0 < h <= 1) of every allowance: atol, rtol and each
        metric's distance from perfect (1 - cosine, KL, 1 - top1 ...). A plan judged against it on the
        calibration set keeps the rest of the budget for inputs it has not seen."""
        if not 0 < headroom <= 1:
            raise ValueError(f"headroom must be in (0, 1], got {headroom!r}")
        limits = [MetricLimit(m.name, METRICS[m.name].tightened(m.limit, headroom)) for m in self.metrics]
        return Budget(self.atol * headroom, self.rtol * headroom, self.outputs, tuple(limits))

    # ---- text form ----

    @classmethod
    def parse(cls, text: str) -> "Budget":
        """Parse 'atol=1e-3,rtol=0,cosine>=0.9999,outputs=logits|hidden' (atol and rtol are required)."""
        if not text.strip():
            raise BudgetSyntaxError("the budget is empty (write e.g. atol=1e-3,rtol=1e-2)", text)
        fields: dict[str, object] = {}
        metrics: list[MetricLimit] = []
        for position, raw in enumerate(text.split(","), start=1):
            token = raw.strip()
            match = _TOKEN.fullmatch(raw)
            if not token:
                raise BudgetSyntaxError(f"empty token #{position} in {text!r}", token)
            if match is None:
                raise BudgetSyntaxError(f"cannot read token {token!r}: expected key=value, metric>=limit "
                                        f"or metric<=limit", token)
            key, op, value = match.groups()
            if key in (*_TOLERANCES, "outputs"):
                if op != "=":
                    raise BudgetSyntaxError(f"{key} takes '=', not {op!r}, in {token!r}", token)
                if key in fields:
                    raise BudgetSyntaxError(f"{key} given twice (again in {token!r})", token)
                fields[key] = cls._parse_field(key, value, token)
            else:
                metrics.append(cls._parse_limit(key, op, value, token, metrics))
        missing = [k for k in _TOLERANCES if k not in fields]
        if missing:
            raise BudgetSyntaxError(f"budget {text!r} lacks {' and '.join(missing)} "
                                    f"(write e.g. atol=1e-3,rtol=1e-2; atol=inf turns allclose off)", text)
        return cls(metrics=tuple(metrics), **fields)

    @staticmethod
    def _parse_field(key: str, value: str, token: str):
        if key == "outputs":
            names = tuple(name.strip() for name in value.split("|"))
            if not all(names) or len(set(names)) != len(names):
                raise BudgetSyntaxError(f"outputs need distinct non-empty names separated by '|' in {token!r}",
                                        token)
            return names
        number = _parse_float(value, token)
        if number < 0:
            raise BudgetSyntaxError(f"{key} must be >= 0 in {token!r}", token)
        return number

    @staticmethod
    def _parse_limit(key: str, op: str, value: str, token: str, seen: list[MetricLimit]) -> MetricLimit:
        try:
            metric = get_metric(key)
        except KeyError as error:
            raise BudgetSyntaxError(f"unknown key {key!r} in {token!r}: {error.args[0]}; "
                                    f"or one of atol, rtol, outputs", token) from None
        if op != metric.direction.operator:
            raise BudgetSyntaxError(f"{metric.name} is '{metric.direction.value}': write "
                                    f"{key}{metric.direction.operator}LIMIT, not {token!r}", token)
        if any(m.name == metric.name for m in seen):
            raise BudgetSyntaxError(f"{metric.name} limited twice (again in {token!r})", token)
        try:
            return MetricLimit(metric.name, _parse_float(value, token))
        except BudgetSyntaxError:
            raise
        except ValueError as error:
            raise BudgetSyntaxError(f"{error} (in {token!r})", token) from None

    def __str__(self) -> str:
        parts = [f"atol={_exact(self.atol)}", f"rtol={_exact(self.rtol)}"]
        if self.outputs is not None:
            parts.append("outputs=" + "|".join(self.outputs))
        return ",".join(parts + [str(m) for m in self.metrics])

    # ---- JSON form ----

    def to_dict(self) -> dict:
        return {"atol": _exact(self.atol), "rtol": _exact(self.rtol),
                "outputs": None if self.outputs is None else list(self.outputs),
                "metrics": [{"name": m.name, "op": m.operator, "limit": _exact(m.limit)} for m in self.metrics]}

    @classmethod
    def from_dict(cls, data: Mapping) -> "Budget":
        unknown = set(data) - {"atol", "rtol", "outputs", "metrics"}
        if unknown:
            raise ValueError(f"unknown budget field(s) {sorted(unknown)}")
        limits = []
        for entry in data.get("metrics", ()):
            limit = MetricLimit(entry["name"], float(entry["limit"]))
            if "op" in entry and entry["op"] != limit.operator:
                raise ValueError(f"{limit.name} needs op {limit.operator!r}, the plan says {entry['op']!r}")
            limits.append(limit)
        outputs = data.get("outputs")
        return cls(float(data["atol"]), float(data["rtol"]), None if outputs is None else tuple(outputs),
                   tuple(limits))

    # ---- judging ----

    def check(self, outputs: Mapping[str, object], refs: Mapping[str, object]) -> BudgetVerdict:
        """Judge outputs against their FP64 references; the reason names the first failure. An output may
        be given as its metrics.Compared against the reference (shared by the budgets that judge it)."""
        names = tuple(refs) if self.outputs is None else self.outputs
        for name in names:
            for where, table in (("reference", refs), ("candidate outputs", outputs)):
                if name not in table:
                    raise KeyError(f"output {name!r} is missing from the {where} (have: {', '.join(table)})")
        verdicts = tuple(self._judge(name, outputs[name], refs[name]) for name in names)
        worst = max((v.allclose_ratio for v in verdicts), default=0.0)
        failed = [v for v in verdicts if v.failures]
        if failed:
            reason = f"output {failed[0].name!r}: {failed[0].failures[0]}"
        else:
            worst_name = max(verdicts, key=lambda v: v.allclose_ratio).name if verdicts else "-"
            shown = f"worst allclose ratio {_shown(worst)} ({worst_name})" if self.allclose_applies else \
                self.summary([dict(v.metric_values) for v in verdicts], worst)
            reason = f"within budget {self}: {shown}"
        return BudgetVerdict(not failed, verdicts, worst, reason)

    @property
    def allclose_applies(self) -> bool:
        """atol = rtol = inf (an LLM budget) passes every value: its allclose ratio, 0, says nothing."""
        return not (math.isinf(self.atol) and math.isinf(self.rtol))

    def within(self, metric_values: Mapping[str, float], worst_allclose: float) -> str:
        """The reason of a pass over several batches: its worst values over all of them (a verdict's
        recorded metric values, error/metric_values.py), not one batch's."""
        return f"within budget {self}: {self.summary([metric_values], worst_allclose)}"

    def summary(self, metric_values, worst_allclose: float) -> str:
        """What a pass is reported with: the worst allclose ratio, or where allclose does not apply the
        worst value of each metric limit over `metric_values` (dicts of metric name -> value)."""
        if self.allclose_applies or not self.metrics:
            return f"worst allclose ratio {_shown(worst_allclose)}"
        worst = []
        for m in self.metrics:
            values = [d[m.name] for d in metric_values if m.name in d]
            if values:
                worst.append(f"{m.name} {_shown(min(values) if m.operator == '>=' else max(values))}")
        return "worst " + ", ".join(worst)

    def _judge(self, name: str, y, ref) -> OutputVerdict:
        compared = y if isinstance(y, Compared) else Compared(y, ref)  # one pair for allclose and every metric
        ratio = allclose_of(compared, self.atol, self.rtol)
        failures = []
        if not ratio <= 1.0:
            failures.append(f"allclose ratio {_shown(ratio)} > 1 (atol={_exact(self.atol)}, rtol={_exact(self.rtol)})")
        values = []
        for limit in self.metrics:
            value = float(METRICS[limit.name].of(compared))
            values.append((limit.name, value))
            if not limit.passes(value):
                failures.append(f"{limit.name}={_shown(value)} violates {limit}")
        return OutputVerdict(name, ratio, tuple(values), tuple(failures))
