"""The launch form as a search choice (issue 33): a lowered program priced kernel by kernel and as one
megakernel, the cheaper form recorded with its latency.

Why here and not in the e-graph: the form chooses no backend op and changes no value. Both forms run the
same lowered kernels' bodies in the same order of dependencies (the CPU backend and the emulated
scheduler give bit-identical outputs, runtime/megakernel_emulator.py), so a verdict holds for either;
only how the GPU launches them differs. It is a property of the lowered program, decided from the cost
model after lowering, like its latency, and recorded beside it in plan.json (search/plan.py).

A program the megakernel lowering cannot take (codegen/megakernel_cuda.render_megakernel refuses it in
one line: a body whose block is not whole warps under 1024 threads, a Gemm reading a QUANTIZE kernel's
scales) is priced kernel by kernel only, and the latency says why. The `cpu` target is measured and runs
kernel by kernel: no form is chosen there.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping

from ..codegen.llir import Program
from ..codegen.megakernel import MegakernelError, build_queue
from ..codegen.megakernel_cuda import render_megakernel
from .cost import LaunchForm, Latency
from .latency import measured_cpu_latency, modelled_latency
from .megakernel_cost import megakernel_latency
from .targets import get_target


def megakernel_refusal(program: Program) -> str:
    """Why `program` cannot run as one megakernel ("" when it can): the lowering's own one-line refusal."""
    if not program.launched():
        return "the program launches no kernel"
    try:
        render_megakernel(program, build_queue(program))
    except MegakernelError as exc:
        return str(exc)
    return ""


def priced_latency(program: Program, target: str, bindings: Mapping[str, int], megakernel: bool = True) -> Latency:
    """Modelled latency of the cheaper launch form (kernel by kernel on a tie), with both prices
    (`megakernel` False: kernel by kernel only)."""
    kernels = modelled_latency(program, target, bindings)
    if not megakernel:
        return kernels
    refusal = megakernel_refusal(program)
    if refusal:
        return dataclasses.replace(kernels, kernels_s=kernels.total_s, megakernel_refusal=refusal)
    mega = megakernel_latency(build_queue(program), program, target, bindings)
    both = dict(kernels_s=kernels.total_s, megakernel_s=mega.total_s)
    if mega.total_s < kernels.total_s:
        return Latency(total_s=mega.total_s, per_kernel=(("megakernel", mega.total_s),), source="modelled",
                       target=kernels.target, cuda_graph=False, form=LaunchForm.MEGAKERNEL, **both)
    return dataclasses.replace(kernels, **both)


def program_latency(program: Program, target: str, bindings: Mapping[str, int], weights=None, inputs=None,
                    megakernel: bool = False) -> Latency:
    """The search's price of a lowered program: measured on the CPU (kernel by kernel), else modelled kernel
    by kernel, or (`megakernel`) in the cheaper launch form. Opt-in: the megakernel's model is not yet
    confirmed on a device, where the one measurement so far (1-layer SmolLM2, before its bodies were
    priced as run) found it 4.7x slower than kernel by kernel (1.03 ms vs 0.22 ms)."""
    if get_target(target).measured_only:
        if inputs is None:
            raise ValueError("the cpu target is measured: calibration inputs are needed")
        return measured_cpu_latency(program, weights, inputs)
    return priced_latency(program, target, bindings, megakernel)
