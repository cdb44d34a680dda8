"""The tensor-core Gemm (issue 35, item 1): WMMA (`nvcuda::wmma`) for the variants whose emulated
accumulation it reproduces, with the tiled kernel's loads and epilogue (codegen/cuda_gemm.py) around it.

Rounding points, in order (runtime/numerics.py defines each variant; nothing here adds a rounding):
1. Operands are loaded and quantized by exactly the tiled kernel's expressions (`GemmWriter.quantized`: the
   unscaled format rounding, or x / s rounded to the 8-bit format / int8, saturating) and staged in
   shared memory as the WMMA element type: BF16 as __nv_bfloat16, F16 as __half, E4M3 and E5M2 as __half
   (every E4M3 / E5M2 value is an F16 value: 2-3 mantissa bits, exponents inside F16's, so staging is
   exact), INT8 as signed char, TF32 as float through wmma::__float_to_tf32 (cvt.rna): the operand is
   already TF32 (the project's one TF32 rounding, nearest even, cuda_body.round_expr), so that
   conversion is the identity and the tensor core sees the emulator's operand bit for bit. A ragged K
   tail and rows / columns past M / N stage as 0: a zero product adds nothing.
2. The MMA: products of <= 11-bit significands are exact in FP32 and summed into the FP32 accumulator in
   an order the hardware picks, which the emulation leaves open too (its gamma_K bound holds for every
   order; the bits match wherever every order gives the same sum); INT8 products into the INT32
   accumulator exactly (wmma without satfinite wraps, as the tiled kernel's unsigned int does).
3. The epilogue, from the accumulator: the tiled kernel's own term (`GemmWriter.result_term`: int32 ->
   float, one fl32(acc * fl32(sa * sb)) for per-tensor / per-channel scales), then the GEMM_EPILOGUE body
   (codegen/cuda_gemm_epilogue.py) and the store, as the tiled kernel writes them.

What stays on the tiled kernel, each refused in one line (`refusal`): FP32 operands (no tensor-core type
holds them), narrow accumulators (an MMA-group rounding the hardware's FP32 accumulator does not make),
promotion and scales varying along K (applied per chunk or per product: inside the K loop), batch-invariant
programs (one fixed summation order for every M: codegen/invariance.py), more than two accumulator views
(shared memory). A B held in a storage format is staged from its stored parts by the tiled kernel's own
load (the format's dequantize, then the variant's quantization: cuda_gemm.py `stored`), so it runs here too.

Decode (M <= SKINNY_M): where the tiled kernel has its decode path (codegen/cuda_gemv.py) it stays there
(codegen/cuda_dispatch.py): a 16-row MMA tile at M <= 4 leaves at least 12 of its 16 rows idle and each
warp still walks all of K, whereas the decode path splits K over 16 lanes and reads each weight row in
contiguous runs. Variants without a decode path (INT8's integer accumulator) run here at every M.

Shape: 8 warps (256 threads) per block, a 32 x 64 output tile (2 x 4 warps, one 16 x 16 accumulator
fragment each; a GLU one per column offset), K staged two MMA steps at a time, A row-major and B
column-major (K contiguous: a (N, K) weight is read in contiguous runs), grid-stride loops as the tiled kernel.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from ..dtypes.formats import BF16, F8E4M3, F8E5M2, F16, F32, INT8, TF32, Format
from ..dtypes.variants import GemmPrecision
from .llir import Kernel, KernelKind, acc_views

WARPS_M, WARPS_N = 2, 4
FRAG = 16                           # a warp's output tile: 16 x 16 (m16n16k16, m16n16k8 for TF32)
BLOCK_M, BLOCK_N = WARPS_M * FRAG, WARPS_N * FRAG
THREADS = 32 * WARPS_M * WARPS_N
K_STEPS = 2                         # MMA K steps per shared-memory stage
MAX_VIEWS = 2                       # GLU gate|up: accumulators (and their shared tiles) per block
ACC_LD = BLOCK_N + 4                # the accumulator tile's row stride (elements; 16-byte multiple)


@dataclass(frozen=True)
class WmmaType:
    """How one operand format enters WMMA: the staged (shared-memory) type, the fragment's element type,
    the MMA K depth, the conversion of the quantized float `{q}` to the staged type, the staged row stride
    (K plus padding; a multiple of 16 bytes as load_matrix_sync needs) and the accumulator type."""

    staged: str
    fragment: str
    k: int
    convert: str
    ld: int
    accumulator: str = "float"


_HALF = WmmaType("__half", "__half", 16, "__float2half_rn({q})", 24)
WMMA_TYPES: dict[Format, WmmaType] = {
    BF16: WmmaType("__nv_bfloat16", "__nv_bfloat16", 16, "__float2bfloat16_rn({q})", 24),
    F16: _HALF, F8E4M3: _HALF, F8E5M2: _HALF,  # E4M3 / E5M2 values are F16 values: exact staging
    TF32: WmmaType("float", "wmma::precision::tf32", 8, "wmma::__float_to_tf32({q})", 12),
    INT8: WmmaType("signed char", "signed char", 16, "static_cast<signed char>({q})", 32, "int"),
}


def refusal(variant: GemmPrecision, kernel: Kernel, invariant: bool) -> str | None:
    """Why `kernel` (in `variant`) stays on the tiled kernel, in one line; None: it runs on tensor cores."""
    if invariant:
        return "batch-invariant program: the tiled kernel's one summation order for every M"
    if variant.a_format is F32 or variant.b_format is F32:
        return "FP32 operands: no tensor-core type holds them exactly"
    if variant.a_format is not variant.b_format or variant.a_format not in WMMA_TYPES:
        return f"operands {variant.a_format.name} x {variant.b_format.name}: no WMMA type pair"
    if variant.grouped:
        return "narrow accumulator: its per-MMA-group rounding is not the hardware's FP32 accumulation"
    if variant.promote_every is not None:
        return "promotion every K chunk: the chunks are summed in the K loop"
    if variant.scale_k_block is not None:
        return "scales vary along K: applied inside the K loop"
    if kernel.kind is KernelKind.GEMM_EPILOGUE and len(acc_views(kernel.body)) > MAX_VIEWS:
        return f"more than {MAX_VIEWS} accumulator views: their tiles exceed shared memory"
    return None


def _suffixed(lines: list[str], sfx: str) -> list[str]:
    """One GLU accumulator's copy of per-accumulator lines (its acc / total / ns, as cuda_gemm._suffixed)."""
    return [re.sub(r"\b(acc|total|ns)\b", lambda m: m.group(1) + sfx, line) for line in lines]


def tensor_core_kernel(entry: str, params: list[str], variant: GemmPrecision, dims: str, a_load: str,
                       b_load: str, offsets: list[int], term: str, finish: list[str]) -> str:
    """The C source of the tensor-core entry `entry`.

    `dims`: the statement declaring M, N, NO (output columns), K, NB; `a_load` / `b_load`: the quantized
    float operand at (bz, lm, lk) / (bz, lk, ln), 0 outside the operand (the tiled kernel's loads);
    `offsets`: the column offset of each accumulator (GLU: one per view, else [0]); `term`: the tiled
    kernel's contribution of the accumulator `acc` (of column `ns`) to `total`; `finish`: the epilogue body
    and the store, reading total<i> (GLU) or total, and m, n, bz."""
    t = WMMA_TYPES[variant.a_format]
    glu = len(offsets) > 1
    sfx = [str(i) for i in range(len(offsets))] if glu else [""]
    bk = K_STEPS * t.k
    acc_c = "unsigned int" if t.accumulator == "int" else "float"
    load_a = t.convert.format(q=a_load)
    load_b = t.convert.format(q=b_load)
    shared = (f"    __shared__ __align__(32) {t.staged} ta[{K_STEPS * BLOCK_M * t.ld}];\n"
              + "".join(f"    __shared__ __align__(32) {t.staged} tb{x}[{K_STEPS * BLOCK_N * t.ld}];\n"
                        f"    __shared__ __align__(32) {t.accumulator} tc{x}[{BLOCK_M * ACC_LD}];\n" for x in sfx))
    frags = "".join(f"        wmma::fragment<wmma::accumulator, {FRAG}, {FRAG}, {t.k}, {t.accumulator}> fc{x};\n"
                    f"        wmma::fill_fragment(fc{x}, 0);\n" for x in sfx)
    b_stage = "".join(f"            for (int e = tid; e < {BLOCK_N * bk}; e += {THREADS}) {{\n"
                      f"                const long long ln = n0 + {off}LL + e / {bk}, lk = k0 + e % {bk};\n"
                      f"                tb{x}[((e % {bk}) / {t.k} * {BLOCK_N} + e / {bk}) * {t.ld} + e % {t.k}] = {load_b};\n"
                      "            }\n" for x, off in zip(sfx, offsets))
    mmas = "".join(f"                wmma::fragment<wmma::matrix_b, {FRAG}, {FRAG}, {t.k}, {t.fragment}, wmma::col_major> fb{x};\n"
                   f"                wmma::load_matrix_sync(fb{x}, tb{x} + (s * {BLOCK_N} + wn * {FRAG}) * {t.ld}, {t.ld});\n"
                   f"                wmma::mma_sync(fc{x}, fa, fb{x}, fc{x});\n" for x in sfx)
    stores = "".join(f"        wmma::store_matrix_sync(tc{x} + wm * {FRAG * ACC_LD} + wn * {FRAG}, fc{x}, {ACC_LD}, "
                     "wmma::mem_row_major);\n" for x in sfx)
    totals = "".join(f"                const long long ns{x} = n + {off}LL;\n"
                     f"                const {acc_c} acc{x} = static_cast<{acc_c}>(tc{x}[(e / {BLOCK_N}) * {ACC_LD} + e % {BLOCK_N}]);\n"
                     f"                float total{x} = -0.0f;\n"
                     f"                if (K > 0) total{x} = __fadd_rn(total{x}, {_suffixed([term], x)[0]});\n"
                     for x, off in zip(sfx, offsets))
    body = "".join(f"                {line}\n" for line in finish)
    return (f'extern "C" __global__ void {entry}({", ".join(params)}) {{\n' + shared
            + f"    {dims}\n"
            f"    const int tid = threadIdx.x, warp = tid / 32, wm = warp / {WARPS_N}, wn = warp % {WARPS_N};\n"
            "    for (long long bz = blockIdx.z; bz < NB; bz += gridDim.z)\n"
            f"    for (long long m0 = blockIdx.x * {BLOCK_M}LL; m0 < M; m0 += gridDim.x * {BLOCK_M}LL)\n"
            f"    for (long long n0 = blockIdx.y * {BLOCK_N}LL; n0 < NO; n0 += gridDim.y * {BLOCK_N}LL) {{\n"
            + frags +
            f"        for (long long k0 = 0; k0 < K; k0 += {bk}) {{\n"
            f"            for (int e = tid; e < {BLOCK_M * bk}; e += {THREADS}) {{\n"
            f"                const long long lm = m0 + e / {bk}, lk = k0 + e % {bk};\n"
            f"                ta[((e % {bk}) / {t.k} * {BLOCK_M} + e / {bk}) * {t.ld} + e % {t.k}] = {load_a};\n"
            "            }\n" + b_stage +
            "            __syncthreads();\n"
            f"            for (int s = 0; s < {K_STEPS}; ++s) {{\n"
            f"                wmma::fragment<wmma::matrix_a, {FRAG}, {FRAG}, {t.k}, {t.fragment}, wmma::row_major> fa;\n"
            f"                wmma::load_matrix_sync(fa, ta + (s * {BLOCK_M} + wm * {FRAG}) * {t.ld}, {t.ld});\n"
            + mmas + "            }\n            __syncthreads();\n        }\n" + stores +
            "        __syncthreads();\n"
            f"        for (int e = tid; e < {BLOCK_M * BLOCK_N}; e += {THREADS}) {{\n"
            f"            const long long m = m0 + e / {BLOCK_N}, n = n0 + e % {BLOCK_N}, ms = m;\n"
            "            if (m < M && n < NO) {\n" + totals + body + "            }\n        }\n"
            "        __syncthreads();\n    }\n}\n")


WMMA_HEADER = '#include "ln_wmma.cuh"\n'
