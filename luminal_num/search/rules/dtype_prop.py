"""`dtype_prop`: the dtype analysis. `dtype(t)` has no merge, so two facts for one e-class raise.

A variant keeps its e-class's logical dtype, so a conflict can only come from an unsound rule.
"""
from __future__ import annotations

from egglog import String, eq, i64, rule, ruleset, set_, var, vars_

from .. import egraph as E

dtype_prop = ruleset(name="dtype_prop")

t, x, y, z = vars_("t x y z", E.T)
vx, vy, vz, ax, c, n, slot, lay = vars_("vx vy vz ax c n slot lay", i64)
d, acc, prec = vars_("d acc prec", String)
body = var("body", E.F)
bx = var("bx", E.B)


@dtype_prop.register
def _kernel_dtypes():
    # Every kernel stores its output in its `dt` argument.
    for pattern in (E.KExt(slot, d), E.KConst(c, d), E.KIota(n, d), E.Ew(body, d), E.KSum(body, ax, acc, d),
                    E.KMax(body, ax, d), E.KSoftmax(body, ax, prec, d), E.KGemm(x, vx, y, vy, lay, prec, d),
                    E.KGather(x, vx, y, vy, d), E.KScatter(x, vx, y, vy, z, vz, d),
                    E.KScatterNoCopy(bx, vx, y, vy, z, vz, d)):
        yield rule(eq(t).to(pattern)).then(set_(E.dtype(t)).to(d))
    # A variant stands for the F32 value it approximates (its buffer's own format is dtype(inner)).
    yield rule(eq(t).to(E.KVariant(x, prec))).then(set_(E.dtype(t)).to("f32"))
