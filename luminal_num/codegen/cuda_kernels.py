"""CUDA C source for every launching LLIR kernel kind, with its launch rule and argument list.

`render_kernel(kernel, program)` returns a `KernelSource`: one compilation unit (one NVRTC compile,
cached by source) holding one or more `extern "C"` entries, the launches that run them in order
(grid from the bound shapes, block size, pointer arguments), the symbol table of `dyn_dims`, and
scratch buffers the launches share (Gemm and QUANTIZE scales). The semantics are the CPU backend's
(runtime/cpu.py); cuda_body.py explains the rounding rules and view rendering. Kernel names are a
hash of the source, so identical kernels (a layer repeated, a candidate drawn twice) are one
compile and one module. `RENDERERS` is the one table from KernelKind to renderer (the Gemm and
QUANTIZE renderers come from cuda_gemm.py; the types they share live in cuda_source.py), and
`gemm_call(kernel, program)` is the cuBLAS(Lt) call a Gemm's source carries.

Reductions: FP32/FP64 accumulators reduce in parallel (one block per output row, any order: equal
to the CPU backend's pairwise sum up to rounding; MAX is order-free and exact); narrow (bf16/f16)
accumulators run one thread per output row in index order, rounding after every add. Softmax runs
one block per row: max, sum of exp(x - max), then the quotients; a bf16/f16 softmax
rounds its inputs and its result to that format, as the CPU backend does. Index errors cannot raise on a
GPU: gather reads an out-of-range row as 0 and scatter skips it (the CPU backend raises).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Callable

from ..dtypes.formats import F8E4M3, F32, F64, Format
from ..dtypes.formats import get as get_format
from ..dtypes.rounding import round_to
from ..hlir.symbolic import Dim, is_const, prod
from . import ctypes_map
from .cuda_body import (BodyWriter, IndexExpr, SymbolTable, body_symbols, c_and, c_index, convert, dims_symbols, dot,
                        float_literal, load_index, round_expr, row_major_strides, store, store_double, unravel,
                        view_index, view_symbols, load_float)
from .cuda_attention import attention_scratch, render_attention
from .cuda_gemm import render_gemm, render_quantize
from .cuda_gemm_epilogue import render_gemm_epilogue
from .blockops import KV_ROUNDED, block_op
from .cuda_rows import render_rows, render_scatter_ew
from .cuda_source import (ELEMENTWISE_THREADS, ENTRY, MAX_GRID, REDUCE_HELPERS, SCALES_SCRATCH, Arg, GemmCall,
                          KernelSource, Launch, Scratch, ceil_count, entry_name, finish_source, indent, name_launches,
                          per, source_header)
from ..quant.storage import STORAGE_FORMATS
from .cuda_weight_only import StoredOperand, stored_operand
from .llir import Kernel, KernelInput, KernelKind, Program

__all__ = ["Arg", "ELEMENTWISE_THREADS", "ENTRY", "KernelSource", "Launch", "MAX_GRID", "RENDERERS", "SCALES_SCRATCH",
           "Scratch", "ceil_count", "entry_name", "gemm_call", "input_formats", "name_launches", "render_kernel"]

ROW_THREADS_MAX = 256
SHORT_ROW = 64            # reductions this short (and known at compile time) use a thread per row


NEG_INF = "(-__int_as_float(0x7f800000))"


def declare(prefix: str, exprs: list[IndexExpr]) -> tuple[list[str], list[IndexExpr]]:
    """`const long long` variables for non-constant coordinates; constants stay literals."""
    lines, names = [], []
    for axis, e in enumerate(exprs):
        if isinstance(e, int) or e.isidentifier():
            names.append(e)
        else:
            lines.append(f"const long long {prefix}{axis} = {e};")
            names.append(f"{prefix}{axis}")
    return lines, names


class _Context:
    """What every renderer needs: the kernel, its input formats, its symbol table."""

    def __init__(self, kernel: Kernel, formats: tuple[Format, ...]):
        self.k, self.formats = kernel, formats
        names = dims_symbols((*kernel.shape, *kernel.body_shape, kernel.value))
        if kernel.layout is not None:
            names |= dims_symbols(kernel.layout.full_shape)
        for inp in kernel.inputs:
            names |= view_symbols(inp.view)
        self.table = SymbolTable.of(names | body_symbols(kernel.body))
        self.extra_formats: set[Format] = set()

    def dim(self, d: Dim) -> IndexExpr:
        return self.table.dim(d)

    def c_dim(self, d: Dim) -> str:
        return c_index(self.table.dim(d))

    def ctype(self, fmt: Format) -> str:
        return ctypes_map.cuda_type(fmt)

    def params(self, out: str | None, slots: tuple[int, ...], scratch: tuple[str, ...] = ()) -> str:
        """`scratch`: declarations of the scratch pointers, after the inputs (the launches' Arg order)."""
        parts = [] if out is None else [f"{self.ctype(self.k.dtype)}* __restrict__ {out}"]
        parts += [f"const {self.ctype(self.formats[s])}* __restrict__ in{s}" for s in slots]
        parts += list(scratch)
        if self.table.symbols:
            parts.append("const long long* __restrict__ dyn_dims")
        return ", ".join(parts)

    def read(self, slot: int, coords: list[IndexExpr]) -> tuple[str, str | None]:
        """(raw element expression, validity) of input `slot` at `coords`."""
        at = view_index(self.k.inputs[slot].view, coords, self.table)
        return f"in{slot}[{c_index(at.pos)}]", at.valid

    def read_float(self, slot: int, coords: list[IndexExpr]) -> str:
        raw, valid = self.read(slot, coords)
        value = load_float(self.formats[slot], raw)
        return value if valid is None else f"({valid}) ? {value} : 0.0f"

    def declare(self, prefix: str, exprs: list[IndexExpr]) -> tuple[list[str], list[IndexExpr]]:
        return declare(prefix, exprs)

    def body(self, coords: list[IndexExpr], prefix: str = "v") -> tuple[list[str], str]:
        return BodyWriter(lambda slot: self.read_float(slot, coords), self.table, prefix).render(self.k.body)


def _args(kernel: Kernel, slots: tuple[int, ...]) -> tuple[Arg, ...]:
    return (Arg("out"),) + tuple(Arg("in", s) for s in slots)


# -- renderers per kind -------------------------------------------------------------------------------

def _elementwise(cx: _Context) -> tuple[str, tuple[Launch, ...]]:
    k = cx.k
    coord_lines, coords = declare("c", unravel("i", [cx.dim(d) for d in k.shape]))
    body_lines, value = cx.body(coords)
    slots = tuple(range(len(k.inputs)))
    numel = cx.c_dim(prod(k.shape))
    src = (f'extern "C" __global__ void {ENTRY}({cx.params("out", slots)}) {{\n'
           f"    LN_GRID_STRIDE_LOOP(i, {numel}) {{\n" + indent(coord_lines + body_lines, 2) +
           f"        out[i] = {store(k.dtype, value)};\n    }}\n}}\n")
    return src, (Launch(ENTRY, (per(prod(k.shape), ELEMENTWISE_THREADS),), (ELEMENTWISE_THREADS,), _args(k, slots)),)


@dataclass(frozen=True)
class _Accumulator:
    c_type: str
    init: str
    update: str       # C statement using `acc` and the body value `{v}`
    combine: str | None  # block-reduce op, None when the order matters (narrow accumulators)
    final: str        # C expression storing `acc` in the kernel dtype


def _accumulator(k: Kernel) -> _Accumulator:
    if k.kind is KernelKind.MAX:
        return _Accumulator("float", NEG_INF, "acc = LnMax::apply(acc, {v});", "LnMax", store(k.dtype, "acc"))
    acc = k.acc or F32
    if acc is F32:
        return _Accumulator("float", "0.0f", "acc = __fadd_rn(acc, {v});", "LnSum", store(k.dtype, "acc"))
    if acc is F64:
        return _Accumulator("double", "0.0", "acc = __dadd_rn(acc, static_cast<double>({v}));", "LnSum",
                            store_double(k.dtype, "acc"))
    rounded = round_expr(acc, "__dadd_rn(static_cast<double>(acc), static_cast<double>({v}))", "double",
                         saturate=False)
    return _Accumulator("float", "0.0f", f"acc = {rounded};", None, store(k.dtype, "acc"))


def _row_threads(length: Dim) -> int:
    if not is_const(length):
        return ROW_THREADS_MAX
    return min(ROW_THREADS_MAX, max(32, 1 << max(int(length) - 1, 0).bit_length()))


def _row_space(cx: _Context, row: str, r: str) -> tuple[list[str], list[IndexExpr]]:
    """Coordinates of the body element (row, r): row unravelled over the kept axes, r on the axis."""
    axis = cx.k.axis
    kept = [cx.dim(d) for i, d in enumerate(cx.k.body_shape) if i != axis]
    lines, coords = declare("c", unravel(row, kept))
    coords.insert(axis, r)
    return lines, coords


def _reduction(cx: _Context) -> tuple[str, tuple[Launch, ...]]:
    k = cx.k
    acc = _accumulator(k)
    length = k.body_shape[k.axis]
    rows = prod(d for i, d in enumerate(k.body_shape) if i != k.axis)
    per_block = acc.combine is not None and not (is_const(length) and length <= SHORT_ROW)
    coord_lines, coords = _row_space(cx, "row", "r")
    body_lines, value = cx.body(coords)
    update = acc.update.format(v=value)
    slots = tuple(range(len(k.inputs)))
    if per_block:
        threads = _row_threads(length)
        outer, inner = "for (long long row = blockIdx.x; row < rows; row += gridDim.x)", \
            "for (long long r = threadIdx.x; r < len; r += blockDim.x)"
        finish = [f"acc = ln_block_reduce<{acc.combine}>(acc, {acc.init});",
                  f"if (threadIdx.x == 0) out[row] = {acc.final};"]
        grid = (per(rows, 1),)
    else:
        threads = 128
        outer, inner = "LN_GRID_STRIDE_LOOP(row, rows)", "for (long long r = 0; r < len; ++r)"
        finish = [f"out[row] = {acc.final};"]
        grid = (per(rows, threads),)
    src = (f'extern "C" __global__ void {ENTRY}({cx.params("out", slots)}) {{\n'
           f"    const long long rows = {cx.c_dim(rows)};\n    const long long len = {cx.c_dim(length)};\n"
           f"    {outer} {{\n" + indent(coord_lines + [f"{acc.c_type} acc = {acc.init};", inner + " {"], 2)
           + indent(body_lines + [update], 3) + indent(["}"] + finish, 2) + "    }\n}\n")
    return REDUCE_HELPERS + src, (Launch(ENTRY, grid, (threads,), _args(k, slots)),)


def _softmax_rounding(k: Kernel) -> Callable[[str], str]:
    """A low-precision softmax rounds its inputs and its result to the compute format (the CPU backend's
    `_softmax`: 16-bit formats overflow to inf, 8-bit ones saturate, as `rounding.store`); FP32: none."""
    if k.precision in (None, "f32"):
        return lambda x: x
    compute = get_format(k.precision)
    return lambda x: round_expr(compute, x, saturate=compute.bits <= 8)


def _softmax(cx: _Context) -> tuple[str, tuple[Launch, ...]]:
    k = cx.k
    length = k.body_shape[k.axis]
    rows = prod(d for i, d in enumerate(k.body_shape) if i != k.axis)
    coord_lines, coords = _row_space(cx, "row", "r")
    out_pos = c_index(dot(coords, row_major_strides([cx.dim(d) for d in k.body_shape])))
    loop = "for (long long r = threadIdx.x; r < len; r += blockDim.x) {"
    rounded = _softmax_rounding(k)
    passes = []
    for step, prefix in (("m = LnMax::apply(m, {v});", "va"), ("s = __fadd_rn(s, expf(__fsub_rn({v}, m)));", "vb"),
                         (f"out[{out_pos}] = " + store(k.dtype, rounded("__fdiv_rn(expf(__fsub_rn({v}, m)), s)"))
                          + ";", "vc")):
        body_lines, value = cx.body(coords, prefix)
        passes.append(indent([loop], 2) + indent(body_lines + [step.replace("{v}", rounded(value))], 3)
                      + indent(["}"], 2))
    slots = tuple(range(len(k.inputs)))
    threads = _row_threads(length)
    src = (f'extern "C" __global__ void {ENTRY}({cx.params("out", slots)}) {{\n'
           f"    const long long rows = {cx.c_dim(rows)};\n    const long long len = {cx.c_dim(length)};\n"
           "    for (long long row = blockIdx.x; row < rows; row += gridDim.x) {\n"
           + indent(coord_lines + [f"float m = {NEG_INF};"], 2) + passes[0]
           + indent([f"m = ln_block_reduce<LnMax>(m, {NEG_INF});", "if (!isfinite(m)) m = 0.0f;", "float s = 0.0f;"], 2)
           + passes[1] + indent(["s = ln_block_reduce<LnSum>(s, 0.0f);"], 2) + passes[2] + "    }\n}\n")
    return REDUCE_HELPERS + src, (Launch(ENTRY, (per(rows, 1),), (threads,), _args(k, slots)),)


def _const(cx: _Context) -> tuple[str, tuple[Launch, ...]]:
    """One element, rounded in Python exactly as the CPU backend rounds it (then stored exactly)."""
    k = cx.k
    if isinstance(k.value, float) and k.dtype is F32:
        value = float_literal(k.value)
    elif isinstance(k.value, float) and k.dtype.is_float and k.dtype.p < F64.p:
        value = store(k.dtype, float_literal(float(round_to(k.value, k.dtype))))
    elif isinstance(k.value, float):  # F64, integers: from the double (integers truncate)
        value = store_double(k.dtype, ctypes_map.c_float_literal(k.value, "double"))
    else:
        value = store_double(k.dtype, f"static_cast<double>({cx.c_dim(k.value)})")
    src = (f'extern "C" __global__ void {ENTRY}({cx.params("out", ())}) {{\n'
           f"    if (blockIdx.x == 0 && threadIdx.x == 0) out[0] = {value};\n}}\n")
    return src, (Launch(ENTRY, (per(1, 1),), (32,), _args(k, ())),)


def _iota(cx: _Context) -> tuple[str, tuple[Launch, ...]]:
    k = cx.k
    src = (f'extern "C" __global__ void {ENTRY}({cx.params("out", ())}) {{\n'
           f"    LN_GRID_STRIDE_LOOP(i, {cx.c_dim(k.value)}) out[i] = {store_double(k.dtype, 'static_cast<double>(i)')};\n}}\n")
    return src, (Launch(ENTRY, (per(k.value, ELEMENTWISE_THREADS),), (ELEMENTWISE_THREADS,), _args(k, ())),)


def _guarded(raw: str, valid: str | None, src: Format, dst: Format) -> str:
    value = convert(src, dst, raw)
    return value if valid is None else f"({valid}) ? {value} : {store(dst, '0.0f')}"


def _gather(cx: _Context) -> tuple[str, tuple[Launch, ...]]:
    k = cx.k
    table, index = k.inputs
    n_idx = len(index.view.shape)
    coord_lines, coords = declare("c", unravel("i", [cx.dim(d) for d in k.shape]))
    raw_i, valid_i = cx.read(1, coords[:n_idx])
    rows = cx.c_dim(table.view.shape[0])
    idx = load_index(cx.formats[1], raw_i)
    raw_t, valid_t = cx.read(0, ["row", *coords[n_idx:]])
    valid = c_and(["(row >= 0 && row < " + rows + ")"] + ([valid_t] if valid_t else []))
    src = (f'extern "C" __global__ void {ENTRY}({cx.params("out", (0, 1))}) {{\n'
           f"    LN_GRID_STRIDE_LOOP(i, {cx.c_dim(prod(k.shape))}) {{\n" + indent(coord_lines, 2)
           + f"        const long long row = {idx if valid_i is None else f'({valid_i}) ? {idx} : 0LL'};\n"
           f"        out[i] = {_guarded(raw_t, valid, cx.formats[0], k.dtype)};\n    }}\n}}\n")
    return src, (Launch(ENTRY, (per(prod(k.shape), ELEMENTWISE_THREADS),), (ELEMENTWISE_THREADS,), _args(k, (0, 1))),)


def _index_at(cx: _Context, linear: str) -> str:
    """The scatter index number `linear` (row-major over the index view) as long long."""
    coords = unravel(linear, [cx.dim(d) for d in cx.k.inputs[2].view.shape])
    raw, valid = cx.read(2, coords)
    idx = load_index(cx.formats[2], raw)
    return idx if valid is None else f"(({valid}) ? {idx} : -1LL)"


def _scatter(cx: _Context) -> tuple[str, tuple[Launch, ...]]:
    """Copying scatter: each output element looks for the LAST index naming its row (numpy's rule)."""
    k = cx.k
    index_shape = cx.k.inputs[2].view.shape
    coord_lines, coords = declare("c", unravel("i", [cx.dim(d) for d in k.shape]))
    hit_coords = unravel("hit", [cx.dim(d) for d in index_shape]) + coords[1:]
    raw_s, valid_s = cx.read(1, hit_coords)
    raw_d, valid_d = cx.read(0, coords)
    src = (f'extern "C" __global__ void {ENTRY}({cx.params("out", (0, 1, 2))}) {{\n'
           f"    const long long n_index = {cx.c_dim(prod(index_shape))};\n"
           f"    LN_GRID_STRIDE_LOOP(i, {cx.c_dim(prod(k.shape))}) {{\n" + indent(coord_lines, 2)
           + "        long long hit = -1;\n"
           f"        for (long long j = n_index - 1; j >= 0; --j) if ({_index_at(cx, 'j')} == {c_index(coords[0])}) "
           "{ hit = j; break; }\n"
           f"        out[i] = (hit >= 0) ? {_guarded(raw_s, valid_s, cx.formats[1], k.dtype)} "
           f": {_guarded(raw_d, valid_d, cx.formats[0], k.dtype)};\n    }}\n}}\n")
    return src, (Launch(ENTRY, (block_op(k).tiles.factors,), (ELEMENTWISE_THREADS,), _args(k, (0, 1, 2))),)


CUDA_KV_ROUNDED = KV_ROUNDED  # KV formats without scales: the scatter rounds each value (blockops declares them)


def _scatter_nocopy(cx: _Context) -> tuple[str, tuple[Launch, ...]]:
    """In-place scatter: one thread per source element writes its row of the aliased destination.

    With duplicate indices the winner is unspecified (the CPU backend keeps the last)."""
    k = cx.k
    dest = k.inputs[0]
    if not dest.view.is_contiguous or cx.formats[0] is not k.dtype:
        raise ValueError(f"kernel {k.id}: a no-copy scatter needs its destination's identity view and dtype, "
                         f"got {dest.view} ({cx.formats[0]} -> {k.dtype})")
    index_shape = k.inputs[2].view.shape
    src_shape = tuple(index_shape) + tuple(k.shape[1:])
    coord_lines, coords = declare("c", unravel("i", [cx.dim(d) for d in src_shape]))
    n_idx = len(index_shape)
    raw_s, valid_s = cx.read(1, coords)
    raw_i, valid_i = cx.read(2, coords[:n_idx])
    idx = load_index(cx.formats[2], raw_i)
    out_pos = c_index(dot(["row", *coords[n_idx:]], row_major_strides([cx.dim(d) for d in k.shape])))
    value = _guarded(raw_s, valid_s, cx.formats[1], k.dtype)
    if k.storage is not None and k.storage not in CUDA_KV_ROUNDED:
        return _scatter_nocopy_scaled(cx)
    if k.storage is not None:  # a KV cache held in a format: the row is written rounded (kept as float values)
        value = round_expr(get_format(k.storage), value, saturate=False)
    src = (f'extern "C" __global__ void {ENTRY}({cx.params("out", (1, 2))}) {{\n'
           f"    LN_GRID_STRIDE_LOOP(i, {cx.c_dim(prod(src_shape))}) {{\n" + indent(coord_lines, 2)
           + f"        const long long row = {idx if valid_i is None else f'({valid_i}) ? {idx} : -1LL'};\n"
           f"        if (row >= 0 && row < {cx.c_dim(k.shape[0])}) out[{out_pos}] = {value};\n    }}\n}}\n")
    return src, (Launch(ENTRY, (block_op(k).tiles.factors,), (ELEMENTWISE_THREADS,), _args(k, (1, 2))),)


Renderer = Callable[[Kernel, tuple[Format, ...], tuple[bool, ...]], KernelSource]


def _scatter_nocopy_scaled(cx: _Context) -> tuple[str, tuple[Launch, ...]]:
    """In-place scatter into an FP8 KV cache (luminal_num.quant.kv): one block per (source row, scale group)
    takes the group's amax, s = fl32(max(amax / 448, 2^-126)) (1 where amax = 0), and writes each value
    as the cache holds it, fl32(RN_e4m3,sat(fl32(x / s)) * s): the CPU backend's cache_values."""
    k = cx.k
    fmt = STORAGE_FORMATS[k.storage]
    index_shape = k.inputs[2].view.shape
    if len(index_shape) != 1 or len(k.shape) != 2 or fmt.element is not F8E4M3:
        raise ValueError(f"kernel {k.id}: an FP8 KV-cache scatter writes (rows, width) rows by a 1-D index, "
                         f"got {k.shape} by {index_shape} as {k.storage}")
    width = k.shape[1]
    group = width if fmt.block == 0 else fmt.block  # per token: the whole row; per head: `block` elements
    raw_s, valid_s = cx.read(1, ["r", "c"])
    x = _guarded(raw_s, valid_s, cx.formats[1], F32)
    raw_i, valid_i = cx.read(2, ["r"])
    idx = load_index(cx.formats[2], raw_i)
    fp8 = ctypes_map.to_float_expr(F8E4M3, ctypes_map.from_float_expr(F8E4M3, "__fdiv_rn(x, s)", saturate=True))
    ratio = f"static_cast<double>(amax) / {ctypes_map.c_float_literal(F8E4M3.max_finite, 'double')}"
    src = (f'extern "C" __global__ void {ENTRY}({cx.params("out", (1, 2))}) {{\n'
           f"    const long long R = {cx.c_dim(index_shape[0])}, W = {cx.c_dim(width)}, G = {cx.c_dim(group)};\n"
           "    const long long NG = W / G;\n"
           "    for (long long b = blockIdx.x; b < R * NG; b += gridDim.x) {\n"
           "        const long long r = b / NG, c0 = (b % NG) * G;\n"
           f"        const long long row = {idx if valid_i is None else f'({valid_i}) ? {idx} : -1LL'};\n"
           "        float amax = 0.0f;\n"
           "        for (long long e = threadIdx.x; e < G; e += blockDim.x) {\n"
           "            const long long c = c0 + e;\n"
           f"            const float x = {x};\n"
           "            amax = LnMax::apply(amax, isfinite(x) ? fabsf(x) : 0.0f);\n        }\n"
           "        amax = ln_block_reduce<LnMax>(amax, 0.0f);\n"
           f"        const float s = (amax > 0.0f) ? static_cast<float>(fmax({ratio}, "
           f"{ctypes_map.c_float_literal(F32.min_normal, 'double')})) : 1.0f;\n"
           f"        if (row >= 0 && row < {cx.c_dim(k.shape[0])})\n"
           "            for (long long e = threadIdx.x; e < G; e += blockDim.x) {\n"
           "                const long long c = c0 + e;\n"
           f"                const float x = {x};\n"
           f"                out[row * W + c] = __fmul_rn({fp8}, s);\n            }}\n    }}\n}}\n")
    cx.extra_formats.add(F8E4M3)
    return REDUCE_HELPERS + src, (Launch(ENTRY, (block_op(k).tiles.factors,), (KV_SCALE_THREADS,),
                                         _args(k, (1, 2))),)


KV_SCALE_THREADS = 256


def _simple(render: Callable[[_Context], tuple[str, tuple[Launch, ...]]],
            scratch: Callable[[Kernel], tuple[Scratch, ...]] | None = None) -> Renderer:
    """A renderer of one entry over the kernel's own inputs (no pre-quantized operands to read);
    `scratch`: the scratch buffers its launches use, if any."""
    def renderer(kernel: Kernel, formats: tuple[Format, ...], prequantized: tuple[bool, ...]) -> KernelSource:
        if any(prequantized):
            raise ValueError(f"{kernel.kind.value} kernels cannot read a QUANTIZE kernel's buffer")
        cx = _Context(kernel, formats)
        body, launches = render(cx)
        extra = tuple(sorted(cx.extra_formats, key=lambda f: f.name))  # formats a body converts to
        src = finish_source(kernel.kind.value, source_header((*formats, kernel.dtype, *extra), body) + body,
                            launches, cx.table)
        return src if scratch is None else replace(src, scratch=scratch(kernel))
    return renderer


# Every launching KernelKind has exactly one renderer (tests/test_cuda_codegen.py checks the coverage).
RENDERERS: dict[KernelKind, Renderer] = {
    KernelKind.ELEMENTWISE: _simple(_elementwise), KernelKind.SUM: _simple(_reduction),
    KernelKind.MAX: _simple(_reduction), KernelKind.SOFTMAX: _simple(_softmax), KernelKind.CONST: _simple(_const),
    KernelKind.IOTA: _simple(_iota), KernelKind.GATHER: _simple(_gather), KernelKind.SCATTER: _simple(_scatter),
    KernelKind.SCATTER_NOCOPY: _simple(_scatter_nocopy),
    KernelKind.GEMM: render_gemm, KernelKind.QUANTIZE: render_quantize,
    KernelKind.GEMM_EPILOGUE: render_gemm_epilogue,
    KernelKind.ATTENTION: _simple(render_attention, attention_scratch),
    KernelKind.ROWS: render_rows, KernelKind.SCATTER_EW: render_scatter_ew,
}


# -- entry point -----------------------------------------------------------------------------------------

def input_formats(kernel: Kernel, program: Program) -> tuple[Format, ...]:
    return tuple(program.kernel(inp.buffer).dtype for inp in kernel.inputs)


def _structure(kernel: Kernel) -> Kernel:
    """The kernel without what does not change its code (ids, provenance): the render cache key."""
    return replace(kernel, id=0, chunk=-1, label="",
                   inputs=tuple(KernelInput(0, inp.view) for inp in kernel.inputs))


@lru_cache(maxsize=4096)
def _render_structure(kernel: Kernel, formats: tuple[Format, ...], prequantized: tuple[bool, ...],
                      invariant: bool = False, stored: StoredOperand | None = None) -> KernelSource:
    """`invariant`: a batch-invariant program's Gemm (its renderers pin one order; no other kind has a choice:
    attention's fixed split size is in its spec). `stored`: how a Gemm reads B from a weight's stored parts."""
    if kernel.kind.is_gemm and (invariant or stored is not None):
        return RENDERERS[kernel.kind](kernel, formats, prequantized, invariant=invariant, stored=stored)
    return RENDERERS[kernel.kind](kernel, formats, prequantized)


def clear_render_cache() -> None:
    """Forget cached renders: a test that changes a renderer's tuning constant (a chunk, a grid cap) renders afresh."""
    _render_structure.cache_clear()


def _rebind(src: KernelSource, kernel: Kernel) -> KernelSource:
    """The cached structural source with this kernel's buffer ids (slot -> producing kernel)."""
    def bound(launches: tuple[Launch, ...]) -> tuple[Launch, ...]:
        return tuple(replace(launch, args=tuple(a.bind(kernel) for a in launch.args)) for launch in launches)
    gemm = None if src.gemm is None else src.gemm.bind_args(kernel)
    return replace(src, kernel_id=kernel.id, launches=bound(src.launches), gemm=gemm,
                   tensor_core=bound(src.tensor_core), at_load=bound(src.at_load),
                   staged=bound(src.staged))


def render_kernel(kernel: Kernel, program: Program) -> KernelSource:
    """Source, launches and arguments of one launching kernel (cached by structure)."""
    if not kernel.kind.launches:
        raise ValueError(f"kernel {kernel.id} is {kernel.kind.value}: it has no code")
    structural = _structure(kernel)
    src = _render_structure(structural, input_formats(kernel, program), program.quantized_inputs(kernel),
                            program.batch_invariant, stored_operand(kernel, program))
    return _rebind(src, kernel)


def gemm_call(kernel: Kernel, program: Program) -> GemmCall | None:
    """The cuBLAS(Lt) call computing this Gemm kernel, or None (run the fallback kernel's launches)."""
    if kernel.kind is not KernelKind.GEMM:
        raise ValueError(f"kernel {kernel.id} is {kernel.kind.value}, not a Gemm")
    return render_kernel(kernel, program).gemm
