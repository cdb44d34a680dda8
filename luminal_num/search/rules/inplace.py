"""`inplace`: a KV-cache write may overwrite its destination when nothing else reads it."""
from __future__ import annotations

from egglog import String, eq, i64, rewrite, rule, ruleset, union, var, vars_

from .. import egraph as E

inplace = ruleset(name="inplace")
cleanup = ruleset(name="inplace_cleanup")

x, y, z, t = vars_("x y z t", E.T)
vx, vy, vz = vars_("vx vy vz", i64)
d = var("d", String)


@inplace.register
def _scatter_no_copy():
    # Legal only when the scatter is the sole reader of dest (SoleReader, computed from the graph's
    # consumers) and reads it through the identity view: then no one can observe the old rows.
    yield rule(eq(t).to(E.KScatter(x, vx, y, vy, z, vz, d)), E.SoleReader(x), eq(vx).to(E.identity_view(x))
               ).then(union(t).with_(E.KScatterNoCopy(E.ConsumedBuffer(x), vx, y, vy, z, vz, d)))


@cleanup.register
def _drop_copying_scatter():
    # Where the no-copy form exists the copying one is dominated (same value, one buffer less):
    # subsume it so extraction never picks the copy.
    yield rewrite(E.KScatter(x, vx, y, vy, z, vz, d), subsume=True).to(
        E.KScatterNoCopy(E.ConsumedBuffer(x), vx, y, vy, z, vz, d), E.SoleReader(x), eq(vx).to(E.identity_view(x)))
