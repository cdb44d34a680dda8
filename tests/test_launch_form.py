"""The launch form as a search choice (issue 33, runtime/launch_form.py): each modelled candidate is priced
kernel by kernel and as one megakernel, the cheaper form is recorded in plan.json and shown, a program
the megakernel lowering cannot take is priced kernel by kernel with its one-line reason, and the chosen
form's program runs in the emulated scheduler with no barrier violation and the kernel-by-kernel outputs."""
from __future__ import annotations

import json

import numpy as np
import pytest

from luminal_num.cli import EXIT_INPUT, EXIT_OK, main
from luminal_num.codegen.megakernel import build_queue
from luminal_num.hlir.graph import Graph
from luminal_num.models.registry import llama_tiny_job, transformer_job
from luminal_num.runtime.cost import LaunchForm
from luminal_num.runtime.cpu import CpuRuntime
from luminal_num.runtime.latency import modelled_latency
from luminal_num.runtime.launch_form import megakernel_refusal, priced_latency, program_latency
from luminal_num.runtime.megakernel_cost import megakernel_latency
from luminal_num.runtime.megakernel_emulator import MegakernelEmulator, bit_identical
from luminal_num.search.plan import Plan
from luminal_num.search.plan_file import with_digest
from luminal_num.search.recipes import pick
from luminal_num.search.space import SearchSpace


def _job_program(job, tags=()):
    space = SearchSpace.build(job.graph)
    return space.program(pick(space, set(tags).__contains__)), job.graph.bind_symbols(job.calibration[0])


def test_both_forms_are_priced_and_the_cheaper_one_is_chosen():
    program, bindings = _job_program(transformer_job(1))
    got = priced_latency(program, "h200", bindings)
    kernels = modelled_latency(program, "h200", bindings).total_s
    mega = megakernel_latency(build_queue(program), program, "h200", bindings).total_s
    assert got.kernels_s == kernels and got.megakernel_s == mega and not got.megakernel_refusal
    assert got.total_s == min(kernels, mega)
    assert got.form is (LaunchForm.MEGAKERNEL if mega < kernels else LaunchForm.KERNELS)


def test_the_megakernel_form_prices_the_bodies_it_inlines():
    """A W4A16 llama-tiny layer: a Gemm reading a stored weight's parts (the dequantize-on-load kernel, or the
    tiled kernel on the parts for the epilogue and GLU forms) keeps its implementation and stored bytes in
    the megakernel; every other Gemm becomes its tiled FP32 body on CUDA cores, with the same bytes, on the
    path that body takes (seq 4: M = 4, the decode path where its source has one, codegen/cuda_gemv.py)."""
    from luminal_num.codegen.cuda_gemv import SKINNY_M
    from luminal_num.codegen.cuda_kernels import render_kernel
    from luminal_num.codegen.cuda_weight_only import weight_only_gemm
    from luminal_num.hlir.symbolic import evaluate
    from luminal_num.runtime.latency import kernel_works
    program, bindings = _job_program(llama_tiny_job(seq=4, layers=1), ("store:int4_g128", "gemm:bf16"))
    kernels = kernel_works(program, bindings)
    mega = kernel_works(program, bindings, LaunchForm.MEGAKERNEL)
    checked = set()
    for k, kw, mw in zip(program.launched(), kernels, mega):
        assert mw.bytes_moved == kw.bytes_moved and mw.flops == kw.flops
        if k.kind.is_gemm:
            dequantizing = weight_only_gemm(k, program) is not None
            decodes = f"if (M <= {SKINNY_M})" in render_kernel(k, program).source and \
                evaluate(k.layout.m, bindings) <= SKINNY_M
            stored = kw.implementation in ("weight_only", "tiled_stored", "tiled_stored_decode")
            tiled = "tiled_decode" if decodes else "tiled"
            want = kw.implementation if stored else tiled
            checked.add(want)
            assert mw.implementation == want
            assert dequantizing == (kw.implementation == "weight_only")
            if kw.implementation.startswith("tiled_stored"):  # the tiled kernel on stored parts, on its path
                assert kw.implementation == ("tiled_stored_decode" if decodes else "tiled_stored")
            assert mw.math == "fp32" and not mw.tensor_core
        else:
            assert mw == kw
    assert {"weight_only", "tiled_decode"} <= checked


def _square_matmul(n: int) -> Graph:
    g = Graph()
    a = g.input("a", (n, n))
    b = g.weight("b", np.random.default_rng(0).standard_normal((n, n)).astype(np.float32))
    g.output(a @ b, "y")
    return g


def test_a_large_tensor_core_gemm_stays_kernel_by_kernel():
    """The megakernel runs every Gemm as its tiled FP32 body: a 1024^3 BF16 product (cuBLAS on tensor cores
    kernel by kernel) is priced far cheaper as a kernel, and the search keeps that form."""
    g = _square_matmul(1024)
    space = SearchSpace.build(g)
    program = space.program(pick(space, {"gemm:bf16"}.__contains__))
    got = priced_latency(program, "h200", {})
    assert got.form is LaunchForm.KERNELS and got.megakernel_s > 5 * got.kernels_s


def test_a_program_the_megakernel_cannot_take_is_priced_kernel_by_kernel_with_the_reason():
    program, bindings = _job_program(transformer_job(1), ["gemm:f8e4m3_tensor_dynamic"])
    why = megakernel_refusal(program)
    assert "reads a QUANTIZE kernel's scales" in why and why.startswith("kernel ") and "\n" not in why
    got = priced_latency(program, "h200", bindings)
    assert got.form is LaunchForm.KERNELS and got.megakernel_s is None and got.megakernel_refusal == why
    assert got.total_s == modelled_latency(program, "h200", bindings).total_s


def test_the_measured_cpu_target_chooses_no_form():
    program, _ = _job_program(transformer_job(1))
    job = transformer_job(1)
    got = program_latency(program, "cpu", {}, job.graph.weights, job.calibration[0])
    assert got.form is LaunchForm.KERNELS and got.megakernel_s is None and got.source == "measured"


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    out = tmp_path_factory.mktemp("launch_form") / "report"
    assert main(["compile", "--model", "transformer", "--candidates", "2", "--quiet", "--megakernel",
                 "--out", str(out)]) == EXIT_OK
    return out


def test_without_the_option_every_candidate_is_priced_kernel_by_kernel(tmp_path):
    """The megakernel's model is opt-in until a device confirms it (the last device run measured it slower)."""
    out = tmp_path / "report"
    assert main(["compile", "--model", "transformer", "--candidates", "2", "--quiet", "--out", str(out)]) == EXIT_OK
    lat = json.loads((out / "plan.json").read_text())["latency"]
    assert lat["form"] == "kernels" and lat.get("megakernel_s") is None


def test_the_plan_records_the_chosen_form_and_its_digest_covers_it(compiled, tmp_path, capsys):
    data = json.loads((compiled / "plan.json").read_text())
    lat = data["latency"]
    prices = {"kernels": lat["kernels_s"], "megakernel": lat["megakernel_s"]}
    assert lat["form"] == min((p, f) for f, p in prices.items() if p is not None)[1]
    assert lat["total_s"] == prices[lat["form"]]
    assert Plan.load(compiled / "plan.json").latency.form == lat["form"]
    capsys.readouterr()
    assert main(["inspect", "--plan", str(compiled / "plan.json")]) == EXIT_OK
    shown = capsys.readouterr().out
    assert ("megakernel; kernel by kernel" if lat["form"] == "megakernel" else "kernel by kernel; megakernel") in shown
    # an edited form is refused by the digest
    other = "kernels" if lat["form"] == "megakernel" else "megakernel"
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps({**data, "latency": {**lat, "form": other}}))
    assert main(["inspect", "--plan", str(edited)]) == EXIT_INPUT
    assert "latency changed" in capsys.readouterr().err
    # a plan written before the form was recorded ran kernel by kernel
    old = {k: v for k, v in data.items() if k != "digest"}
    old["latency"] = {k: lat[k] for k in ("total_s", "source", "target", "cuda_graph")}
    (tmp_path / "old.json").write_text(json.dumps(with_digest(old)))
    assert Plan.load(tmp_path / "old.json").latency.form == "kernels"


def test_the_chosen_form_runs_in_the_emulated_scheduler_like_kernel_by_kernel():
    """A llama-tiny program in the form the search chooses for it (the bodies are the same in either form)
    through the work queue in random interleavings: no barrier violation, no deadlock, outputs bit for bit
    the CPU backend's."""
    job = llama_tiny_job(seq=4, layers=1)
    program, bindings = _job_program(job, ("store:int4_g128", "gemm:bf16"))
    assert priced_latency(program, "h200", bindings).form is LaunchForm.MEGAKERNEL
    inputs = job.calibration[0]
    reference = CpuRuntime(program, job.graph.weights).run(inputs).outputs
    emulator = MegakernelEmulator(program, build_queue(program), job.graph.weights, inputs)
    for seed, sms in enumerate((2, 7, 132)):
        run = emulator.run(seed, sms)
        assert not run.violations and run.deadlock is None
        assert bit_identical(run.outputs, reference)


@pytest.mark.slow
def test_smollm2_one_layer_decode_chosen_form_runs_clean():
    """FP32 and W4A16 + fused attention of a 1-layer SmolLM2 step: each priced in the cheaper form, and
    its queue runs clean in the emulated scheduler."""
    from luminal_num.models.registry import llm_job
    job = llm_job("smollm2", workload="decode:1@64", layers=1)
    for tags in ((), ("store:int4_g128", "gemm:bf16", "attn:flash_bf16")):
        program, bindings = _job_program(job, tags)
        got = priced_latency(program, "h200", bindings)
        assert got.total_s == min(got.kernels_s, got.megakernel_s)
        inputs = job.calibration[0]
        reference = CpuRuntime(program, job.graph.weights).run(inputs).outputs
        emulator = MegakernelEmulator(program, build_queue(program), job.graph.weights, inputs)
        for seed in range(4):
            run = emulator.run(seed, (2, 8, 32, 132)[seed])
            assert not run.violations and run.deadlock is None
            assert bit_identical(run.outputs, reference)
