"""The search's tasks on one process, two local processes and a 2-node Ray cluster: candidates per second,
what each task costs on top of its own run, and whether the plan is the same bytes.

The job is the SmolLM2 demo's (the bundled GGUF, decode:8@64, the real calibration prompts). The Ray
cluster is two nodes of one CPU each inside this machine (ray.cluster_utils.Cluster), started before the
compile; its actors start with the compile and are up before the search stage, whose time gives the
candidates per second. A task's overhead is its turnaround at the driver (dispatch to result, one task per actor at a
time) minus its own run inside the worker: the object-store round trips, the program's decoding and
the scheduling (`worker_extra_ms`: the part spent inside the worker around the run). All three compiles run in this one process, one after the other, so their ratios share
the machine's load. Writes reports/bench/executors.csv.

    python -m bench.executors                        # the demo job, 12 candidates
    python -m bench.executors --layers 8 --candidates 8
    python -m bench.scale --executor ray             # the same
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import tempfile
import time
from pathlib import Path

import pandas as pd

from luminal_num.cli_jobs import parse_budget
from luminal_num.compiler import compile as compile_plan
from luminal_num.error.executors import ExecutorKind, ExecutorSpec
from luminal_num.error.ray_pool import import_ray
from luminal_num.memory import plan_memory
from luminal_num.models.registry import llm_job
from luminal_num.report.compile_report import write_compile_report
from luminal_num.search.search import SearchOptions

from .summary import write_csv

NODE_STORE = 1 << 30  # each node's object store: SmolLM2's FP32 weights (~0.6 GB) and the chunk inputs


def _run(job, label: str, options: SearchOptions, workers: int, out: Path) -> dict:
    t0 = time.perf_counter()
    stages: dict[str, float] = {}
    result = compile_plan(job.graph, parse_budget(job.default_budget), "h200", job.calibration, options,
                          memory=plan_memory(job.graph.weights, workers=workers),
                          on_stage=lambda name, s: stages.__setitem__(name, s))
    wall = time.perf_counter() - t0
    write_compile_report(result, out, f"{job.name}: error vs latency (h200)")
    t = result.tasks
    stats = result.search.stats
    return {"executor": label, "candidates": stats.candidates, "search_s": stages["search"],
            "candidates_per_s": stats.candidates / stages["search"], "compile_s": wall, "tasks": t.tasks,
            "task_own_ms": 1e3 * t.own_s / max(t.tasks, 1),
            "task_overhead_ms": 1e3 * (t.turnaround_s - t.own_s) / max(t.tasks, 1) if label.startswith("ray") else None,
            "overhead_share": (t.turnaround_s - t.own_s) / t.own_s if label.startswith("ray") and t.own_s else None,
            # of the overhead, the share spent in the workers (inputs read, program decoded, outputs packed)
            "worker_extra_ms": 1e3 * t.worker_extra_s / max(t.tasks, 1),
            "retries": t.retries,
            "plan_sha256": hashlib.sha256((out / "plan.json").read_bytes()).hexdigest()[:16]}


def main(argv=None) -> pd.DataFrame:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=None, help="keep the first N decoder layers (default: all 30)")
    ap.add_argument("--candidates", type=int, default=12)
    args = ap.parse_args(argv)
    job = llm_job("smollm2", layers=args.layers)
    ray = import_ray(single_host=True)
    from ray.cluster_utils import Cluster
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "object_store_memory": NODE_STORE,
                                                            "include_dashboard": False})
    cluster.add_node(num_cpus=1, object_store_memory=NODE_STORE)
    cluster.wait_for_nodes()
    rows = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            base = SearchOptions(max_candidates=args.candidates, progress=False)
            for label, options, workers in (
                    ("local-1", dataclasses.replace(base, workers=1), 1),
                    ("local-2", dataclasses.replace(base, workers=2), 2),
                    ("ray-2", dataclasses.replace(base, executor=ExecutorSpec(ExecutorKind.RAY, cluster.address)), 2)):
                rows.append(_run(job, label, options, workers, Path(tmp) / label))
                print(rows[-1], flush=True)
    finally:
        if ray.is_initialized():
            ray.shutdown()
        cluster.shutdown()
    df = pd.DataFrame(rows)
    df.insert(0, "job", job.name)
    df["same_plan"] = df.plan_sha256 == df.plan_sha256.iloc[0]
    write_csv(df, "executors.csv")
    print(df.to_string(index=False))
    return df


if __name__ == "__main__":
    main()
