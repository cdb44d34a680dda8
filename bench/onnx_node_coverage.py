"""ONNX backend node cases of the ops the importer claims: how many pass, are refused, are wrong, crash.

Every case of the `onnx` wheel whose every node is in the import table (onnx/ops.py) runs through
luminal_num.onnx.node_cases.run_case: import, FP64 reference and FP32 CPU plan against ONNX's expected
outputs. Outcomes: `pass` (both), `pass_fp64` (only the FP64 reference ran: the runtime refuses the case's
NaN/Inf inputs, or the model holds double data, which no plan may run at FP32), `refused` (one-line
OnnxImportError or CaseRefused, with its reason class), `wrong` (an output outside the case's tolerance),
`crash` (any other exception). Writes
reports/bench/onnx_node_coverage.csv (case, op, outcome, reason_class, reason).

    python -m bench.onnx_node_coverage
"""
from __future__ import annotations

import argparse
import re
import time
import warnings

import numpy as np
import onnx
import pandas as pd

from luminal_num.onnx import OnnxImportError
from luminal_num.onnx.node_cases import CaseRefused, claimed_cases, run_case

from .summary import write_csv

# (pattern in the refusal, its class), first match wins
REASON_CLASSES = (
    (r"element type (DOUBLE)", "double data"),
    (r"element type (U?INT(8|16|32|64))\b", "integer data"),
    (r"element type", "other input type"),
    (r"saturate=0", "saturate=0"),
    (r"cast of a run-time .* to (FLOAT16|BFLOAT16|FLOAT8|FLOAT4|U?INT[24]\b)", "rounding cast"),
    (r"cast of a run-time", "other cast"),
    (r"holds NaN or Inf|holds inf/nan", "non-finite known tensor"),
    (r"supported only on values known at import", "run-time value of a fold-only op"),
    (r"holds (int|u?int\d+) values; this op takes", "integer data"),
    (r"holds \w+ values; this op takes", "value kind"),
    (r"negative run-time indices", "negative indices"),
    (r"outside|beyond|exact", "integer range"),
    (r"exponent", "per-element exponent"),
    (r"zero-sized|empty slice", "zero-sized tensor"),
)


def reason_class(reason: str) -> str:
    for pattern, name in REASON_CLASSES:
        if re.search(pattern, reason):
            return name
    return "other"


def run_one(case) -> dict:
    nodes = case.model.graph.node
    row = {"case": case.name, "op": nodes[0].op_type if len(nodes) == 1 else f"{len(nodes)} nodes"}
    try:
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")
            result = run_case(case)
    except (OnnxImportError, CaseRefused) as exc:
        reason = " ".join(str(exc).split())
        return {**row, "outcome": "refused", "reason_class": reason_class(reason), "reason": reason}
    except AssertionError as exc:
        return {**row, "outcome": "wrong", "reason_class": "wrong", "reason": " ".join(str(exc).split())[:300]}
    except Exception as exc:  # noqa: BLE001 - a crash is what this bench counts
        return {**row, "outcome": "crash", "reason_class": type(exc).__name__,
                "reason": f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"}
    if result.fp32_plan_ran:
        return {**row, "outcome": "pass", "reason_class": "", "reason": ""}
    why = ("double data: FP64 only", result.fp64_only) if result.fp64_only else ("NaN/Inf inputs", "")
    return {**row, "outcome": "pass_fp64", "reason_class": why[0], "reason": why[1]}


def main(argv: list[str] | None = None) -> pd.DataFrame:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="onnx_node_coverage.csv", help="CSV name under reports/bench/")
    args = parser.parse_args(argv)
    t0 = time.process_time()
    cases = claimed_cases()
    df = pd.DataFrame([run_one(c) for c in cases])
    path = write_csv(df, args.out)
    cpu = time.process_time() - t0
    print(f"onnx {onnx.__version__}: {len(df)} node cases of claimed ops, {cpu:.0f} s CPU -> {path}")
    print(df.outcome.value_counts().to_string())
    refused = df[df.outcome == "refused"]
    print("refused by reason class:")
    print(refused.reason_class.value_counts().to_string())
    print("passed on the FP64 reference only, by why:")
    print(df[df.outcome == "pass_fp64"].reason_class.value_counts().to_string())
    for bad in ("wrong", "crash"):
        for _, r in df[df.outcome == bad].iterrows():
            print(f"{bad}: {r.case}: {r.reason}")
    return df


if __name__ == "__main__":
    main()
