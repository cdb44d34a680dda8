"""Measured kernel classes: what each implementation the CUDA runtime launches costs on a real device.

Why: the roofline prices a kernel as if it ran at the machine's bandwidth or peak. The first H200 run
(reports/bench/gpu_kernels.csv, `scripts/gpu_stages.py kernels`) measured the kernels this project
generates at 4-60x their roofline time: the 16x16 tiled Gemm loops over K with a few tiles in flight
(a decode GEMV of K = 576 took 40-80 us), the fused attention kernel of that run recomputed Q.K per output
column (~270 us per layer; the class `attention` still describes it: codegen/cuda_attention.py now computes
each score once per chunk, not yet measured), the per-tensor FP8 quantize reduces in one block (~130 us). A model that ignores
this ranks plans upside down (fused attention modelled faster, measured 2.5x slower). So a target may
carry one fitted cost per implementation class, each a non-negative linear model over features of the
kernel's work, fitted (relative least squares) to the recorded per-kernel times by
`python -m bench.gpu_calibration`; the cost model takes max(roofline, class fit).

Features (why each): a fixed cost (setup, one wave of tiny blocks), bytes and flops (what streams and
what computes), waves x serial extent (a block that loops over the reduced axis takes time in proportion
to it, and the kernel takes one such loop per wave of blocks), waves x flops per tile (work a block does
serially when its loop is not the reduced axis). `implementation` is the runtime's name for what it
launches: a Gemm's codegen.cuda_dispatch.GemmImpl value, else the kernel kind.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from importlib import resources

import numpy as np

FEATURES = ("fixed", "per_byte", "per_flop", "per_wave_step", "per_wave_flop")


def features(bytes_moved: int, flops: int, tiles: int | None, serial_extent: int, sm_count: int) -> np.ndarray:
    """The feature vector a class fit multiplies (seconds = coefficients . features)."""
    blocks = max(tiles or sm_count, 1)
    waves = math.ceil(blocks / sm_count)
    return np.array([1.0, float(bytes_moved), float(flops), float(waves * serial_extent),
                     float(waves * flops / blocks)])


@dataclass(frozen=True)
class KernelClassFit:
    """One implementation's fitted cost: coefficients in seconds per feature unit, and how well it fits."""

    implementation: str
    coefficients: tuple[float, ...]  # one per FEATURES entry, each >= 0
    samples: int
    median_relative_error: float
    p90_relative_error: float
    derived_from: str = ""  # a class no device measured: priced by this measured class's fit (DERIVED_CLASSES)

    def __post_init__(self) -> None:
        if len(self.coefficients) != len(FEATURES) or any(not c >= 0.0 for c in self.coefficients):
            raise ValueError(f"{self.implementation}: need {len(FEATURES)} coefficients >= 0, got {self.coefficients}")

    def seconds(self, bytes_moved: int, flops: int, tiles: int | None, serial_extent: int, sm_count: int) -> float:
        return float(np.dot(self.coefficients, features(bytes_moved, flops, tiles, serial_extent, sm_count)))


# Classes no device has measured yet: class -> the measured class whose coefficients price it. A device
# recording that has the class replaces the derivation (get() prefers a measured fit).
#
# tiled_decode (the tiled Gemm's decode path, codegen/cuda_gemv.py, M <= 4 in ordinary programs) from tiled:
# it is the same launch (grid, 16 x 16 threads per block, the same bytes loaded and stored, the same flops),
# so the fixed, per-byte, per-flop and per-wave-flop coefficients carry over; what differs is the chain of
# steps a block runs in order, which is the feature the tiled fit charges most (per_wave_step, 53 ns per
# step on the H200: a K = 576 decode GEMV's sequential walk is 576 steps, ~31 us of its measured 39 us).
# The sequential path's block walks K products per thread; the decode path's walks, for each of its M rows,
# ceil(K / 16) products per lane and a 4-step tree (codegen/cuda_gemv.decode_serial_steps: 40 steps for
# K = 576, M = 1), priced at the same cost per step. Modelled, not measured: a decode step issues its own
# global loads where a sequential step reads shared memory (loads amortized over 32 steps), so a step may
# cost more than 53 ns; the cost model's max(roofline, class fit) keeps it at least bytes / bandwidth.
#
# tiled_stored (the tiled kernel reading a stored B's parts, codegen/cuda_gemm.py `stored`) from tiled: the same
# body (grid, K loop) on fewer bytes plus the dequantize arithmetic per B element; tiled_stored_decode, its decode
# path, from tiled_decode likewise.
#
# tensor_core (the WMMA kernel, codegen/cuda_gemm_tc.py: fused epilogues and scaled variants) from cublas: MODELLED,
# NOT MEASURED. Both are tensor-core Gemms over the same bytes and flops whose blocks walk K in MMA steps, so the
# cuBLAS fit (a fixed cost plus a cost per wave and K step, priced on the same serial extent K) is the nearest
# measured class; the tiled fit (53 ns per K step of one FP32 FMA per thread) is not, as each WMMA step retires
# 16 x 16 x 16 products per warp. Expect it optimistic: this kernel stages through shared memory without
# cp.async pipelining and has a 32 x 64 block tile, where cuBLAS picks a tuned kernel per shape; a device run
# (bench.gpu_calibration) replaces the derivation with the kernel's own fit. tensor_core_stored (the same kernel
# staging B from a weight's stored parts) from cublas likewise: the same K loop on fewer bytes, the dequantize
# arithmetic done once per staged B element (shared by the block's 32 rows).
#
# cublasLt_bias (cublasLtMatmul with CUBLASLT_EPILOGUE_BIAS: FP32-output `+ bias along N` epilogues,
# codegen/cuda_gemm_bias.py) from cublas: MODELLED, NOT MEASURED. The same library Gemm (cuBLASLt is the engine
# under cublasGemmStridedBatchedEx) in the same math, plus an N-vector read and one add per output element
# in its epilogue (charged as bytes and flops by the kernel's work). A device run replaces it with its own fit.
DERIVED_CLASSES = {"tiled_decode": "tiled", "tiled_stored": "tiled", "tiled_stored_decode": "tiled_decode",
                   "tensor_core": "cublas", "tensor_core_stored": "cublas", "cublasLt_bias": "cublas"}


@dataclass(frozen=True)
class MeasuredKernels:
    """A device's measured kernel classes and where they came from."""

    device: str
    source: str
    fits: tuple[KernelClassFit, ...]

    def get(self, implementation: str) -> KernelClassFit | None:
        """The measured fit of `implementation`, else, for a class of DERIVED_CLASSES, the fit it is derived
        from (marked `derived_from`), else None."""
        for fit in self.fits:
            if fit.implementation == implementation:
                return fit
        base = self.get(DERIVED_CLASSES[implementation]) if implementation in DERIVED_CLASSES else None
        if base is None:
            return None
        return dataclasses.replace(base, implementation=implementation, samples=0, derived_from=base.implementation)

    def to_json(self) -> str:
        return json.dumps({"device": self.device, "source": self.source, "features": list(FEATURES),
                           "fits": [{"implementation": f.implementation, "coefficients": list(f.coefficients),
                                     "samples": f.samples, "median_relative_error": f.median_relative_error,
                                     "p90_relative_error": f.p90_relative_error} for f in self.fits]}, indent=1)

    @staticmethod
    def from_json(text: str) -> "MeasuredKernels":
        data = json.loads(text)
        if tuple(data["features"]) != FEATURES:
            raise ValueError(f"measured kernel classes use features {data['features']}, this code {list(FEATURES)}")
        return MeasuredKernels(data["device"], data["source"],
                               tuple(KernelClassFit(f["implementation"], tuple(f["coefficients"]), f["samples"],
                                                    f["median_relative_error"], f["p90_relative_error"])
                                     for f in data["fits"]))


def fit_class(implementation: str, rows: np.ndarray, seconds: np.ndarray) -> KernelClassFit:
    """Non-negative least squares on relative error: every kernel counts alike, tiny or large.
    `rows`: one feature vector per measured kernel; `seconds`: its measured body time (> 0)."""
    from scipy.optimize import nnls
    if len(rows) == 0 or np.any(seconds <= 0):
        raise ValueError(f"{implementation}: need measured times > 0 to fit")
    scale = rows.max(axis=0)
    scale[scale == 0] = 1.0
    weighted = rows / scale / seconds[:, None]
    solution, _ = nnls(weighted, np.ones(len(rows)))
    coefficients = solution / scale
    errors = np.abs(rows @ coefficients / seconds - 1.0)
    return KernelClassFit(implementation, tuple(float(c) for c in coefficients), len(rows),
                          float(np.median(errors)), float(np.quantile(errors, 0.9)))


def load_measured(name: str) -> MeasuredKernels | None:
    """The package's measured classes `runtime/data/<name>.json`, or None when that file is absent."""
    try:
        text = resources.files(__package__).joinpath("data", f"{name}.json").read_text()
    except FileNotFoundError:
        return None
    return MeasuredKernels.from_json(text)
