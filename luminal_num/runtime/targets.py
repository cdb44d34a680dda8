"""Hardware targets as data: one frozen record per target, numbers copied from NVIDIA's published specs.

Why data and not code: the cost model is one formula (roofline + launch overhead); what differs between
an H100 and an A100 is only numbers. Keeping them in one table, each with its source, makes a wrong
number a one-line, reviewable fix and lets a new target be added without touching the model.

All peaks are DENSE rates (NVIDIA datasheets print tensor-core peaks "with sparsity", i.e. 2x the dense
rate; the dense value is the one a GEMM on ordinary weights can reach). Units: FLOP/s (OP/s for int8),
bytes/s, seconds, bytes.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from ..dtypes.variants import GemmPrecision
from .kernel_classes import MeasuredKernels, load_measured

MATH_MODES: tuple[str, ...] = ("fp32", "tf32", "bf16", "fp16", "fp8", "int8", "fp64")

# The math mode a Gemm's flops run in, from its A operand format: (mode, on tensor cores). Public data:
# the search ranks variants by the target's peak for it, the cost model prices their flops with it.
OPERAND_MATH: dict[str, tuple[str, bool]] = {
    "f32": ("fp32", False), "tf32": ("tf32", True), "bf16": ("bf16", True), "f16": ("fp16", True),
    "f8e4m3": ("fp8", True), "f8e5m2": ("fp8", True), "int8": ("int8", True)}


def gemm_math(variant: GemmPrecision) -> tuple[str, bool]:
    """(math mode, tensor cores) of a Gemm variant; an operand format with no mode is refused."""
    try:
        return OPERAND_MATH[variant.a_format.name]
    except KeyError:
        raise ValueError(f"Gemm variant {variant.name}: no math mode for operand format {variant.a_format.name}") from None

TERA = 1e12


@dataclass(frozen=True)
class MathPeaks:
    """Dense peak rate per math mode on one kind of execution unit; None = that unit has no such mode."""

    fp64: float | None = None
    fp32: float | None = None
    tf32: float | None = None
    bf16: float | None = None
    fp16: float | None = None
    fp8: float | None = None  # E4M3 and E5M2 run at the same rate
    int8: float | None = None

    def rate(self, math: str) -> float | None:
        if math not in MATH_MODES:
            raise ValueError(f"unknown math mode {math!r}; known: {', '.join(MATH_MODES)}")
        return getattr(self, math)


@dataclass(frozen=True)
class Efficiency:
    """Achievable fraction of the published peaks, and where that fraction comes from.

    Why: datasheet peaks are never reached; a model that assumes 100% ranks candidates correctly but
    predicts latencies ~20% too low. One bandwidth and one compute fraction per target is coarse, but it
    is stated, sourced and easy to replace with a better measurement.
    """

    bandwidth: float  # achieved copy bandwidth / published HBM bandwidth
    compute: float  # achieved dense GEMM rate / published dense tensor-core peak
    source: str

    def __post_init__(self) -> None:
        for name in ("bandwidth", "compute"):
            value = getattr(self, name)
            if not 0.0 < value <= 1.0:
                raise ValueError(f"efficiency {name} must lie in (0, 1], got {value!r}")


@dataclass(frozen=True)
class Target:
    """One hardware target. `measured_only` targets have no model: their latency comes from profiling."""

    name: str
    description: str
    hbm_bandwidth: float | None  # bytes/s
    tensor_cores: MathPeaks  # dense tensor-core peaks
    cuda_cores: MathPeaks  # non-tensor (SIMT) peaks
    efficiency: Efficiency | None
    launch: "LaunchConstants | None"  # launch, minimum-kernel and wave constants
    l2_bytes: int | None
    sm_count: int | None
    measured_only: bool = False
    # per-implementation costs measured on the device (runtime/kernel_classes.py): the cost model takes
    # max(roofline, the class fit) for a kernel of a measured class; None: the roofline alone
    measured_kernels: MeasuredKernels | None = None

    @property
    def launch_s(self) -> float | None:
        """One plain kernel launch from a stream."""
        return None if self.launch is None else self.launch.plain_s

    @property
    def graph_launch_s(self) -> float | None:
        """Per kernel node when replayed inside a CUDA graph."""
        return None if self.launch is None else self.launch.graph_node_s


# Achievable fractions measured on the project's H200 (notes/toolchain.md): ~4.3 TB/s device-to-device
# copy against 4.8 TB/s nominal, and a dense bf16 GEMM at ~790 TFLOP/s against 989.4 nominal.
H200_MEASURED_COPY = 4.3 * TERA
H200_MEASURED_BF16_GEMM = 790.0 * TERA
H200_PUBLISHED_BANDWIDTH = 4.8 * TERA  # H200 datasheet: "GPU Memory Bandwidth 4.8TB/s"
HOPPER_DENSE_BF16 = 989.4 * TERA  # H100/H200 whitepaper/datasheet: 1,979 TF with sparsity -> 989.4 dense

H200_EFFICIENCY = Efficiency(
    bandwidth=H200_MEASURED_COPY / H200_PUBLISHED_BANDWIDTH,
    compute=H200_MEASURED_BF16_GEMM / HOPPER_DENSE_BF16,
    source="measured on H200: ~4.3 TB/s copy, bf16 dense GEMM ~790 TFLOP/s (notes/toolchain.md)",
)
# No H100 or A100 was available to measure: the H200 fractions are carried over (same generation of
# HBM controllers and cuBLAS kernels for the H100; the A100 typically reaches similar fractions).
CARRIED_OVER_EFFICIENCY = Efficiency(
    bandwidth=H200_EFFICIENCY.bandwidth,
    compute=H200_EFFICIENCY.compute,
    source="assumed: the H200 measurement carried over (not measured on this target)",
)

@dataclass(frozen=True)
class LaunchConstants:
    """What a kernel costs besides its bytes and flops (issue 33), each figure with its source.

    `graph_node_s`: per kernel node of a replayed CUDA graph (the gap in which no useful work is done);
    `plain_s`: per plain stream launch; `min_kernel_s`: the shortest a launched kernel runs however little
    it does (grid setup and drain); `wave_quantization`: a kernel of T tiles on S SMs runs ceil(T / S)
    full waves, so its roofline time is divided by T / (ceil(T / S) * S).
    """

    plain_s: float
    graph_node_s: float
    min_kernel_s: float
    wave_quantization: bool
    source: str

    def __post_init__(self) -> None:
        for name in ("plain_s", "graph_node_s", "min_kernel_s"):
            if not getattr(self, name) >= 0.0:
                raise ValueError(f"launch constant {name} must be >= 0, got {getattr(self, name)!r}")


# Launch figures are not datasheet numbers; they are published measurements on Hopper:
# - graph node 1.3 us: Hazy Research, "Look Ma, No Bubbles! Designing a Low-Latency Megakernel for
#   Llama-1B" (hazyresearch.stanford.edu/blog/2025-05-27-no-bubbles, 2025-05-27): even with CUDA graphs,
#   an H100 spends ~1.3 us per kernel launch during which no useful work is done.
# - minimum kernel time 1.0 us: sglang PR #24733 (github.com/sgl-project/sglang/pull/24733, H100 80GB,
#   median over its bench): an RMSNorm of hidden 512 over 16 tokens runs 0.86-1.07 us, hidden 2048 1.2 us;
#   a kernel that moves next to nothing still takes ~1 us.
# - plain launch 4 us: NVIDIA's "Getting Started with CUDA Graphs" blog (developer.nvidia.com/blog/cuda-graphs)
#   and common measurements put a plain stream launch of a small kernel at ~3-5 us end to end.
# Together a small kernel node costs 2.3 us, inside the 1-2.5 us per node H100/H200 graphs show.
PUBLISHED_HOPPER_LAUNCH = LaunchConstants(
    plain_s=4e-6, graph_node_s=1.3e-6, min_kernel_s=1.0e-6, wave_quantization=True,
    source="graph node 1.3 us (Hazy Research no-bubbles, H100), min kernel 1.0 us (sglang #24733, H100), "
           "plain launch 4 us (NVIDIA CUDA graphs blog), waves = ceil(tiles / SMs)")
# The model before issue 33, kept to show what the new constants change (bench/launch_model.py).
LEGACY_LAUNCH = LaunchConstants(
    plain_s=4e-6, graph_node_s=1e-6, min_kernel_s=0.0, wave_quantization=False,
    source="before issue 33: 1 us per graph node, no minimum kernel time, no wave quantization")
# No A100 measurement was found: the Hopper figures are carried over (an A100 launches no faster).
CARRIED_OVER_LAUNCH = LaunchConstants(
    plain_s=PUBLISHED_HOPPER_LAUNCH.plain_s, graph_node_s=PUBLISHED_HOPPER_LAUNCH.graph_node_s,
    min_kernel_s=PUBLISHED_HOPPER_LAUNCH.min_kernel_s, wave_quantization=True,
    source="assumed: the H100 launch measurements carried over (not measured on this target)")
PLAIN_LAUNCH_S = PUBLISHED_HOPPER_LAUNCH.plain_s
GRAPH_LAUNCH_S = PUBLISHED_HOPPER_LAUNCH.graph_node_s

MIB = 1024 * 1024  # NVIDIA's "50 MB" / "40 MB" L2 sizes are binary megabytes

# Hopper compute is identical on the H100 SXM5 and the H200 SXM (same GH100 die, 132 SMs); only the
# memory differs. Sources: NVIDIA H100 datasheet and "NVIDIA H100 Tensor Core GPU Architecture"
# whitepaper (Table: H100 SXM5): FP64 34 TF, FP64 tensor core 67 TF, FP32 67 TF, FP16/BF16 non-tensor
# 133.8 TF, TF32 494.7 TF dense, BF16/FP16 989.4 TF dense, FP8 1978.9 TF dense, INT8 1978.9 TOPS dense,
# L2 50 MB. The H200 datasheet lists the same compute figures.
HOPPER_TENSOR_CORES = MathPeaks(
    fp64=67 * TERA, tf32=494.7 * TERA, bf16=989.4 * TERA, fp16=989.4 * TERA,
    fp8=1978.9 * TERA, int8=1978.9 * TERA,
)
HOPPER_CUDA_CORES = MathPeaks(fp64=34 * TERA, fp32=67 * TERA, bf16=133.8 * TERA, fp16=133.8 * TERA)
HOPPER_L2_BYTES = 50 * MIB
HOPPER_SMS = 132

H200 = Target(
    name="h200",
    description="NVIDIA H200 SXM 141GB (HBM3e)",
    hbm_bandwidth=H200_PUBLISHED_BANDWIDTH,
    tensor_cores=HOPPER_TENSOR_CORES,
    cuda_cores=HOPPER_CUDA_CORES,
    efficiency=H200_EFFICIENCY,
    launch=PUBLISHED_HOPPER_LAUNCH,
    l2_bytes=HOPPER_L2_BYTES,
    sm_count=HOPPER_SMS,
)
# `python -m bench.gpu_calibration` fits runtime/data/h200_kernels.json from an H200 run of scripts/gpu_check.sh
H200_KERNELS = load_measured("h200_kernels")

TARGETS: tuple[Target, ...] = (
    # the same Hopper chip with HBM3: only the memory and the efficiencies carried over differ
    replace(H200, name="h100", description="NVIDIA H100 SXM5 80GB (HBM3)",
            hbm_bandwidth=3.35 * TERA,  # H100 SXM datasheet: "GPU Memory Bandwidth 3.35TB/s"
            efficiency=CARRIED_OVER_EFFICIENCY),
    H200,
    *(() if H200_KERNELS is None else (replace(
        H200, name="h200-measured", measured_kernels=H200_KERNELS,
        description=f"NVIDIA H200 SXM as this project's kernels measured on it ({H200_KERNELS.source})"),)),
    Target(
        name="a100",
        description="NVIDIA A100 SXM4 80GB (HBM2e)",
        # A100 datasheet (80GB SXM column): bandwidth 2,039 GB/s; FP64 9.7 TF, FP64 tensor core 19.5 TF,
        # FP32 19.5 TF, TF32 156 TF dense (312 sparse), BF16/FP16 312 TF dense (624 sparse), INT8 624
        # TOPS dense (1,248 sparse); no FP8 (Ampere tensor cores have no FP8 mode). A100 whitepaper:
        # non-tensor FP16 78 TF, non-tensor BF16 39 TF, 108 SMs, 40 MB L2.
        hbm_bandwidth=2.039 * TERA,
        tensor_cores=MathPeaks(fp64=19.5 * TERA, tf32=156 * TERA, bf16=312 * TERA, fp16=312 * TERA,
                               int8=624 * TERA),
        cuda_cores=MathPeaks(fp64=9.7 * TERA, fp32=19.5 * TERA, bf16=39 * TERA, fp16=78 * TERA),
        efficiency=CARRIED_OVER_EFFICIENCY,
        launch=CARRIED_OVER_LAUNCH,
        l2_bytes=40 * MIB,
        sm_count=108,
    ),
    Target(
        name="cpu",
        description="this machine's CPU running the numpy emulation backend (latency is profiled, not modelled)",
        hbm_bandwidth=None,
        tensor_cores=MathPeaks(),
        cuda_cores=MathPeaks(),
        efficiency=None,
        launch=None,
        l2_bytes=None,
        sm_count=None,
        measured_only=True,
    ),
)

TARGET_NAMES: tuple[str, ...] = tuple(t.name for t in TARGETS)


def get_target(name: str | Target) -> Target:
    """Look a target up by name (case-insensitive); raises a KeyError listing the known names."""
    if isinstance(name, Target):
        return name
    for target in TARGETS:
        if target.name == str(name).lower():
            return target
    raise KeyError(f"unknown target {name!r}; known targets: {', '.join(TARGET_NAMES)}")
