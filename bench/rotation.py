"""Hadamard rotation and GPTQ on SmolLM2 (issue 32): what W4 and FP8 W8A8 reach on pooled teacher-forced
positions with and without them.

SmolLM2 decode:8@64 (all 30 layers unless --layers), its search space with the rotation (`rot:`) and GPTQ
(`+gptq`) alternatives; per genome, one pooled judgement on >= --positions teacher-forced positions (the
compile's `positions` stage: windows over the 24 calibration prompts + FP64's continuation, every position fed
as a decode step) and the same metrics on the search's 24 calibration positions. GPTQ fills use the Hessians
the compile collects: the FP64 pass over the calibration batches (24 activation rows per Gemm). Genomes are
the storage recipes of search/recipes.py applied to every Gemm; "+ rotation" rotates every Gemm whose K an
offered block divides (all of SmolLM2's: K = 576 = 9 x 64, 1536 = 6 x 256) and stores its rotated weight in
the recipe's format. One CSV: reports/bench/rotation.csv.

With --hessian-positions N, GPTQ's Hessians come instead from >= N teacher-forced positions over the 12
held-out prompts (FP64 decode steps of the graph evaluator, 32 rows a step; the judged positions are the
calibration prompts', so none of them calibrated the fill): how far GPTQ gets with enough calibration rows.

`python -m bench.rotation [--layers N] [--positions 2000] [--hessian-positions N] [--genomes NAME ...]`
"""
from __future__ import annotations

import argparse
import tempfile
import time

import pandas as pd

from .llm_calibration import row_metrics
from .summary import write_csv

CSV = "rotation.csv"
WORKLOAD = "decode:8@64"
MEMORY = 5 << 30  # the memory plan the caches are sized from (as bench/llm_calibration.py) ...
DERIVED_CACHE = 3 << 30  # ... but the derived cache at least this (see rows())
W4 = frozenset({"store:int4_g128", "gemm:bf16"})
W4_GPTQ = frozenset({"store:int4_g128+gptq", "gemm:bf16"})
W8A8 = frozenset({"store:f8e4m3_channel", "gemm:f8e4m3_channel_prologue"})
W8A8_GPTQ = frozenset({"store:f8e4m3_channel+gptq", "gemm:f8e4m3_channel_prologue"})
# name -> (recipe tags, rotated)
GENOMES: dict[str, tuple[frozenset[str], bool]] = {
    "W4A16 INT4 g128 RTN": (W4, False),
    "W4A16 INT4 g128 + GPTQ": (W4_GPTQ, False),
    "W4A16 INT4 g128 + rotation": (W4, True),
    "W4A16 INT4 g128 + rotation + GPTQ": (W4_GPTQ, True),
    "FP8 W8A8 dynamic per-token RTN": (W8A8, False),
    "FP8 W8A8 dynamic per-token + rotation": (W8A8, True),
    "FP8 W8A8 dynamic per-token + rotation + GPTQ": (W8A8_GPTQ, True),
}


def genome_of(space, tags: frozenset[str], rotated: bool):
    from luminal_num.search.recipes import pick, rotated_recipe
    return rotated_recipe(space, tags) if rotated else pick(space, tags.__contains__)


def heldout_hessians(job, minimum: int, rows: int):
    """Calibration Hessians from teacher-forced positions over the 12 held-out prompts (never the positions the
    genomes are judged on): each decode step's FP64 evaluation feeds the collector, `rows` windows a step (a
    short last group repeats its own windows, as the positions stage runs them: those rows count twice)."""
    from luminal_num.error.hessians import HessianCollector
    from luminal_num.hlir.evaluate import evaluate_nodes
    from luminal_num.models.llm import load_prompts
    from luminal_num.models.llm_positions import TeacherForcedWindows
    m = job.llm.model
    source = TeacherForcedWindows(m, job.llm.built, tuple(load_prompts("heldout", m.architecture.prompts)), minimum,
                                  cut=True).widened(rows)
    collector = HessianCollector(source.graph)
    steps = 0
    for batch in source.batches():
        collector.batch()
        evaluate_nodes(source.graph, batch.inputs, keep=(), observe=collector)
        steps += 1
    return collector.result(), source.positions, steps * rows


def rows(names, minimum: int, layers: int | None, hessian_positions: int = 0) -> list[dict]:
    from luminal_num.compiler import POSITION_ROWS, WidenedPositions
    from luminal_num.error.budget import Budget
    from luminal_num.error.hessians import HessianCollector
    from luminal_num.error.metrics import Compared
    from luminal_num.error.pooled import RowStats, judge_positions
    from luminal_num.error.reference import references
    from luminal_num.hlir.partition import partition
    from luminal_num.memory import plan_memory
    from luminal_num.models.registry import llm_job
    from luminal_num.quant.calibration import CALIBRATION
    from luminal_num.quant.stored import CONVERTED
    from luminal_num.hlir.weightcache import WEIGHTS
    from luminal_num.runtime.blas_threads import one_blas_thread
    from luminal_num.runtime.cpu import CpuRuntime
    from luminal_num.search.space import SearchSpace

    job = llm_job("smollm2", WORKLOAD, layers=layers, positions_minimum=minimum)
    budget = Budget.parse(job.default_budget)
    source = job.llm.positions
    out = []
    memory = plan_memory(job.graph.weights, MEMORY, workers=1, rotation=True)
    print(memory.describe(), f"; derived cache raised to {DERIVED_CACHE >> 20} MB", flush=True)
    with one_blas_thread(), memory.applied(), tempfile.TemporaryDirectory() as converted, CONVERTED.on_disk(converted):
        # GPTQ fills evicted from the in-memory caches are read back from disk, not filled again (a compile keeps
        # them beside its verdict cache the same way); the rotated weights (FP32, one per weight) and what is
        # derived from them need about twice the derived cache the memory plan gives a model without them
        WEIGHTS.resize(max(WEIGHTS.budget_bytes, DERIVED_CACHE))
        t0 = time.perf_counter()
        made = source.positions
        out.append({"what": "make windows", "positions": made, "seconds": time.perf_counter() - t0})
        t0 = time.perf_counter()
        space = SearchSpace.saturated(job.graph, partition(job.graph), calibrated=True, rotation=True)
        out.append({"what": "saturate (rotation + GPTQ offered)", "seconds": time.perf_counter() - t0})
        collector = HessianCollector(job.graph)
        refs = [r.outputs(job.graph)["logits"] for r in references(job.graph, job.calibration, space.part, collector)]
        hessians, hessian_rows = collector.result(), sum(len(b["ids"]) for b in job.calibration)
        if hessian_positions:
            t0 = time.perf_counter()
            hessians, made, hessian_rows = heldout_hessians(job, hessian_positions, POSITION_ROWS)
            out.append({"what": "held-out Hessians", "positions": made, "seconds": time.perf_counter() - t0})
        wide = WidenedPositions(space, source, POSITION_ROWS, True, True)
        with CALIBRATION.installed(hessians):
            for name in names:
                tags, rotated = GENOMES[name]
                genome = genome_of(space, tags, rotated)
                program = space.program(genome)
                runtime = CpuRuntime(program, job.graph.weights)
                batch_rows = RowStats.concat([RowStats.of(Compared(runtime.run(b).outputs["logits"], ref))
                                              for b, ref in zip(job.calibration, refs)])
                del runtime
                t0 = time.perf_counter()
                run, on = wide.program(genome, program)
                verdict, stats = judge_positions(run, on.graph.weights, on, budget, budget)
                row = {"what": name, "positions": stats.rows, "rows_per_run": on.rows,
                       "hessian_rows": hessian_rows if "+gptq" in " ".join(tags) else 0,
                       "seconds": time.perf_counter() - t0, "passes_budget": verdict.passed,
                       "rotated_gemms": sum(1 for k in program.kernels if k.rotation is not None and k.rotation.source),
                       "hadamard_gemms": sum(1 for k in program.kernels if k.kind.is_gemm and _reads_hadamard(program, k)),
                       "gemms": sum(1 for k in program.kernels if k.kind.is_gemm)}
                row.update(row_metrics(stats, batch_rows))
                out.append(row)
                print(row, flush=True)
    return out


def _reads_hadamard(program, k) -> bool:
    b = program.kernel(k.inputs[1].buffer)
    return b.rotation is not None and b.rotation.source is None


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--genomes", nargs="*", default=list(GENOMES)[:6], choices=list(GENOMES))
    ap.add_argument("--positions", type=int, default=2000)
    ap.add_argument("--layers", type=int, default=None, help="the first N layers only (a quick look; default all 30)")
    ap.add_argument("--hessian-positions", type=int, default=0,
                    help="GPTQ's Hessians from at least N teacher-forced positions over the held-out prompts (default 0: "
                         "the compile's, the calibration batches' 24 rows)")
    ap.add_argument("--csv", default=CSV)
    args = ap.parse_args(argv)
    path = write_csv(pd.DataFrame(rows(args.genomes, args.positions, args.layers, args.hessian_positions)), args.csv)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
