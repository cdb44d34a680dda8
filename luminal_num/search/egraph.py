"""egglog sorts and constructors, derived from the HLIR op declarations.

Sort `T` is a tensor value: one e-class holds the HLIR term and every kernel implementation of the
same value (up to rounding). Sort `F` is a per-element scalar expression evaluated inside a kernel
(fused elementwise bodies, reduction bodies). `B` is a buffer handed to an in-place kernel.
Views, constants and Gemm layouts are interned Python values referenced by i64 ids.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass

from egglog import Expr, StringLike, function, i64, i64Like, relation, String

from ..hlir.ops import BINARY_OPS, UNARY_OPS, Group, Op


class T(Expr):
    """A tensor value."""


class F(Expr):
    """A scalar expression evaluated per element inside one kernel."""


class B(Expr):
    """A buffer a kernel may overwrite."""


def _constructor(name: str, params: list[tuple[str, type]], ret: type):
    """A bodiless egglog constructor with a generated signature (egg_fn = name, stable)."""
    def f(*args): ...
    f.__name__ = f.__qualname__ = name
    f.__annotations__ = {**dict(params), "return": ret}
    f.__signature__ = inspect.Signature(
        [inspect.Parameter(p, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=t) for p, t in params],
        return_annotation=ret)
    return function(f, egg_fn=name)


# Attribute types: every HLIR attribute is an i64 id (input slot, constant id, dim id, axis) or a String.
_ATTR_TYPES = {"name": i64Like, "value": i64Like, "length": i64Like, "axis": i64Like, "kind": StringLike}


def _hlir_params(op: Op) -> list[tuple[str, type]]:
    arity = 1 if op is Op.CUSTOM else op.decl.arity
    params: list[tuple[str, type]] = []
    for i in range(arity):
        params += [(f"x{i}", T), (f"v{i}", i64Like)]
    params += [(a, _ATTR_TYPES[a]) for a in op.decl.attrs]
    return params + [("dt", StringLike)]


# One HLIR constructor per primop (Input is replaced by HExt: chunk sources are external slots).
HLIR: dict[Op, object] = {op: _constructor("H" + op.decl.name, _hlir_params(op), T) for op in Op if op is not Op.INPUT}
HExt = _constructor("HExt", [("slot", i64Like), ("dt", StringLike)], T)

# Kernel ops (sort T): what the runtimes execute.
KExt = _constructor("KExt", [("slot", i64Like), ("dt", StringLike)], T)
KConst = _constructor("KConst", [("cid", i64Like), ("dt", StringLike)], T)
KIota = _constructor("KIota", [("length", i64Like), ("dt", StringLike)], T)
Ew = _constructor("Ew", [("body", F), ("dt", StringLike)], T)
KSum = _constructor("KSum", [("body", F), ("axis", i64Like), ("acc", StringLike), ("dt", StringLike)], T)
KMax = _constructor("KMax", [("body", F), ("axis", i64Like), ("dt", StringLike)], T)
KSoftmax = _constructor("KSoftmax", [("body", F), ("axis", i64Like), ("prec", StringLike), ("dt", StringLike)], T)
KGemm = _constructor("KGemm", [("a", T), ("va", i64Like), ("b", T), ("vb", i64Like), ("layout", i64Like),
                               ("prec", StringLike), ("dt", StringLike)], T)
KGather = _constructor("KGather", [("table", T), ("vt", i64Like), ("idx", T), ("vi", i64Like), ("dt", StringLike)], T)
KScatter = _constructor("KScatter", [("dest", T), ("vd", i64Like), ("src", T), ("vs", i64Like), ("idx", T),
                                     ("vi", i64Like), ("dt", StringLike)], T)
KScatterNoCopy = _constructor("KScatterNoCopy", [("dest", B), ("vd", i64Like), ("src", T), ("vs", i64Like),
                                                 ("idx", T), ("vi", i64Like), ("dt", StringLike)], T)
ConsumedBuffer = _constructor("ConsumedBuffer", [("t", T)], B)
# The F32 value of a buffer held in a lower-precision format (a precision variant). It launches
# nothing: consumers read `inner`'s buffer and widen on load (exact), so low-precision kernels hand
# data to each other without casts. `tag` names the variant ("ew:bf16", "sum:f16_accf32", ...).
KVariant = _constructor("KVariant", [("inner", T), ("tag", StringLike)], T)

# Scalar expressions (sort F).
Load = _constructor("Load", [("t", T), ("view", i64Like)], F)
FConst = _constructor("FConst", [("cid", i64Like), ("view", i64Like)], F)  # view: keeps the iteration shape
FRound = _constructor("FRound", [("x", F), ("dt", StringLike)], F)
FCustom = _constructor("FCustom", [("kind", StringLike), ("x", F)], F)
FUNARY: dict[Op, object] = {op: _constructor("F" + op.decl.name, [("x", F)], F) for op in UNARY_OPS}
FBINARY: dict[Op, object] = {op: _constructor("F" + op.decl.name, [("a", F), ("b", F)], F) for op in BINARY_OPS}

# Analyses and facts computed in Python from the view algebra (see hlir/gemm.py, search/facts.py).
dtype = _constructor("dtype", [("t", T)], String)          # no merge: a conflicting fact is an error
identity_view = _constructor("identity_view", [("t", T)], i64)
GemmLayoutOf = relation("GemmLayoutOf", i64, i64, i64, i64)     # (va, vb, k_axis, layout id)
SplitView = relation("SplitView", i64, i64, i64)                # (view, inner view, outer view)
Unmasked = relation("Unmasked", i64)                            # view reads every element it indexes
SoleReader = relation("SoleReader", T)                          # the value has exactly one consumer
IsWeight = relation("IsWeight", T)                              # compile-time-known value (static scales)


@dataclass(frozen=True)
class KernelCtor:
    """How a selectable e-node name maps to the kernel/scalar vocabulary (used by the choice space)."""

    name: str
    sort: str  # "T" | "F" | "B"


KERNEL_T = ("KExt", "KConst", "KIota", "Ew", "KSum", "KMax", "KSoftmax", "KGemm", "KGather", "KScatter",
            "KScatterNoCopy", "KVariant")
SCALAR_F = ("Load", "FConst", "FRound", "FCustom") + tuple("F" + o.decl.name for o in UNARY_OPS + BINARY_OPS)
BUFFER_B = ("ConsumedBuffer",)
SELECTABLE = frozenset(KERNEL_T + SCALAR_F + BUFFER_B)
HLIR_NAMES = frozenset(["HExt"] + ["H" + op.decl.name for op in HLIR])
UNARY_BY_NAME = {"F" + o.decl.name: o for o in UNARY_OPS}
BINARY_BY_NAME = {"F" + o.decl.name: o for o in BINARY_OPS}
assert all(o.group in (Group.UNARY, Group.BINARY) for o in UNARY_OPS + BINARY_OPS)
