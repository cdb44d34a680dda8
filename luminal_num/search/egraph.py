"""egglog sorts and constructors, derived from the HLIR op declarations.

Sort `T` is a tensor value: one e-class holds the HLIR term and every kernel implementation of the
same value (up to rounding). Sort `F` is a per-element scalar expression evaluated inside a kernel
(fused elementwise bodies, reduction bodies). `B` is a buffer handed to an in-place kernel.
Views, constants and Gemm layouts are interned Python values referenced by i64 ids.
"""
from __future__ import annotations

import inspect
from egglog import Expr, StringLike, function, i64, i64Like, relation, String

from ..codegen.kinds import DECLS, Sort
from ..hlir.ops import BINARY_OPS, UNARY_OPS, Op


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

# Kernel, buffer and scalar constructors: generated from the declarations in codegen/kinds.py.
_SORT_TYPE = {Sort.T: T, Sort.F: F, Sort.B: B, Sort.I64: i64Like, Sort.STR: StringLike}
_SORT_CLASS = {Sort.T: T, Sort.F: F, Sort.B: B}
CTOR: dict[str, object] = {d.name: _constructor(d.name, [(p.name, _SORT_TYPE[p.sort]) for p in d.params],
                                                _SORT_CLASS[d.sort]) for d in DECLS.values()}
KExt, KConst, KIota, Ew = CTOR["KExt"], CTOR["KConst"], CTOR["KIota"], CTOR["Ew"]
KSum, KMax, KSoftmax, KGemm = CTOR["KSum"], CTOR["KMax"], CTOR["KSoftmax"], CTOR["KGemm"]
KGather, KScatter, KScatterNoCopy = CTOR["KGather"], CTOR["KScatter"], CTOR["KScatterNoCopy"]
KQuantize, ConsumedBuffer = CTOR["KQuantize"], CTOR["ConsumedBuffer"]
# The F32 value of a buffer held in a lower-precision format (a precision variant). It launches
# nothing: consumers read `inner`'s buffer and widen on load (exact), so low-precision kernels hand
# data to each other without casts. `tag` names the variant ("ew:bf16", "sum:f16_accf32", ...).
KVariant = CTOR["KVariant"]
Load, FConst, FRound, FCustom = CTOR["Load"], CTOR["FConst"], CTOR["FRound"], CTOR["FCustom"]
FUNARY: dict[Op, object] = {op: CTOR["F" + op.decl.name] for op in UNARY_OPS}
FBINARY: dict[Op, object] = {op: CTOR["F" + op.decl.name] for op in BINARY_OPS}

# Analyses and facts computed in Python from the view algebra (hlir/gemm.py) by search/encode.py.
dtype = _constructor("dtype", [("t", T)], String)          # no merge: a conflicting fact is an error
identity_view = _constructor("identity_view", [("t", T)], i64)
GemmLayoutOf = relation("GemmLayoutOf", i64, i64, i64, i64)     # (va, vb, k_axis, layout id)
SplitView = relation("SplitView", i64, i64, i64)                # (view, inner view, outer view)
Unmasked = relation("Unmasked", i64)                            # view reads every element it indexes
SoleReader = relation("SoleReader", T)                          # the value has exactly one consumer
IsWeight = relation("IsWeight", T)                              # compile-time-known value (static scales)
MatrixWeight = relation("MatrixWeight", T)                      # a 2-D weight: may be held in a storage format
QuantView = relation("QuantView", i64, i64)                     # (layout, view a Gemm reads its QUANTIZE buffer by)
GGUFSource = relation("GGUFSource", T, String)                  # a weight loaded from GGUF blocks of this storage format
CalibratedWeight = relation("CalibratedWeight", T)               # read K-major by a Gemm: has a calibration Hessian
GGUFSourcePerChunk = relation("GGUFSourcePerChunk", T)           # loaded from GGUF blocks in every chunk, of types that differ
# (va, vb, layout, block, rotation's A view, its B view, its layout, the rotated Gemm's A view): a Gemm x W^T
# whose weight may be rotated along K, with the views and layouts of the two Gemms that compute it rotated
RotationOf = relation("RotationOf", i64, i64, i64, i64, i64, i64, i64, i64)
# (weight slot, va, vb, layout, smoothing group, x's (M..., K) view, the scale vector's view, the smoothed Gemm's
# A view): a Gemm x W^T whose K may be smoothed (search/rules/smooth.py), group: ChunkTables.smooth_groups
SmoothOf = relation("SmoothOf", i64, i64, i64, i64, i64, i64, i64, i64)
KVCache = relation("KVCache", T, i64)                           # a cache input a Scatter overwrites in place, its head width (0: unknown)


SELECTABLE = frozenset(DECLS)
HLIR_NAMES = frozenset(["HExt"] + ["H" + op.decl.name for op in HLIR])
