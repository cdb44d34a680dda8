"""Gemm on CUDA: a tiled kernel for every variant, and (cuda_gemm_call.py) the cuBLAS / cuBLASLt call.

`render_gemm` writes the fallback for every variant: per-block scale kernels (luminal_num.quant.scales'
rule) and a 16x16-tile kernel that quantizes operands as it loads them and accumulates exactly as
runtime/numerics.py defines each GemmPrecision (chunks, MMA groups, narrow accumulators, promotion,
per-product scales), and attaches the GemmCall where cuBLAS(Lt) can compute the kernel (an epilogue: only
cuBLASLt's bias epilogue, codegen/cuda_gemm_bias.py). Per-tensor FP8
goes through cuBLASLt: the same scale kernels, then quantize kernels writing both operands K-contiguous.
Beside the tiled entry, where codegen/cuda_gemm_tc.refusal gives no reason, the same source carries the
tensor-core entry (<name>_tc, KernelSource.tensor_core's launches): the same arguments, loads (`_load`),
accumulator term (`GemmWriter.result_term`), epilogue and store around a WMMA K loop; the runtime launches
whichever codegen/cuda_dispatch picks at the bound sizes. A Gemm whose A scales a step computes and whose A fits
a shared-memory copy (gemm_scales.staged_a_bytes) also carries the `_staged` entry (KernelSource.staged): the tiled
kernel with A and its scales read from copies its first statements make in one pass over A
(cuda_gemm_operands.stage_a), for the megakernel's GEMV tiles, which would otherwise read A twice. The operands'
index math and the scale kernels are codegen/cuda_gemm_operands.py.

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

from ..dtypes.formats import F32, INT32, Format
from ..hlir.symbolic import Dim, prod
from . import ctypes_map
from .cuda_body import IndexExpr, SymbolTable, c_index, dot, round_expr, row_major_strides, store
from .cuda_gemm_bias import bias_call
from .cuda_gemm_call import CUDA_DATA_TYPES, cublas_call, geometry, lt_call, lt_capable
from .cuda_source import (COMPUTE_TYPES, CUBLAS_ENUMS, ELEMENTWISE_THREADS, ENTRY, REDUCE_HELPERS, SCALES_SCRATCH, Arg,
                          GemmCall, KernelSource, Launch, Scratch, entry_name, indent, name_launches, per, source_header)
from .cuda_gemm_tc import BLOCK_M as TC_BLOCK_M, BLOCK_N as TC_BLOCK_N, THREADS as TC_THREADS, WMMA_HEADER
from .cuda_gemm_tc import refusal, tensor_core_kernel
from .cuda_gemv import SKINNY_M, has_decode_path, skinny_block
from .gemm_scales import own_scales, staged_a_bytes, static_scales
from .cuda_gemm_operands import SCALE_HELPER, TILE, GemmWriter, quant_kernel, scale_kernel, stage_a
from .cuda_weight_only import StoredOperand, stored_formats
from .llir import Kernel, quantized_a_view

K_TILE = 32    # K per shared-memory stage: a multiple of every mma_k
SCALE_THREADS = 256

__all__ = ["COMPUTE_TYPES", "CUBLAS_ENUMS", "CUDA_DATA_TYPES", "GemmCall", "render_gemm", "render_quantize"]


# -- the fallback kernels ------------------------------------------------------------------------------------

def _accumulate(w: GemmWriter) -> list[str]:
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


def _skinny(w: GemmWriter, suffixes: list[str], offsets: list[int], n_bound: str, finish: list[str]) -> str:
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


def _params(w: GemmWriter, epilogue: EpilogueCode | None) -> list[str]:
    """The Gemm entry's parameters (the tiled and the tensor-core entry take the same arguments)."""
    params = [f"{ctypes_map.cuda_type(w.k.dtype)}* __restrict__ out", w.in_param(0), w.in_param(1)]
    params += [w.in_param(s) for s in (epilogue.slots if epilogue else ())]
    return params + [f"const float* __restrict__ scale{s}" for s in (0, 1)
                     if w.specs[s] is not None and not (s == 0 and w.staged)] + w.dyn_param()


def _load(w: GemmWriter, slot: int) -> str:
    """The tiled kernel's staged operand element: quantized at (bz, lm, lk) of A / (bz, lk, ln) of B, 0 outside."""
    row, col, bound = ("lm", "lk", "lm < M && lk < K") if slot == 0 else ("lk", "ln", "lk < K && ln < N")
    return f"({bound}) ? {w.quantized(slot, w.element(slot, 'bz', row, col), w.scale_value(slot, 'bz', row, col))} : 0.0f"


def _tensor_core_entry(w: GemmWriter, epilogue: EpilogueCode | None) -> str:
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


def _glu_kernel(w: GemmWriter, epilogue: EpilogueCode, entry: str = ENTRY, prologue: str = "") -> str:
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
    return (f'extern "C" __global__ void {entry}({", ".join(params)}) {{\n' + prologue +
            f"    __shared__ float ta[{TILE}][{K_TILE + 1}];\n{tiles}"
            f"    const long long M = {c_index(w.dim(lay.m))}, N = {c_index(w.dim(lay.n))}, "
            f"NO = {c_index(w.dim(epilogue.n_out))}, K = {c_index(w.dim(lay.k))}, NB = {c_index(w.dim(lay.batch))};\n"
            f"    const int tx = threadIdx.x, ty = threadIdx.y, tid = ty * {TILE} + tx;\n"
            + _tiled_only_above(skinny, loops) + "}\n")


def _gemm_kernel(w: GemmWriter, epilogue: EpilogueCode | None = None, entry: str = ENTRY, prologue: str = "") -> str:
    """The tiled kernel (with its decode path); `entry` its name, `prologue` statements run first (stage_a)."""
    if epilogue is not None and epilogue.col_offsets:
        return _glu_kernel(w, epilogue, entry, prologue)
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
    return (f'extern "C" __global__ void {entry}({", ".join(params)}) {{\n' + prologue +
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
    w = GemmWriter(kernel, formats, prequantized, invariant, stored)
    lay = kernel.layout
    # cuBLASLt takes a pre-quantized A as it is: only when read in the (batch, M, K) layout it was written in
    single = all(len(inp.view.views) == 1 for inp in kernel.inputs[:2])  # cuBLAS needs one strided view each
    library = not invariant and stored is None
    lt = library and epilogue is None and single and lt_capable(w.variant, kernel.dtype) and (
        not prequantized[0] or kernel.inputs[0].view == quantized_a_view(kernel.layout))
    own = own_scales(kernel, prequantized)
    own_quant = own if lt else []
    tensor_core = refusal(w.variant, kernel, invariant) is None
    staged = staged_a_bytes(kernel, prequantized) is not None
    ws = GemmWriter(kernel, formats, prequantized, invariant, stored, staged=True) if staged else None
    source = _source("".join([scale_kernel(w, s) for s in own] + [quant_kernel(w, s) for s in own_quant]
                                + [_gemm_kernel(w, epilogue)] + ([_tensor_core_entry(w, epilogue)] if tensor_core else [])
                                + ([_gemm_kernel(ws, epilogue, f"{ENTRY}_staged", stage_a(ws))] if staged else [])),
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
    staged_launch = (Launch(f"{ENTRY}_staged", gemm.grid, gemm.block, args[:-len(scale_arg)] + tuple(
        a for s, a in scale_arg.items() if s != 0)),) if staged else ()
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
                        name_launches(at_load, name), name_launches(staged_launch, name))


def render_quantize(kernel: Kernel, formats: tuple[Format, ...], prequantized: tuple[bool, ...] = (False,)) -> KernelSource:
    """A QUANTIZE kernel: the Gemm's scale kernel for A into scratch SCALES_SCRATCH (the scales kept
    beside the buffer, which the Gemm reads), then its quantize kernel (the main entry, named after
    the source) writing (batch, M, K)."""
    if any(prequantized):
        raise ValueError(f"kernel {kernel.id}: a QUANTIZE kernel cannot read another QUANTIZE kernel's buffer")
    w = GemmWriter(kernel, formats)
    source = _source(scale_kernel(w, 0) + quant_kernel(w, 0, entry=ENTRY), {*formats, kernel.dtype})
    scales = Arg("scratch", SCALES_SCRATCH)
    launches = (Launch(f"{ENTRY}_scale0", (w.scale_blocks(0),), (SCALE_THREADS,), (scales, Arg("in", 0))),
                Launch(ENTRY, (per(prod(kernel.shape), ELEMENTWISE_THREADS),), (ELEMENTWISE_THREADS,),
                       (Arg("out"), Arg("in", 0), scales)))
    name = entry_name("quantize", source)
    return KernelSource(0, name, source.replace(ENTRY, name), name_launches(launches, name), w.table,
                        (Scratch("scales", F32, w.scale_blocks(0)),))
