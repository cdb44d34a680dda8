"""A Gemm's operand index math and its operand-scale kernels (codegen/cuda_gemm.py renders the Gemm around them).

`GemmWriter` says where each operand element and scale lies (a Gemm or QUANTIZE kernel's operands as (batch, rows,
cols) over the Mul's full shape) and how an element is quantized as the MMA sees it; the scale kernels compute one
scale per scale block (luminal_num.quant.scales' rule), the quantize kernels write 8-bit operands K-contiguous, and
`stage_a` is the first statements of a Gemm's `_staged` entry, which computes A's scales in its own pass over A.
Why a module of its own: the scale launch and the staged body must compute a scale by one expression
(`scale_of_amax`), so both live here, beside the index math they share.
"""
from __future__ import annotations

from ..dtypes.formats import F32, INT32, Format, Kind
from ..dtypes.variants import WHOLE, Granularity
from ..hlir.symbolic import Dim
from . import ctypes_map
from .cuda_body import (IndexExpr, SymbolTable, body_symbols, c_add, c_div, c_index, c_mul, dims_symbols, load_float,
                        round_expr, unravel, view_index, view_symbols)
from .cuda_source import ENTRY, Arg
from .cuda_weight_only import StoredOperand, part_params
from .gemm_scales import scale_blocks, variant_of
from .llir import Kernel

TILE = 16      # output rows and columns per block (16 x 16 threads)

SCALE_HELPER = r"""
// E8M0 scale: 2^ceil(log2(ratio)), exponent clamped to [-127, 127] (luminal_num.quant.scales).
static __device__ __forceinline__ float ln_pow2_scale(double ratio) {
    int e;
    const double mantissa = frexp(ratio, &e);
    if (mantissa == 0.5) e -= 1;
    return ldexpf(1.0f, max(-127, min(127, e)));
}
"""


class GemmWriter:
    """Index math of one Gemm (or QUANTIZE) kernel: operands as (batch, rows, cols) over the Mul's full
    shape. `prequantized[slot]`: that input is a QUANTIZE kernel's q, to be read as it is; `stored`: B's
    storage format when B is read as its stored parts (cuda_weight_only.stored_operand); `staged`: A and its
    scales are read from the `_staged` entry's shared copies (`ln_sa`, `ln_ss`: stage_a)."""

    def __init__(self, kernel: Kernel, formats: tuple[Format, ...], prequantized: tuple[bool, ...] = (False, False),
                 invariant: bool = False, stored: StoredOperand | None = None, staged: bool = False):
        self.k, self.formats, self.variant = kernel, formats, variant_of(kernel)
        self.prequantized = prequantized
        self.stored = stored
        self.staged = staged
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
        if slot == 0 and self.staged:  # (batch, M, K) row-major in shared memory
            return f"ln_sa[{c_index(c_add(c_mul(c_add(c_mul(b, int(self.lay.m)), row), int(self.lay.k)), col))}]"
        return self.source_element(slot, b, row, col)

    def source_element(self, slot: int, b: IndexExpr, row: IndexExpr, col: IndexExpr) -> str:
        """Operand `slot` at (batch, row, col) read from its input buffer (never the staged copy)."""
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
        if slot == 0 and self.staged:
            return f"ln_ss[{c_index(self.scale_index(slot, b, row, col))}]"
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


def scale_blocks_c(w: GemmWriter, slot: int) -> str:
    """The scale blocks of operand `slot` as C constants: extents NB, R, C; blocks per axis SB, SR, SC; spans BB, BR, BC."""
    spec = w.specs[slot]
    nb, rows, cols = (c_index(w.dim(d)) for d in w.extents(slot))
    counts = [c_index(c) for c in w.scale_counts(slot)]
    spans = [nb if spec.granularity is Granularity.TENSOR else "1",
             rows if spec.block[0] == WHOLE else str(spec.block[0]),
             cols if spec.block[1] == WHOLE else str(spec.block[1])]
    return (f"    const long long NB = {nb}, R = {rows}, C = {cols};\n"
            f"    const long long SB = {counts[0]}, SR = {counts[1]}, SC = {counts[2]};\n"
            f"    const long long BB = {spans[0]}, BR = {spans[1]}, BC = {spans[2]};\n")


def scale_of_amax(w: GemmWriter, slot: int) -> str:
    """One scale block's scale from its `amax` (luminal_num.quant.scales' rule): the scale launch's expression,
    which the staged entry (stage_a) repeats, so both give the same bits from the same amax."""
    spec, fmt = w.specs[slot], w.op_formats[slot]
    ratio = (f"static_cast<double>(amax) * {ctypes_map.c_float_literal(spec.margin, 'double')} / "
             f"{ctypes_map.c_float_literal(fmt.max_finite, 'double')}")
    scale = f"ln_pow2_scale({ratio})" if spec.scale_format.kind is Kind.SCALE else \
        f"static_cast<float>(fmax({ratio}, {ctypes_map.c_float_literal(F32.min_normal, 'double')}))"
    return f"(amax > 0.0f) ? {scale} : 1.0f"


def scale_kernel(w: GemmWriter, slot: int) -> str:
    params = ", ".join(["float* __restrict__ scale", w.in_param(slot)] + w.dyn_param())
    x = w.element(slot, "b", "row", "col")
    return (f'extern "C" __global__ void {ENTRY}_scale{slot}({params}) {{\n'
            + scale_blocks_c(w, slot) +
            "    for (long long s = blockIdx.x; s < SB * SR * SC; s += gridDim.x) {\n"
            "        const long long sb = s / (SR * SC), sr = (s / SC) % SR, sc = s % SC;\n"
            "        const long long nb = min(BB, NB - sb * BB), nr = min(BR, R - sr * BR), nc = min(BC, C - sc * BC);\n"
            "        float amax = 0.0f;\n"
            "        for (long long e = threadIdx.x; e < nb * nr * nc; e += blockDim.x) {\n"
            "            const long long b = sb * BB + e / (nr * nc), row = sr * BR + (e / nc) % nr, col = sc * BC + e % nc;\n"
            f"            const float x = {x};\n"
            "            amax = LnMax::apply(amax, isfinite(x) ? fabsf(x) : 0.0f);\n        }\n"
            "        amax = ln_block_reduce<LnMax>(amax, 0.0f);\n"
            f"        if (threadIdx.x == 0) scale[s] = {scale_of_amax(w, slot)};\n    }}\n}}\n")


def quant_kernel(w: GemmWriter, slot: int, entry: str | None = None) -> str:
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


def stage_a(w: GemmWriter) -> str:
    """The `_staged` entry's first statements: the block loads A once into shared memory (`ln_sa`, (batch, M, K)
    row-major), taking each scale block's amax as it loads (a max per element over the block's threads, then a
    fixed tree over them), and writes each block's scale (`ln_ss`) by the scale launch's own expression. A max is
    exact and order-free, so the scales (and the values quantized from the copy) are the separate launch's bits;
    the body then reads A and its scales from these copies (GemmWriter.staged), never A from memory again."""
    lay = w.lay
    threads = TILE * TILE
    values = int(lay.batch) * int(lay.m) * int(lay.k)
    scales = 1
    for d, per_block in w.scale_blocks(0):
        scales *= -(-int(d) // per_block)
    tree = "".join(f"            if (ln_t < {h}) ln_amax[ln_t] = LnMax::apply(ln_amax[ln_t], ln_amax[ln_t + {h}]);\n"
                   "            __syncthreads();\n" for h in (threads >> i for i in range(1, threads.bit_length())))
    return (f"    __shared__ float ln_sa[{values}];\n    __shared__ float ln_ss[{scales}];\n"
            f"    __shared__ float ln_amax[{threads}];\n    {{\n"
            "    const int ln_t = threadIdx.y * blockDim.x + threadIdx.x;\n" + scale_blocks_c(w, 0) +
            "        for (long long s = 0; s < SB * SR * SC; ++s) {\n"
            "            const long long sb = s / (SR * SC), sr = (s / SC) % SR, sc = s % SC;\n"
            "            const long long nb = min(BB, NB - sb * BB), nr = min(BR, R - sr * BR), nc = min(BC, C - sc * BC);\n"
            "            float amax = 0.0f;\n"
            f"            for (long long e = ln_t; e < nb * nr * nc; e += {threads}) {{\n"
            "                const long long b = sb * BB + e / (nr * nc), row = sr * BR + (e / nc) % nr, col = sc * BC + e % nc;\n"
            f"                const float x = {w.source_element(0, 'b', 'row', 'col')};\n"
            "                ln_sa[(b * R + row) * C + col] = x;\n"
            "                amax = LnMax::apply(amax, isfinite(x) ? fabsf(x) : 0.0f);\n            }\n"
            "            ln_amax[ln_t] = amax;\n            __syncthreads();\n" + tree +
            "            amax = ln_amax[0];\n"
            f"            if (ln_t == 0) ln_ss[s] = {scale_of_amax(w, 0)};\n"
            "            __syncthreads();\n        }\n    }\n")


