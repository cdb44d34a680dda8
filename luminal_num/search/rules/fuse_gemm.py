"""`fuse_gemm`: a Gemm's elementwise consumer computed on the FP32 accumulator inside the Gemm (an epilogue).

A Gemm stores its FP32 accumulator (every variant's dt is "f32"); an elementwise consumer loads that
FP32 value and computes in FP32. Computing the consumer's body on the accumulator register instead, then
storing once, is the same arithmetic minus one FP32 store/load of the same value (exact): the fused form
equals the unfused one bit for bit, and only the launch and the intermediate buffer go away. It is legal
only where every reader of the Gemm is inside the fused region (`EpilogueOf`, from the graph's
consumers, in every chunk of the group): otherwise the Gemm's buffer is still needed and fusing would
run it twice. A region of elementwise readers with one sink (bias then residual add; GELU) fuses whole.

The fused node `KGemmEpi` joins the consumer's e-class (the unfused Ew stays there, extractable); its
`acc` child is the Gemm's class, whose chosen variant decides which `KGemmEpi` extraction takes.

Horizontal fusion (facts from search/horizontal.py) makes one Gemm over weights concatenated along N;
`_stored_concat` offers that concatenation held in a storage format its parts share (KCatStored), and
`_glu` fuses a region fed by every part of one fused Gemm (gate/up -> silu(gate) * up) into that Gemm:
its `acc` is the fused Gemm, whose column slices the body reads (FAcc views), and it stores only the
region's F-wide result.
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


def epilogue_sinks(graph: Graph, chunks: Sequence[Chunk], consumers: Mapping[int, list[int]]) -> dict[int, int]:
    """Local SumReduce position -> the local position of its region's sink, for every SumReduce of a Mul
    (a Gemm candidate) whose readers, in every chunk of the group alike, form an elementwise region with
    one sink: each region node reads its producer through the identity view, and every node but the sink
    is read only inside the region and is no export or output (bias + residual adds; GELU's
    x * 0.5 * (1 + erf(x / sqrt 2)), which reads x twice: recomputed in registers for free)."""
    rep = chunks[0]
    out = {}
    for local, nid in enumerate(rep.nodes):
        node = graph.nodes[nid]
        if node.op is not Op.SUM_REDUCE or graph.nodes[node.srcs[0].node].op is not Op.MUL:
            continue
        sinks = {_region_sink(graph, c, c.nodes[local], consumers) for c in chunks}
        if len(sinks) == 1 and None not in sinks:
            out[local] = sinks.pop()
    return out


def epilogue_facts(graph: Graph, chunks: Sequence[Chunk], terms: Mapping[int, object],
                   consumers: Mapping[int, list[int]]) -> list:
    """EpilogueOf(sum, sink) for every Gemm candidate with a region (epilogue_sinks): the sink's fused
    body is the region on the accumulator."""
    rep = chunks[0]
    return [EpilogueOf(terms[rep.nodes[g]], terms[rep.nodes[s]])
            for g, s in epilogue_sinks(graph, chunks, consumers).items()]


_ELEMENTWISE = frozenset(UNARY_OPS) | frozenset(BINARY_OPS) | {Op.CUSTOM, Op.CAST}


def _region_sink(graph: Graph, chunk: Chunk, gemm: int, consumers) -> int | None:
    """The local position of the one sink of `gemm`'s elementwise region in `chunk` (see epilogue_facts)."""
    outputs = set(graph.outputs.values())
    members = set(chunk.nodes)

    def private(n: int) -> bool:
        return n not in outputs and n not in chunk.exported

    def absorbs(reader: int, producer: int) -> bool:
        r, shape = graph.nodes[reader], graph.nodes[producer].shape
        return reader in members and r.op in _ELEMENTWISE and tuple(r.shape) == tuple(shape) and all(
            s.view == ShapeTracker.contiguous(shape) for s in r.srcs if s.node == producer)

    if not private(gemm) or not consumers.get(gemm) or not all(absorbs(r, gemm) for r in consumers[gemm]):
        return None
    region: set[int] = set()
    work = list(consumers[gemm])
    while work:
        n = work.pop()
        if n in region:
            continue
        region.add(n)
        readers = consumers.get(n, [])
        if private(n) and readers and all(absorbs(r, n) for r in readers):
            work += readers
    sinks = [n for n in region if not (private(n) and consumers.get(n) and set(consumers[n]) <= region)]
    if len(sinks) != 1:
        return None
    # every region node's sources are the Gemm, region nodes, or values from outside (never a value
    # computed from the region by a node outside it: then the sink would not be one fused body)
    return chunk.nodes.index(sinks[0])


# -- horizontal fusion (facts: search/horizontal.py) ---------------------------------------------------
# (fused id, A value, fused A view, fused B view, fused layout, its QUANTIZE view, concat id)
HFused = relation("HFused", i64, E.T, i64, i64, i64, i64, i64)
HPart = relation("HPart", E.T, i64, i64, i64)   # (part Gemm value, its layout, fused id, its slice view)
HVariant = relation("HVariant", i64, String)    # a Gemm variant the fused Gemm may use (scales per part)
HStorable = relation("HStorable", i64, String)  # (concat id, a storage format its parts concatenate in)
GluOf = relation("GluOf", i64, E.T)             # (fused id, the one sink of every part's epilogue region)

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


@fuse_gemm.register
def _stored_concat():
    # Sound: a format whose blocks run along K and never span parts (HStorable: quant/concat.py refuses
    # the others) holds [W_1; ..; W_n] as the parts' own stored values side by side: widened, it is the
    # concatenation of the widened parts, each read exactly as that part's KStored would be.
    yield rule(HStorable(cat, tag), HFused(fid, a, vaf, vbf, layf, vqf, cat), HPart(g, lay, fid, vs),
               eq(g).to(E.KGemm(a=q, va=va, b=w, vb=vb, layout=lay, prec=prec, dt="f32")),
               eq(w).to(E.CTOR["KStored"](v, tag))).then(union(E.CTOR["KCatW"](cat)).with_(E.CTOR["KCatStored"](cat, tag)))


@fuse_gemm.register
def _glu():
    # GLU form: the parts of one fused Gemm (gate, up) all feed one elementwise region with sink t
    # (GluOf); its body reads each part at the element, i.e. the fused accumulator through the part's
    # column slice. Sound: the fused Gemm's columns are the parts' FP32 accumulators (horizontal rule),
    # so the body on them is the unfused body on the values the parts' Gemms store (dt f32).
    facts = (GluOf(fid, t), HPart(g, lay, fid, vs), HFused(fid, a, vaf, vbf, layf, vqf, cat), HVariant(fid, prec),
             ReadsAcc(body, g))
    fused_b = E.CTOR["KCatW"](cat)
    epi = E.CTOR["KGemmEpi"]
    plain = E.KGemm(a=a, va=va, b=w, vb=vb, layout=lay, prec=prec, dt="f32")
    fused = E.KGemm(a=a, va=vaf, b=fused_b, vb=vbf, layout=layf, prec=prec, dt="f32")
    quant = E.KGemm(a=q, va=va, b=w, vb=vb, layout=lay, prec=prec, dt="f32")
    fused_a = E.KQuantize(a=a, va=vaf, layout=layf, prec=prec, dt=kind)
    fused_q = E.KGemm(a=fused_a, va=vqf, b=fused_b, vb=vbf, layout=layf, prec=prec, dt="f32")
    for gemm, extra, x_a, x_va, x in ((plain, (), a, vaf, fused),
                                      (quant, (eq(q).to(E.KQuantize(a=a, va=va, layout=lay, prec=prec, dt=kind)),),
                                       fused_a, vqf, fused_q)):
        yield rule(*facts, eq(g).to(gemm), *extra, eq(t).to(E.Ew(body, d))).then(
            union(t).with_(epi(x_a, x_va, fused_b, vbf, layf, prec, x, body, d)))
        yield rule(*facts, eq(g).to(gemm), *extra, eq(t).to(E.KVariant(inner, tag)), eq(inner).to(E.Ew(body, d))).then(
            union(inner).with_(epi(x_a, x_va, fused_b, vbf, layf, prec, x, body, d)))


def horizontal_facts(fused, terms_of_local, a_term_of_group, sinks: Mapping[int, int] | None = None) -> list:
    """Facts for `fused` (search/horizontal.FusedGemm): `terms_of_local[local]` is a part's term,
    `a_term_of_group[group]` the shared A's; `sinks` (epilogue_sinks) gives GluOf where every part of a
    fused Gemm feeds the same epilogue region."""
    out = []
    sinks = sinks or {}
    for i, f in enumerate(fused):
        out.append(HFused(i, a_term_of_group[f.group], f.va, f.vb, f.layout, f.quant_view, f.cat))
        out += [HVariant(i, name) for name in f.variants]
        out += [HStorable(f.cat, fmt) for fmt in f.storable]
        out += [HPart(terms_of_local[local], lay_id, i, view) for local, lay_id, view in f.parts]
        ends = {sinks.get(local) for local, _, _ in f.parts}
        if len(ends) == 1 and None not in ends:
            out.append(GluOf(i, terms_of_local[ends.pop()]))
    return out
