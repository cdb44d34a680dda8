"""The price of batch invariance (issue 37) next to the fastest plan: per job, two compiles at the same budget,
seed and candidate count, one plain and one with `--batch-invariant`; the chosen plans' latency ratio
(invariant / fastest), modelled on `h200` (roofline) and `h200-measured` (the roofline or, where more, the
per-class fits of this project's kernels on a real H200), and measured on the CPU backend (medians of
`--repeats` runs of each program, alternating, in one run; with 1 and with 2 BLAS / tile threads).

Jobs: MiniLM (batch 12 x 41 tokens, all 6 layers) and SmolLM2-135M with its first `--layers` layers at each
of `--smollm2-workloads` (default decode:1@64, one sequence: its dense Gemms at M = 1, and decode:8@64; the full 30
layers take minutes per CPU run; the per-layer price is what repeats). The compiles search
for `--target` (default h200-measured: the target with evidence of what each implementation costs); both plans
are then priced on both modelled targets. `same_genome_ratio`: the invariant plan's own genome lowered
without invariance (plan.json's invariance_price), i.e. the price of the dispatch alone, without the search
choosing another genome. What differs: on CUDA the invariant program runs every Gemm in the tiled kernel's
sequential order (no cuBLAS, no M <= 4 decode tree) and decode attention in fixed 64-key splits; on the CPU
the fixed-order Gemm (runtime/fixed_gemm.py) instead of BLAS. `{plain,invariant}_decode_path_gemms`: Gemms
each program runs on the tiled kernel's M <= 4 decode path, priced on h200-measured by the tiled_decode
class, which is MODELLED from the measured tiled fit (runtime/kernel_classes.DERIVED_CLASSES), not measured
on a device; `h200-measured_*_decode_as_sequential`: the plain plan priced with those Gemms as the sequential
kernel, as the model did before that class (the price of invariance it understated).
Writes reports/bench/batch_invariance.csv.
"""
from __future__ import annotations

import argparse
import dataclasses
import time

import numpy as np
import pandas as pd

from luminal_num.compiler import compile
from luminal_num.error.budget import Budget
from luminal_num.memory import plan_memory
from luminal_num.runtime import tile_threads
from luminal_num.blas_threads import set_blas_threads
from luminal_num.runtime.cpu import CpuRuntime
from luminal_num.codegen.cuda_dispatch import GemmImpl
from luminal_num.runtime.cost import model_latency
from luminal_num.runtime.latency import kernel_works, modelled_latency, serial_extent
from luminal_num.search.search import SearchOptions

from .summary import write_csv
CPU_THREADS = (1, 2)
MODELLED = ("h200", "h200-measured")
# 1 and 2 threads: on a shared 2-core machine OpenBLAS's second thread spins for a busy core (an 8 x 576 @
# 576 x 1536 FP32 matmul took 16 ms with 2 threads, 0.35 ms with 1 here), which the plain plan pays in every
# BLAS call and the fixed-order kernel does not: the 1-thread ratio is the price of the order itself


def _jobs(layers: int, workloads: list[str]):
    from luminal_num.models.registry import llm_job, minilm_job
    yield "minilm (6 layers, batch 12x41)", minilm_job(batch=12)
    for workload in workloads:
        yield f"smollm2 ({layers} of 30 layers, {workload})", llm_job("smollm2", workload, layers=layers)


# a decode-path implementation -> the sequential one the model priced it as before the tiled_decode class
_DECODE_PATH = {GemmImpl.TILED_DECODE.value: GemmImpl.TILED, GemmImpl.TILED_STORED_DECODE.value: GemmImpl.TILED_STORED}


def _decode_path_gemms(program) -> int:
    """Gemms the program runs on the tiled kernel's decode path (the modelled tiled_decode class)."""
    return sum(w.implementation in _DECODE_PATH for w in kernel_works(program, {}))


def _decode_as_sequential_us(program, target: str) -> float:
    """The program priced as the model did before the tiled_decode class: each decode-path Gemm as the
    sequential tiled kernel (class tiled, serial extent K), i.e. what that model understated."""
    works = [dataclasses.replace(w, implementation=_DECODE_PATH[w.implementation].value,
                                 serial_extent=serial_extent(k, {}, GemmImpl.TILED))
             if w.implementation in _DECODE_PATH else w
             for k, w in zip(program.launched(), kernel_works(program, {}))]
    return model_latency(works, target).total_s * 1e6


def _tags(genome) -> str:
    """The genome's precision tags, once each (FP32 when it changes nothing)."""
    tags = sorted({str(tag) for _, _, tag in genome})
    return " ".join(tags) if tags else "FP32"


def _cpu_ms(programs: dict, weights, feed, repeats: int, threads: int) -> dict[str, float]:
    """Median wall time (ms) of each program on the CPU backend with `threads` BLAS and tile threads, runs
    alternating so load hits all alike."""
    set_blas_threads(threads)
    tile_threads.TILE_THREADS = threads
    runtimes = {key: CpuRuntime(p, weights) for key, p in programs.items()}
    for rt in runtimes.values():
        rt.run(feed)  # warm: weights' stored forms, packed panels, numba's compile
    times: dict[str, list[float]] = {key: [] for key in runtimes}
    for _ in range(repeats):
        for key, rt in runtimes.items():
            t0 = time.perf_counter()
            rt.run(feed)
            times[key].append(time.perf_counter() - t0)
    return {key: float(np.median(v)) * 1e3 for key, v in times.items()}


def measure_job(name: str, job, target: str, candidates: int, seed: int, repeats: int,
                max_memory_gb: float, workers: int) -> dict:
    budget = Budget.parse(job.default_budget)
    results = {}
    for key, invariant in (("plain", False), ("invariant", True)):
        options = SearchOptions(seed=seed, max_candidates=candidates, target=target, batch_invariant=invariant,
                                progress=False, workers=workers)
        t0 = time.perf_counter()
        results[key] = compile(job.graph, budget, target, job.calibration, options,
                               memory=plan_memory(job.graph.weights, int(max_memory_gb * 2**30)))
        print(f"[batch_invariance] {name}: {key} compile {time.perf_counter() - t0:.0f} s, "
              f"{_tags(results[key].search.chosen.genome)}", flush=True)
    programs = {key: r.program for key, r in results.items()}
    row = {"job": name, "budget": job.default_budget, "search_target": target, "candidates": candidates,
           "seed": seed, "plain_genome": _tags(results["plain"].search.chosen.genome),
           "invariant_genome": _tags(results["invariant"].search.chosen.genome)}
    for tgt in MODELLED:
        us = {key: modelled_latency(p, tgt, {}).total_s * 1e6 for key, p in programs.items()}
        row |= {f"{tgt}_plain_us": us["plain"], f"{tgt}_invariant_us": us["invariant"],
                f"{tgt}_ratio": us["invariant"] / us["plain"]}
    row |= {f"{key}_decode_path_gemms": _decode_path_gemms(p) for key, p in programs.items()}
    before = _decode_as_sequential_us(programs["plain"], "h200-measured")
    row |= {"h200-measured_plain_us_decode_as_sequential": before,
            "h200-measured_ratio_decode_as_sequential": row["h200-measured_invariant_us"] / before}
    price = results["invariant"].plan.invariance_price
    row["same_genome_ratio"] = price.ratio
    row["same_genome_ratio_target"] = price.target
    for threads in CPU_THREADS:
        cpu = _cpu_ms(programs, job.graph.weights, job.calibration[0], repeats, threads)
        row |= {f"cpu{threads}t_plain_ms": cpu["plain"], f"cpu{threads}t_invariant_ms": cpu["invariant"],
                f"cpu{threads}t_ratio": cpu["invariant"] / cpu["plain"]}
    row["cpu_repeats"] = repeats
    print(row, flush=True)
    return row


def main(argv=None) -> pd.DataFrame:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--candidates", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int, default=2, help="SmolLM2 layers (2..4; 30 is the whole model)")
    ap.add_argument("--smollm2-workloads", default="decode:1@64,decode:8@64",
                    help="comma-separated SmolLM2 workloads, one job each")
    ap.add_argument("--target", default="h200-measured", help="the target both compiles search for")
    ap.add_argument("--max-memory-gb", type=float, default=4.0, help="each compile's memory budget")
    ap.add_argument("--workers", type=int, default=SearchOptions.workers,
                    help="local verdict processes per compile (1: none; the plans are the same for any count)")
    args = ap.parse_args(argv)
    rows = [measure_job(name, job, args.target, args.candidates, args.seed, args.repeats, args.max_memory_gb,
                        args.workers)
            for name, job in _jobs(args.layers, args.smollm2_workloads.split(","))]
    frame = pd.DataFrame(rows)
    write_csv(frame, "batch_invariance.csv")
    print(frame.to_string(index=False))
    print("note: h200-measured prices the decode-path Gemms (*_decode_path_gemms) by the tiled_decode class, "
          "modelled from the measured tiled fit, not measured on a device")
    return frame


if __name__ == "__main__":
    main()
