"""LLIR pieces as CUDA C expressions: symbolic dims, ShapeTracker views, fused FExpr bodies, casts.

Why a module of its own: every kernel template (elementwise, reductions, softmax, gather/scatter,
the fallback Gemm) reads its inputs through the same view rendering and evaluates the same fused
bodies; the CPU backend (runtime/cpu.py) is the semantics each rendering must reproduce:
* a view maps logical coordinates to `offset + sum(coord * stride)`; a stacked view feeds that
  position, unravelled over the lower view's shape, into the view below; outside a mask reads 0;
* every body op is computed in float and rounded once (the CUDA `_rn` intrinsics are correctly
  rounded and never contracted into FMAs, so Add/Mul/Recip/Sqrt/Mod/LessThan match the CPU
  backend's exact-then-round-to-FP32 bit for bit);
* FRoundTo and stores round to nearest even and saturate (rounding.Overflow.SATURATE), FP32 stores
  do not (an FP32 overflow is inf on both backends); integer stores truncate (numpy's astype).

Index expressions are `IndexExpr`s: a Python int when constant (folded here, so shapes known at
compile time cost nothing at run time) or a C expression of type `long long`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence, Union

import numpy as np

from ..dtypes.formats import F32, F64, Format, Kind
from ..hlir.ops import CUSTOM_KINDS, Op
from ..hlir.shape import ShapeTracker
from ..hlir.symbolic import Dim, Poly, is_const
from . import ctypes_map
from .llir import FApply, FAt, FConstV, FExpr, FLoad, FRoundTo, FRowSum

IndexExpr = Union[int, str]

# -- symbolic dims ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class SymbolTable:
    """Symbol name -> slot of the kernel's `dyn_dims` argument (sorted names: stable sources)."""

    symbols: tuple[str, ...]

    @staticmethod
    def of(names: Iterable[str]) -> "SymbolTable":
        return SymbolTable(tuple(sorted(set(names))))

    def index(self, name: str) -> int:
        return self.symbols.index(name)

    def dim(self, d: Dim) -> IndexExpr:
        """A dimension as an IndexExpr: ints stay ints, polynomials read LN_DYN(k)."""
        if is_const(d):
            return int(d)
        terms = []
        for monomial, coef in d.terms:
            factors = [f"LN_DYN({self.index(s)})" for s in monomial]
            if coef != 1 or not factors:
                factors.insert(0, _literal(coef))
            terms.append("*".join(factors))
        return "(" + " + ".join(terms) + ")"


def dims_symbols(dims: Iterable[object]) -> set[str]:
    return {s for d in dims if isinstance(d, Poly) for s in d.symbols()}


def view_symbols(st: ShapeTracker) -> set[str]:
    out: set[str] = set()
    for v in st.views:
        out |= dims_symbols((*v.shape, *v.strides, v.offset))
        if v.mask is not None:
            out |= dims_symbols(b for pair in v.mask for b in pair)
    return out


def body_symbols(e: FExpr | None) -> set[str]:
    if isinstance(e, FApply):
        return set().union(*(body_symbols(a) for a in e.args))
    if isinstance(e, FRoundTo):
        return body_symbols(e.x)
    if isinstance(e, FConstV):
        return dims_symbols((e.value,))
    if isinstance(e, FRowSum):  # a ROWS kernel's row reduction
        return body_symbols(e.body) | dims_symbols(e.shape)
    if isinstance(e, FAt):  # a ROWS kernel's read of an earlier row value through a view
        return body_symbols(e.x) | view_symbols(e.view) | dims_symbols(e.src_shape)
    return set()


# -- integer arithmetic with folding ------------------------------------------------------------------

def _literal(v: int) -> str:
    """long long literals where an int would not hold the value."""
    return f"{v}LL" if not -2 ** 31 <= v < 2 ** 31 else str(v)


def c_index(x: IndexExpr) -> str:
    return _literal(x) if isinstance(x, int) else x


def c_add(*terms: IndexExpr) -> IndexExpr:
    const = sum(t for t in terms if isinstance(t, int))
    parts = [t for t in terms if isinstance(t, str)]
    if not parts:
        return const
    if const:
        parts.append(_literal(const))
    return parts[0] if len(parts) == 1 else "(" + " + ".join(parts) + ")"


def c_mul(a: IndexExpr, b: IndexExpr) -> IndexExpr:
    if isinstance(a, int) and isinstance(b, int):
        return a * b
    if a == 0 or b == 0:
        return 0
    if a == 1:
        return b
    if b == 1:
        return a
    return f"({c_index(a)} * {c_index(b)})"


def c_div(a: IndexExpr, b: IndexExpr) -> IndexExpr:
    """C division (truncating); only ever applied to non-negative positions of valid elements."""
    if b == 1:
        return a
    if isinstance(a, int) and isinstance(b, int):
        return int(a / b) if b else 0
    return f"({c_index(a)} / {c_index(b)})"


def c_mod(a: IndexExpr, b: IndexExpr) -> IndexExpr:
    if b == 1:
        return 0
    if isinstance(a, int) and isinstance(b, int):
        return int(np.fmod(a, b)) if b else 0
    return f"({c_index(a)} % {c_index(b)})"


def c_and(conditions: Sequence[str | bool]) -> str | None:
    """Conjunction with folding: None when always true, "false" when a constant condition fails."""
    if any(c is False for c in conditions):
        return "false"
    parts = [c for c in conditions if isinstance(c, str)]
    return " && ".join(parts) if parts else None


def c_compare(a: IndexExpr, op: str, b: IndexExpr) -> str | bool:
    if isinstance(a, int) and isinstance(b, int):
        return {"<": a < b, ">=": a >= b}[op]
    return f"({c_index(a)} {op} {c_index(b)})"


# -- views -------------------------------------------------------------------------------------------

def unravel(linear: IndexExpr, shape: Sequence[IndexExpr]) -> list[IndexExpr]:
    """Row-major coordinates of `linear` over `shape` (the first one needs no modulo: linear < numel)."""
    coords: list[IndexExpr] = []
    inner: IndexExpr = 1
    for pos in range(len(shape) - 1, -1, -1):
        size = shape[pos]
        if size == 1:
            coords.append(0)
        elif pos == 0:
            coords.append(c_div(linear, inner))
        else:
            coords.append(c_mod(c_div(linear, inner), size))
        inner = c_mul(inner, size)
    return coords[::-1]


def dot(coords: Sequence[IndexExpr], strides: Sequence[IndexExpr], base: IndexExpr = 0) -> IndexExpr:
    return c_add(base, *(c_mul(c, s) for c, s in zip(coords, strides)))


def row_major_strides(shape: Sequence[IndexExpr]) -> list[IndexExpr]:
    strides: list[IndexExpr] = []
    acc: IndexExpr = 1
    for size in reversed(shape):
        strides.append(acc)
        acc = c_mul(acc, size)
    return strides[::-1]


@dataclass(frozen=True)
class ViewIndex:
    """Where a logical element lives: `pos` in the buffer, readable only when `valid` (None: always)."""

    pos: IndexExpr
    valid: str | None


def view_index(st: ShapeTracker, coords: Sequence[IndexExpr], table: SymbolTable) -> ViewIndex:
    """The C index math of ShapeTracker.index_map for one element with the given top-view coordinates."""
    if len(coords) != len(st.shape):
        raise ValueError(f"{len(coords)} coordinates for a view of shape {st.shape}")
    conditions: list[str | bool] = []
    pos: IndexExpr = 0
    for level, v in enumerate(reversed(st.views)):
        shape = [table.dim(d) for d in v.shape]
        if level > 0:
            if any(s == 0 for s in shape):  # an empty lower view: nothing is readable
                return ViewIndex(0, "false")
            coords = unravel(pos, shape)
        pos = dot(coords, [table.dim(s) for s in v.strides], table.dim(v.offset))
        if v.mask is not None:
            for c, (lo, hi), size in zip(coords, v.mask, shape):
                lo_e, hi_e = table.dim(lo), table.dim(hi)
                if lo_e != 0:
                    conditions.append(c_compare(c, ">=", lo_e))
                if hi_e != size:
                    conditions.append(c_compare(c, "<", hi_e))
    return ViewIndex(pos, c_and(conditions))


# -- values: loads, stores, rounding ------------------------------------------------------------------

def float_literal(value: float) -> str:
    """The FP32 constant the CPU backend uses for `value` (rounded once to FP32), as an exact literal."""
    return ctypes_map.c_float_literal(float(np.float32(value)))


def load_float(fmt: Format, raw: str) -> str:
    return ctypes_map.to_float_expr(fmt, raw)


def store(fmt: Format, x: str) -> str:
    """A float `x` converted to fmt's storage type as the CPU backend stores it (module docstring)."""
    if fmt is F32:
        return x
    if fmt is F64:
        return f"static_cast<double>({x})"
    if fmt.kind is Kind.INT:
        return f"static_cast<{ctypes_map.cuda_type(fmt)}>(static_cast<long long>({x}))"
    return ctypes_map.from_float_expr(fmt, x, saturate=True)


def convert(src: Format, dst: Format, raw: str) -> str:
    """A stored value moved to another storage format (a plain copy when they agree: bit-exact)."""
    return raw if src is dst else store(dst, load_float(src, raw))


def load_index(fmt: Format, raw: str) -> str:
    """A stored index as long long (float indices truncate, as numpy's astype(int64))."""
    return f"static_cast<long long>({raw if fmt.kind is Kind.INT else load_float(fmt, raw)})"


def round_expr(fmt: Format, x: str, source: str = "float", saturate: bool = True) -> str:
    """`x` (a float or double C expression) rounded to fmt, as a float.

    saturate=True is rounding.Overflow.SATURATE (the CPU's `_round`, operand conversions); False is
    Overflow.INF, the accumulators' rule: overflow gives inf, or NaN in a format without infinities.
    """
    if source not in ("float", "double"):
        raise ValueError(f"source must be 'float' or 'double', got {source!r}")
    if fmt.kind is not Kind.FLOAT or fmt.p >= F32.p:  # ints pass through; F32/F64 are a float already
        return x if source == "float" else f"static_cast<float>({x})"
    overflow = fmt.max_finite if saturate else (math.inf if fmt.has_inf else math.nan)
    params = ", ".join(ctypes_map.c_float_literal(v, "double")
                       for v in (fmt.min_normal, fmt.min_subnormal, fmt.max_finite, overflow))
    return f"static_cast<float>(ln_round_format(static_cast<double>({x}), {fmt.p - 1}, {params}))"


ROUND_HELPER = r"""
// Round to a float format with `keep` stored mantissa bits: nearest even, the subnormal quantum below
// min_normal; a rounded magnitude above max_finite (or an infinity) becomes `overflow` (max_finite:
// saturation; inf or NaN: IEEE overflow). NaN stays NaN. rounding.round_to, on one double.
static __device__ __forceinline__ double ln_round_format(double x, int keep, double min_normal,
                                                         double min_subnormal, double max_finite,
                                                         double overflow) {
    if (x != x) return x;
    const double ax = fabs(x);
    double r = ax;
    if (ax < min_normal) {  // 1.5 * 2^52 quanta: adding it rounds to a multiple of the quantum
        const double magic = 6755399441055744.0 * min_subnormal;
        r = __dsub_rn(__dadd_rn(ax, magic), magic);
    } else if (ax <= 1.7976931348623157e308) {
        const int drop = 52 - keep;
        unsigned long long bits = static_cast<unsigned long long>(__double_as_longlong(ax));
        bits += ((1ULL << (drop - 1)) - 1ULL) + ((bits >> drop) & 1ULL);
        bits &= ~((1ULL << drop) - 1ULL);
        r = __longlong_as_double(static_cast<long long>(bits));
    }
    return copysign(r > max_finite ? overflow : r, x);
}
"""

# -- fused bodies -------------------------------------------------------------------------------------

OP_TEMPLATES: dict[Op, str] = {
    Op.EXP2: "exp2f({0})",
    Op.LOG2: "log2f({0})",
    Op.SIN: "sinf({0})",
    Op.RECIP: "__frcp_rn({0})",
    Op.SQRT: "__fsqrt_rn({0})",
    Op.ADD: "__fadd_rn({0}, {1})",
    Op.MUL: "__fmul_rn({0}, {1})",
    Op.MOD: "fmodf({0}, {1})",
    Op.LESS_THAN: "(({0} < {1}) ? 1.0f : 0.0f)",
}
# Correctly rounded (or exact) in CUDA: bodies made of these match the CPU backend bit for bit.
EXACT_OPS = frozenset({Op.RECIP, Op.SQRT, Op.ADD, Op.MUL, Op.MOD, Op.LESS_THAN})


def op_template(e: FApply) -> str:
    if e.op is Op.CUSTOM:
        return CUSTOM_KINDS[e.kind].cuda_fn + "({0})"
    if e.op not in OP_TEMPLATES:
        raise ValueError(f"{e.op!r} is not an elementwise op a fused body can hold")
    return OP_TEMPLATES[e.op]


def is_exact(e: FExpr | None) -> bool:
    """Whether a body uses only ops CUDA computes bit-identically to the CPU backend."""
    if isinstance(e, FApply):
        return e.op in EXACT_OPS and all(is_exact(a) for a in e.args)
    if isinstance(e, FRoundTo):
        return is_exact(e.x)
    return True


class BodyWriter:
    """A fused body as SSA statements, each distinct sub-expression (and load) computed once.

    `load(slot)` returns the float C expression reading input `slot` at the current coordinates.
    """

    def __init__(self, load: Callable[[int], str], table: SymbolTable, prefix: str = "v"):
        self.load, self.table, self.prefix = load, table, prefix
        self.lines: list[str] = []
        self._names: dict[FExpr, str] = {}

    def _emit(self, e: FExpr, expr: str) -> str:
        name = f"{self.prefix}{len(self._names)}"
        self._names[e] = name
        self.lines.append(f"const float {name} = {expr};")
        return name

    def value(self, e: FExpr) -> str:
        if e in self._names:
            return self._names[e]
        if isinstance(e, FConstV):
            if isinstance(e.value, (int, Poly)) and not isinstance(e.value, bool):
                return f"static_cast<float>({c_index(self.table.dim(e.value))})"
            return float_literal(e.value)
        if isinstance(e, FLoad):
            return self._emit(e, self.load(e.slot))
        if isinstance(e, FRoundTo):
            inner = self.value(e.x)
            rounded = round_expr(e.fmt, inner)
            return inner if rounded == inner else self._emit(e, rounded)
        if isinstance(e, FApply):
            args = [self.value(a) for a in e.args]
            return self._emit(e, op_template(e).format(*args))
        raise TypeError(f"not a body expression: {e!r}")

    def render(self, e: FExpr) -> tuple[list[str], str]:
        """(statements, the float expression of the body's value)."""
        result = self.value(e)
        return self.lines, result


def store_double(fmt: Format, x: str) -> str:
    """A double `x` stored in fmt with one rounding (no detour through float for narrow formats)."""
    if fmt is F64:
        return x
    if fmt.kind is Kind.INT:
        return f"static_cast<{ctypes_map.cuda_type(fmt)}>(static_cast<long long>({x}))"
    return store(fmt, round_expr(fmt, x, "double"))
