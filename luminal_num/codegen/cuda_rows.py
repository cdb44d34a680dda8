"""CUDA C for a ROWS kernel: one block per row (the last axis); the row's values read through FAt (its
row sums and what is computed from them) first, by the whole block, then the elementwise tail per
element and one store. The semantics are the CPU backend's (runtime/cpu.py `_rows`):
* a row sum accumulates as the SUM kernel of its accumulator does (cuda_kernels.py `_accumulator`):
  FP32 / FP64 in parallel over the block (any order), narrow accumulators by one thread in index order
  rounding after every add; then it is rounded once to its storage format, as that kernel stores it;
* every FAt view has stride 0 along the last axis (search/rules/fuse_rows.py), so its value is the
  same for the whole row: it is computed once per row, before the loop that needs it.
"""
from __future__ import annotations

from typing import Sequence

from ..dtypes.formats import F32, F64, Format
from ..hlir.symbolic import Dim, is_const, prod
from ..quant.storage import STORAGE_FORMATS
from .ctypes_map import cuda_type
from .cuda_body import (BodyWriter, IndexExpr, SymbolTable, body_symbols, c_index, dims_symbols, dot, load_float,
                        load_index, round_expr, row_major_strides, store, unravel, view_index, view_symbols)
from .cuda_source import (ELEMENTWISE_THREADS, ENTRY, REDUCE_HELPERS, Arg, KernelSource, Launch, finish_source, indent,
                          per, source_header)
from .blockops import block_op
from .rows import is_row_view
from .llir import FApply, FAt, FExpr, FLoad, FRoundTo, FRowSum, Kernel

ROW_THREADS_MAX = 256
_PSEUDO = 1 << 20  # slots from here on name values computed earlier in the row (not kernel inputs)


def _lengths(e: FExpr) -> list[Dim]:
    if isinstance(e, FApply):
        return [n for a in e.args for n in _lengths(a)]
    if isinstance(e, (FRoundTo, FAt)):
        return _lengths(e.x)
    if isinstance(e, FRowSum):
        return [e.shape[-1], *_lengths(e.body)]
    return []


class _RowWriter:
    def __init__(self, k: Kernel, formats: tuple[Format, ...]):
        self.k, self.formats = k, formats
        names = dims_symbols((*k.shape, *k.body_shape)) | body_symbols(k.body)
        for inp in k.inputs:
            names |= view_symbols(inp.view)
        self.table = SymbolTable.of(names)
        self.n = 0

    def fresh(self, stem: str) -> str:
        self.n += 1
        return f"{stem}{self.n}"

    def read(self, slot: int, coords: Sequence[IndexExpr], values: dict[int, str]) -> str:
        if slot >= _PSEUDO:
            return values[slot]
        at = view_index(self.k.inputs[slot].view, coords, self.table)
        value = load_float(self.formats[slot], f"in{slot}[{c_index(at.pos)}]")
        return value if at.valid is None else f"({at.valid}) ? {value} : 0.0f"

    def space(self, e: FExpr, coords: Sequence[IndexExpr], hoisted: list[str] | None) -> tuple[list[str], str]:
        """`e` at `coords`: its row values' statements go to `hoisted` (once per row; None: this code runs
        per element, so everything stays inline), the rest are returned with the value."""
        values: dict[int, str] = {}
        inline: list[str] = []

        def substitute(x: FExpr) -> FExpr:
            if isinstance(x, (FAt, FRowSum)):
                slot = _PSEUDO + len(values)
                per_row = hoisted is not None and (isinstance(x, FRowSum) or is_row_view(x.view))
                values[slot] = self.special(x, coords, hoisted if per_row else inline, per_row)
                return FLoad(slot)
            if isinstance(x, FApply):
                return FApply(x.op, tuple(substitute(a) for a in x.args), x.kind)
            if isinstance(x, FRoundTo):
                return FRoundTo(substitute(x.x), x.fmt, x.origin)
            return x
        plain = substitute(e)
        lines, value = BodyWriter(lambda slot: self.read(slot, coords, values), self.table,
                                  self.fresh("v") + "_").render(plain)
        return inline + lines, value

    def special(self, e: FExpr, coords: Sequence[IndexExpr], out: list[str], per_row: bool) -> str:
        """A value read through FAt or a row sum, its statements emitted into `out` (the row's prologue when
        `per_row`, else the per-element code); the name of the float holding it."""
        if isinstance(e, FAt):  # the coordinates the view maps to, in the space of what it reads
            at = view_index(e.view, coords, self.table)
            name = self.fresh("p")
            pos = c_index(at.pos) if at.valid is None else f"({at.valid}) ? {c_index(at.pos)} : 0LL"
            out.append(f"const long long {name} = {pos};")  # outside a mask: any valid element, then 0
            src = unravel(name, [self.table.dim(d) for d in e.src_shape])
            if isinstance(e.x, FRowSum):
                value = self.row_sum(e.x, src, out, per_row)
            else:
                lines, value = self.space(e.x, src, out if per_row else None)
                out.extend(lines)
            if at.valid is None:
                return value
            masked = self.fresh("m")
            out.append(f"const float {masked} = ({at.valid}) ? {value} : 0.0f;")
            return masked
        return self.row_sum(e, coords, out, per_row)

    def row_sum(self, s: FRowSum, coords: Sequence[IndexExpr], hoisted: list[str], per_row: bool = True) -> str:
        r, acc, length = self.fresh("r"), self.fresh("acc"), self.fresh("len")
        hoisted.append(f"const long long {length} = {c_index(self.table.dim(s.shape[-1]))};")
        lines, value = self.space(s.body, [*coords, r], hoisted if per_row else None)  # its row values first
        if not per_row:  # inside per-element code: this thread alone, in index order
            return self._serial_sum(s, r, acc, length, lines, value, hoisted)
        if s.acc in (F32, F64):  # the whole block, any order, then every thread has the sum
            ctype, zero = ("float", "0.0f") if s.acc is F32 else ("double", "0.0")
            hoisted += [f"{ctype} {acc} = {zero};", f"for (long long {r} = threadIdx.x; {r} < {length}; {r} += blockDim.x) {{"]
            hoisted += ["    " + ln for ln in lines] + [f"    {acc} = {self._update(s, acc, value)};", "}",
                                                        f"{acc} = ln_block_reduce<LnSum>({acc}, {zero});"]
        else:  # a narrow accumulator: one thread, index order, rounding after every add; shared with the block
            shared = self.fresh("ln_row_")
            hoisted += [f"__shared__ float {shared}[1];", f"float {acc} = 0.0f;", "if (threadIdx.x == 0) {",
                        f"    for (long long {r} = 0; {r} < {length}; ++{r}) {{"]
            hoisted += ["        " + ln for ln in lines] + [f"        {acc} = {self._update(s, acc, value)};", "    }",
                                                            f"    {shared}[0] = {acc};", "}", "__syncthreads();",
                                                            f"{acc} = {shared}[0];", "__syncthreads();"]
        return self._stored(s, acc, hoisted)

    def _update(self, s: FRowSum, acc: str, value: str) -> str:
        if s.acc is F32:
            return f"__fadd_rn({acc}, {value})"
        if s.acc is F64:
            return f"__dadd_rn({acc}, static_cast<double>({value}))"
        return round_expr(s.acc, f"__dadd_rn(static_cast<double>({acc}), static_cast<double>({value}))", "double",
                          saturate=False)

    def _serial_sum(self, s: FRowSum, r: str, acc: str, length: str, lines: list[str], value: str,
                    out: list[str]) -> str:
        out += [f"{'double' if s.acc is F64 else 'float'} {acc} = 0.0;",
                f"for (long long {r} = 0; {r} < {length}; ++{r}) {{"]
        out += ["    " + ln for ln in lines] + [f"    {acc} = {self._update(s, acc, value)};", "}"]
        return self._stored(s, acc, out)

    def _stored(self, s: FRowSum, acc: str, out: list[str]) -> str:
        name = self.fresh("s")
        out.append(f"const float {name} = {round_expr(s.dt, acc, 'float' if s.acc is not F64 else 'double')};")
        return name


def _threads(k: Kernel) -> int:
    lengths = [k.shape[-1], *_lengths(k.body)]
    if not all(is_const(d) for d in lengths):
        return ROW_THREADS_MAX
    return min(ROW_THREADS_MAX, max(32, 1 << max(int(max(lengths)) - 1, 0).bit_length()))


def render_rows(kernel: Kernel, formats: tuple[Format, ...], prequantized: tuple[bool, ...]) -> KernelSource:
    if any(prequantized):
        raise ValueError("row kernels cannot read a QUANTIZE kernel's buffer")
    w = _RowWriter(kernel, formats)
    kept = [w.table.dim(d) for d in kernel.shape[:-1]]
    coords = unravel("row", kept) + ["j"]
    hoisted: list[str] = []
    lines, value = w.space(kernel.body, coords, hoisted)
    slots = tuple(range(len(kernel.inputs)))
    params = [f"{cuda_type(kernel.dtype)}* __restrict__ out"] + [
        f"const {cuda_type(formats[s])}* __restrict__ in{s}" for s in slots]
    if w.table.symbols:
        params.append("const long long* __restrict__ dyn_dims")
    rows = prod(kernel.shape[:-1]) if kernel.shape[:-1] else 1
    body = (f'extern "C" __global__ void {ENTRY}({", ".join(params)}) {{\n'
            f"    const long long rows = {c_index(w.table.dim(rows))};\n"
            f"    const long long len = {c_index(w.table.dim(kernel.shape[-1]))};\n"
            "    for (long long row = blockIdx.x; row < rows; row += gridDim.x) {\n" + indent(hoisted, 2)
            + "        for (long long j = threadIdx.x; j < len; j += blockDim.x) {\n" + indent(lines, 3)
            + f"            out[row * len + j] = {store(kernel.dtype, value)};\n        }}\n    }}\n}}\n")
    src = REDUCE_HELPERS + body
    launch = Launch(ENTRY, (per(rows, 1),), (_threads(kernel),), (Arg("out"),) + tuple(Arg("in", s) for s in slots))
    return finish_source(kernel.kind.value, source_header((*formats, kernel.dtype), src) + src, (launch,), w.table)


def _kv_rounded(kernel: Kernel, value: str) -> str:
    """The value as a KV cache held in an unscaled format (BF16/FP16) keeps it: rounded, as the plain
    in-place scatter writes it. A scaled (FP8) cache needs a row's amax first: that write is the plain
    scatter's (extraction keeps the fused one off such caches); refused here in one line, never approximated."""
    if kernel.storage is None:
        return value
    fmt = STORAGE_FORMATS[kernel.storage]
    if fmt.scale is not None:
        raise ValueError(f"kernel {kernel.id}: a computed-source KV write into a {fmt.name} cache (per-row scales) "
                         "is not rendered; the plain in-place scatter writes it")
    return round_expr(fmt.element, value, saturate=False)


def render_scatter_ew(kernel: Kernel, formats: tuple[Format, ...], prequantized: tuple[bool, ...]) -> KernelSource:
    """One thread per source element: its body (inline: a source element is no row of this kernel), then
    its row of the aliased destination (cuda_kernels.py `_scatter_nocopy`: an out-of-range index skips)."""
    if any(prequantized):
        raise ValueError("scatter kernels cannot read a QUANTIZE kernel's buffer")
    dest, index = kernel.inputs[:2]
    if not dest.view.is_contiguous or formats[0] is not kernel.dtype:
        raise ValueError(f"kernel {kernel.id}: an in-place scatter needs its destination's identity view and dtype, "
                         f"got {dest.view} ({formats[0]} -> {kernel.dtype})")
    w = _RowWriter(kernel, formats)
    n_idx = len(index.view.shape)
    coords = unravel("i", [w.table.dim(d) for d in kernel.body_shape])
    lines, value = w.space(kernel.body, coords, None)
    at = view_index(index.view, coords[:n_idx], w.table)
    idx = load_index(formats[1], f"in1[{c_index(at.pos)}]")
    out_pos = c_index(dot(["row", *coords[n_idx:]], row_major_strides([w.table.dim(d) for d in kernel.shape])))
    slots = tuple(range(1, len(kernel.inputs)))
    params = [f"{cuda_type(kernel.dtype)}* __restrict__ out"] + [
        f"const {cuda_type(formats[s])}* __restrict__ in{s}" for s in slots]
    if w.table.symbols:
        params.append("const long long* __restrict__ dyn_dims")
    n = prod(kernel.body_shape)
    body = (f'extern "C" __global__ void {ENTRY}({", ".join(params)}) {{\n'
            f"    LN_GRID_STRIDE_LOOP(i, {c_index(w.table.dim(n))}) {{\n"
            + f"        const long long row = {idx if at.valid is None else f'({at.valid}) ? {idx} : -1LL'};\n"
            f"        if (row >= 0 && row < {c_index(w.table.dim(kernel.shape[0]))}) {{\n"
            + indent(lines, 3) + f"            out[{out_pos}] = {store(kernel.dtype, _kv_rounded(kernel, value))};\n        }}\n    }}\n}}\n")
    src = REDUCE_HELPERS + body
    launch = Launch(ENTRY, (block_op(kernel).tiles.factors,), (ELEMENTWISE_THREADS,),
                    (Arg("out"),) + tuple(Arg("in", s) for s in slots))
    kv = (STORAGE_FORMATS[kernel.storage].element,) if kernel.storage else ()  # the cache's rounding helpers
    return finish_source(kernel.kind.value, source_header((*formats, kernel.dtype, *kv), src) + src, (launch,), w.table)
