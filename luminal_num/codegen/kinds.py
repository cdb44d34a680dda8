"""The kernel vocabulary, declared once: every e-node constructor the search can select.

Each `ENodeDecl` names its parameters (and their sorts) in constructor order. Everything else is
derived from it: the egglog constructor (search/egraph.py), the dtype rule (search/rules/dtype_prop.py),
named child access in extraction and lowering (`ENode.arg("prec")`, never `children[5]`), the LLIR
kind a tensor constructor lowers to, its inputs (tensor/view parameter pairs) and its precision tag.
Backends plug in as tables keyed by `KernelKind` (`backend_table` / `assert_covers` check coverage).

Adding a kernel kind = one `KernelKind` member, one declaration here, one entry per backend table.
This module is plain data (no egglog): the LLIR layer and every backend may import it.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from types import MappingProxyType
from typing import Iterable, Mapping, TypeVar

from ..hlir.ops import BINARY_OPS, UNARY_OPS, Op
from .llir import KernelKind


class Sort(enum.Enum):
    T = "T"          # a tensor value (one buffer)
    F = "F"          # a per-element scalar expression inside one kernel
    B = "B"          # a buffer an in-place kernel overwrites
    I64 = "i64"      # an interned id (view, constant, dim, layout) or an axis / slot
    STR = "String"   # a dtype, precision or tag name


@dataclass(frozen=True)
class Param:
    name: str
    sort: Sort


def params(spec: str) -> tuple[Param, ...]:
    """'a:T va:i64 dt:S' -> the named, sorted parameters (S = String)."""
    sorts = {"T": Sort.T, "F": Sort.F, "B": Sort.B, "i64": Sort.I64, "S": Sort.STR}
    return tuple(Param(n, sorts[s]) for n, s in (p.split(":") for p in spec.split()))


@dataclass(frozen=True)
class ENodeDecl:
    """One selectable e-node constructor (`name` is its stable egglog name)."""

    name: str
    sort: Sort                                # what it builds
    params: tuple[Param, ...]
    kind: KernelKind | None = None            # the LLIR kernel a T constructor launches (None: no launch)
    operands: tuple[tuple[str, str], ...] = ()  # (tensor, view) parameter pairs: the kernel's inputs, in order
    dtype: str | None = None                  # dtype rule: dtype(node) = this String parameter ...
    dtype_const: str | None = None            # ... or this literal (a variant stands for its F32 value)
    knob: tuple[str, str] | None = None       # (parameter, tag prefix): the precision tag extraction reads
    op: Op | None = None                      # the HLIR primop a scalar constructor applies

    def __post_init__(self):
        names = [p.name for p in self.params]
        if len(set(names)) != len(names):
            raise ValueError(f"{self.name}: duplicate parameter names {names}")
        for ref in [*(x for pair in self.operands for x in pair), self.dtype, self.knob and self.knob[0]]:
            if ref and ref not in names:
                raise ValueError(f"{self.name}: {ref!r} is not one of its parameters {names}")
        if self.sort is Sort.T and (self.dtype is None) == (self.dtype_const is None):
            raise ValueError(f"{self.name}: a tensor constructor needs exactly one dtype rule")

    def index(self, param: str) -> int:
        """Position of `param` among the children (the serialized e-node keeps constructor order)."""
        for i, p in enumerate(self.params):
            if p.name == param:
                return i
        raise KeyError(f"{self.name} has no parameter {param!r} (it has {', '.join(p.name for p in self.params)})")


_T, _F, _B = Sort.T, Sort.F, Sort.B
K = KernelKind

# Tensor kernels (sort T). Parameter order is the egglog constructor's: changing it changes e-graphs.
TENSOR_DECLS: tuple[ENodeDecl, ...] = (
    ENodeDecl("KExt", _T, params("slot:i64 dt:S"), dtype="dt"),  # a chunk source: the buffer itself
    ENodeDecl("KConst", _T, params("cid:i64 dt:S"), K.CONST, dtype="dt"),
    ENodeDecl("KIota", _T, params("length:i64 dt:S"), K.IOTA, dtype="dt"),
    ENodeDecl("Ew", _T, params("body:F dt:S"), K.ELEMENTWISE, dtype="dt"),
    ENodeDecl("KSum", _T, params("body:F axis:i64 acc:S dt:S"), K.SUM, dtype="dt"),
    ENodeDecl("KMax", _T, params("body:F axis:i64 dt:S"), K.MAX, dtype="dt"),
    ENodeDecl("KSoftmax", _T, params("body:F axis:i64 prec:S dt:S"), K.SOFTMAX, dtype="dt",
              knob=("prec", "softmax:")),
    ENodeDecl("KGemm", _T, params("a:T va:i64 b:T vb:i64 layout:i64 prec:S dt:S"), K.GEMM,
              operands=(("a", "va"), ("b", "vb")), dtype="dt", knob=("prec", "gemm:")),
    ENodeDecl("KGather", _T, params("table:T vt:i64 idx:T vi:i64 dt:S"), K.GATHER,
              operands=(("table", "vt"), ("idx", "vi")), dtype="dt"),
    ENodeDecl("KScatter", _T, params("dest:T vd:i64 src:T vs:i64 idx:T vi:i64 dt:S"), K.SCATTER,
              operands=(("dest", "vd"), ("src", "vs"), ("idx", "vi")), dtype="dt"),
    ENodeDecl("KScatterNoCopy", _T, params("dest:B vd:i64 src:T vs:i64 idx:T vi:i64 dt:S"), K.SCATTER_NOCOPY,
              operands=(("dest", "vd"), ("src", "vs"), ("idx", "vi")), dtype="dt"),
    # An alias: the F32 value of a buffer held in a lower-precision format (consumers widen on load).
    ENodeDecl("KVariant", _T, params("inner:T tag:S"), dtype_const="f32", knob=("tag", "")),
    # A weight (chunk source `slot`) held in storage format `fmt`; readers widen each element on load
    # (luminal_num.quant.stored). No launch: the compiler converts it once, the plan's weights file holds it.
    ENodeDecl("KStored", _T, params("slot:i64 fmt:S"), dtype_const="f32", knob=("fmt", "store:")),
    # A Gemm's A operand in the variant's format, contiguous (batch, M, K), dynamic scales beside it.
    ENodeDecl("KQuantize", _T, params("a:T va:i64 layout:i64 prec:S dt:S"), K.QUANTIZE,
              operands=(("a", "va"),), dtype="dt"),
    # A Gemm (variant `prec`) with the elementwise consumer `epi` computed on its FP32 accumulator before
    # its one store in dt; `acc` is the plain Gemm's e-class, which `epi` reads by its identity view
    # (search/rules/fuse_gemm.py). No knob: its variant is the one chosen for `acc`.
    ENodeDecl("KGemmEpi", _T, params("a:T va:i64 b:T vb:i64 layout:i64 prec:S acc:T epi:F dt:S"), K.GEMM_EPILOGUE,
              operands=(("a", "va"), ("b", "vb")), dtype="dt"),
    # Compile-time weights (the external slots in the group's concats table entry `cat`) concatenated along
    # their rows: one buffer the compiler builds once (no launch), read by a horizontally fused Gemm.
    ENodeDecl("KCatW", _T, params("cat:i64"), dtype_const="f32"),
    # The same concatenation with every part held in storage format `fmt` (each part's stored values and
    # scales kept: quant/concat.py), read widened on load as KStored is. No launch, no knob: extraction
    # takes it where the genome stores every part in `fmt` (search/horizontal.SliceChoice).
    ENodeDecl("KCatStored", _T, params("cat:i64 fmt:S"), dtype_const="f32"),
    # An alias: the value is `src`'s buffer read through `view` (a horizontally fused Gemm's columns of
    # one part); readers compose their own view on top of it. No launch.
    ENodeDecl("KSlice", _T, params("src:T view:i64"), dtype_const="f32"),
    # A KV-cache input (chunk source `slot`, overwritten in place by the step's Scatter) held in KV format
    # `fmt` (luminal_num.quant.kv): the Scatter writes its rows converted, attention reads them widened.
    ENodeDecl("KCacheStored", _T, params("slot:i64 fmt:S"), dtype_const="f32", knob=("fmt", "kv:")),
    # Hadamard rotation of a Gemm's K (hlir/rotation.py, search/rules/rotate.py). No launch for any of them:
    # weight `slot` with its rows rotated by the block-diagonal H of blocks `block` (computed in FP64 once);
    ENodeDecl("KRotW", _T, params("slot:i64 block:i64"), dtype_const="f32"),
    # ... the same rotated weight held in storage format `fmt` (widened on load, as KStored);
    ENodeDecl("KRotStored", _T, params("slot:i64 block:i64 fmt:S"), dtype_const="f32", knob=("fmt", "store:")),
    # ... H_b itself, the (b, b) operand of the FP32 Gemm that rotates the activation online;
    ENodeDecl("KHadamard", _T, params("block:i64"), dtype_const="f32"),
    # ... and an alias: the value is `inner`'s (a Gemm of the rotated activation and weight), a knob `rot:`.
    ENodeDecl("KRotated", _T, params("inner:T rot:S"), dtype_const="f32", knob=("rot", "rot:")),
    # Per-channel smoothing of a Gemm's K (hlir/smoothing.py, search/rules/smooth.py). No launch for any of them:
    # weight `slot` with its columns scaled by 2^e (e of smoothing `sm` over group `grp`'s weights);
    ENodeDecl("KSmoothW", _T, params("slot:i64 grp:i64 sm:S"), dtype_const="f32"),
    # ... the same smoothed weight held in storage format `fmt` (widened on load, as KStored);
    ENodeDecl("KSmoothStored", _T, params("slot:i64 grp:i64 sm:S fmt:S"), dtype_const="f32", knob=("fmt", "store:")),
    # ... the (K,) vector 2^-e an elementwise kernel multiplies the activation by;
    ENodeDecl("KSmoothInv", _T, params("grp:i64 sm:S"), dtype_const="f32"),
    # ... and an alias: the value is `inner`'s (the Gemm of the smoothed activation and weight), a knob `smooth:`.
    ENodeDecl("KSmoothed", _T, params("inner:T sm:S"), dtype_const="f32", knob=("sm", "smooth:")),
    # softmax(Q K^T * scale + bias) V as one kernel (codegen/attention.py); `scale` is a constant id
    ENodeDecl("KAttention", _T, params("q:T vq:i64 k:T vk:i64 bias:T vb:i64 v:T vv:i64 scale:i64 prec:S dt:S"),
              K.ATTENTION, operands=(("q", "vq"), ("k", "vk"), ("bias", "vb"), ("v", "vv")), dtype="dt",
              knob=("prec", "attn:")),
    # An elementwise body computed one block per row (last axis): it may hold row sums (FRowSum) read
    # through per-row views (FAt), so a norm is one kernel (search/rules/fuse_rows.py).
    ENodeDecl("KRows", _T, params("body:F dt:S"), K.ROWS, dtype="dt"),
    # An in-place KV-cache write whose source rows `body` computes (RoPE fused with the cache write).
    ENodeDecl("KScatterEw", _T, params("dest:B vd:i64 body:F idx:T vi:i64 dt:S"), K.SCATTER_EW,
              operands=(("dest", "vd"), ("idx", "vi")), dtype="dt"),
)

BUFFER_DECLS: tuple[ENodeDecl, ...] = (ENodeDecl("ConsumedBuffer", _B, params("t:T")),)

# Scalar bodies (sort F): loads, constants, roundings, and one constructor per elementwise primop.
SCALAR_DECLS: tuple[ENodeDecl, ...] = (
    ENodeDecl("Load", _F, params("t:T view:i64")),
    ENodeDecl("FConst", _F, params("cid:i64 view:i64")),  # view: keeps the iteration shape
    ENodeDecl("FRound", _F, params("x:F dt:S")),
    ENodeDecl("FCustom", _F, params("kind:S x:F"), op=Op.CUSTOM),
    *(ENodeDecl("F" + o.decl.name, _F, params("x:F"), op=o) for o in UNARY_OPS),
    *(ENodeDecl("F" + o.decl.name, _F, params("a:F b:F"), op=o) for o in BINARY_OPS),
    # Row-kernel bodies (search/rules/fuse_rows.py): RowBody(x) is x inside a KRows body (its own
    # e-classes, so row sums never reach ordinary kernels' bodies); FRowSum is the last-axis sum of its
    # body stored as dt; FAt reads a scalar value through a view, as a load reads a buffer.
    ENodeDecl("RowBody", _F, params("x:F")),
    ENodeDecl("FRowSum", _F, params("body:F acc:S dt:S")),
    ENodeDecl("FAt", _F, params("x:F view:i64")),
)

DECLS: Mapping[str, ENodeDecl] = MappingProxyType({d.name: d for d in TENSOR_DECLS + BUFFER_DECLS + SCALAR_DECLS})
assert len(DECLS) == len(TENSOR_DECLS + BUFFER_DECLS + SCALAR_DECLS), "two declarations share a name"
DECL_OF_KIND: Mapping[KernelKind, ENodeDecl] = MappingProxyType({d.kind: d for d in TENSOR_DECLS if d.kind})
# EXTERNAL is a graph input buffer: no e-node produces it (KExt resolves to the source's kernel).
LOWERED_KINDS = frozenset(DECL_OF_KIND) | {KernelKind.EXTERNAL}


def decl(name: str) -> ENodeDecl:
    try:
        return DECLS[name]
    except KeyError:
        raise KeyError(f"{name!r} is not a declared kernel constructor") from None


# -- backend tables ---------------------------------------------------------------------------
V = TypeVar("V")


def assert_covers(table: Mapping[KernelKind, object], kinds: Iterable[KernelKind], backend: str) -> None:
    """Fail with one line naming what `backend`'s table lacks (or has that is not a kind)."""
    want = set(kinds)
    missing = sorted(k.value for k in want - set(table))
    extra = sorted(repr(k) for k in set(table) - set(KernelKind))
    if missing or extra:
        raise AssertionError(f"backend table {backend!r}: missing kinds {missing}" + (f", not kinds {extra}" if extra else ""))


def backend_table(backend: str, entries: Mapping[KernelKind, V],
                  kinds: Iterable[KernelKind] = tuple(KernelKind)) -> Mapping[KernelKind, V]:
    """A read-only table keyed by kind, checked for coverage when it is built (at import)."""
    assert_covers(entries, kinds, backend)
    return MappingProxyType(dict(entries))


LAUNCHED_KINDS: tuple[KernelKind, ...] = tuple(k for k in KernelKind if k.launches)
