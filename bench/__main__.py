"""`python -m bench`: every benchmark in one run, CSVs and SUMMARY.md under reports/bench/.

The compiles of the transformer and MiniLM jobs run once and feed both the search-efficiency and the
numerics (plan vs baselines) tables. `--quick` is a smoke run (a few minutes): fewer layers, candidates,
rounds and variants, and no MiniLM compile.
"""
from __future__ import annotations

import argparse
import time

import pandas as pd

from . import (compile_time, emulation, fusion, judge_loop, numerics, onnx_minilm, prediction, render_reports, runtime,
               search_efficiency, smollm2, storage, storage_decode)
from . import heldout, strict_budget
from .summary import OUT, write_summary


def emulation_figures(quick: bool) -> dict:
    df = emulation.main(["--size", "256", "--repeats", "1"] if quick else [])
    variants = df[df.variant != emulation.BASELINE]
    slowest = variants.loc[variants.ratio_vs_numpy_f32.idxmax()]
    return {"matrix size": int(df["size"].iloc[0]),
            "emulated FP32 Gemm / numpy FP32": float(df.loc[df.variant == "f32", "ratio_vs_numpy_f32"].item()),
            f"slowest variant ({slowest.variant}) / numpy FP32": float(slowest.ratio_vs_numpy_f32)}


def judge_loop_figures(quick: bool) -> dict:
    """The FP64 reference against its own matmuls' BLAS time, and seconds per measured candidate."""
    df = judge_loop.run("after", rounds=1, with_minilm=not quick, tags=("f32", "gemm:bf16") if quick
                        else judge_loop.CANDIDATE_TAGS)
    ref = df[df.measure == "fp64_reference"].set_index("model")
    cand = df[df.measure != "fp64_reference"]
    return {**{f"{m} FP64 reference / FP64 BLAS of its matmuls": float(r.ratio_vs_fp64_blas) for m, r in ref.iterrows()},
            **{f"{m} seconds per candidate (median over tags)": float(g.seconds.median())
               for m, g in cand.groupby("model")}}


def storage_figures(quick: bool) -> dict:
    """Weight storage formats on SmolLM2's tensors: bits per weight and storage error."""
    df = storage.main(["--no-embedding"] if quick else [])
    return {f"{r.format} bits/weight, rel RMS error": f"{r.bits_per_weight:.3g}, {r.rel_rms_storage_error:.3g}"
            for r in df.itertuples()}


def storage_decode_figures(quick: bool) -> dict:
    """SmolLM2 decode bytes moved per genome, against a hand count."""
    df = storage_decode.main(["--layers", "2"] if quick else [])
    return {f"{r.genome} bytes moved / hand count": float(r.ratio) for r in df.itertuples()}


def prediction_figures(quick: bool) -> dict:
    """How often a genome's predicted error is within 2x of the measured one."""
    # quick: the test transformer only (MiniLM and SmolLM2 are full compiles-worth of chunk runs)
    prediction.main(["--n", "5", "--jobs", "transformer"] if quick else ["--n", "30"])
    return prediction.figures(pd.read_csv(OUT / "prediction.csv"))


def slow_tests() -> dict:
    """The model-scale checks kept out of the default suite (the MiniLM demo end to end, wide search)."""
    import re
    import subprocess
    import sys
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "slow", "-p", "no:cacheprovider"],
                          capture_output=True, text=True)
    tail = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr.strip()[-200:]
    counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|error)", tail)}
    print(tail)
    return {"exit code": proc.returncode, "passed": counts.get("passed", 0), "failed": counts.get("failed", 0),
            "seconds": time.perf_counter() - t0}


def main(argv=None) -> str:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="smoke run (about 3 minutes)")
    quick = ap.parse_args(argv).quick
    start = time.perf_counter()
    headlines = {}
    print("== compile time")
    headlines["compile_time"] = compile_time.run(layers=(2, 8) if quick else (2, 8, 32), with_minilm=not quick,
                                                 repeats=1 if quick else 3)
    print("== search efficiency (compiles shared with numerics)")
    compiled = search_efficiency.compile_jobs(quick)
    headlines["search_efficiency"] = search_efficiency.run(compiled)
    print("== numerics")
    headlines["numerics"] = numerics.run(compiled, quick=quick)
    print("== runtime")
    headlines["runtime"] = runtime.run(rounds=1, variant_rounds=1, variants=runtime.QUICK_VARIANTS) if quick \
        else runtime.run()
    print("== emulation")
    headlines["emulation"] = emulation_figures(quick)
    print("== reports rendered by headless Chromium")
    # the one bench that needs a program outside Python: without it the others still run (and say so)
    headlines["report_render"] = render_reports.run() if render_reports.find_browser() \
        else {"skipped": render_reports.NO_BROWSER}
    print("== SmolLM2 decode: judge cost per candidate, FP64 reference, token-level error")
    headlines["smollm2"] = smollm2.run(layers=2, genomes=("FP32", "BF16 autocast")) if quick else smollm2.run()
    print("== the judge's inner loop: FP64 reference vs BLAS, seconds per candidate")
    headlines["judge_loop"] = judge_loop_figures(quick)
    print("== weight storage formats")
    headlines["storage"] = storage_figures(quick)
    print("== SmolLM2 decode bytes per storage genome")
    headlines["storage_decode"] = storage_decode_figures(quick)
    print("== error prediction from chunk verdicts")
    headlines["prediction"] = prediction_figures(quick)
    print("== fusion: kernels per layer, bytes and modelled H200 latency, fusion rules off vs on")
    headlines["fusion"] = fusion.run(layers=2, with_minilm=False) if quick else fusion.run()
    print("== held-out audit of every returned plan against the user's budget")
    headlines["heldout"] = heldout.run(("transformer",) if quick else ("transformer", "minilm", "smollm2"))
    if not quick:
        print("== MiniLM at the strict budget: chosen plan vs the faithful BF16-autocast baseline")
        headlines["strict_budget"] = strict_budget.run()
        print("== ONNX import (MiniLM from an ONNX file)")
        headlines["onnx_minilm"] = onnx_minilm.run()
        print("== model-scale checks (pytest -m slow)")
        headlines["slow_tests"] = slow_tests()
    summary = write_summary(headlines, wall_s=time.perf_counter() - start).read_text()
    print(summary)
    return summary


if __name__ == "__main__":
    main()
