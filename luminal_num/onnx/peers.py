"""ONNX Runtime as a peer: the recipes a user would otherwise reach for, judged like every plan.

Two peers: ORT FP32 on the original file, and ORT after its own float16 converter with FP32 inputs
and outputs (`onnxruntime.transformers.float16.convert_float_to_float16(keep_io_types=True)`). Each
runs the same calibration batches and is judged by the same Budget against the same FP64 reference
as the searched plans. onnxruntime is optional (the `test` extra): without it there are no peer rows.
"""
from __future__ import annotations

import importlib.util
import time
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np
import onnx
import pandas as pd

from ..error.budget import Budget
from ..report.numbers import fmt_latency
from ..error.metric_values import MetricValues
from ..error.predict import budget_ratio
from ..report.pareto import ALLCLOSE_COLUMN, ERROR_COLUMN

PEER_FP32, PEER_FP16 = "ORT FP32", "ORT FP16 (fp32 I/O)"
PEER_LATENCY_SOURCE = "measured (onnxruntime, CPU)"


@dataclass(frozen=True)
class PeerResult:
    label: str
    error: float        # worst share of the budget over the batches, allclose and every metric (<= 1 fits)
    passes: bool
    latency_s: float    # median wall time of one batch on this machine's CPU
    reason: str
    allclose: float = float("nan")  # worst allclose ratio alone
    metrics: MetricValues = MetricValues()  # each budget metric's worst value over the batches (none if it did not run)


def ort_available() -> bool:
    return importlib.util.find_spec("onnxruntime") is not None


def _fp16_model(model: onnx.ModelProto) -> onnx.ModelProto:
    from onnxruntime.transformers.float16 import convert_float_to_float16  # optional dependency
    return convert_float_to_float16(model, keep_io_types=True, disable_shape_infer=True)


def _run(model: onnx.ModelProto, batches: Sequence[Mapping[str, np.ndarray]], repeats: int):
    import onnxruntime as ort  # optional dependency
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    outs, times = [], []
    for feed in batches:
        for r in range(repeats):
            t0 = time.perf_counter()
            res = sess.run(None, dict(feed))
            times.append(time.perf_counter() - t0)
        outs.append(dict(zip(names, res)))
    return outs, float(np.median(times))


def run_peers(model: onnx.ModelProto, batches: Sequence[Mapping[str, np.ndarray]],
              refs: Sequence[Mapping[str, np.ndarray]], budget: Budget, repeats: int = 3) -> list[PeerResult]:
    """Both ORT peers on the ONNX input batches, judged against the FP64 outputs `refs` (same order)."""
    if not ort_available():
        return []
    out = []
    for label, make in ((PEER_FP32, lambda m: m), (PEER_FP16, _fp16_model)):
        try:
            outs, latency = _run(make(model), batches, repeats)
        except Exception as exc:  # noqa: BLE001 - a peer that cannot run is reported, not fatal
            out.append(PeerResult(label, float("inf"), False, float("nan"),
                                  f"onnxruntime could not run it: {' '.join(str(exc).split())[:200]}"))
            continue
        verdicts = [budget.check({k: np.asarray(v, np.float64) for k, v in o.items()}, r) for o, r in zip(outs, refs)]
        worst = max(verdicts, key=lambda v: budget_ratio(budget, v))
        failed = next((v for v in verdicts if not v.passed), None)
        out.append(PeerResult(label, budget_ratio(budget, worst), failed is None, latency, (failed or worst).reason,
                              max(v.worst_allclose for v in verdicts), MetricValues.worst_of(verdicts)))
    return out


def peer_rows(peers: Sequence[PeerResult], target: str) -> pd.DataFrame:
    """Pareto-report rows for the peers (candidate ids -1, -2, ...). Their latency is measured on the
    CPU, so it is placed on the latency axis only for target 'cpu'; other targets are modelled."""
    rows = []
    for i, p in enumerate(peers):
        rows.append({"candidate": -(i + 1), ERROR_COLUMN: p.error, ALLCLOSE_COLUMN: p.allclose,
                     "latency_s": p.latency_s if target == "cpu" else float("nan"),
                     "latency_source": PEER_LATENCY_SOURCE + ("" if target == "cpu" else
                                                              f": {fmt_latency(p.latency_s)} on this CPU, not comparable to {target}"),
                     "verdict_source": "measured", "passes": bool(p.passes), "label": p.label, "stage": "peer",
                     "changes": 0, "max_abs": float("nan"), **p.metrics, "variants": p.label, "reason": p.reason})
    return pd.DataFrame(rows)
