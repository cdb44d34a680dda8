"""What one pass over the teacher-forced positions costs, phase by phase (the compile's positions stage and every
end-to-end measurement on positions pay it per plan).

SmolLM2 decode:8@64 (`--layers N`, default all 30), the positions widened to POSITION_ROWS rows a step as the
compile runs them; per genome one pass as error/pooled.run_positions makes it (STEPS_TOGETHER steps a group,
CpuRuntime.run_many, batch_stats), with the seconds of each phase: `steps_s` (the steps' inputs and FP64
logits made: TeacherForcedWindows.batches), `kernels_s` (run_many), `stats_s` (row statistics) and
`total_s`, and the weight cache's lookups in the pass (`weight_cache_uncached`: operands made and dropped again).
The windows (FP64's continuation) are made once before, `windows_s`; the FP64 pass over the windows is kept
from one genome's pass to the next (models/llm_positions.py FP64_HELD_BYTES), so the first genome's `steps_s`
includes it and the others' do not. One BLAS thread throughout.
`--digests FILE` also writes each step's SHA-256 of its inputs, FP64 logits, targets and the plan's outputs,
so that a change meant to keep every bit can be checked against the same file written before it.

`python -m bench.positions_speed [--layers 2] [--genomes "BF16 autocast" ...] [--digests out.csv]`
Writes reports/bench/positions_speed.csv.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import time

import numpy as np
import pandas as pd

from .summary import write_csv

CSV = "positions_speed.csv"
WORKLOAD = "decode:8@64"
GENOMES = ("FP32 everywhere", "BF16 autocast", "W8A16 INT8 per-channel")
MEMORY = 5 << 30  # the memory plan a compile within 5 GB would apply (as bench.llm_calibration)


def digest(arrays) -> str:
    """SHA-256 over arrays (name, dtype, shape and bytes of each, in name order for a mapping)."""
    h = hashlib.sha256()
    items = sorted(arrays.items()) if isinstance(arrays, dict) else enumerate(arrays)
    for name, a in items:
        a = np.ascontiguousarray(a)
        h.update(f"{name}:{a.dtype.str}:{a.shape};".encode())
        h.update(a.view(np.uint8).ravel() if a.size else b"")
    return h.hexdigest()


def one_pass(runtime, source, name: str, digests: list | None) -> dict:
    """run_positions' loop (error/pooled.py) with each phase timed."""
    from luminal_num.error.pooled import STEPS_TOGETHER, RowStats, batch_stats
    from luminal_num.hlir.weightcache import WEIGHTS
    seconds = {"steps_s": 0.0, "kernels_s": 0.0, "stats_s": 0.0}
    parts, group, step = [], [], 0
    batches = source.batches()
    counts = {n: getattr(WEIGHTS, n) for n in ("hits", "misses", "uncached", "shared")}  # this pass's lookups
    start = time.perf_counter()

    def run(group) -> None:
        nonlocal step
        t0 = time.perf_counter()
        with WEIGHTS.scanning():
            outs = [r.outputs[source.output] for r in runtime.run_many([b.inputs for b in group])]
        t1 = time.perf_counter()
        parts.extend(batch_stats(out, b) for out, b in zip(outs, group))
        seconds["kernels_s"] += t1 - t0
        seconds["stats_s"] += time.perf_counter() - t1
        if digests is not None:
            for out, b in zip(outs, group):
                digests.append({"genome": name, "step": step, "inputs": digest(b.inputs),
                                "reference": digest([b.reference]), "targets": digest([b.targets]),
                                "outputs": digest([out])})
                step += 1

    while True:
        t0 = time.perf_counter()
        batch = next(batches, None)
        seconds["steps_s"] += time.perf_counter() - t0
        if batch is None:
            break
        group.append(batch)
        if len(group) == STEPS_TOGETHER:
            run(group)
            group = []
    if group:
        run(group)
    stats = RowStats.concat(parts)
    return {**seconds, "total_s": time.perf_counter() - start,
            **{f"weight_cache_{n}": getattr(WEIGHTS, n) - counts[n] for n in counts},
            "weight_cache_mb": WEIGHTS.bytes / 2**20, "weight_cache_budget_mb": WEIGHTS.budget_bytes / 2**20,
            "positions": stats.rows,
            "kl_mean": float(np.mean(stats.kl)), "top1": float(np.mean(stats.top1))}


def measure(layers: int | None, genomes, minimum: int, digests: list | None) -> list[dict]:
    from luminal_num.blas_threads import blas_threads, one_blas_thread
    from luminal_num.compiler import POSITION_ROWS, WidenedPositions
    from luminal_num.hlir.partition import partition
    from luminal_num.memory import plan_memory
    from luminal_num.models.registry import llm_job
    from luminal_num.runtime.cpu import CpuRuntime
    from luminal_num.search.recipes import baseline_genomes
    from luminal_num.search.space import SearchSpace

    job = llm_job("smollm2", WORKLOAD, layers=layers, positions_minimum=minimum)
    memory = plan_memory(job.graph.weights, MEMORY, workers=1)
    rows = []
    with one_blas_thread(), memory.applied():
        source = job.llm.positions
        t0 = time.perf_counter()
        made = source.positions
        windows_s = time.perf_counter() - t0
        space = SearchSpace.saturated(job.graph, partition(job.graph))
        recipes = baseline_genomes(space)
        wide = WidenedPositions(space, source, POSITION_ROWS)
        for name in genomes:
            program, on = wide.program(recipes[name], space.program(recipes[name]))
            load = os.getloadavg()
            row = {"genome": name, "layers": job.llm.model.config.num_hidden_layers, "rows_per_step": on.rows,
                   "windows": made, "windows_s": windows_s, "blas_threads": blas_threads(),
                   **one_pass(CpuRuntime(program, on.graph.weights), on, name, digests),
                   "load_1min_before": load[0], "load_1min_after": os.getloadavg()[0]}
            rows.append(row)
            print(row, flush=True)
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=None, help="SmolLM2's first N layers (default: all 30)")
    ap.add_argument("--genomes", nargs="*", default=list(GENOMES))
    ap.add_argument("--positions", type=int, default=2000)
    ap.add_argument("--digests", default=None, help="also write each step's SHA-256s to this CSV")
    args = ap.parse_args(argv)
    digests = [] if args.digests else None
    rows = measure(args.layers, args.genomes, args.positions, digests)
    print(f"wrote {write_csv(pd.DataFrame(rows), CSV)}")
    if digests is not None:
        pd.DataFrame(digests).to_csv(args.digests, index=False)
        print(f"wrote {args.digests}")


if __name__ == "__main__":
    main()
