"""The price of batch invariance (issue 37): per job and genome, the modelled H200 latency and the measured
CPU-backend latency of the batch-invariant program over the plain one, measured in one run.

Jobs: MiniLM (batch 12 x 41 tokens, all 6 layers) and SmolLM2-135M decode:8@64 with its first 2 layers
(the per-layer price is what matters; the full 30 layers take minutes per CPU run). Genomes: FP32
everywhere and BF16 Gemms with fused FP32 attention. What differs: on H200 the invariant program runs every
Gemm in the project's tiled kernel (no cuBLAS, whose algorithm and split-K follow the shape) and decode
attention in fixed 64-key splits; on the CPU the fixed-order Gemm (runtime/fixed_gemm.py) instead of
BLAS. CPU times are medians of `--repeats` runs of each program, alternating. This is the same genome with
and without invariance, not two compiles under one budget (a compile would pick other genomes).
Writes reports/bench/batch_invariance.csv.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import pandas as pd

from luminal_num.runtime.cpu import CpuRuntime
from luminal_num.runtime.latency import modelled_latency
from luminal_num.search.recipes import pick
from luminal_num.search.space import SearchSpace

OUT = Path("reports/bench")
GENOMES = {"FP32": (), "BF16 Gemms + flash attention": ("gemm:bf16", "attn:flash_f32")}


def _jobs():
    from luminal_num.models.registry import llm_job, minilm_job
    yield "minilm (6 layers, batch 12x41)", minilm_job(batch=12)
    yield "smollm2 (2 of 30 layers, decode:8@64)", llm_job("smollm2", "decode:8@64", layers=2)


def _median_seconds(rt: CpuRuntime, feed, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        rt.run(feed)
        out.append(time.perf_counter() - t0)
    return out


def main(argv=None) -> pd.DataFrame:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    rows = []
    for job_name, job in _jobs():
        space = SearchSpace.build(job.graph)
        feed = job.calibration[0]
        for label, tags in GENOMES.items():
            genome = pick(space, tags.__contains__)
            plain = space.program(genome)
            inv = space.with_batch_invariance(True).program(genome)
            model = {k: modelled_latency(p, "h200", {}).total_s for k, p in (("plain", plain), ("inv", inv))}
            rts = {"plain": CpuRuntime(plain, job.graph.weights), "inv": CpuRuntime(inv, job.graph.weights)}
            for rt in rts.values():
                rt.run(feed)  # warm: weights' stored forms, packed panels, numba's compile
            times = {"plain": [], "inv": []}
            for _ in range(args.repeats):  # alternating, so load changes hit both alike
                for key, rt in rts.items():
                    times[key] += _median_seconds(rt, feed, 1)
            cpu = {k: float(np.median(v)) for k, v in times.items()}
            rows.append({"job": job_name, "genome": label,
                         "h200_plain_us": model["plain"] * 1e6, "h200_invariant_us": model["inv"] * 1e6,
                         "h200_ratio": model["inv"] / model["plain"],
                         "cpu_plain_ms": cpu["plain"] * 1e3, "cpu_invariant_ms": cpu["inv"] * 1e3,
                         "cpu_ratio": cpu["inv"] / cpu["plain"], "cpu_repeats": args.repeats})
            print(rows[-1], flush=True)
    frame = pd.DataFrame(rows)
    OUT.mkdir(parents=True, exist_ok=True)
    frame.to_csv(OUT / "batch_invariance.csv", index=False)
    print(frame.to_string(index=False))
    return frame


if __name__ == "__main__":
    main()
