"""Exhaustive check: is the float32 loop of a custom function the float64 one rounded once to FP32?

The CPU backend's exact semantics for erf and tanh are "float64 function, then one rounding to
FP32" (hlir CustomKind.fn on float64). Where the float32 ufunc loop gives the same bits on every one
of the 2^32 float32 inputs, the backend may call it directly (runtime/cpu.py, F32_EXACT_CUSTOM).
scipy's erf float32 loop is xsf::erf(float) = erf(static_cast<double>(x)) returned as float, i.e.
the identity by construction; this script confirms it for the installed build, and counts how
often numpy's own float32 tanh (a SIMD approximation) differs. Writes reports/bench/erf_f32.csv.
Runs once (about 2-4 minutes per function on one core): `python -m bench.erf_f32`.
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import pandas as pd
import scipy

from luminal_num.hlir.ops import CUSTOM_KINDS

from .summary import write_csv

CHUNK = 1 << 24  # float32 bit patterns per step (64 MB of float32)


def mismatches(fn, start: int, stop: int) -> tuple[int, int]:
    """(inputs checked, inputs whose fn(float32) bits differ from float32(fn(float64))) over bit patterns
    [start, stop); two NaNs count as equal (a NaN's payload is not a value)."""
    bits = np.arange(start, stop, dtype=np.uint64).astype(np.uint32)
    x = bits.view(np.float32)
    with np.errstate(all="ignore"):
        direct = np.asarray(fn(x))
        via64 = np.asarray(fn(x.astype(np.float64))).astype(np.float32)
    if direct.dtype != np.float32:
        raise TypeError(f"{fn} has no float32 loop (it returned {direct.dtype})")
    differ = (direct.view(np.uint32) != via64.view(np.uint32)) & ~(np.isnan(direct) & np.isnan(via64))
    return int(x.size), int(np.count_nonzero(differ))


def check(name: str, limit: int = 1 << 32) -> dict:
    fn = CUSTOM_KINDS[name].fn
    t0 = time.perf_counter()
    checked = bad = 0
    for start in range(0, limit, CHUNK):
        n, m = mismatches(fn, start, min(start + CHUNK, limit))
        checked, bad = checked + n, bad + m
    return dict(function=name, implementation=f"{type(fn).__name__} {fn.__name__}",
                inputs_checked=checked, exhaustive=checked == 1 << 32, mismatches=bad,
                seconds=time.perf_counter() - t0, numpy=np.__version__, scipy=scipy.__version__)


def main(argv=None) -> pd.DataFrame:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--functions", nargs="+", default=sorted(CUSTOM_KINDS), choices=sorted(CUSTOM_KINDS))
    ap.add_argument("--limit", type=int, default=1 << 32, help="bit patterns checked from 0 (default: all)")
    args = ap.parse_args(argv)
    df = pd.DataFrame([check(name, args.limit) for name in args.functions])
    if args.limit == 1 << 32:
        write_csv(df, "erf_f32.csv")
    print(df.to_string(index=False))
    return df


if __name__ == "__main__":
    main()
