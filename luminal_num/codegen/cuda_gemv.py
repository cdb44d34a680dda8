"""The decode path of the tiled Gemm: a few rows of A split K over the block's threads (issue 35).

Why: a decode step multiplies one token per sequence (M = 1 .. a few) by each weight. The 16 x 16 tile
kernel then keeps one of its 16 thread rows busy, and each busy thread walks all of K alone: an H200
measured 40-80 us for a K = 576/1536 GEMV that moves 0.5-3.5 MB (reports/bench/gpu_kernels.csv). Here,
while M <= SKINNY_M, the same launch (16 x 16 threads over 16-column blocks) gives each of the block's
16 columns to one thread row, and that row's 16 threads stride over K (consecutive threads read
consecutive K elements: a (N, K) row-major weight is read in contiguous runs), then add their partial
sums in a fixed tree (8, 4, 2, 1 apart), the same for every run: another FP32 summation order than the
sequential kernel, inside the same gamma_K envelope, and batch-invariant per row (no dependence on M).

Only variants whose K sum is one FP32 accumulation qualify: narrow (MMA-group) accumulators, integer
accumulators, promotion or K-varying scales define their order and keep the sequential kernel.
"""
from __future__ import annotations

from ..dtypes.formats import INT32
from ..dtypes.variants import GemmPrecision

SKINNY_M = 4  # at most this many rows of A take the split-K path
LANES = 16    # threads per column splitting K (the tile's thread-row width)


TREE_STEPS = LANES.bit_length() - 1  # the partial sums' tree: 8, 4, 2, 1 apart


def skinny_eligible(variant: GemmPrecision) -> bool:
    """One FP32 accumulation over all of K, scales (if any) applied once after it."""
    return (not variant.grouped and variant.acc_format is not INT32 and not variant.scales_per_product
            and variant.promote_every is None and variant.scale_k_block is None)


def has_decode_path(variant: GemmPrecision, batch_invariant: bool) -> bool:
    """Whether the tiled kernel rendered for this variant carries the decode path (taken at run time while
    M <= SKINNY_M): the renderer (codegen/cuda_gemm.py) and the dispatch (codegen/cuda_dispatch.py) both
    ask here. A batch-invariant program keeps the sequential order for every M."""
    return not batch_invariant and skinny_eligible(variant)


def decode_serial_steps(m: int, k: int) -> int:
    """The steps one block of the decode path runs one after another: its M rows in turn (the grid has one
    block along M), each ceil(K / LANES) strided products per thread, then the TREE_STEPS of the tree.
    The sequential tiled kernel's block instead walks all K products per thread (its serial extent K)."""
    return m * (-(-k // LANES) + TREE_STEPS)


def skinny_block(a_load: str, b_loads: list[str], n_bound: str, suffixes: list[str], column_offsets: list[int],
                 term: str, finish: list[str]) -> str:
    """C source of the split-K path, run by the whole block when M <= SKINNY_M.

    `a_load` / `b_loads[i]`: the quantized operand at (bz, ms, kk) / (bz, kk, ns<suffix_i>); `term`: the
    accumulator's contribution to `total` with `{acc}` for the reduced sum (scaled or not); `finish`: the
    statements that apply the epilogue (reading total<suffix> and m, n, bz) and store the output."""
    columns = "".join(f"            const long long ns{x} = min(n + {off}LL, N - 1);\n            float acc{x} = 0.0f;\n"
                      for x, off in zip(suffixes, column_offsets))
    shared = "".join(f"        __shared__ float red{x}[{LANES}][{LANES + 1}];\n" for x in suffixes)
    products = "".join(f"                {{ const float qb{x} = {load}; acc{x} = __fmaf_rn(qa, qb{x}, acc{x}); }}\n"
                       for x, load in zip(suffixes, b_loads))
    stash = "".join(f"            red{x}[ty][tx] = acc{x};\n" for x in suffixes)
    tree = ""
    for step in (8, 4, 2, 1):
        adds = "".join(f"red{x}[ty][tx] = __fadd_rn(red{x}[ty][tx], red{x}[ty][tx + {step}]); " for x in suffixes)
        tree += f"            if (tx < {step}) {{ {adds}}}\n            __syncthreads();\n"
    totals = "".join(f"                float total{x} = -0.0f;\n                total{x} = __fadd_rn(total{x}, "
                     f"{term.format(acc=f'red{x}[ty][0]', x=x)});\n" for x in suffixes)
    body = "".join(f"                {line}\n" for line in finish)
    return (f"    if (M <= {SKINNY_M}) {{  // decode rows: K split over each column's {LANES} threads, a fixed tree\n"
            + shared +
            "        for (long long bz = blockIdx.z; bz < NB; bz += gridDim.z)\n"
            f"        for (long long n0 = blockIdx.y * {LANES}LL; n0 < {n_bound}; n0 += gridDim.y * {LANES}LL)\n"
            "        for (long long m = blockIdx.x; m < M; m += gridDim.x) {\n"
            "            const long long n = n0 + ty, ms = m;\n" + columns +
            f"            for (long long kk = tx; kk < K; kk += {LANES}) {{\n"
            f"                const float qa = {a_load};\n" + products + "            }\n" + stash
            + "            __syncthreads();\n" + tree +
            f"            if (tx == 0 && n < {n_bound}) {{\n" + totals + body + "            }\n"
            "            __syncthreads();\n        }\n    }\n")
