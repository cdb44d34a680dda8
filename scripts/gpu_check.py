"""The device stages of scripts/gpu_check.sh: CUDA against the CPU backend, graph replay, event timing.

Run by the shell script after `pytest -m gpu` (`python scripts/gpu_check.py STAGE`), each stage its
own process so one failure does not hide the next:
* e2e:    the test transformer and MiniLM (all-MiniLM-L6-v2's shapes with seeded random weights: no
          weight files travel to the device), each with an FP32, TF32, BF16 and FP8 (E4M3 per-tensor,
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
import dataclasses
import datetime
import os
import sys
import time
from pathlib import Path

import numpy as np

from luminal_num.hlir import evaluate as evaluate_fp64
from luminal_num.models.assets import Encoded
from luminal_num.models.bert import BertConfig, build_bert
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
# all-MiniLM-L6-v2's config.json (the fields the graph depends on) and the batch the MiniLM job compiles
MINILM = BertConfig(vocab_size=30522, hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
                    intermediate_size=1536, max_position_embeddings=512, type_vocab_size=2, layer_norm_eps=1e-12,
                    hidden_act="gelu")
MINILM_BATCH, MINILM_SEQ = 12, 32


def minilm_weights(config: BertConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded FP32 weights with the Hugging Face names and (out, in) Linear layout: norm gains near 1,
    matrices ~ N(0, 1/fan_in), as an initialised model (scores stay O(1), softmax is not saturated)."""
    rng = np.random.default_rng(seed)
    h, inner = config.hidden_size, config.intermediate_size

    def normal(*shape, scale=1.0):
        return (scale * rng.standard_normal(shape)).astype(np.float32)

    weights = {"embeddings.word_embeddings.weight": normal(config.vocab_size, h),
               "embeddings.position_embeddings.weight": normal(config.max_position_embeddings, h),
               "embeddings.token_type_embeddings.weight": normal(config.type_vocab_size, h)}
    norms = ["embeddings.LayerNorm"]
    linears = {"attention.self.query": (h, h), "attention.self.key": (h, h), "attention.self.value": (h, h),
               "attention.output.dense": (h, h), "intermediate.dense": (inner, h), "output.dense": (h, inner)}
    for layer in range(config.num_hidden_layers):
        prefix = f"encoder.layer.{layer}"
        for name, (rows, cols) in linears.items():
            weights[f"{prefix}.{name}.weight"] = normal(rows, cols, scale=1 / np.sqrt(cols))
            weights[f"{prefix}.{name}.bias"] = normal(rows, scale=0.1)
        norms += [f"{prefix}.attention.output.LayerNorm", f"{prefix}.output.LayerNorm"]
    for name in norms:
        weights[f"{name}.weight"] = 1 + normal(h, scale=0.1)
        weights[f"{name}.bias"] = normal(h, scale=0.1)
    return weights


def random_minilm(batch: int = MINILM_BATCH, seq: int = MINILM_SEQ, layers: int | None = None, seed: int = 0):
    """(graph, weights, one input batch): MiniLM's shapes, random weights, random token ids whose sentence
    lengths vary from seq // 2 to seq (so padding masks are exercised)."""
    config = MINILM if layers is None else dataclasses.replace(MINILM, num_hidden_layers=layers)
    model = build_bert(config, minilm_weights(config, seed), batch, seq)
    rng = np.random.default_rng(seed + 1)
    lengths = rng.integers(seq // 2, seq + 1, size=batch)
    lengths[0] = seq
    mask = (np.arange(seq)[None, :] < lengths[:, None]).astype(np.int64)
    ids = np.where(mask > 0, rng.integers(1000, config.vocab_size, size=(batch, seq)), 0).astype(np.int64)
    return model.graph, model.graph.weights, model.make_inputs(Encoded(ids, mask, lengths.astype(np.int64)))


def plan_genome(space: SearchSpace, plan: str) -> frozenset:
    """Every Gemm that offers the plan's variant takes it; everything else stays FP32."""
    tag = PLANS[plan]
    return frozenset(c for c in space.all_changes() if c[2] == tag) if tag else frozenset()


def workload(name: str) -> tuple[object, dict, dict]:
    """(graph, weights, one input batch) of the test transformer or MiniLM."""
    if name == "minilm":
        return random_minilm()
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
    write_csv(report, rows)
    return True


def write_csv(report: Path, rows: list[dict]) -> None:
    """`rows` to `report` (and to $OUT when set), each written whole then moved into place."""
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


def run_stage(stages: dict, argv=None, description: str = "") -> int:
    """Parse the stage name, stop with NO_DEVICE without a CUDA device, run the stage (given the probe)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("stage", choices=tuple(stages))
    args = parser.parse_args(argv)
    found = probe()
    if not found.available:
        print(f"no CUDA device: {found.reason}")
        return NO_DEVICE
    started = time.perf_counter()
    ok = stages[args.stage](found)
    print(f"stage {args.stage}: {'passed' if ok else 'FAILED'} in {time.perf_counter() - started:.1f} s")
    return 0 if ok else 1


def main(argv=None) -> int:
    return run_stage({"e2e": lambda found: stage_e2e(CudaRuntime), "graph": lambda found: stage_graph(CudaRuntime),
                      "timing": lambda found: stage_timing(CudaRuntime, found.device_name or "?")},
                     argv, __doc__.splitlines()[0])


if __name__ == "__main__":
    sys.exit(main())
