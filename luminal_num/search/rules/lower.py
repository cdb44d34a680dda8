"""`lower`: every HLIR op -> its kernel op; Mul+SumReduce over matmul views -> Gemm; elementwise fusion.

All rules are generated from the op declarations (one rule per op group, not one per op).
"""
from __future__ import annotations

from egglog import String, eq, i64, rewrite, rule, ruleset, union, var, vars_

from ...hlir.ops import BINARY_OPS, UNARY_OPS, Op
from .. import egraph as E

lower = ruleset(name="lower")

x, y, z = vars_("x y z", E.T)
vx, vy, vz, v, vi, vo, ax, c, n, slot, lay = vars_("vx vy vz v vi vo ax c n slot lay", i64)
d, acc, kind = vars_("d acc kind", String)
body, fa, fb = vars_("body fa fb", E.F)


@lower.register
def _lower_ops():
    # Sources: the value is the buffer itself (an external slot, a scalar constant, an arange).
    yield rewrite(E.HExt(slot, d)).to(E.KExt(slot, d))
    yield rewrite(E.HLIR[Op.CONSTANT](c, d)).to(E.KConst(c, d))
    yield rewrite(E.HLIR[Op.IOTA](n, d)).to(E.KIota(n, d))
    # Elementwise: the kernel evaluates the op on loads of its sources through their views.
    for op in UNARY_OPS:
        yield rewrite(E.HLIR[op](x, vx, d)).to(E.Ew(E.FUNARY[op](E.Load(x, vx)), d))
    for op in BINARY_OPS:
        yield rewrite(E.HLIR[op](x, vx, y, vy, d)).to(E.Ew(E.FBINARY[op](E.Load(x, vx), E.Load(y, vy)), d))
    yield rewrite(E.HLIR[Op.CUSTOM](x, vx, kind, d)).to(E.Ew(E.FCustom(kind, E.Load(x, vx)), d))
    # Cast: a copy kernel whose store rounds to the target dtype.
    yield rewrite(E.HLIR[Op.CAST](x, vx, d)).to(E.Ew(E.Load(x, vx), d))
    # Output: a copy through the view (identity views are unioned with the source below).
    yield rewrite(E.HLIR[Op.OUTPUT](x, vx, n, d)).to(E.Ew(E.Load(x, vx), d))
    # Reductions: the body is evaluated over the un-reduced index space; the accumulator is the
    # storage dtype by default (the precision phase adds other accumulators).
    yield rewrite(E.HLIR[Op.SUM_REDUCE](x, vx, ax, d)).to(E.KSum(E.Load(x, vx), ax, d, d))
    yield rewrite(E.HLIR[Op.MAX_REDUCE](x, vx, ax, d)).to(E.KMax(E.Load(x, vx), ax, d))
    yield rewrite(E.HLIR[Op.SOFTMAX](x, vx, ax, d)).to(E.KSoftmax(E.Load(x, vx), ax, d, d))
    yield rewrite(E.HLIR[Op.GATHER](x, vx, y, vy, d)).to(E.KGather(x, vx, y, vy, d))
    yield rewrite(E.HLIR[Op.SCATTER](x, vx, y, vy, z, vz, d)).to(E.KScatter(x, vx, y, vy, z, vz, d))


@lower.register
def _views_and_fusion():
    # An Output read through the identity view of a same-dtype value is that value (no copy).
    yield rule(eq(z).to(E.HLIR[Op.OUTPUT](x, vx, n, d)), eq(vx).to(E.identity_view(x)), eq(d).to(E.dtype(x))
               ).then(union(z).with_(x))
    # Fusion: reading element i of an elementwise kernel through its identity view = its body at i,
    # rounded to the kernel's storage dtype (so fusing never skips a rounding the plan promised).
    # FRound(body, "f32") is kept as a node (lowering drops it: bodies compute in FP32, so it is
    # exact): merging the read with the body itself would put every variant's rounding of the value
    # into the body's own e-class, and a consumer could no longer pick a rounding its producer lacks.
    yield rule(eq(fa).to(E.Load(x, v)), eq(x).to(E.Ew(body, d)), eq(v).to(E.identity_view(x))
               ).then(union(fa).with_(E.FRound(body, d)))
    # A scalar constant read through any unmasked (broadcast) view is the constant everywhere (the
    # view stays an argument so loads of different shapes never share an e-class).
    yield rule(eq(fa).to(E.Load(x, v)), eq(x).to(E.KConst(c, "f32")), E.Unmasked(v)).then(union(fa).with_(E.FConst(c, v)))
    # A stacked view = materialise the lower views (a copy kernel), then read with the top view.
    yield rule(eq(fa).to(E.Load(x, v)), E.SplitView(v, vi, vo), eq(d).to(E.dtype(x))
               ).then(union(fa).with_(E.Load(E.Ew(E.Load(x, vi), d), vo)))


@lower.register
def _gemm():
    # sum_k A[.., m, k] * B[.., k, n] over strided views with the layout math of hlir/gemm.py
    # (transposes are strides, batch axes share one launch): a Gemm in the storage precision.
    # Only an FP32-accumulated sum is a plain Gemm (exact products, FP32 accumulation, stored in d);
    # a sum accumulated in BF16 is not any Gemm variant, so it stays a reduction.
    product = E.FBINARY[Op.MUL](E.Load(x, vx), E.Load(y, vy))
    for body_form in (product, E.FRound(product, "f32")):  # the Mul fused into the sum, exactly
        yield rule(eq(z).to(E.KSum(body_form, ax, "f32", d)),
                   E.GemmLayoutOf(vx, vy, ax, lay)).then(union(z).with_(E.KGemm(x, vx, y, vy, lay, "f32", d)))
