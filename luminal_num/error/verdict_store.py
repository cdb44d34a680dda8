"""Measured verdicts persisted on disk, so a second or interrupted compile reuses them.

A verdict is a pure function of (program, weights, calibration inputs, budget): the file is named by a
hash of the graph's structure, its weights' bytes, the calibration bytes and both budgets, and maps
program keys to verdicts. Only end-to-end measurements are stored (predictions depend on the search's
state). The file is rewritten atomically after each new measurement; a file that cannot be read is
ignored with a warning (the compile measures again), never a crash.
"""
from __future__ import annotations

import hashlib
import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from ..files import atomic_write_text
from ..hlir.graph import Graph
from ..hlir.store import content_key
from .budget import Budget
from .metric_values import MetricValues
from .share import Share
from .verdict import Verdict

STORE_FORMAT = "luminal_num.verdicts"
# 2: a verdict's share of the budget is one record ("share"), not three loose numbers; 3: a verdict records the
# value of every budget metric ("metrics"). A file of an older version is ignored with a warning and measured
# again: its verdicts would give the chosen plan no metric values.
STORE_VERSION = 3


def context_key(graph: Graph, calibration: Sequence[Mapping[str, np.ndarray]], gate: Budget, budget: Budget,
                positions: int = 0) -> str:
    """What a verdict depends on besides the program: structure, weight values, inputs, both budgets, and the
    teacher-forced positions measurements are judged on (0: the calibration batches; the windows follow from
    the model, the calibration prompts and their count)."""
    h = hashlib.sha256(graph.structural_key().encode())
    for name in sorted(graph.weights):  # each weight by its content key (computed once, hlir/store.py)
        h.update(f"{name}:{content_key(graph.weights[name])}".encode())
    for batch in calibration:
        for name in sorted(batch):
            a = np.ascontiguousarray(batch[name])
            h.update(f"{name}:{a.dtype.str}:{a.shape}".encode())
            h.update(a.tobytes())
    h.update(json.dumps([gate.to_dict(), budget.to_dict()], sort_keys=True).encode())
    if positions:
        h.update(f"positions:{positions}".encode())
    return h.hexdigest()[:32]


def _num(x: float):
    return float(x) if np.isfinite(x) else repr(float(x))


class VerdictCacheWarning(RuntimeWarning):
    """A cache file that is ignored (the compile measures again): its own class, so the CLI shows it while
    it hides the numeric RuntimeWarnings of bound arithmetic."""


@dataclass
class VerdictStore:
    """`path`: one JSON file per context (the directory is created on the first write)."""

    directory: Path
    context: str
    entries: dict[str, dict] = field(default_factory=dict)
    loaded: int = 0  # verdicts found on disk when opened

    @property
    def path(self) -> Path:
        return Path(self.directory) / f"verdicts-{self.context}.json"

    @staticmethod
    def open(directory: str | Path, context: str) -> "VerdictStore":
        store = VerdictStore(Path(directory), context)
        if store.path.exists():
            try:
                data = json.loads(store.path.read_text())
                if data.get("format") == STORE_FORMAT and isinstance(data.get("version"), int) \
                        and data["version"] < STORE_VERSION:
                    raise ValueError(f"written by an older compiler (version {data['version']}, this one writes "
                                     f"{STORE_VERSION}): its verdicts hold no metric values; measuring again")
                if data.get("format") != STORE_FORMAT or data.get("version") != STORE_VERSION \
                        or data.get("context") != context or not isinstance(data.get("verdicts"), dict):
                    raise ValueError("not a verdict cache of this version and context")
                store.entries = dict(data["verdicts"])
                store.loaded = len(store.entries)
            except (OSError, ValueError, UnicodeDecodeError, AttributeError) as exc:
                warnings.warn(f"ignoring the unreadable verdict cache {store.path}: {exc}", VerdictCacheWarning,
                              stacklevel=2)
                store.entries = {}
        return store

    def get(self, program_key: str) -> Verdict | None:
        rec = self.entries.get(program_key)
        if rec is None:
            return None
        try:
            return verdict_of(rec)
        except (TypeError, ValueError, KeyError, AttributeError):
            return None  # an entry of another shape: measure again

    def put(self, program_key: str, verdict: Verdict) -> None:
        self.entries[program_key] = verdict_record(verdict)
        atomic_write_text(self.path, json.dumps({"format": STORE_FORMAT, "version": STORE_VERSION,
                                                 "context": self.context, "verdicts": self.entries},
                                                sort_keys=True, indent=0) + "\n")


def verdict_record(v: Verdict) -> dict:
    """A verdict as JSON (non-finite numbers as their repr: JSON has none)."""
    return {"passed": bool(v.passed), "source": str(v.source), "reason": v.reason, "tentative": bool(v.tentative),
            "exact": bool(v.exact), "bias": None if v.bias is None else _num(v.bias),
            "max_abs": _num(v.max_abs), "bound": None if v.bound is None else _num(v.bound),
            "share": {"gate": _num(v.share.gate), "allclose": _num(v.share.allclose),
                      "user_allclose": _num(v.share.user_allclose)},
            "metrics": v.metrics.record()}


def verdict_of(rec: dict) -> Verdict:
    def num(x):
        return None if x is None else float(x)
    share = rec["share"]
    return Verdict(bool(rec["passed"]), rec["source"],
                   Share(float(share["gate"]), float(share["allclose"]), float(share["user_allclose"])),
                   float(rec["max_abs"]), num(rec["bound"]), str(rec["reason"]), bool(rec["tentative"]),
                   num(rec["bias"]), bool(rec["exact"]), metrics=MetricValues.from_record(rec["metrics"]))
