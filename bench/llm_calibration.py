"""LLM calibration on pooled teacher-forced positions (issue 32): what judging on >= 2,000 positions costs
and what it finds.

Two parts, one CSV (reports/bench/llm_calibration.csv):
- `stage`: SmolLM2 decode:8@64 (all 30 layers); the positions the demo judges its chosen plan on (windows
  over the 24 calibration prompts + FP64's continuation), the time to make them, and per baseline genome
  the time of one pooled judgement (every position through the decode plan) with its pooled metrics next
  to the same metrics on the search's calibration batches (3 steps of 8: 24 positions).
- `demo` (--demo): `luminal-num demo` wall time with the positions stage off (`--positions 0`: the compile
  main runs) and on (default), one after the other in this run, each a fresh process, both under the same
  `--max-memory` (default 10G; at 6G the demo stops before its confirm stage, issue 29's driver growth).

`python -m bench.llm_calibration [--demo] [--genomes "FP32 everywhere" ...]`
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd

from .summary import OUT, write_csv

CSV = "llm_calibration.csv"
WORKLOAD = "decode:8@64"
GENOMES = ("FP32 everywhere", "BF16 autocast", "W8A16 INT8 per-channel", "FP8 W8A8 dynamic per-token",
           "W4A16 INT4 group 128")
MEMORY = 5 << 30  # the stage part's memory plan (the job alone holds ~2 GB)
ROW_METRICS = ("kl_logits", "kl_p99", "kl_max", "top1_agreement", "ppl_ratio")


def row_metrics(stats, batch_rows) -> dict[str, float]:
    """Each row metric over the pooled positions (`stats`) and, as `name@rows`, over the calibration batches'
    rows (`batch_rows`): the columns both positions benches write."""
    from luminal_num.error.metrics import METRICS
    from luminal_num.error.pooled import PooledRows
    out = {}
    for m in ROW_METRICS:
        out[m] = float(METRICS[m].of(PooledRows(stats)))
        out[f"{m}@{batch_rows.rows}"] = float(METRICS[m].of(PooledRows(batch_rows)))
    return out


def stage_rows(genomes, minimum: int) -> list[dict]:
    from luminal_num.compiler import POSITION_ROWS, WidenedPositions
    from luminal_num.error.budget import Budget
    from luminal_num.memory import plan_memory
    from luminal_num.error.metrics import Compared
    from luminal_num.error.pooled import RowStats, judge_positions
    from luminal_num.hlir.partition import partition
    from luminal_num.models.registry import llm_job
    from luminal_num.blas_threads import one_blas_thread
    from luminal_num.runtime.cpu import CpuRuntime
    from luminal_num.error.reference import references
    from luminal_num.search.recipes import baseline_genomes
    from luminal_num.search.space import SearchSpace

    job = llm_job("smollm2", WORKLOAD, positions_minimum=minimum)
    budget = Budget.parse(job.default_budget)
    source = job.llm.positions
    rows = []
    memory = plan_memory(job.graph.weights, MEMORY, workers=1)  # caches sized as a compile within MEMORY sizes them
    print(memory.describe(), flush=True)
    with one_blas_thread(), memory.applied():
        t0 = time.perf_counter()
        made = source.positions
        rows.append({"part": "stage", "what": "make windows", "positions": made, "seconds": time.perf_counter() - t0})
        space = SearchSpace.saturated(job.graph, partition(job.graph))
        recipes = baseline_genomes(space)
        wide = WidenedPositions(space, source, POSITION_ROWS)
        refs = [r.outputs(job.graph)["logits"] for r in references(job.graph, job.calibration)]
        for name in genomes:
            program = space.program(recipes[name])
            runtime = CpuRuntime(program, job.graph.weights)
            batch_rows = RowStats.concat([RowStats.of(Compared(runtime.run(b).outputs["logits"], ref))
                                          for b, ref in zip(job.calibration, refs)])
            del runtime
            t0 = time.perf_counter()
            run, on = wide.program(recipes[name], program)
            verdict, stats = judge_positions(run, on.graph.weights, on, budget, budget)
            seconds = time.perf_counter() - t0
            row = {"part": "stage", "what": name, "positions": stats.rows, "rows_per_run": on.rows, "seconds": seconds,
                   "passes_budget": verdict.passed}
            row.update(row_metrics(stats, batch_rows))
            rows.append(row)
            print(row, flush=True)
    return rows


STAGE_LINE = re.compile(r"stage (\w+): ([0-9.]+) s")
CHOSEN_LINE = re.compile(r"^Chosen plan(.*?): budget share (.*)$", re.MULTILINE)


def demo_rows(max_memory: str, runs) -> list[dict]:
    rows = []
    for positions in runs:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "demo"
            t0 = time.perf_counter()
            run = subprocess.run([sys.executable, "-m", "luminal_num.cli", "demo", "--quiet", "-v", "--no-verdict-cache",
                                  "--positions", str(positions), "--max-memory", max_memory, "--out", str(out)],
                                 capture_output=True, text=True)
            wall = time.perf_counter() - t0
            stages = {m.group(1): float(m.group(2)) for m in STAGE_LINE.finditer(run.stdout)}
            plan = json.loads((out / "plan.json").read_text()) if (out / "plan.json").is_file() else {}
            record = plan.get("search", {}).get("positions", {})
            row = {"part": "demo", "what": f"--positions {positions} --max-memory {max_memory}",
                   "positions": record.get("positions", 0),
                   "seconds": wall, "rc": run.returncode, "positions_stage_s": stages.get("positions", 0.0),
                   "search_s": stages.get("search"), "plans_judged_on_positions": record.get("judged", 0),
                   "chosen_share": plan.get("verdict", {}).get("budget_share"),
                   "chosen": m.group(1).strip(" ()") if (m := CHOSEN_LINE.search(run.stdout)) else "",
                   **{m: float(v) for m, v in record.get("metrics", {}).items()}}
            if run.returncode:
                row["error"] = run.stderr.strip().splitlines()[-1] if run.stderr.strip() else ""
            rows.append(row)
            print(row, flush=True)
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--demo", action="store_true", help="also time the demo with the positions stage off and on")
    ap.add_argument("--genomes", nargs="*", default=list(GENOMES))
    ap.add_argument("--positions", type=int, default=2000)
    ap.add_argument("--max-memory", default="10G", help="the demos' --max-memory (every run alike; at 6G the demo "
                    "stops before its confirm stage: issue 29's growth)")
    ap.add_argument("--demo-positions", type=int, nargs="+", default=[0, 2000],
                    help="the demos' --positions, one run each (0: the compile main runs)")
    args = ap.parse_args(argv)
    rows = stage_rows(args.genomes, args.positions) if args.genomes else []
    if args.demo:
        if not args.genomes and (OUT / CSV).is_file():  # a demo-only run keeps the stage rows measured before
            rows = pd.read_csv(OUT / CSV).query("part == 'stage'").to_dict("records")
        rows += demo_rows(args.max_memory, args.demo_positions)
    path = write_csv(pd.DataFrame(rows), CSV)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
