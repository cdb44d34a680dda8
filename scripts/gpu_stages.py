"""More device stages of scripts/gpu_check.sh (issues 33 and 35): what the cost model prices against what
runs, the megakernel on the device, and the FP8 tensor cores' accumulation as data.

`python scripts/gpu_stages.py STAGE`, each stage its own process:
* kernels:    per-kernel CUDA-event time (eager, the host queued ahead of the device) next to the H200
              model's time for that kernel, for MiniLM (FP32, BF16, FP8 plans) and a SmolLM2-135M-shaped
              decode step (30 layers, random weights, context 256) under each genome of bench/fusion.py;
              plus each step's graph replay against the model's whole step. Writes gpu_kernels.csv and
              gpu_steps.csv (reports/bench/, and $OUT when set).
* megakernel: the megakernel (runtime/cuda_megakernel.py) of a 1-layer and the 30-layer SmolLM2-shaped
              step and of MiniLM, FP32 and BF16 + fused attention: outputs against the CPU backend (the
              FP32 envelope of test_megakernel_cuda), CUDA-event time against the megakernel cost model
              and the kernel-by-kernel graph replay. Writes gpu_megakernel.csv.
* fp8acc:     E4M3 per-tensor Gemms through cuBLASLt for K = 32 ... 4096 on data with wide magnitude
              ranges: inputs and device outputs saved (fp8acc.npz) so the accumulation can be modelled
              offline against the CPU emulator (the tensor cores do not accumulate FP8 products in FP32).
Exit 0 when the stage passed, 1 when a check failed, 3 without a CUDA device.
"""
from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gpu_cases import device_cases, genome_program, smollm2_step  # noqa: E402
from luminal_num.codegen.cuda_dispatch import gemm_implementation  # noqa: E402
from luminal_num.runtime.cpu import CpuRuntime, bind_program  # noqa: E402
from luminal_num.runtime.cost import kernel_latency  # noqa: E402
from luminal_num.runtime.cuda import CudaRuntime  # noqa: E402
from luminal_num.runtime.latency import kernel_works, modelled_latency  # noqa: E402
from luminal_num.runtime.megakernel_cost import megakernel_latency  # noqa: E402
from luminal_num.runtime.targets import get_target  # noqa: E402
from luminal_num.search.space import SearchSpace  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_check import plan_genome, random_minilm, run_stage  # noqa: E402
from gpu_check import write_csv as check_csv  # noqa: E402

TARGET = "h200"
REPORTS = Path("reports/bench")


def write_csv(name: str, rows: list[dict]) -> None:
    check_csv(REPORTS / name, rows)


def kernel_rows(model: str, plan: str, program, weights, inputs) -> tuple[list[dict], float, float]:
    target = get_target(TARGET)
    bindings = bind_program(program, {**weights, **inputs})
    runtime = CudaRuntime(program, weights)
    measured = runtime.profile_kernels(inputs, n=5)
    works = {k.id: w for k, w in zip(program.launched(), kernel_works(program, bindings))}
    rows = []
    for k in program.launched():
        work = works[k.id]
        modelled = kernel_latency(work, target, cuda_graph=True) - target.launch.graph_node_s
        impl = gemm_implementation(k, program, bindings).value if k.kind.is_gemm else k.kind.value
        rows.append(dict(model=model, plan=plan, kernel=k.id, kind=k.kind.value, label=k.label,
                         implementation=impl, precision=k.precision or "", bytes_moved=work.bytes_moved,
                         flops=work.flops, tiles=work.tiles or 0, measured_us=round(1e6 * measured[k.id], 3),
                         modelled_body_us=round(1e6 * modelled, 3)))
    step_measured = runtime.profile(inputs, n=20, warmup=3)
    step_modelled = modelled_latency(program, TARGET, bindings).total_s
    runtime.close()
    return rows, step_measured, step_modelled


def stage_kernels() -> bool:
    ok, kernel_table, steps = True, [], []
    cases = list(device_cases())
    for model, plan, program, w, x in cases:
        started = time.perf_counter()
        try:
            rows, measured, modelled = kernel_rows(model, plan, program, w, x)
        except Exception as error:  # one line per case; the stage fails, the other cases still run
            ok = False
            print(f"FAIL kernels {model} {plan}: {type(error).__name__}: {str(error).splitlines()[0][:300]}")
            continue
        kernel_table += rows
        by_impl: dict[str, list[float]] = {}
        for r in rows:
            by_impl.setdefault(r["implementation"], []).append(r["measured_us"] / max(r["modelled_body_us"], 1e-3))
        ratios = ", ".join(f"{impl} x{statistics.median(v):.2f} (n={len(v)})" for impl, v in sorted(by_impl.items()))
        steps.append(dict(model=model, plan=plan, kernels=len(rows), measured_step_us=round(1e6 * measured, 2),
                          modelled_step_us=round(1e6 * modelled, 2),
                          sum_kernel_measured_us=round(sum(r["measured_us"] for r in rows), 2),
                          modelled_over_measured=round(modelled / measured, 4)))
        print(f"ok   kernels {model} {plan}: step measured {1e6 * measured:.1f} us, modelled {1e6 * modelled:.1f} us;"
              f" measured/modelled per kernel by implementation: {ratios} [{time.perf_counter() - started:.1f} s]")
    if steps:
        write_csv("gpu_kernels.csv", kernel_table)
        write_csv("gpu_steps.csv", steps)
    return ok


def stage_megakernel() -> bool:
    from luminal_num.runtime.cuda_megakernel import MegakernelCudaRuntime
    ok, rows = True, []
    cases = []
    for layers in (1,):  # NVRTC compiles one function of every op's body: 30 layers did not finish in 120 s
        _, w, x, space = smollm2_step(layers)
        # W4A16: its plain Gemms inline the dequantize-on-load body on the packed weights (issue 33)
        for label in ("FP32", "BF16 + fused attention", "W4A16 INT4 group 128 + fused attention"):
            cases.append((f"smollm2-decode-{layers}l", label, genome_program(space, label), w, x))
    graph, weights, batch = random_minilm(layers=1)
    space = SearchSpace.build(graph)
    cases.append(("minilm-1l", "fp32", space.program(plan_genome(space, "fp32")), weights, batch))
    for model, label, program, w, x in cases:
        started = time.perf_counter()
        bindings = bind_program(program, {**w, **x})
        try:
            mega = MegakernelCudaRuntime(program, w)
            got = mega.run(x, repeats=10)
        except Exception as error:  # one line per case; the stage fails
            ok = False
            print(f"FAIL megakernel {model} {label}: {type(error).__name__}: {str(error).splitlines()[0][:300]}")
            continue
        cpu = CpuRuntime(program, w).run(x).outputs
        worst = 0.0
        good = True
        for name, ref in cpu.items():
            scale = float(np.max(np.abs(ref), initial=0.0)) + 1.0
            gap = float(np.max(np.abs(got.outputs[name] - ref), initial=0.0)) / scale
            worst = max(worst, gap)
            good &= bool(np.all(np.isfinite(got.outputs[name])))
        good &= worst <= 1e-3  # the kernels' own FP32 sums in another order
        ok &= good
        if not good:
            first_wrong(mega, program, {**w, **x})
        measured = got.kernel_seconds[0][1]
        modelled = megakernel_latency(mega.queue, program, TARGET, bindings).total_s
        kernel_by_kernel = CudaRuntime(program, w).profile(x, n=10, warmup=2)
        rows.append(dict(model=model, plan=label, ops=len(mega.queue.ops), grid=mega.grid,
                         max_rel_gap_vs_cpu=f"{worst:.3e}", measured_us=round(1e6 * measured, 2),
                         modelled_us=round(1e6 * modelled, 2), graph_replay_us=round(1e6 * kernel_by_kernel, 2)))
        print(f"{'ok  ' if good else 'FAIL'} megakernel {model} {label}: {len(mega.queue.ops)} ops on {mega.grid} blocks,"
              f" |gpu-cpu|/max {worst:.2e}; measured {1e6 * measured:.1f} us, modelled {1e6 * modelled:.1f} us, "
              f"kernel-by-kernel graph {1e6 * kernel_by_kernel:.1f} us [{time.perf_counter() - started:.1f} s]")
    if rows:
        write_csv("gpu_megakernel.csv", rows)
    return ok


def first_wrong(mega, program, feed, show: int = 6) -> None:
    """Each op's value as the megakernel left it against the CPU backend's, in queue order: the first
    ops that differ say which body or which barrier is wrong."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from test_cuda_codegen import stored_values
    values = stored_values(program, feed)
    shown = 0
    for position, q in enumerate(mega.queue.ops):
        k = program.kernel(q.kernel)
        if q.recomputed_by is not None:  # no tiles: its reader's tiles made private copies, its buffer is unwritten
            print(f"     ---- op {position} kernel {k.id} {k.kind.value} recomputed by op {q.recomputed_by}")
            continue
        got = mega._read(mega.state, k.id).reshape(-1)
        ref = np.asarray(values[k.id], dtype=np.float64).reshape(-1)
        scale = float(np.max(np.abs(ref), initial=0.0)) + 1.0
        bad = np.abs(got - ref) > 1e-4 * scale
        status = "ok  " if not bad.any() else "DIFF"
        detail = "" if not bad.any() else (f" {int(bad.sum())}/{bad.size} elements differ, first at {int(np.argmax(bad))}:"
                                           f" {got[np.argmax(bad)]:.6g} vs {ref[np.argmax(bad)]:.6g}")
        waits = [(w.producer, w.read_elements) for w in q.waits]
        print(f"     {status} op {position} kernel {k.id} {k.kind.value} {k.label} {q.block.partition.name} "
              f"stride {q.stride} waits {waits}{detail}")
        shown += bad.any()
        if shown >= show:
            break


def stage_fp8acc() -> bool:
    """Save inputs and cuBLASLt outputs of E4M3 per-tensor Gemms for the offline accumulation model."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from test_cuda_codegen import gemm_cases
    saved = {}
    rng = np.random.default_rng(7)
    for k in (32, 64, 128, 256, 1024, 4096):
        program, _ = gemm_cases(64, 64, k, "f8e4m3_tensor")["row_major"]
        for trial, spread in enumerate((0.0, 4.0, 12.0)):  # magnitudes 2^N(0, spread): plain to very wide
            feed = {}
            for kern in program.kernels:
                if kern.external:
                    shape = tuple(int(d) for d in kern.shape)
                    signs = rng.choice([-1.0, 1.0], size=shape)
                    feed[kern.external] = signs * np.exp2(rng.normal(0.0, spread, size=shape)) if spread else \
                        rng.standard_normal(shape)
            cuda = CudaRuntime(program)
            got = cuda.run(feed).outputs["y"]
            used_lt = [plan.algo is not None for plan in cuda.lt.plans.values()] == [True]
            cpu = CpuRuntime(program).run(feed).outputs["y"]
            for name, value in feed.items():
                saved[f"k{k}_t{trial}_{name}"] = np.asarray(value, dtype=np.float32)  # what the plan reads
            saved[f"k{k}_t{trial}_gpu"] = got
            saved[f"k{k}_t{trial}_cpu"] = cpu
            rel = float(np.max(np.abs(got - cpu)) / (np.max(np.abs(cpu)) + 1e-300))
            print(f"ok   fp8acc K={k} spread={spread}: cuBLASLt {used_lt}, max |gpu-cpu| / max|cpu| {rel:.3e}")
            cuda.close()
    out = Path(os.environ.get("OUT", "reports/bench")) / "fp8acc.npz"
    out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(out, **saved)
    print(f"     wrote {out}")
    return True


def main(argv=None) -> int:
    return run_stage({"kernels": lambda found: stage_kernels(), "megakernel": lambda found: stage_megakernel(),
                      "fp8acc": lambda found: stage_fp8acc()}, argv, __doc__.splitlines()[0])


if __name__ == "__main__":
    sys.exit(main())
