"""`fuse_rows`: constants without a launch, and a row reduction fused with its elementwise consumers.

Constants: a scalar constant read through an unmasked view is already `FConst` there (lower.py);
the load of its CONST kernel is dominated (the same FP32 value, one launch less), so it is subsumed.

Rows: RMSNorm is SUM(x^2) -> rsqrt(s * 1/n + eps) -> x * r * g, three kernels. `KRows(RowBody(b), d)`
is an alternative of `Ew(b, d)`: the same body per element, one block per row (the last axis). Inside
`RowBody` (its own e-classes, so ordinary kernels never see row nodes) a read of a last-axis KSum
through a per-row view (stride 0 along the last axis) may be `FAt(FRowSum(body, acc, dt), view)`:
the row's sum in the same accumulator, rounded once to the same storage format as the SUM kernel
would store it; a read of an elementwise value of such sums the same way (`FAt(RowBody(body))`,
rounded to its storage format). Every rounding of the unfused chain is kept, so the fused kernel
computes the unfused values bit for bit; only launches and intermediate buffers go. The unfused
form stays in the e-graph (Ew, plain loads): extraction prefers the row kernel (search/extract.py).
"""
from __future__ import annotations

from egglog import String, eq, i64, ne, relation, rewrite, rule, ruleset, union, var, vars_

from ...codegen.kinds import SCALAR_DECLS, Sort
from ...hlir.graph import Graph
from ...hlir.ops import Op
from ...hlir.partition import Group
from ...codegen.rows import is_row_view
from .. import egraph as E
from .dtype_prop import pattern

fuse_rows = ruleset(name="fuse_rows")

RowView = relation("RowView", i64)           # one unmasked view with stride 0 along its last axis
OneView = relation("OneView", i64)           # a single view (masks allowed): a value can be read through it
RowReady = relation("RowReady", E.F)         # some alternative reads a row sum through a per-row view
LastAxisReduce = relation("LastAxisReduce", E.T)  # a SumReduce along its input's last axis

t, inner = vars_("t inner", E.T)
v, c, ax = vars_("v c ax", i64)
d, acc, tag = vars_("d acc tag", String)
fa, body = vars_("fa body", E.F)
x = var("x", E.F)

RowBody, FRowSum, FAt, KRows, KScatterEw = (E.CTOR[n] for n in ("RowBody", "FRowSum", "FAt", "KRows", "KScatterEw"))
dest, src, idx = vars_("dest src idx", E.T)
vd, vs, vi = vars_("vd vs vi", i64)
dd = var("dd", String)
_ROW_NODES = ("RowBody", "FRowSum", "FAt")
# scalar constructors the row analysis and RowBody see through (leaves: Load, FConst; row nodes excluded)
_INNER = tuple(dcl for dcl in SCALAR_DECLS if dcl.name not in _ROW_NODES and dcl.name != "Load"
               and any(p.sort is Sort.F for p in dcl.params))


def row_facts(graph: Graph, group: Group, terms: dict, views) -> list:
    """The Python-computed facts the rules read: per-row views, last-axis sums (representative chunk)."""
    facts = [RowView(i) for i, st in enumerate(views) if is_row_view(st)]
    facts += [OneView(i) for i, st in enumerate(views) if len(st.views) == 1]
    for nid in group.representative.nodes:
        node = graph.nodes[nid]
        if node.op is Op.SUM_REDUCE and node.attr("axis") == len(node.srcs[0].view.shape) - 1:
            facts.append(LastAxisReduce(terms[nid]))
    return facts


@fuse_rows.register
def _constants():
    # the same FP32 constant without its CONST kernel (FConst exists wherever this rewrite applies)
    yield rewrite(E.Load(E.KConst(c, "f32"), v), subsume=True).to(E.FConst(c, v), E.Unmasked(v))


def _sum_forms():
    """(condition facts, accumulator, storage) of every KSum form a value `t` may have."""
    yield [eq(t).to(E.KSum(body, ax, acc, "f32"))], String("f32")
    yield [eq(t).to(E.KVariant(inner, tag)), eq(inner).to(E.KSum(body, ax, acc, d))], d


def _ew_forms(value=t):
    """Condition facts of every elementwise form `value` may have (its body and storage)."""
    yield [eq(value).to(E.Ew(body, d))]
    yield [eq(value).to(E.KVariant(inner, tag)), eq(inner).to(E.Ew(body, d))]


@fuse_rows.register
def _row_analysis():
    for conds, _ in _sum_forms():
        # a last-axis sum read per row: readable as its row's sum inside a row kernel
        yield rule(eq(fa).to(E.Load(t, v)), *conds, LastAxisReduce(t), RowView(v)).then(RowReady(fa))
    for conds in _ew_forms():
        # an elementwise value read through any other single view (a RoPE half through a pad, a value
        # of row sums per row): a row kernel can compute it where it reads it
        yield rule(eq(fa).to(E.Load(t, v)), *conds, OneView(v), ne(v).to(E.identity_view(t))).then(RowReady(fa))
    for dcl in _INNER:
        pat, vs = pattern(dcl)
        for p in dcl.params:
            if p.sort is Sort.F:  # an expression over such a read can fuse it
                yield rule(eq(fa).to(pat), RowReady(vs[p.name])).then(RowReady(fa))


@fuse_rows.register
def _row_kernels():
    # a body that can read row sums may run as a row kernel: the same per-element values, one block a row
    yield rule(eq(t).to(E.Ew(body, d)), RowReady(body)).then(union(t).with_(KRows(RowBody(body), d)))
    for dcl in _INNER:
        pat, vs = pattern(dcl)
        # RowBody is transparent: an op inside a row body applies to the row bodies of its operands
        pushed = E.CTOR[dcl.name](**{p.name: RowBody(vs[p.name]) if p.sort is Sort.F else vs[p.name]
                                     for p in dcl.params})
        yield rule(eq(fa).to(RowBody(x)), eq(x).to(pat), RowReady(x)).then(union(fa).with_(pushed))
    for conds, store in _sum_forms():
        # the row's sum, same body, accumulator and stored rounding as the SUM kernel: the same value
        yield rule(eq(fa).to(RowBody(x)), eq(x).to(E.Load(t, v)), *conds, LastAxisReduce(t), RowView(v)).then(
            union(fa).with_(FAt(FRowSum(RowBody(body), acc, store), v)))
    for conds in _ew_forms():
        # an elementwise value computed in the row kernel where it is read (through the view the load
        # reads its buffer by) and rounded as it would be stored: the value the load reads
        yield rule(eq(fa).to(RowBody(x)), eq(x).to(E.Load(t, v)), *conds, OneView(v),
                   ne(v).to(E.identity_view(t))).then(union(fa).with_(E.FRound(FAt(RowBody(body), v), d)))



@fuse_rows.register
def _scatter_rows():
    # A KV-cache write (in place: the inplace rule's own conditions, sole reader and identity view) whose
    # source is elementwise computes the source rows itself: each written element is the source's body
    # read through the scatter's source view and rounded as the source would be stored, the value the
    # copy would have written (one launch and no source buffer).
    legal = [E.SoleReader(dest), eq(vd).to(E.identity_view(dest)), OneView(vs)]
    for conds in _ew_forms(src):
        yield rule(eq(t).to(E.KScatter(dest, vd, src, vs, idx, vi, dd)), *conds, *legal).then(
            union(t).with_(KScatterEw(E.ConsumedBuffer(dest), vd, E.FRound(FAt(RowBody(body), vs), d), idx, vi, dd)))
