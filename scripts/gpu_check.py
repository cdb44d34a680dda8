"""The device stages of scripts/gpu_check.sh: CUDA against the CPU backend, graph replay, event timing.

Run by the shell script after `pytest -m gpu` (`python scripts/gpu_check.py STAGE`), each stage its
own process so one failure does not hide the next:
* e2e:    the test transformer and MiniLM, each with an FP32, TF32, BF16 and FP8 (E4M3 per-tensor,
          cuBLASLt) plan: the CUDA run against the CPU backend's emulation of the same plan, judged by
          their errors against FP64 (the GPU may not be more than 4x further from FP64 than the CPU);
* graph:  every such program captured as one CUDA graph and replayed twice: bit for bit the eager run;
* timing: MiniLM FP32 vs BF16 vs FP8, median CUDA-event time of one graph replay next to the H200 cost
          model's latency (a modelled/measured ratio per plan), written to reports/bench/gpu_latency.csv
          (and under $OUT when set).
Exit 0 when the stage passed, 1 when a check failed (the lines say which), 3 without a CUDA device.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import os
import sys
import time
from pathlib import Path

import numpy as np

from luminal_num.hlir import evaluate as evaluate_fp64
from luminal_num.models.registry import load_job
from luminal_num.models.testnets import all_test_models
from luminal_num.runtime.cpu import CpuRuntime, bind_program
from luminal_num.runtime.cuda import CudaRuntime
from luminal_num.runtime.cuda_device import probe
from luminal_num.runtime.latency import modelled_latency
from luminal_num.search.space import SearchSpace

PLANS = {"fp32": None, "tf32": "gemm:tf32", "bf16": "gemm:bf16", "fp8": "gemm:f8e4m3_tensor"}
TIMED_PLANS = ("fp32", "bf16", "fp8")
MODELS = ("transformer4", "minilm")
NO_DEVICE = 3
TARGET = "h200"
REPORT = Path("reports/bench/gpu_latency.csv")


def plan_genome(space: SearchSpace, plan: str) -> frozenset:
    """Every Gemm that offers the plan's variant takes it; everything else stays FP32."""
    tag = PLANS[plan]
    return frozenset(c for c in space.all_changes() if c[2] == tag) if tag else frozenset()


def workload(name: str) -> tuple[object, dict, dict]:
    """(graph, weights, one input batch) of the test transformer or MiniLM."""
    if name == "minilm":
        job = load_job("minilm")
        return job.graph, job.graph.weights, job.calibration[0]
    model = {m.name: m for m in all_test_models()}[name]  # the test nets: transformer4, mlp, ...
    return model.graph, model.graph.weights, model.make_inputs(1)


def programs(names):
    for name in names:
        graph, weights, batch = workload(name)
        space = SearchSpace.build(graph)
        for plan in PLANS:
            genome = plan_genome(space, plan)
            if PLANS[plan] and not genome:
                raise AssertionError(f"{name}: no Gemm offers {PLANS[plan]}")
            yield name, plan, graph, weights, batch, space.program(genome)


def stage_e2e(cuda_runtime, names=MODELS) -> bool:
    ok, refs = True, {}
    for name, plan, graph, weights, batch, program in programs(names):
        if name not in refs:  # one FP64 pass per model
            refs[name] = evaluate_fp64(graph, batch)
        ref = refs[name]
        cpu = CpuRuntime(program, weights).run(batch).outputs
        gpu = cuda_runtime(program, weights).run(batch).outputs
        for out, expected in ref.items():
            cpu_err = float(np.max(np.abs(cpu[out] - expected)))
            gpu_err = float(np.max(np.abs(gpu[out] - expected)))
            gap = float(np.max(np.abs(gpu[out] - cpu[out])))
            good = np.all(np.isfinite(gpu[out])) and gpu_err <= 4 * max(cpu_err, 1e-6)
            ok &= bool(good)
            print(f"{'ok  ' if good else 'FAIL'} e2e {name} {plan} {out}: |gpu-fp64| {gpu_err:.3e}, "
                  f"|cpu-fp64| {cpu_err:.3e}, |gpu-cpu| {gap:.3e}")
    return ok


def stage_graph(cuda_runtime, names=MODELS) -> bool:
    ok = True
    for name, plan, _, weights, batch, program in programs(names):
        cuda = cuda_runtime(program, weights)
        eager = cuda.run(batch).outputs
        state = cuda.capture(batch)
        for replay in range(2):
            got = cuda.replay(state)
            same = all(np.array_equal(got[k], eager[k]) for k in eager)
            ok &= same
            print(f"{'ok  ' if same else 'FAIL'} graph {name} {plan} replay {replay}: "
                  f"{'bit for bit' if same else 'differs from'} the eager run")
    return ok


def stage_timing(cuda_runtime, device: str, name: str = "minilm", report: Path = REPORT, n: int = 20,
                 warmup: int = 3) -> bool:
    graph, weights, batch = workload(name)
    space = SearchSpace.build(graph)
    rows = []
    for plan in TIMED_PLANS:
        program = space.program(plan_genome(space, plan))
        measured = cuda_runtime(program, weights).profile(batch, n=n, warmup=warmup)
        modelled = modelled_latency(program, TARGET, bind_program(program, {**weights, **batch})).total_s
        rows.append({"model": name, "plan": plan, "device": device, "target": TARGET,
                     "measured_s": f"{measured:.6e}", "modelled_s": f"{modelled:.6e}",
                     "modelled_over_measured": f"{modelled / measured:.4g}",
                     "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")})
        print(f"ok   timing {name} {plan}: measured {measured * 1e3:.3f} ms, modelled {modelled * 1e3:.3f} ms "
              f"({modelled / measured:.2f}x)")
    base = float(rows[0]["measured_s"])
    for row in rows:
        print(f"     speed-up over fp32 ({row['plan']}): {base / float(row['measured_s']):.2f}x")
    targets = [report] + ([Path(os.environ["OUT"]) / report.name] if os.environ.get("OUT") else [])
    for path in targets:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        with tmp.open("w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
        tmp.replace(path)
        print(f"     wrote {path}")
    return True


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stage", choices=("e2e", "graph", "timing"))
    args = parser.parse_args(argv)
    found = probe()
    if not found.available:
        print(f"no CUDA device: {found.reason}")
        return NO_DEVICE
    started = time.perf_counter()
    stages = {"e2e": lambda: stage_e2e(CudaRuntime), "graph": lambda: stage_graph(CudaRuntime),
              "timing": lambda: stage_timing(CudaRuntime, found.device_name or "?")}
    ok = stages[args.stage]()
    print(f"stage {args.stage}: {'passed' if ok else 'FAILED'} in {time.perf_counter() - started:.1f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
