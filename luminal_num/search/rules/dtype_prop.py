"""`dtype_prop`: the dtype analysis. `dtype(t)` has no merge, so two facts for one e-class raise.

One rule per tensor constructor, generated from its declaration (codegen/kinds.py): the value's
dtype is its `dtype` parameter, or the declared literal (a variant stands for its F32 value).
A variant keeps its e-class's logical dtype, so a conflict can only come from an unsound rule.
"""
from __future__ import annotations

from egglog import String, eq, i64, rule, ruleset, set_, var

from ...codegen.kinds import TENSOR_DECLS, ENodeDecl, Sort
from .. import egraph as E

dtype_prop = ruleset(name="dtype_prop")

_VAR_SORT = {Sort.T: E.T, Sort.F: E.F, Sort.B: E.B, Sort.I64: i64, Sort.STR: String}


def pattern(d: ENodeDecl):
    """The constructor applied to one fresh variable per parameter (named after it), and those variables."""
    vs = {p.name: var(f"{d.name}_{p.name}", _VAR_SORT[p.sort]) for p in d.params}
    return E.CTOR[d.name](**vs), vs


@dtype_prop.register
def _kernel_dtypes():
    t = var("t", E.T)
    for d in TENSOR_DECLS:
        pat, vs = pattern(d)
        # every kernel stores its output in its dtype parameter; a variant is the F32 value it approximates
        yield rule(eq(t).to(pat)).then(set_(E.dtype(t)).to(vs[d.dtype] if d.dtype else d.dtype_const))
