"""`precision`: equal-up-to-rounding implementations of each value in other formats.

Every rule rewrites from the literal "f32" form that lowering produced, so it fires once per e-node
and the phase terminates (no rule's output matches any rule's input). Variants keep the e-class's
logical dtype: a value held in BF16 is `KVariant(inner, tag)`, an alias whose consumers read the
BF16 buffer and widen on load (exact), so no cast kernel ever runs. The catalogues in
dtypes/variants.py are the data; this module only turns them into rules.
"""
from __future__ import annotations

from egglog import String, eq, i64, rule, ruleset, union, var, vars_

from ...dtypes.formats import BF16, F32
from ...dtypes.variants import ELEMENTWISE_VARIANTS, GEMM_VARIANTS, REDUCE_VARIANTS
from ...hlir.ops import BINARY_OPS, UNARY_OPS, Op
from ...hlir.rotation import ROTATION_BLOCKS
from ...hlir.smoothing import SMOOTHINGS
from ...quant.kv import KV_HEAD_DIMS, KV_HEAD_FORMAT, KV_TOKEN_FORMATS
from ...quant.stored import CALIBRATED_CHOICES, GGUF_KEPT, SEARCHED_STORAGE, SOURCE_BLOCKS
from .. import egraph as E

precision = ruleset(name="precision")

t, x, y, inner = vars_("t x y inner", E.T)
vx, vy, ax, lay, v, vq = vars_("vx vy ax lay v vq", i64)
kind, d, tag = vars_("kind d tag", String)
body = var("body", E.F)
fa = var("fa", E.F)


def _in(f, fmt):
    """A value as the kernel's arithmetic sees it: rounded to BF16 when computing in BF16."""
    return f if fmt is F32 else E.FRound(f, fmt.name)


def _elementwise_bodies(compute):
    """(HLIR pattern, kernel body computing in `compute`) for every elementwise primop."""
    for op in UNARY_OPS:
        yield E.HLIR[op](x, vx, "f32"), _in(E.FUNARY[op](_in(E.Load(x, vx), compute)), compute)
    for op in BINARY_OPS:
        yield (E.HLIR[op](x, vx, y, vy, "f32"),
               _in(E.FBINARY[op](_in(E.Load(x, vx), compute), _in(E.Load(y, vy), compute)), compute))
    yield E.HLIR[Op.CUSTOM](x, vx, kind, "f32"), _in(E.FCustom(kind, _in(E.Load(x, vx), compute)), compute)


@precision.register
def _elementwise_variants():
    for name, p in ELEMENTWISE_VARIANTS.items():
        if p.compute is F32 and p.storage is F32:
            continue  # the lowering's own form
        for pattern, kbody in _elementwise_bodies(p.compute):
            # compute in p.compute, store in p.storage: the F32 value up to those two roundings
            yield rule(eq(t).to(pattern)).then(union(t).with_(E.KVariant(E.Ew(kbody, p.storage.name), "ew:" + name)))


@precision.register
def _fuse_variants():
    # reading a low-precision elementwise value through its identity view = its body rounded to its
    # storage format: consumers fuse it as they fuse FP32 producers, keeping the variant's rounding
    yield rule(eq(fa).to(E.Load(x, v)), eq(x).to(E.KVariant(inner, tag)), eq(inner).to(E.Ew(body, d)),
               eq(v).to(E.identity_view(x))).then(union(fa).with_(E.FRound(body, d)))


@precision.register
def _reduction_variants():
    for name, p in REDUCE_VARIANTS.items():
        if p.acc is F32 and p.storage is F32:
            continue
        # accumulate rounding to p.acc after every add, store in p.storage: the sum up to gamma_n(u_acc)
        yield rule(eq(t).to(E.KSum(body, ax, "f32", "f32"))).then(
            union(t).with_(E.KVariant(E.KSum(body, ax, p.acc.name, p.storage.name), "sum:" + name)))
    # softmax with BF16-rounded inputs and a BF16-rounded result: the distribution up to ~3 u_bf16
    yield rule(eq(t).to(E.KSoftmax(body, ax, "f32", "f32"))).then(
        union(t).with_(E.KSoftmax(body, ax, BF16.name, "f32")))


@precision.register
def _gemm_variants():
    for name, v in GEMM_VARIANTS.items():
        if name == "f32":
            continue
        guard = [E.IsWeight(y)] if v.b_scale is not None and v.b_scale.static else []
        # the same product with operands rounded/quantized and accumulated as `v` says: equal up to
        # v.a_priori_bound; static weight scales need B to be a compile-time weight (IsWeight).
        f32_gemm = E.KGemm(a=x, va=vx, b=y, vb=vy, layout=lay, prec="f32", dt="f32")
        if v.a_scale is not None and not v.a_scale.static and not v.a_prologue:
            # activations scaled at run time: A goes through its own QUANTIZE kernel ((batch, M, K) in
            # the variant's format, scales beside it), which the Gemm reads by QuantView's view
            a = E.KQuantize(a=x, va=vx, layout=lay, prec=name, dt=v.a_format.name)
            yield rule(eq(t).to(f32_gemm), *guard, E.QuantView(lay, vq)).then(
                union(t).with_(E.KGemm(a=a, va=vq, b=y, vb=vy, layout=lay, prec=name, dt="f32")))
        else:  # (a prologue variant quantizes A itself, reading it raw)
            yield rule(eq(t).to(f32_gemm), *guard).then(
                union(t).with_(E.KGemm(a=x, va=vx, b=y, vb=vy, layout=lay, prec=name, dt="f32")))


@precision.register
def _weight_storage():
    # a 2-D weight held in a storage format and widened on load: the same value up to its storage
    # error, which the compiler knows exactly (quant.stored.storage_error); KStored matches no rule
    for fmt in SEARCHED_STORAGE:
        yield rule(eq(t).to(E.KExt(vx, "f32")), E.MatrixWeight(t)).then(union(t).with_(E.CTOR["KStored"](vx, fmt)))
    # the same format filled by a calibration-aware rounding (GPTQ) where a Gemm reads the weight K-major (so
    # the compile's FP64 pass collects its Hessian): the same value up to its stored values' error, which the
    # compiler knows exactly too (storage_error reads the filled values, not the format's rounding bound)
    for choice in CALIBRATED_CHOICES:
        yield rule(eq(t).to(E.KExt(vx, "f32")), E.MatrixWeight(t), E.CalibratedWeight(t)).then(
            union(t).with_(E.CTOR["KStored"](vx, choice)))
    # a rotated weight (search/rules/rotate.py) held in a storage format: the same value up to its storage error
    # from its FP64 rotation, which the compiler knows exactly (error/static.py); filled by GPTQ under the
    # rotated Hessian where its source has one (quant/calibration.py)
    for b in ROTATION_BLOCKS:
        for fmt in SEARCHED_STORAGE:
            yield rule(eq(t).to(E.CTOR["KRotW"](vx, b))).then(union(t).with_(E.CTOR["KRotStored"](vx, b, fmt)))
        for choice in CALIBRATED_CHOICES:
            yield rule(eq(t).to(E.CTOR["KRotW"](vx, b)), eq(x).to(E.KExt(vx, "f32")), E.CalibratedWeight(x)).then(
                union(t).with_(E.CTOR["KRotStored"](vx, b, choice)))
    # a smoothed weight (search/rules/smooth.py) held in a storage format: the same value up to its storage error
    # from W diag(2^e), which the compiler knows exactly (error/static.py); filled by GPTQ under the smoothed
    # Hessian where its source has one (quant/calibration.py)
    for sm in SMOOTHINGS:
        for fmt in SEARCHED_STORAGE:
            yield rule(eq(t).to(E.CTOR["KSmoothW"](vx, vy, sm))).then(
                union(t).with_(E.CTOR["KSmoothStored"](vx, vy, sm, fmt)))
        for choice in CALIBRATED_CHOICES:
            yield rule(eq(t).to(E.CTOR["KSmoothW"](vx, vy, sm)), eq(x).to(E.KExt(vx, "f32")), E.CalibratedWeight(x)
                       ).then(union(t).with_(E.CTOR["KSmoothStored"](vx, vy, sm, choice)))
    # a weight loaded from GGUF Q4_1 / Q8_0 blocks kept in them: zero storage error (they ARE its values)
    for fmt in GGUF_KEPT:
        yield rule(eq(t).to(E.KExt(vx, "f32")), E.MatrixWeight(t), E.GGUFSource(t, fmt)).then(
            union(t).with_(E.CTOR["KStored"](vx, fmt)))
    # chunks of the group loaded it from blocks of different types (Q4_K_M's Q4_K / Q6_K layers): each
    # chunk's weight held in its own blocks (quant.stored.held_format): zero storage error in every chunk
    yield rule(eq(t).to(E.KExt(vx, "f32")), E.MatrixWeight(t), E.GGUFSourcePerChunk(t)).then(
        union(t).with_(E.CTOR["KStored"](vx, SOURCE_BLOCKS)))


@precision.register
def _cache_storage():
    # a KV-cache input overwritten in place, held in a KV format: every row (old ones on entry, new ones as
    # the Scatter writes them) is the same value up to its row's quantization (quant.kv.cache_error);
    # per-head scales only where the readers' head width is known (KVCache's second field)
    for fmt in KV_TOKEN_FORMATS:
        yield rule(eq(t).to(E.KExt(vx, "f32")), E.KVCache(t, vy)).then(union(t).with_(E.CTOR["KCacheStored"](vx, fmt)))
    for head in KV_HEAD_DIMS:
        yield rule(eq(t).to(E.KExt(vx, "f32")), E.KVCache(t, head)).then(
            union(t).with_(E.CTOR["KCacheStored"](vx, KV_HEAD_FORMAT.format(head=head))))
