"""Fit the H200's measured kernel classes and show what they change (issue 35: price what runs).

Reads the per-kernel table and the per-step graph replays an H200 recorded (reports/bench/gpu_kernels.csv,
gpu_steps.csv from `scripts/gpu_check.sh`'s kernels stage), rebuilds the same programs here
(bench/gpu_cases.py) for each kernel's work, and fits one cost per implementation class
(runtime/kernel_classes.py). A kernel's body time is its CUDA-event time less the event overhead of its
step (the per-kernel events' sum minus the graph replay, per kernel) and the graph node cost the model
adds, so that the model's step (bodies + nodes) is the replay. Writes:
* luminal_num/runtime/data/h200_kernels.json: the fits, read by the `h200-measured` target;
* reports/bench/gpu_calibration.csv: per class, coefficients, samples and fit error;
* reports/bench/gpu_calibration_steps.csv: per step, the replay against `h200` (roofline) and `h200-measured`,
  the latter also fitted without the step's own model (leave one model out), and the rank of each genome.
"""
from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import numpy as np
import pandas as pd

from luminal_num.runtime.cost import model_latency
from luminal_num.runtime.cpu import bind_program
from luminal_num.runtime.kernel_classes import MeasuredKernels, features, fit_class
from luminal_num.runtime.targets import get_target
from .gpu_cases import device_cases, recorded_works

REPORTS = Path("reports/bench")
FITS = Path(__file__).resolve().parents[1] / "luminal_num" / "runtime" / "data" / "h200_kernels.json"
MIN_BODY_S = 0.25e-6  # a body is never taken below this (event overheads vary by kernel)


def kernel_table(kernels: pd.DataFrame, steps: pd.DataFrame) -> tuple[pd.DataFrame, dict]:
    """Measured kernels joined with their rebuilt work; also each step's works for modelling."""
    h200 = get_target("h200")
    overhead = {(r.model, r.plan): (r.sum_kernel_measured_us - r.measured_step_us) / r.kernels
                for r in steps.itertuples()}
    rows, works_of = [], {}
    for model, plan, program, weights, inputs in device_cases():
        bindings = bind_program(program, {**weights, **inputs})
        measured = kernels[(kernels.model == model) & (kernels.plan == plan)].set_index("kernel")
        if len(measured) != len(program.launched()):
            raise ValueError(f"{model} {plan}: {len(measured)} measured kernels, {len(program.launched())} rebuilt: "
                             "not the same programs")
        works = recorded_works(program, bindings, measured.implementation.to_dict())
        works_of[(model, plan)] = works
        for k, work in zip(program.launched(), works):
            row = measured.loc[k.id]
            if row.implementation != work.implementation or int(row.bytes_moved) != work.bytes_moved:
                raise ValueError(f"{model} {plan} kernel {k.id}: recorded {row.implementation} / {row.bytes_moved} B, "
                                 f"rebuilt {work.implementation} / {work.bytes_moved} B")
            body = max((row.measured_us - overhead[(model, plan)]) * 1e-6 - h200.launch.graph_node_s, MIN_BODY_S)
            rows.append(dict(model=model, plan=plan, kernel=k.id, implementation=work.implementation, body_s=body,
                             features=features(work.bytes_moved, work.flops, work.tiles, work.serial_extent,
                                               h200.sm_count)))
    return pd.DataFrame(rows), works_of


def fit(table: pd.DataFrame, source: str) -> MeasuredKernels:
    fits = tuple(fit_class(impl, np.stack(group.features.to_list()), group.body_s.to_numpy())
                 for impl, group in table.groupby("implementation"))
    return MeasuredKernels("NVIDIA H200 (sm_90)", source, fits)


def step_rows(steps: pd.DataFrame, works_of: dict, measured: MeasuredKernels, left_out: dict) -> list[dict]:
    h200 = get_target("h200")
    calibrated = dataclasses.replace(h200, name="h200-measured", measured_kernels=measured)
    rows = []
    for r in steps.itertuples():
        works = works_of[(r.model, r.plan)]
        lomo = dataclasses.replace(calibrated, measured_kernels=left_out[r.model])
        rows.append(dict(model=r.model, plan=r.plan, kernels=r.kernels, measured_us=r.measured_step_us,
                         h200_us=1e6 * model_latency(works, h200).total_s,
                         h200_measured_us=1e6 * model_latency(works, calibrated).total_s,
                         h200_measured_left_out_us=1e6 * model_latency(works, lomo).total_s))
    df = pd.DataFrame(rows)
    for key in ("measured_us", "h200_us", "h200_measured_us"):
        df[f"rank_{key[:-3]}"] = df.groupby("model")[key].rank(method="min").astype(int)
    return df


def run(kernels_csv: Path = REPORTS / "gpu_kernels.csv", steps_csv: Path = REPORTS / "gpu_steps.csv",
        write_fits: bool = True) -> dict:
    kernels, steps = pd.read_csv(kernels_csv), pd.read_csv(steps_csv)
    table, works_of = kernel_table(kernels, steps)
    source = f"{kernels_csv.name} + {steps_csv.name}, scripts/gpu_stages.py kernels, 2026-12-04"
    measured = fit(table, source)
    left_out = {model: fit(table[table.model != model], f"{source}, without {model}") for model in table.model.unique()}
    classes = pd.DataFrame([dict(implementation=f.implementation, samples=f.samples,
                                 **{f"{name}": c for name, c in zip(("fixed_s", "s_per_byte", "s_per_flop",
                                                                     "s_per_wave_step", "s_per_wave_flop"), f.coefficients)},
                                 median_relative_error=f.median_relative_error, p90_relative_error=f.p90_relative_error)
                            for f in measured.fits])
    steps_df = step_rows(steps, works_of, measured, left_out)
    REPORTS.mkdir(parents=True, exist_ok=True)
    classes.to_csv(REPORTS / "gpu_calibration.csv", index=False)
    steps_df.to_csv(REPORTS / "gpu_calibration_steps.csv", index=False)
    if write_fits:
        FITS.parent.mkdir(parents=True, exist_ok=True)
        FITS.write_text(measured.to_json() + "\n")
    with pd.option_context("display.width", 250, "display.max_columns", 20):
        print(classes.round(4).to_string(index=False))
        print(steps_df.round(1).to_string(index=False))
    smol = steps_df[steps_df.model == "smollm2-decode"]
    err = lambda col: float(np.median(np.abs(steps_df[col] / steps_df.measured_us - 1)))  # noqa: E731
    return {"H200 step, roofline model / measured (median)": float(np.median(steps_df.h200_us / steps_df.measured_us)),
            "H200 step, measured classes: median |error|": err("h200_measured_us"),
            "H200 step, measured classes fitted without the model: median |error|": err("h200_measured_left_out_us"),
            "SmolLM2 fastest genome measured": smol.loc[smol.measured_us.idxmin()].plan,
            "SmolLM2 fastest genome, roofline model": smol.loc[smol.h200_us.idxmin()].plan,
            "SmolLM2 fastest genome, measured classes": smol.loc[smol.h200_measured_us.idxmin()].plan}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-write-fits", action="store_true", help="do not rewrite runtime/data/h200_kernels.json")
    args = ap.parse_args(argv)
    figures = run(write_fits=not args.no_write_fits)
    for key, value in figures.items():
        print(f"{key}: {value}")
    return figures


if __name__ == "__main__":
    main()
