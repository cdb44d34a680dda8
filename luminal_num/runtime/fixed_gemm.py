"""The batch-invariant FP32 Gemm (issue 37): one summation order per output, whatever M, the row's place
in A, the CPU's BLAS kernel or the thread count.

Why not BLAS: an sgemm's order of additions (its K blocking, FMA or not, the split among threads) is the
library's choice per shape and per CPU, so a row's bits change with the batch it is in (measured on
SmolLM2: 0 of 32 held-out positions bit-identical alone vs in a batch of 8).

The order, per output (m, n): K in groups of FIXED_K_GROUP products from k = 0; each group's sum formed
in FP64 by fused multiply-adds in k order from +0 (the products of FP32 values are exact in FP64), then
acc = RN_f32(fl64(acc + group)), the first group entering alone; the output is acc. It is an FP32
accumulation (one FP32 rounding per group, the group sums' FP64 errors below 2^-53 per term), so the
FP32 Gemm's static bound gamma_K(2^-24) sum|a||b| covers it: its error is at most
gamma_{ceil(K/32)}(2^-24) + gamma_32(2^-53) (1 + ...) times sum|a||b|.

It is runtime/jit_gemm.py's narrow-accumulator kernel with acc = F32 (register tiles of MR rows: rows
past M are zero padding, no row's sum reads another row), so the bits are fixed by its definition; there
is no numpy fallback with the same order (an FP64 BLAS group sum has its own), so without numba (or
with LUMINAL_NUM_JIT=0) a batch-invariant plan is refused in one line.
"""
from __future__ import annotations

import math

import numpy as np

from ..dtypes.formats import F32
from .gemm_operand import Operand
from .tile_threads import for_each_tile

FIXED_K_GROUP = 32  # products per FP64 group sum (an MMA k-tile's worth: one FP32 rounding per 32 products)


class FixedOrderUnavailable(RuntimeError):
    """The fixed-order kernel cannot run here (no numba, or LUMINAL_NUM_JIT=0)."""


def _no_f16(*_args) -> bool:
    raise AssertionError("the fixed-order Gemm accumulates in FP32, never F16")


def available() -> bool:
    from . import jit_gemm  # numba's import (~0.5 s) is paid only where a fixed-order Gemm runs
    return jit_gemm.kernel() is not None


def fixed_matmul(a: np.ndarray | Operand, b: np.ndarray | Operand) -> np.ndarray:
    """a (..., M, K) @ b (..., K, N) as float32 in the fixed order (module doc). An Operand (its values
    float32, no scales) keeps what is derived from it (B's packed FP64 panels) for the next call."""
    from . import jit_gemm
    qa = a if isinstance(a, Operand) else Operand(np.asarray(a, dtype=np.float32), None, None)
    qb = b if isinstance(b, Operand) else Operand(np.asarray(b, dtype=np.float32), None, None)
    if qa.scales is not None or qb.scales is not None:
        raise ValueError("fixed_matmul takes unscaled operands (scales are applied after the sum)")
    va, vb = qa.values, qb.values  # the kernel reads C-contiguous float32 (one compiled layout)
    if va.dtype != np.float32 or not va.flags.c_contiguous:
        qa = Operand(np.ascontiguousarray(va, dtype=np.float32), None, None)
    if vb.dtype != np.float32 or not vb.flags.c_contiguous:
        qb = Operand(np.ascontiguousarray(vb, dtype=np.float32), None, None)
    k = qa.values.shape[-1]
    if qa.values.ndim < 2 or qb.values.ndim < 2 or qb.values.shape[-2] != k:
        raise ValueError(f"cannot multiply shapes {qa.values.shape} and {qb.values.shape}")
    lead = np.broadcast_shapes(qa.values.shape[:-2], qb.values.shape[:-2])
    m, n = qa.values.shape[-2], qb.values.shape[-1]
    if k == 0 or m == 0 or n == 0 or math.prod(lead) == 0:
        return np.zeros(lead + (m, n), np.float32)
    out = jit_gemm.grouped_gemm(qa, qb, F32, FIXED_K_GROUP, k, k, False, f16_in_range=_no_f16,
                                for_each_tile=for_each_tile)
    if out is None:
        raise FixedOrderUnavailable("a batch-invariant plan needs the fixed-order Gemm kernel, which needs numba "
                                    "(installed, and LUMINAL_NUM_JIT not 0)")
    return out
