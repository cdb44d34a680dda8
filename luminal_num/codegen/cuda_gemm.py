"""Gemm on CUDA: a tiled kernel for every variant, and (cuda_gemm_call.py) the cuBLAS / cuBLASLt call.

`render_gemm` writes the fallback for every variant: per-block scale kernels (luminal_num.quant.scales'
rule) and a 16x16-tile kernel that quantizes operands as it loads them and accumulates exactly as
runtime/numerics.py defines each GemmPrecision (chunks, MMA groups, narrow accumulators, promotion,
per-product scales), and attaches the GemmCall where cuBLAS(Lt) can compute the kernel (an epilogue: only
cuBLASLt's bias epilogue, codegen/cuda_gemm_bias.py). Per-tensor FP8
goes through cuBLASLt: the same scale kernels, then quantize kernels writing both operands K-contiguous.
Beside the tiled entry, where codegen/cuda_gemm_tc.refusal gives no reason, the same source carries the
tensor-core entry (<name>_tc, KernelSource.tensor_core's launches): the same arguments, loads (`_load`),
accumulator term (`_Writer.result_term`), epilogue and store around a WMMA K loop; the runtime launches
whichever codegen/cuda_dispatch picks at the bound sizes.

A B held in a storage format (`stored`: cuda_weight_only.stored_operand) is read as its stored parts
(Arg role "part": packed codes, scales), each element widened in registers by the format's own
dequantize (cuda_weight_only.dequant_expr, the FP32 value the CPU backend's widened buffer holds, bit
for bit), then treated exactly as the widened B would be: every form (epilogue, GLU, scaled, a
pre-quantized A) and every rounding point is unchanged, only the bytes read are the stored ones. Such a
Gemm has no library call (cuBLAS reads a dense B).

An LLIR QUANTIZE kernel (`render_quantize`) is those scale and quantize kernels for A alone. A Gemm
reading its buffer (`prequantized[0]`) loads q as it is with the QUANTIZE kernel's scales (Arg role
"scales"); for cuBLASLt that buffer is A (batch x M x K): its prologue only quantizes B.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

from ..dtypes.formats import F32, INT32, Format, Kind
from ..dtypes.variants import WHOLE, Granularity
from ..hlir.symbolic import Dim, prod
from . import ctypes_map
from .cuda_body import (IndexExpr, SymbolTable, body_symbols, c_add, c_div, c_index, c_mul, dims_symbols, dot, load_float,
                        round_expr, row_major_strides, store, unravel, view_index, view_symbols)
from .cuda_gemm_bias import bias_call
from .cuda_gemm_call import CUDA_DATA_TYPES, cublas_call, geometry, lt_call, lt_capable
from .cuda_source import (COMPUTE_TYPES, CUBLAS_ENUMS, ELEMENTWISE_THREADS, ENTRY, REDUCE_HELPERS, SCALES_SCRATCH, Arg,
                          GemmCall, KernelSource, Launch, Scratch, entry_name, indent, name_launches, per, source_header)
from .cuda_gemm_tc import BLOCK_M as TC_BLOCK_M, BLOCK_N as TC_BLOCK_N, THREADS as TC_THREADS, WMMA_HEADER
from .cuda_gemm_tc import refusal, tensor_core_kernel
from .cuda_gemv import SKINNY_M, has_decode_path, skinny_block
from .gemm_scales import own_scales, scale_blocks, static_scales, variant_of
from .cuda_weight_only import StoredOperand, part_params, stored_formats
from .llir import Kernel, quantized_a_view

TILE = 16      # output rows and columns per block (16 x 16 threads)
K_TILE = 32    # K per shared-memory stage: a multiple of every mma_k
SCALE_THREADS = 256

__all__ = ["COMPUTE_TYPES", "CUBLAS_ENUMS", "CUDA_DATA_TYPES", "GemmCall", "render_gemm", "render_quantize"]


# -- the fallback kernels ------------------------------------------------------------------------------------

SCALE_HELPER = r"""
// E8M0 scale: 2^ceil(log2(ratio)), exponent clamped to [-127, 127] (luminal_num.quant.scales).
static __device__ __forceinline__ float ln_pow2_scale(double ratio) {
    int e;
    const double mantissa = frexp(ratio, &e);
    if (mantissa == 0.5) e -= 1;
    return ldexpf(1.0f, max(-127, min(127, e)));
}
"""


class _Writer:
    """Index math of one Gemm (or QUANTIZE) kernel: operands as (batch, rows, cols) over the Mul's full
    shape. `prequantized[slot]`: that input is a QUANTIZE kernel's q, to be read as it is; `stored`: B's
    storage format when B is read as its stored parts (cuda_weight_only.stored_operand)."""

    def __init__(self, kernel: Kernel, formats: tuple[Format, ...], prequantized: tuple[bool, ...] = (False, False),
                 invariant: bool = False, stored: StoredOperand | None = None):
        self.k, self.formats, self.variant = kernel, formats, variant_of(kernel)
        self.prequantized = prequantized
        self.stored = stored
        self.invariant = invariant  # a batch-invariant program: one summation order for every M
        lay = kernel.layout
        names = dims_symbols(lay.full_shape).union(*(view_symbols(inp.view) for inp in kernel.inputs),
                                                   body_symbols(kernel.body))
        self.table = SymbolTable.of(names)
        self.lay = lay
        self.specs = (self.variant.a_scale, self.variant.b_scale)
        self.op_formats = (self.variant.a_format, self.variant.b_format)

    def dim(self, d: Dim) -> IndexExpr:
        return self.table.dim(d)

    def extents(self, slot: int) -> tuple[Dim, Dim, Dim]:
        lay = self.lay
        return (lay.batch, lay.m, lay.k) if slot == 0 else (lay.batch, lay.k, lay.n)

    def full_coords(self, b: IndexExpr, m: IndexExpr, n: IndexExpr, k: IndexExpr) -> list[IndexExpr]:
        lay, full = self.lay, self.lay.full_shape
        coords: list[IndexExpr] = [0] * len(full)
        for axes, linear in ((lay.batch_axes, b), (lay.m_axes, m), (lay.n_axes, n)):
            for axis, c in zip(axes, unravel(linear, [self.dim(full[a]) for a in axes])):
                coords[axis] = c
        coords[lay.k_axis] = k
        return coords

    def element(self, slot: int, b: IndexExpr, row: IndexExpr, col: IndexExpr) -> str:
        """Operand `slot` at (batch, row, col) as float (a stored B: its element (col, row) of the (N, K)
        weight, dequantized from the stored parts)."""
        if slot == 1 and self.stored is not None:
            return self.stored.element(int(self.lay.n), int(self.lay.k), f"({c_index(col)})", f"({c_index(row)})")
        coords = self.full_coords(b, row, 0, col) if slot == 0 else self.full_coords(b, 0, col, row)
        at = view_index(self.k.inputs[slot].view, coords, self.table)
        return load_float(self.formats[slot], f"in{slot}[{c_index(at.pos)}]")

    # -- scales: one per (batch, row block, col block); WHOLE extents and TENSOR collapse to one --------
    def scale_blocks(self, slot: int) -> tuple[tuple[Dim, int], ...]:
        return scale_blocks(self.k, slot)

    def scale_counts(self, slot: int) -> list[IndexExpr]:
        out: list[IndexExpr] = []
        for d, block in self.scale_blocks(slot):
            e = self.dim(d)
            out.append(-(-e // block) if isinstance(e, int) else (e if block == 1 else f"ln_ceil_div({e}, {block})"))
        return out

    def scale_index(self, slot: int, b: IndexExpr, row: IndexExpr, col: IndexExpr) -> IndexExpr:
        spec = self.specs[slot]
        _, rows_count, cols_count = self.scale_counts(slot)
        b_term = 0 if spec.granularity is Granularity.TENSOR else b
        r_term = 0 if spec.block[0] == WHOLE else c_div(row, spec.block[0])
        c_term = 0 if spec.block[1] == WHOLE else c_div(col, spec.block[1])
        return c_add(c_mul(c_add(c_mul(b_term, rows_count), r_term), cols_count), c_term)

    def scale_value(self, slot: int, b: IndexExpr, row: IndexExpr, col: IndexExpr) -> str:
        if self.specs[slot] is None:
            return "1.0f"
        return f"scale{slot}[{c_index(self.scale_index(slot, b, row, col))}]"

    def quantized(self, slot: int, x: str, scale: str) -> str:
        """What the MMA sees of one operand element: x (or x / s) rounded to the operand format; a
        pre-quantized operand's x is that already."""
        fmt, spec = self.op_formats[slot], self.specs[slot]
        value = x if spec is None else f"__fdiv_rn({x}, {scale})"
        if self.prequantized[slot]:
            q = x
        elif fmt.kind is Kind.INT:
            low, high = -fmt.max_finite - 1, fmt.max_finite
            q = f"fminf(fmaxf(rintf({value}), {low!r}f), {high!r}f)"
        else:
            q = round_expr(fmt, value) if fmt is not F32 else value
        if spec is not None and self.variant.scales_per_product and not self.variant.grouped:
            q = f"__fmul_rn({q}, {scale})"  # power-of-two scales: exact on the operand
        return q

    def result_term(self, k: IndexExpr) -> str:
        """A chunk's accumulator `acc` as it enters `total` (the tiled kernel and the tensor-core one): int32
        to float, times fl32(sa * sb) where the scales are not applied per product (K index `k`)."""
        part = "static_cast<float>(static_cast<int>(acc))" if self.variant.acc_format is INT32 else "acc"
        if not any(self.specs) or self.variant.scales_per_product:
            return part
        return f"__fmul_rn({part}, __fmul_rn({self.scale_value(0, 'bz', 'ms', k)}, {self.scale_value(1, 'bz', k, 'ns')}))"

    def dyn_param(self) -> list[str]:
        return ["const long long* __restrict__ dyn_dims"] if self.table.symbols else []

    def in_param(self, slot: int) -> str:
        if slot == 1 and self.stored is not None:
            return ", ".join(part_params(self.stored.fmt))
        return f"const {ctypes_map.cuda_type(self.formats[slot])}* __restrict__ in{slot}"

    def operand_args(self, slot: int) -> tuple[Arg, ...]:
        """The pointer arguments in_param(slot) declares."""
        if slot == 1 and self.stored is not None:
            return tuple(Arg("part", i) for i in range(len(self.stored.fmt.parts)))
        return (Arg("in", slot),)


def _scale_kernel(w: _Writer, slot: int) -> str:
    spec, fmt = w.specs[slot], w.op_formats[slot]
    nb, rows, cols = (c_index(w.dim(d)) for d in w.extents(slot))
    counts = [c_index(c) for c in w.scale_counts(slot)]
    spans = [nb if spec.granularity is Granularity.TENSOR else "1",
             rows if spec.block[0] == WHOLE else str(spec.block[0]),
             cols if spec.block[1] == WHOLE else str(spec.block[1])]
    ratio = (f"static_cast<double>(amax) * {ctypes_map.c_float_literal(spec.margin, 'double')} / "
             f"{ctypes_map.c_float_literal(fmt.max_finite, 'double')}")
    scale = f"ln_pow2_scale({ratio})" if spec.scale_format.kind is Kind.SCALE else \
        f"static_cast<float>(fmax({ratio}, {ctypes_map.c_float_literal(F32.min_normal, 'double')}))"
    params = ", ".join(["float* __restrict__ scale", w.in_param(slot)] + w.dyn_param())
    x = w.element(slot, "b", "row", "col")
    return (f'extern "C" __global__ void {ENTRY}_scale{slot}({params}) {{\n'
            f"    const long long NB = {nb}, R = {rows}, C = {cols};\n"
            f"    const long long SB = {counts[0]}, SR = {counts[1]}, SC = {counts[2]};\n"
            f"    const long long BB = {spans[0]}, BR = {spans[1]}, BC = {spans[2]};\n"
            "    for (long long s = blockIdx.x; s < SB * SR * SC; s += gridDim.x) {\n"
            "        const long long sb = s / (SR * SC), sr = (s / SC) % SR, sc = s % SC;\n"
            "        const long long nb = min(BB, NB - sb * BB), nr = min(BR, R - sr * BR), nc = min(BC, C - sc * BC);\n"
            "        float amax = 0.0f;\n"
            "        for (long long e = threadIdx.x; e < nb * nr * nc; e += blockDim.x) {\n"
            "            const long long b = sb * BB + e / (nr * nc), row = sr * BR + (e / nc) % nr, col = sc * BC + e % nc;\n"
            f"            const float x = {x};\n"
            "            amax = LnMax::apply(amax, isfinite(x) ? fabsf(x) : 0.0f);\n        }\n"
            "        amax = ln_block_reduce<LnMax>(amax, 0.0f);\n"
            f"        if (threadIdx.x == 0) scale[s] = (amax > 0.0f) ? {scale} : 1.0f;\n    }}\n}}\n")


def _quant_kernel(w: _Writer, slot: int, entry: str | None = None) -> str:
    """An 8-bit operand written K-contiguous: A as (batch, M, K), B as (batch, N, K); x / s rounded to
    nearest even, saturating (luminal_num.quant)."""
    fmt = w.op_formats[slot]
    nb, rows, cols = (c_index(w.dim(d)) for d in w.extents(slot))
    outer, k = ("M", "K") if slot == 0 else ("N", "K")
    at = ("b", "o", "k") if slot == 0 else ("b", "k", "o")
    q = ctypes_map.from_float_expr(fmt, f"__fdiv_rn({w.element(slot, *at)}, {w.scale_value(slot, *at)})",
                                   saturate=True)
    params = ", ".join([f"{ctypes_map.cuda_type(fmt)}* __restrict__ q", w.in_param(slot),
                        f"const float* __restrict__ scale{slot}"] + w.dyn_param())
    sizes = (rows, cols) if slot == 0 else (cols, rows)
    return (f'extern "C" __global__ void {entry or f"{ENTRY}_quant{slot}"}({params}) {{\n'
            f"    const long long {outer} = {sizes[0]}, {k} = {sizes[1]};\n"
            f"    LN_GRID_STRIDE_LOOP(i, {nb} * {outer} * {k}) {{\n"
            f"        const long long b = i / ({outer} * {k}), o = (i / {k}) % {outer}, k = i % {k};\n"
            f"        q[i] = {q};\n    }}\n}}\n")


def _accumulate(w: _Writer) -> list[str]:
    """The per-product update (qa, qb at K index kk) of numerics.emulate_gemm's arithmetic."""
    v = w.variant
    scaled = any(w.specs)
    per_product = v.scales_per_product
    sab = f"__fmul_rn({w.scale_value(0, 'bz', 'ms', 'kk')}, {w.scale_value(1, 'bz', 'kk', 'ns')})"
    lines = []
    if v.grouped:
        acc_add = "__dadd_rn(static_cast<double>(acc), {x})"
        term = f"static_cast<double>(__fmul_rn(static_cast<float>(grp), {sab}))" if per_product and scaled else "grp"
        lines += ["grp = __dadd_rn(grp, __dmul_rn(static_cast<double>(qa), static_cast<double>(qb)));",
                  f"if ((kk + 1) % {v.mma_k} == 0 || kk + 1 == K) {{",
                  f"    acc = {round_expr(v.accumulator, acc_add.format(x=term), 'double', saturate=False)};",
                  "    grp = 0.0;", "}"]
    elif v.acc_format is INT32:  # two's complement wrap, as the hardware's int32 accumulator
        lines.append("acc += static_cast<unsigned int>(static_cast<int>(qa) * static_cast<int>(qb));")
    else:
        lines.append("acc = __fmaf_rn(qa, qb, acc);")
    chunk = None if per_product else (v.promote_every or v.scale_k_block)
    term = w.result_term("kk")
    end = "kk + 1 == K" if chunk is None else f"(kk + 1) % {chunk} == 0 || kk + 1 == K"
    lines += [f"if ({end}) {{", f"    total = __fadd_rn(total, {term});", "    acc = 0;", "}"]
    return lines


@dataclass(frozen=True)
class EpilogueCode:
    """What a Gemm epilogue adds to the tiled kernel: its own operands (input slots 2..), and, from the
    output coordinates and the symbol table, the statements and the float value stored in place of the
    accumulator `total` (codegen/cuda_gemm_epilogue.py). `col_offsets` (a GLU epilogue): the thread
    computes one accumulator `total<i>` per offset, Gemm column n + offset_i for output column n < `n_out`."""
    slots: tuple[int, ...]
    body: Callable[[list[IndexExpr], SymbolTable], tuple[list[str], str]]
    col_offsets: tuple[int, ...] = ()
    n_out: Dim | None = None


def _skinny(w: _Writer, suffixes: list[str], offsets: list[int], n_bound: str, finish: list[str]) -> str:
    """The decode path (codegen/cuda_gemv.py) of this kernel, or "" when its variant orders the K sum or the
    program is batch-invariant (its tree order for M <= SKINNY_M and the sequential one above would give a
    row other bits in a batch of 8 than alone: such a program keeps the sequential kernel for every M)."""
    if not has_decode_path(w.variant, w.invariant):
        return ""
    a_load = w.quantized(0, w.element(0, "bz", "ms", "kk"), w.scale_value(0, "bz", "ms", "kk"))
    b_loads = [w.quantized(1, w.element(1, "bz", "kk", f"ns{x}"), w.scale_value(1, "bz", "kk", f"ns{x}"))
               for x in suffixes]
    term = "{acc}"
    if any(w.specs):  # per-tensor / per-channel scales: once, on the whole sum, as the sequential kernel does
        term = f"__fmul_rn({{acc}}, __fmul_rn({w.scale_value(0, 'bz', 'ms', 0)}, {w.scale_value(1, 'bz', 0, 'ns{x}')}))"
    return skinny_block(a_load, b_loads, n_bound, suffixes, offsets, term, finish)


def _params(w: _Writer, epilogue: EpilogueCode | None) -> list[str]:
    """The Gemm entry's parameters (the tiled and the tensor-core entry take the same arguments)."""
    params = [f"{ctypes_map.cuda_type(w.k.dtype)}* __restrict__ out", w.in_param(0), w.in_param(1)]
    params += [w.in_param(s) for s in (epilogue.slots if epilogue else ())]
    return params + [f"const float* __restrict__ scale{s}" for s in (0, 1) if w.specs[s] is not None] + w.dyn_param()


def _load(w: _Writer, slot: int) -> str:
    """The tiled kernel's staged operand element: quantized at (bz, lm, lk) of A / (bz, lk, ln) of B, 0 outside."""
    row, col, bound = ("lm", "lk", "lm < M && lk < K") if slot == 0 else ("lk", "ln", "lk < K && ln < N")
    return f"({bound}) ? {w.quantized(slot, w.element(slot, 'bz', row, col), w.scale_value(slot, 'bz', row, col))} : 0.0f"


def _tensor_core_entry(w: _Writer, epilogue: EpilogueCode | None) -> str:
    """The tensor-core entry (codegen/cuda_gemm_tc.py) with this kernel's loads, term, epilogue and store."""
    k, lay = w.k, w.lay
    glu = epilogue is not None and bool(epilogue.col_offsets)
    if glu and tuple(lay.n_axes) != (max(i for i in range(len(lay.full_shape)) if i != lay.k_axis),):
        raise ValueError(f"kernel {k.id}: a GLU epilogue needs one N axis, the last of its output")
    full = w.full_coords("bz", "m", "n", 0)
    out_coords = [c for axis, c in enumerate(full) if axis != lay.k_axis]
    out_pos = dot(out_coords, row_major_strides([w.dim(d) for d in k.shape]))
    lines, value = epilogue.body(out_coords, w.table) if epilogue else ([], "total")
    n_out = epilogue.n_out if glu else lay.n
    dims = (f"const long long M = {c_index(w.dim(lay.m))}, N = {c_index(w.dim(lay.n))}, NO = {c_index(w.dim(n_out))}, "
            f"K = {c_index(w.dim(lay.k))}, NB = {c_index(w.dim(lay.batch))};")
    return tensor_core_kernel(f"{ENTRY}_tc", _params(w, epilogue), w.variant, dims, _load(w, 0), _load(w, 1),
                              list(epilogue.col_offsets) if glu else [0], w.result_term(0),
                              [*lines, f"out[{c_index(out_pos)}] = {store(k.dtype, value)};"])


def _tiled_only_above(skinny: str, loops: str) -> str:
    """The tiled loops, guarded to run only where the decode path did not (M > SKINNY_M)."""
    return loops if not skinny else skinny + f"    if (M > {SKINNY_M}) {{\n" + loops + "    }\n"


def _suffixed(lines: list[str], sfx: str) -> list[str]:
    """The per-product update of one of a GLU thread's accumulators (its own acc / grp / total, B element
    qb and column ns)."""
    return [re.sub(r"\b(acc|grp|total|qb|ns)\b", lambda m: m.group(1) + sfx, line) for line in lines]


def _glu_kernel(w: _Writer, epilogue: EpilogueCode) -> str:
    """The tiled kernel for a GLU epilogue: per output (m, n), n < n_out, one FP32 accumulation per column
    offset (B tile i holds columns n0 + offset_i ..), each exactly the plain kernel's, then the body."""
    k, lay, v = w.k, w.lay, w.variant
    if tuple(lay.n_axes) != (max(i for i in range(len(lay.full_shape)) if i != lay.k_axis),):
        raise ValueError(f"kernel {k.id}: a GLU epilogue needs one N axis, the last of its output")
    acc_type = "unsigned int" if v.acc_format is INT32 else "float"
    sfx = [str(i) for i in range(len(epilogue.col_offsets))]
    full = w.full_coords("bz", "m", "n", 0)
    out_coords = [c for axis, c in enumerate(full) if axis != lay.k_axis]
    out_pos = dot(out_coords, row_major_strides([w.dim(d) for d in k.shape]))
    a_load, b_load = _load(w, 0), _load(w, 1)
    params = _params(w, epilogue)
    lines, value = epilogue.body(out_coords, w.table)
    tiles = "".join(f"    __shared__ float tb{x}[{K_TILE}][{TILE + 1}];\n" for x in sfx)
    cols = "".join(f"        const long long ns{x} = min(n + {off}LL, N - 1);\n"
                   f"        {acc_type} acc{x} = 0;\n        double grp{x} = 0.0;\n        float total{x} = -0.0f;\n"
                   for x, off in zip(sfx, epilogue.col_offsets))
    b_tiles = "".join(f"            for (int e = tid; e < {TILE * K_TILE}; e += {TILE * TILE}) {{\n"
                      f"                const long long lk = k0 + e / {TILE}, ln = n0 + {off}LL + e % {TILE};\n"
                      f"                tb{x}[e / {TILE}][e % {TILE}] = {b_load};\n            }}\n"
                      for x, off in zip(sfx, epilogue.col_offsets))
    updates = "".join(f"                {{ const float qb{x} = tb{x}[t][tx];\n" + indent(_suffixed(_accumulate(w), x), 4)
                      + "                }\n" for x in sfx)
    store_line = f"out[{c_index(out_pos)}] = {store(k.dtype, value)};"
    skinny = _skinny(w, sfx, list(epilogue.col_offsets), "NO", [*lines, store_line])
    loops = ("    for (long long bz = blockIdx.z; bz < NB; bz += gridDim.z)\n"
             f"    for (long long m0 = blockIdx.x * {TILE}LL; m0 < M; m0 += gridDim.x * {TILE}LL)\n"
             f"    for (long long n0 = blockIdx.y * {TILE}LL; n0 < NO; n0 += gridDim.y * {TILE}LL) {{\n"
             "        const long long m = m0 + ty, n = n0 + tx, ms = min(m, M - 1);\n" + cols +
             f"        for (long long k0 = 0; k0 < K; k0 += {K_TILE}) {{\n"
             f"            for (int e = tid; e < {TILE * K_TILE}; e += {TILE * TILE}) {{\n"
             f"                const long long lm = m0 + e / {K_TILE}, lk = k0 + e % {K_TILE};\n"
             f"                ta[e / {K_TILE}][e % {K_TILE}] = {a_load};\n            }}\n" + b_tiles +
             "            __syncthreads();\n"
             f"            const int kt = static_cast<int>(min(static_cast<long long>({K_TILE}), K - k0));\n"
             "            for (int t = 0; t < kt; ++t) {\n"
             "                const long long kk = k0 + t;\n"
             "                const float qa = ta[ty][t];\n" + updates + "            }\n            __syncthreads();\n        }\n"
             "        if (m < M && n < NO) {\n" + indent(lines, 3) + f"            {store_line}\n        }}\n    }}\n")
    return (f'extern "C" __global__ void {ENTRY}({", ".join(params)}) {{\n'
            f"    __shared__ float ta[{TILE}][{K_TILE + 1}];\n{tiles}"
            f"    const long long M = {c_index(w.dim(lay.m))}, N = {c_index(w.dim(lay.n))}, "
            f"NO = {c_index(w.dim(epilogue.n_out))}, K = {c_index(w.dim(lay.k))}, NB = {c_index(w.dim(lay.batch))};\n"
            f"    const int tx = threadIdx.x, ty = threadIdx.y, tid = ty * {TILE} + tx;\n"
            + _tiled_only_above(skinny, loops) + "}\n")


def _gemm_kernel(w: _Writer, epilogue: EpilogueCode | None = None) -> str:
    if epilogue is not None and epilogue.col_offsets:
        return _glu_kernel(w, epilogue)
    k, lay, v = w.k, w.lay, w.variant
    acc_type = "unsigned int" if v.acc_format is INT32 else "float"
    full = w.full_coords("bz", "m", "n", 0)
    out_coords = [c for axis, c in enumerate(full) if axis != lay.k_axis]
    out_pos = dot(out_coords, row_major_strides([w.dim(d) for d in k.shape]))
    loads = [_load(w, 0), _load(w, 1)]
    params = _params(w, epilogue)
    lines, value = epilogue.body(out_coords, w.table) if epilogue else ([], "total")
    store_line = f"out[{c_index(out_pos)}] = {store(k.dtype, value)};"
    skinny = _skinny(w, [""], [0], "N", [*lines, store_line])
    loops = ("    for (long long bz = blockIdx.z; bz < NB; bz += gridDim.z)\n"
             f"    for (long long m0 = blockIdx.x * {TILE}LL; m0 < M; m0 += gridDim.x * {TILE}LL)\n"
             f"    for (long long n0 = blockIdx.y * {TILE}LL; n0 < N; n0 += gridDim.y * {TILE}LL) {{\n"
             "        const long long m = m0 + ty, n = n0 + tx, ms = min(m, M - 1), ns = min(n, N - 1);\n"
             f"        {acc_type} acc = 0;\n        double grp = 0.0;\n        float total = -0.0f;\n"
             f"        for (long long k0 = 0; k0 < K; k0 += {K_TILE}) {{\n"
             f"            for (int e = tid; e < {TILE * K_TILE}; e += {TILE * TILE}) {{\n"
             f"                const long long lm = m0 + e / {K_TILE}, lk = k0 + e % {K_TILE};\n"
             f"                ta[e / {K_TILE}][e % {K_TILE}] = {loads[0]};\n            }}\n"
             f"            for (int e = tid; e < {TILE * K_TILE}; e += {TILE * TILE}) {{\n"
             f"                const long long lk = k0 + e / {TILE}, ln = n0 + e % {TILE};\n"
             f"                tb[e / {TILE}][e % {TILE}] = {loads[1]};\n            }}\n"
             "            __syncthreads();\n"
             f"            const int kt = static_cast<int>(min(static_cast<long long>({K_TILE}), K - k0));\n"
             "            for (int t = 0; t < kt; ++t) {\n"
             "                const long long kk = k0 + t;\n"
             "                const float qa = ta[ty][t], qb = tb[t][tx];\n"
             + indent(_accumulate(w), 4) + "            }\n            __syncthreads();\n        }\n"
             "        if (m < M && n < N) {\n" + indent(lines, 3) + f"            {store_line}\n        }}\n    }}\n")
    return (f'extern "C" __global__ void {ENTRY}({", ".join(params)}) {{\n'
            f"    __shared__ float ta[{TILE}][{K_TILE + 1}];\n    __shared__ float tb[{K_TILE}][{TILE + 1}];\n"
            f"    const long long M = {c_index(w.dim(lay.m))}, N = {c_index(w.dim(lay.n))}, "
            f"K = {c_index(w.dim(lay.k))}, NB = {c_index(w.dim(lay.batch))};\n"
            f"    const int tx = threadIdx.x, ty = threadIdx.y, tid = ty * {TILE} + tx;\n"
            + _tiled_only_above(skinny, loops) + "}\n")


def _source(code: str, formats) -> str:
    text = (WMMA_HEADER if "wmma::" in code else "") + REDUCE_HELPERS + (SCALE_HELPER if "ln_pow2_scale(" in code else "") + code
    return source_header(formats, text) + text


def render_gemm(kernel: Kernel, formats: tuple[Format, ...],
                prequantized: tuple[bool, ...] = (False, False), epilogue: EpilogueCode | None = None,
                invariant: bool = False, stored: StoredOperand | None = None) -> KernelSource:
    """The fallback (scales, then the tiled kernel) and, where cuBLAS can, the GemmCall. `invariant`: a
    batch-invariant program's Gemm: the tiled kernel's sequential order for every M and no library call
    (cuBLAS(Lt) picks its algorithm, split-K included, per shape: no order a plan can pin). `stored`: B's
    storage format, read as its stored parts by every launch (no library call).

    Scratch: the scales of each operand this kernel scales itself, then (cuBLASLt) its quantized
    copies; a pre-quantized operand brings both from its QUANTIZE kernel instead. A static scale (a weight's)
    is written by an at-load launch (KernelSource.at_load, with cuBLASLt's quantized copy), not by every step."""
    w = _Writer(kernel, formats, prequantized, invariant, stored)
    lay = kernel.layout
    # cuBLASLt takes a pre-quantized A as it is: only when read in the (batch, M, K) layout it was written in
    single = all(len(inp.view.views) == 1 for inp in kernel.inputs[:2])  # cuBLAS needs one strided view each
    library = not invariant and stored is None
    lt = library and epilogue is None and single and lt_capable(w.variant, kernel.dtype) and (
        not prequantized[0] or kernel.inputs[0].view == quantized_a_view(kernel.layout))
    own = own_scales(kernel, prequantized)
    own_quant = own if lt else []
    tensor_core = refusal(w.variant, kernel, invariant) is None
    source = _source("".join([_scale_kernel(w, s) for s in own] + [_quant_kernel(w, s) for s in own_quant]
                                + [_gemm_kernel(w, epilogue)] + ([_tensor_core_entry(w, epilogue)] if tensor_core else [])),
                     {*formats, kernel.dtype, *(w.op_formats if lt else ()), *(stored_formats(stored.fmt) if stored else ())})
    scratch = tuple(Scratch(f"scale{s}", F32, w.scale_blocks(s)) for s in own)
    scratch += tuple(Scratch(f"quant{s}", w.op_formats[s], ((lay.batch, 1), (w.extents(s)[1 + s], 1), (lay.k, 1)))
                     for s in own_quant)
    scale_arg = {s: Arg("scales", s) if prequantized[s] else Arg("scratch", own.index(s))
                 for s in (0, 1) if w.specs[s] is not None}
    operand_arg = {s: Arg("scratch", len(own) + own_quant.index(s)) if s in own_quant else Arg("in", s) for s in (0, 1)}
    scale_launch = {s: Launch(f"{ENTRY}_scale{s}", (w.scale_blocks(s),), (SCALE_THREADS,),
                              (scale_arg[s], *w.operand_args(s))) for s in own}
    static = static_scales(kernel, prequantized)  # a weight's scales (and cuBLASLt's copy of it): once, at load
    scale_launches = tuple(scale_launch[s] for s in own if s not in static)
    n_out = epilogue.n_out if epilogue is not None and epilogue.col_offsets else lay.n
    args = (Arg("out"), Arg("in", 0), *w.operand_args(1), *(Arg("in", s) for s in (epilogue.slots if epilogue else ())),
            *scale_arg.values())
    gemm = Launch(ENTRY, (per(lay.m, TILE), per(n_out, TILE), per(lay.batch, 1)), (TILE, TILE), args)
    tc = (Launch(f"{ENTRY}_tc", (per(lay.m, TC_BLOCK_M), per(n_out, TC_BLOCK_N), per(lay.batch, 1)), (TC_THREADS,), args),)
    name = entry_name("gemm", source)
    quant = {s: Launch(f"{ENTRY}_quant{s}", (per(prod(w.extents(s)), ELEMENTWISE_THREADS),),
                       (ELEMENTWISE_THREADS,), (operand_arg[s], Arg("in", s), scale_arg[s])) for s in own_quant}
    at_load = tuple(scale_launch[s] for s in static) + tuple(quant[s] for s in static if s in quant)
    if lt:
        call = lt_call(kernel, w.variant, geometry(kernel),
                       name_launches(scale_launches + tuple(quant[s] for s in own_quant if s not in static), name),
                       (operand_arg[0], operand_arg[1]), (scale_arg[0], scale_arg[1]))
    elif epilogue is not None:  # cuBLASLt's bias epilogue where it adds as the emulator does, else the kernels
        call = bias_call(kernel, w.variant, formats, geometry(kernel)) if library and single else None
    else:
        call = cublas_call(kernel, w.variant, formats, geometry(kernel)) if library and single else None
    return KernelSource(0, name, source.replace(ENTRY, name), name_launches(scale_launches + (gemm,), name),
                        w.table, scratch, call, name_launches(scale_launches + tc, name) if tensor_core else (),
                        name_launches(at_load, name))


def render_quantize(kernel: Kernel, formats: tuple[Format, ...], prequantized: tuple[bool, ...] = (False,)) -> KernelSource:
    """A QUANTIZE kernel: the Gemm's scale kernel for A into scratch SCALES_SCRATCH (the scales kept
    beside the buffer, which the Gemm reads), then its quantize kernel (the main entry, named after
    the source) writing (batch, M, K)."""
    if any(prequantized):
        raise ValueError(f"kernel {kernel.id}: a QUANTIZE kernel cannot read another QUANTIZE kernel's buffer")
    w = _Writer(kernel, formats)
    source = _source(_scale_kernel(w, 0) + _quant_kernel(w, 0, entry=ENTRY), {*formats, kernel.dtype})
    scales = Arg("scratch", SCALES_SCRATCH)
    launches = (Launch(f"{ENTRY}_scale0", (w.scale_blocks(0),), (SCALE_THREADS,), (scales, Arg("in", 0))),
                Launch(ENTRY, (per(prod(kernel.shape), ELEMENTWISE_THREADS),), (ELEMENTWISE_THREADS,),
                       (Arg("out"), Arg("in", 0), scales)))
    name = entry_name("quantize", source)
    return KernelSource(0, name, source.replace(ENTRY, name), name_launches(launches, name), w.table,
                        (Scratch("scales", F32, w.scale_blocks(0)),))
