"""`precision`: equal-up-to-rounding implementations of each value in other formats.

Every rule is guarded by the literal "f32" it rewrites from, so it fires once per e-node and the
phase terminates. Variants keep the e-class's logical dtype: a value stored in BF16 is wrapped in a
copy back to F32 (`Ew(Load(inner, iv), "f32")`), which the fusion rule dissolves into the consumer,
and Gemm reads a BF16/F16 buffer directly when its operand format is that format (exact round trip).
The catalogues in dtypes/variants.py are the data; this module only turns them into rules.
"""
from __future__ import annotations

from egglog import String, eq, i64, rule, ruleset, set_, union, var, vars_

from ...dtypes.formats import BF16, F32
from ...dtypes.variants import ELEMENTWISE_VARIANTS, GEMM_VARIANTS, REDUCE_VARIANTS
from ...hlir.ops import BINARY_OPS, UNARY_OPS, Op
from .. import egraph as E

precision = ruleset(name="precision")

t, x, y, inner = vars_("t x y inner", E.T)
vx, vy, ax, iv, lay = vars_("vx vy ax iv lay", i64)
kind = var("kind", String)
body = var("body", E.F)


def _in(f, fmt):
    """An operand as the kernel's arithmetic sees it: rounded to BF16 for BF16 compute."""
    return f if fmt is F32 else E.FRound(f, fmt.name)


def _elementwise_bodies(compute):
    """(HLIR pattern, kernel body computing in `compute`) for every elementwise primop."""
    for op in UNARY_OPS:
        yield E.HLIR[op](x, vx, "f32"), _in(E.FUNARY[op](_in(E.Load(x, vx), compute)), compute)
    for op in BINARY_OPS:
        yield (E.HLIR[op](x, vx, y, vy, "f32"),
               _in(E.FBINARY[op](_in(E.Load(x, vx), compute), _in(E.Load(y, vy), compute)), compute))
    yield E.HLIR[Op.CUSTOM](x, vx, kind, "f32"), _in(E.FCustom(kind, _in(E.Load(x, vx), compute)), compute)


def _stored_in(kernel, storage_name: str):
    """The F32-typed value of a kernel whose output buffer is in another storage format."""
    return E.Ew(E.Load(kernel, iv), "f32")


@precision.register
def _elementwise_variants():
    for name, p in ELEMENTWISE_VARIANTS.items():
        if p.compute is F32 and p.storage is F32:
            continue  # the lowering's own form
        for pattern, kbody in _elementwise_bodies(p.compute):
            kernel = E.Ew(kbody, p.storage.name)
            # compute in p.compute, store in p.storage, read back as F32: the value up to those roundings
            yield rule(eq(t).to(pattern), eq(iv).to(E.identity_view(t))).then(
                union(t).with_(_stored_in(kernel, p.storage.name)), set_(E.identity_view(kernel)).to(iv))


@precision.register
def _reduction_variants():
    for name, p in REDUCE_VARIANTS.items():
        if p.acc is F32 and p.storage is F32:
            continue
        kernel = E.KSum(body, ax, p.acc.name, p.storage.name)
        # accumulate with rounding to p.acc after every add, store in p.storage: same sum up to gamma_n(u_acc)
        yield rule(eq(t).to(E.KSum(body, ax, "f32", "f32")), eq(iv).to(E.identity_view(t))).then(
            union(t).with_(_stored_in(kernel, p.storage.name)), set_(E.identity_view(kernel)).to(iv))
    # softmax computed with BF16 inputs and output rounding: the same distribution up to ~2 u_bf16
    yield rewrite_softmax()


def rewrite_softmax():
    return rule(eq(t).to(E.KSoftmax(body, ax, "f32", "f32"))).then(
        union(t).with_(E.KSoftmax(body, ax, BF16.name, "f32")))


@precision.register
def _gemm_variants():
    for name, v in GEMM_VARIANTS.items():
        if name == "f32":
            continue
        guard = [E.IsWeight(y)] if v.b_scale is not None and v.b_scale.static else []
        # the same product with operands rounded/quantized as `v` says, accumulated as it says:
        # equal up to v.a_priori_bound; static weight scales need B to be a compile-time weight.
        yield rule(eq(t).to(E.KGemm(x, vx, y, vy, lay, "f32", "f32")), *guard).then(
            union(t).with_(E.KGemm(x, vx, y, vy, lay, name, "f32")))


@precision.register
def _gemm_reads_low_precision_buffers():
    for name, v in GEMM_VARIANTS.items():
        for side, fmt in (("a", v.a_format), ("b", v.b_format)):
            if fmt.name not in ("bf16", "f16"):
                continue
            # a BF16 buffer widened to F32 and rounded back to BF16 by the Gemm is itself: read it directly
            if side == "a":
                yield rule(eq(t).to(E.KGemm(x, vx, y, vy, lay, name, "f32")), eq(x).to(E.Ew(E.Load(inner, iv), "f32")),
                           eq(E.dtype(inner)).to(fmt.name), eq(iv).to(E.identity_view(x))).then(
                    union(t).with_(E.KGemm(inner, vx, y, vy, lay, name, "f32")))
            else:
                yield rule(eq(t).to(E.KGemm(x, vx, y, vy, lay, name, "f32")), eq(y).to(E.Ew(E.Load(inner, iv), "f32")),
                           eq(E.dtype(inner)).to(fmt.name), eq(iv).to(E.identity_view(y))).then(
                    union(t).with_(E.KGemm(x, vx, inner, vy, lay, name, "f32")))
