"""CPU emulation throughput of every Gemm variant against a plain FP32 numpy matmul on the same data.

The emulator runs in the search's inner loop (the measured-error verdict), so its cost per variant
matters; ratios are measured in one run, interleaved, best of `--repeats` rounds. Static weight scales are
computed once up front, as the compiler does. Also reports each variant's relative RMS error vs FP64.
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import pandas as pd

from luminal_num.dtypes import GEMM_VARIANTS
from luminal_num.quant import compute_scales
from luminal_num.runtime.numerics import emulate_gemm

from .summary import write_csv
BASELINE = "numpy_f32"


def interleaved_best(runs: dict, rounds: int) -> dict[str, tuple[float, object]]:
    """Best time of each run over `rounds` rounds, every round running all of them in turn, so that
    a busy spell of the machine hits the baseline and the variants alike."""
    best: dict[str, tuple[float, object]] = {}
    for _ in range(rounds):
        for name, run in runs.items():
            start = time.perf_counter()
            result = run()
            elapsed = time.perf_counter() - start
            if name not in best or elapsed < best[name][0]:
                best[name] = (elapsed, result)
    return best


def main(argv=None) -> pd.DataFrame:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--size", type=int, default=1024, help="M = K = N")
    ap.add_argument("--repeats", type=int, default=5, help="interleaved rounds; best of them")
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((args.size, args.size)).astype(np.float32) for _ in range(2))
    reference = a.astype(np.float64) @ b.astype(np.float64)
    reference_rms = float(np.sqrt(np.mean(reference ** 2)))
    runs = {BASELINE: lambda: np.matmul(a, b)}
    for name, variant in GEMM_VARIANTS.items():
        weights_static = variant.b_scale is not None and variant.b_scale.static
        static = compute_scales(b, variant.b_format, variant.b_scale) if weights_static else None
        runs[name] = lambda v=variant, s=static: emulate_gemm(a, b, v, b_scales=s)
    rows = []
    for name, (seconds, result) in interleaved_best(runs, args.repeats).items():
        variant = GEMM_VARIANTS.get(name)
        rows.append(dict(variant=name, operands=variant.a_format.name if variant else "f32",
                         accumulator=variant.accumulator.name if variant else "f32",
                         scales=variant.a_scale.granularity.value if variant and variant.a_scale else "none",
                         ms=seconds * 1e3,
                         rel_rms_error=float(np.sqrt(np.mean((result - reference) ** 2))) / reference_rms))
    df = pd.DataFrame(rows)
    df["ratio_vs_numpy_f32"] = df.ms / df.loc[df.variant == BASELINE, "ms"].item()
    df.insert(0, "size", args.size)
    write_csv(df, "emulation.csv")
    print(df.to_string(index=False))
    return df


if __name__ == "__main__":
    main()
