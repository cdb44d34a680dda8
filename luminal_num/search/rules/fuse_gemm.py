"""`fuse_gemm`: a Gemm's elementwise consumer computed on the FP32 accumulator inside the Gemm (an epilogue).

A Gemm stores its FP32 accumulator (every variant's dt is "f32"); an elementwise consumer loads that
FP32 value and computes in FP32. Computing the consumer's body on the accumulator register instead, then
storing once, is the same arithmetic minus one FP32 store/load of the same value (exact): the fused form
equals the unfused one bit for bit, and only the launch and the intermediate buffer go away. It is legal
only where the consumer is the Gemm's sole reader (`EpilogueOf`, from the graph's consumers, in every
chunk of the group): otherwise the Gemm's buffer is still needed and fusing would run it twice. A chain
of such sole readers (bias add, then residual add) fuses whole: its last node's body reads the Gemm.

The fused node `KGemmEpi` joins the consumer's e-class (the unfused Ew stays there, extractable); its
`acc` child is the Gemm's class, whose chosen variant decides which `KGemmEpi` extraction takes.
"""
from __future__ import annotations

from typing import Mapping, Sequence

from egglog import String, eq, i64, relation, rule, ruleset, union, vars_

from ...hlir.graph import Graph
from ...hlir.ops import BINARY_OPS, UNARY_OPS, Op
from ...hlir.partition import Chunk
from ...hlir.shape import ShapeTracker
from .. import egraph as E

fuse_gemm = ruleset(name="fuse_gemm")

# (Gemm value, its only consumer): computed in Python from the graph (epilogue_facts).
EpilogueOf = relation("EpilogueOf", E.T, E.T)
# The scalar expression reads Gemm value g through g's identity view (the accumulator at this element).
ReadsAcc = relation("ReadsAcc", E.F, E.T)

t, g, a, b, inner = vars_("t g a b inner", E.T)
va, vb, lay, v = vars_("va vb lay v", i64)
prec, d, tag, kind = vars_("prec d tag kind", String)
body, x, y, f = vars_("body x y f", E.F)


@fuse_gemm.register
def _reads_accumulator():
    # a load of g through its identity view reads the value the accumulator holds at that element
    yield rule(eq(f).to(E.Load(g, v)), eq(v).to(E.identity_view(g)), EpilogueOf(g, t)).then(ReadsAcc(f, g))
    # an expression over such a read reads it too (propagation through every scalar constructor)
    for op in UNARY_OPS:
        yield rule(eq(f).to(E.FUNARY[op](x)), ReadsAcc(x, g)).then(ReadsAcc(f, g))
    for op in BINARY_OPS:
        yield rule(eq(f).to(E.FBINARY[op](x, y)), ReadsAcc(x, g)).then(ReadsAcc(f, g))
        yield rule(eq(f).to(E.FBINARY[op](x, y)), ReadsAcc(y, g)).then(ReadsAcc(f, g))
    yield rule(eq(f).to(E.FCustom(kind, x)), ReadsAcc(x, g)).then(ReadsAcc(f, g))
    yield rule(eq(f).to(E.FRound(x, d)), ReadsAcc(x, g)).then(ReadsAcc(f, g))


@fuse_gemm.register
def _epilogue():
    gemm = E.KGemm(a=a, va=va, b=b, vb=vb, layout=lay, prec=prec, dt="f32")
    # Sound: t = body(g, ...) with g's sole reader t; every Gemm variant yields its FP32 accumulator and the
    # unfused Gemm stores exactly that (dt f32), so body on the accumulator = body on the stored value.
    yield rule(eq(t).to(E.Ew(body, d)), ReadsAcc(body, g), EpilogueOf(g, t), eq(g).to(gemm)).then(
        union(t).with_(E.CTOR["KGemmEpi"](a, va, b, vb, lay, prec, g, body, d)))
    # The same for a consumer held in a lower-precision format (KVariant of an Ew): the epilogue stores
    # in that format, as the variant's own kernel would (its rounding is the store's, kept).
    yield rule(eq(t).to(E.KVariant(inner, tag)), eq(inner).to(E.Ew(body, d)), ReadsAcc(body, g), EpilogueOf(g, t),
               eq(g).to(gemm)).then(union(inner).with_(E.CTOR["KGemmEpi"](a, va, b, vb, lay, prec, g, body, d)))


def epilogue_facts(graph: Graph, chunks: Sequence[Chunk], terms: Mapping[int, object],
                   consumers: Mapping[int, list[int]]) -> list:
    """EpilogueOf(sum, end) for every SumReduce of a Mul (a Gemm candidate) followed, in every chunk of the
    group alike, by a chain of elementwise nodes each the only reader of the one before (read once,
    through its identity view) and none before `end` exported or an output: `end`'s fused body is the
    whole chain on the accumulator (`terms`: the representative chunk's)."""
    rep = chunks[0]
    outputs = set(graph.outputs.values())
    facts = []
    for local, nid in enumerate(rep.nodes):
        node = graph.nodes[nid]
        if node.op is not Op.SUM_REDUCE or graph.nodes[node.srcs[0].node].op is not Op.MUL:
            continue
        end = None
        cur = local
        while (nxt := _sole_reader(graph, chunks, cur, consumers, outputs)) is not None:
            end = cur = nxt
        if end is not None:
            facts.append(EpilogueOf(terms[nid], terms[rep.nodes[end]]))
    return facts


_ELEMENTWISE = frozenset(UNARY_OPS) | frozenset(BINARY_OPS) | {Op.CUSTOM, Op.CAST}


def _sole_reader(graph: Graph, chunks: Sequence[Chunk], local: int, consumers, outputs) -> int | None:
    """The local position of the one elementwise node reading chunk node `local` (once, through its
    identity view), the same in every chunk; None if `local` is exported or an output, or there is none."""
    found = None
    for c in chunks:
        nid = c.nodes[local]
        readers = consumers.get(nid, [])
        if nid in outputs or nid in c.exported or len(readers) != 1 or readers[0] not in c.nodes:
            return None
        reader = graph.nodes[readers[0]]
        uses = [s for s in reader.srcs if s.node == nid]
        shape = graph.nodes[nid].shape
        if reader.op not in _ELEMENTWISE or len(uses) != 1 or uses[0].view != ShapeTracker.contiguous(shape) \
                or tuple(reader.shape) != tuple(shape):
            return None
        pos = c.nodes.index(readers[0])
        if found is not None and pos != found:
            return None
        found = pos
    return found


# -- horizontal fusion (facts: search/horizontal.py) ---------------------------------------------------
# (fused id, A value, fused A view, fused B view, fused layout, its QUANTIZE view, concat id)
HFused = relation("HFused", i64, E.T, i64, i64, i64, i64, i64)
HPart = relation("HPart", E.T, i64, i64, i64)   # (part Gemm value, its layout, fused id, its slice view)
HVariant = relation("HVariant", i64, String)    # a Gemm variant the fused Gemm may use (scales per part)

fid, vaf, vbf, layf, vqf, cat, vs, vq = vars_("fid vaf vbf layf vqf cat vs vq", i64)
w, q = vars_("w q", E.T)


@fuse_gemm.register
def _horizontal():
    facts = (HPart(g, lay, fid, vs), HFused(fid, a, vaf, vbf, layf, vqf, cat), HVariant(fid, prec))
    fused_b = E.CTOR["KCatW"](cat)
    # Sound: columns [off, off + N_i) of A @ [W_1; ..; W_n]^T are A @ W_i^T, each element the same dot
    # product with the same operand roundings (HVariant: no B scale spans two parts; A is the same value).
    yield rule(*facts, eq(g).to(E.KGemm(a=a, va=va, b=w, vb=vb, layout=lay, prec=prec, dt="f32"))).then(
        union(g).with_(E.CTOR["KSlice"](E.KGemm(a=a, va=vaf, b=fused_b, vb=vbf, layout=layf, prec=prec, dt="f32"), vs)))
    # A quantized at run time: the fused Gemm's QUANTIZE reads the same A (its scales are A's alone).
    yield rule(*facts, eq(g).to(E.KGemm(a=q, va=vq, b=w, vb=vb, layout=lay, prec=prec, dt="f32")),
               eq(q).to(E.KQuantize(a=a, va=va, layout=lay, prec=prec, dt=d))).then(
        union(g).with_(E.CTOR["KSlice"](E.KGemm(a=E.KQuantize(a=a, va=vaf, layout=layf, prec=prec, dt=d), va=vqf,
                                                b=fused_b, vb=vbf, layout=layf, prec=prec, dt="f32"), vs)))


def horizontal_facts(fused, terms_of_local, a_term_of_group) -> list:
    """Facts for `fused` (search/horizontal.FusedGemm): `terms_of_local[local]` is a part's term,
    `a_term_of_group[group]` the shared A's."""
    out = []
    for i, f in enumerate(fused):
        out.append(HFused(i, a_term_of_group[f.group], f.va, f.vb, f.layout, f.quant_view, f.cat))
        out += [HVariant(i, name) for name in f.variants]
        out += [HPart(terms_of_local[local], lay_id, i, view) for local, lay_id, view in f.parts]
    return out
