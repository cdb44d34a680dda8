"""Roofline cost model: latency of LLIR kernels on a named target, without running them.

Why a model at all: the search ranks many candidates that only differ in dtypes; the roofline
max(bytes / bandwidth, flops / peak) (divided by the wave efficiency, at least the minimum kernel time)
+ launch overhead captures the two effects precision changes have
(fewer bytes moved, a faster tensor-core mode) at no cost, on targets we do not have. Measured profiles
(CPU always, CUDA where a GPU exists) produce the same `Latency` record with source="measured".
"""
from __future__ import annotations

from collections.abc import Sequence
import enum
import math
from dataclasses import dataclass

from luminal_num.runtime.targets import MATH_MODES, LaunchConstants, Target, get_target

LATENCY_SOURCES = ("modelled", "measured")


class LaunchForm(enum.Enum):
    """How a lowered program is launched on a GPU: a property of the program the search prices both ways
    (runtime/launch_form.py) and records in the plan; the CPU backend runs the same bodies either way."""

    KERNELS = "kernels"        # one launch per kernel, replayed as a CUDA graph
    MEGAKERNEL = "megakernel"  # one persistent kernel over the work queue (codegen/megakernel.py)


class UnsupportedOnTarget(ValueError):
    """A kernel needs a math mode the target does not have (FP8 on an A100): the variant is unavailable."""

    def __init__(self, target: str, math: str, kernel: str):
        super().__init__(f"kernel {kernel!r} needs {math} math, which target {target!r} does not support")
        self.target = target
        self.math = math
        self.kernel = kernel


class MeasuredOnlyTarget(ValueError):
    """The target's latency is profiled, never modelled (the CPU emulation backend)."""


@dataclass(frozen=True)
class KernelWork:
    """What one kernel moves and computes: the inputs of the roofline.

    `bytes_read` / `bytes_written` count global-memory traffic in each buffer's stored dtype; `flops` counts
    multiply and add separately (a GEMM M x N x K is 2*M*N*K). `math` is the arithmetic mode the flops run
    in. `tensor_core=False` means SIMT (CUDA-core) execution: the target's CUDA-core rate for `math` where
    the hardware has one (fp64, fp32, and packed fp16/bf16), otherwise the FP32 rate, since tf32 / fp8 /
    int8 data handled outside tensor cores is widened to FP32 in registers. `fused_ops` records how many
    HLIR ops the kernel fuses; fusion shows in the model as one launch and no intermediate traffic (the
    lowering already left the intermediates out of the byte counts), so it does not enter the formula.
    `tiles`: the thread blocks it launches (codegen/blockops.py), for wave quantization; None = enough
    to fill every SM (no quantization).
    """

    name: str
    bytes_read: int
    bytes_written: int
    flops: int
    math: str = "fp32"
    tensor_core: bool = False
    fused_ops: int = 1
    tiles: int | None = None
    implementation: str = ""  # what the runtime launches (GemmImpl value or kernel kind): its measured class
    serial_extent: int = 0    # the reduced axis a block loops over (a Gemm's K, a row's length); 0: none

    def __post_init__(self) -> None:
        if self.math not in MATH_MODES:
            raise ValueError(f"kernel {self.name!r}: unknown math mode {self.math!r}; known: {', '.join(MATH_MODES)}")
        for field_name in ("bytes_read", "bytes_written", "flops"):
            if getattr(self, field_name) < 0:
                raise ValueError(f"kernel {self.name!r}: {field_name} must be >= 0, got {getattr(self, field_name)!r}")
        if self.tiles is not None and self.tiles < 1:
            raise ValueError(f"kernel {self.name!r}: tiles must be >= 1, got {self.tiles!r}")
        if self.fused_ops < 1:
            raise ValueError(f"kernel {self.name!r}: fused_ops must be >= 1, got {self.fused_ops!r}")

    @property
    def bytes_moved(self) -> int:
        return self.bytes_read + self.bytes_written


@dataclass(frozen=True)
class Latency:
    """Latency of a whole plan on one target, per kernel, and whether it was modelled or measured."""

    total_s: float
    per_kernel: tuple[tuple[str, float], ...]
    source: str
    target: str
    cuda_graph: bool
    form: LaunchForm = LaunchForm.KERNELS
    # both forms' prices where the search priced both (None: not priced), and why the program cannot be a
    # megakernel ("" when it can, or when the target is measured and runs kernel by kernel)
    kernels_s: float | None = None
    megakernel_s: float | None = None
    megakernel_refusal: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.form, LaunchForm):
            raise ValueError(f"latency form must be a LaunchForm, got {self.form!r}")
        if self.source not in LATENCY_SOURCES:
            raise ValueError(f"latency source must be one of {LATENCY_SOURCES}, got {self.source!r}")
        if not self.total_s >= 0.0:
            raise ValueError(f"total latency must be >= 0, got {self.total_s!r}")


def _modellable(target: Target | str) -> Target:
    resolved = get_target(target)
    if resolved.measured_only:
        raise MeasuredOnlyTarget(f"target {resolved.name!r} is measured only: profile the backend instead of modelling it")
    return resolved


def peak_rate(work: KernelWork, target: Target | str) -> float:
    """The dense peak (FLOP/s) `work` runs at on `target`; raises UnsupportedOnTarget if the mode is absent.

    A math mode is available when either unit has it; tf32 / fp8 / int8 on CUDA cores fall back to the
    FP32 rate (see KernelWork), but only on targets that support the mode at all.
    """
    resolved = _modellable(target)
    tensor_rate = resolved.tensor_cores.rate(work.math)
    simt_rate = resolved.cuda_cores.rate(work.math)
    if tensor_rate is None and simt_rate is None:
        raise UnsupportedOnTarget(resolved.name, work.math, work.name)
    if work.tensor_core:
        if tensor_rate is None:
            raise UnsupportedOnTarget(resolved.name, f"{work.math} tensor-core", work.name)
        return tensor_rate
    return simt_rate if simt_rate is not None else resolved.cuda_cores.rate("fp32")


def wave_efficiency(tiles: int | None, sm_count: int) -> float:
    """The fraction of the machine a kernel of `tiles` blocks keeps busy over its waves:
    tiles / (ceil(tiles / SMs) * SMs); 1 when `tiles` is None (a kernel sized to the machine)."""
    if tiles is None:
        return 1.0
    return tiles / (math.ceil(tiles / sm_count) * sm_count)


def roofline_s(work: KernelWork, target: Target | str) -> float:
    """max(bytes / achievable bandwidth, flops / achievable peak): the kernel's body on the whole machine."""
    resolved = _modellable(target)
    efficiency = resolved.efficiency
    memory_s = work.bytes_moved / (resolved.hbm_bandwidth * efficiency.bandwidth)
    compute_s = work.flops / (peak_rate(work, resolved) * efficiency.compute)
    return max(memory_s, compute_s)


def kernel_latency(work: KernelWork, target: Target | str, *, cuda_graph: bool = True,
                   launch: LaunchConstants | None = None) -> float:
    """Seconds for one kernel: max(roofline / wave efficiency, minimum kernel time) + launch overhead.
    `launch`: other constants than the target's (the bench compares the old model with the new)."""
    resolved = _modellable(target)
    constants = launch or resolved.launch
    body = roofline_s(work, resolved)
    if constants.wave_quantization:
        body /= wave_efficiency(work.tiles, resolved.sm_count)
    body = max(body, constants.min_kernel_s)
    measured = resolved.measured_kernels.get(work.implementation) if resolved.measured_kernels else None
    if measured is not None:  # what this implementation was measured to take, where more than the roofline
        body = max(body, measured.seconds(work.bytes_moved, work.flops, work.tiles, work.serial_extent,
                                          resolved.sm_count))
    return body + (constants.graph_node_s if cuda_graph else constants.plain_s)


def model_latency(works: Sequence[KernelWork], target: Target | str, cuda_graph: bool = True,
                  launch: LaunchConstants | None = None) -> Latency:
    """Modelled latency of a kernel sequence run back to back (no overlap between kernels)."""
    resolved = _modellable(target)
    per_kernel = tuple((work.name, kernel_latency(work, resolved, cuda_graph=cuda_graph, launch=launch))
                       for work in works)
    return Latency(total_s=sum(seconds for _, seconds in per_kernel), per_kernel=per_kernel,
                   source="modelled", target=resolved.name, cuda_graph=cuda_graph)
