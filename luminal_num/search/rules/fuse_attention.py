"""`fuse_attention`: softmax(Q K^T * scale + bias) @ V -> one KAttention e-node, found by pattern.

What both model builders already produce after lowering (models/llama.py, models/bert.py,
models/testnets.py): a P V KGemm whose A operand is a KSoftmax over the key axis, whose body is
FRound(FAdd(FRound(FMul(Load(S), FConst(scale))), Load(bias))) with S the Q K^T KGemm read through
its identity view. The rule adds KAttention to the P V value's e-class, next to the unfused Gemm
(which stays extractable): the FP32 kernel always, its BF16/FP16 operand variants (matching the unfused
Gemms' operand roundings) only when precision is searched (a structure-only space stays FP32).
Python-computed facts (from the interned views and layouts) guard what egglog cannot see: P V reads
P broadcast along its N axis and reduces the key axis, and Q K^T reduces its last axis.
"""
from __future__ import annotations

from egglog import String, eq, i64, relation, rule, ruleset, union, var, vars_

from ...codegen.attention import ATTENTION_VARIANTS
from ...dtypes.formats import F32
from ...hlir.ops import Op
from ...hlir.shape import ShapeTracker, contiguous_strides
from .. import egraph as E
from ..encode import ChunkTables

fuse_attention = ruleset(name="fuse_attention")                # the FP32 fused kernel
fuse_attention_lowp = ruleset(name="fuse_attention_lowp")      # its low-precision variants (precision on)

# (P view, P V layout, softmax axis): P V reads the softmax output P (contiguous, score shape) broadcast
# along its one N axis, which sits just before its K axis (the last, = the softmax axis): out[a, c] =
# sum_j P[a, j] * V[a, c, j].
AttnRowView = relation("AttnRowView", i64, i64, i64)
# a Gemm layout reducing the last axis of its Mul (Q K^T: scores[a, j] = sum_d q[a, j, d] k[a, j, d])
LastAxisLayout = relation("LastAxisLayout", i64)
FloatConst = relation("FloatConst", i64)  # an interned constant that is a number (not a symbolic dim)

t, p, s, q, k, v, bias = vars_("t p s q k v bias", E.T)
vp, vv, vq, vk, vs, vb, vc, lpv, lqk, ax, c = vars_("vp vv vq vk vs vb vc lpv lqk ax c", i64)
sb, e_add, e_mul, e_dot, e_scale, e_bias = vars_("sb e_add e_mul e_dot e_scale e_bias", E.F)
d = var("d", String)


def attention_facts(tables: ChunkTables) -> list:
    """The guard facts of one group (pure functions of its interned views and layouts)."""
    facts: list = [LastAxisLayout(i) for i, lay in enumerate(tables.layouts) if lay.k_axis == len(lay.full_shape) - 1]
    facts += [FloatConst(i) for i, c in enumerate(tables.constants) if isinstance(c, tuple) and c[0] == "f"]
    layouts = [(i, lay) for i, lay in enumerate(tables.layouts)
               if lay.k_axis == len(lay.full_shape) - 1 and lay.n_axes == (len(lay.full_shape) - 2,)]
    for vid, st in enumerate(tables.views):
        for lid, lay in layouts:
            if _reads_rows(st, lay):
                facts.append(AttnRowView(vid, lid, len(lay.full_shape) - 2))
    return facts


def _reads_rows(st: ShapeTracker, lay) -> bool:
    """The view reads a contiguous score tensor (the full shape without the N axis) at offset 0,
    stride 0 along the N axis."""
    if len(st.views) != 1 or st.views[0].mask is not None or tuple(st.shape) != tuple(lay.full_shape):
        return False
    view, n_axis = st.views[0], len(lay.full_shape) - 2
    rows = [x for i, x in enumerate(lay.full_shape) if i != n_axis]
    want = list(contiguous_strides(rows))
    want.insert(n_axis, 0)
    return view.offset == 0 and tuple(view.strides) == tuple(want)


def _attention(names):
    pv = E.KGemm(a=p, va=vp, b=v, vb=vv, layout=lpv, prec="f32", dt=d)
    softmax = E.KSoftmax(sb, ax, "f32", "f32")
    qk = E.KGemm(a=q, va=vq, b=k, vb=vk, layout=lqk, prec="f32", dt="f32")
    score = [eq(e_mul).to(E.FBINARY[Op.MUL](e_dot, e_scale)), eq(e_dot).to(E.Load(s, vs)),
             eq(e_scale).to(E.FConst(c, vc)), FloatConst(c), eq(e_bias).to(E.Load(bias, vb)), eq(s).to(qk),
             eq(vs).to(E.identity_view(s)), LastAxisLayout(lqk), AttnRowView(vp, lpv, ax)]
    for add in (E.FBINARY[Op.ADD](E.FRound(e_mul, "f32"), e_bias), E.FBINARY[Op.ADD](e_bias, E.FRound(e_mul, "f32"))):
        for name in names:
            # softmax_j(fl(fl(q.k) * c) + bias) P-weighted sum of V rows: the same value as the three
            # unfused kernels (an FP32 store of FP32 values is exact), up to the variant's operand
            # roundings and the online softmax's order of operations (error/attention_bound.py)
            yield rule(eq(t).to(pv), eq(p).to(softmax), eq(sb).to(E.FRound(e_add, "f32")), eq(e_add).to(add),
                       *score).then(
                union(t).with_(E.CTOR["KAttention"](q, vq, k, vk, bias, vb, v, vv, c, name, d)))


fuse_attention.register(lambda: _attention([n for n, x in ATTENTION_VARIANTS.items() if x.qk is F32 and x.pv is F32]))
fuse_attention_lowp.register(lambda: _attention([n for n, x in ATTENTION_VARIANTS.items()
                                                 if x.qk is not F32 or x.pv is not F32]))


def attention_schedule(with_precision: bool):
    """The fusion phase: the FP32 kernel, and its low-precision variants when precision is searched."""
    return fuse_attention.saturate() + fuse_attention_lowp.saturate() if with_precision else fuse_attention.saturate()
