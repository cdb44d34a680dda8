"""`smooth`: a Gemm x W^T with its K smoothed per channel (SmoothQuant, issue 32), one knob per Gemm.

x W^T = (x diag(s)^-1)(W diag(s))^T for any positive s; hlir/smoothing.py takes s = 2^e from the calibration
activations' channel max and the weights' column max (SmoothQuant's formula, rounded to a power of two). The
smoothed form is an elementwise kernel x * 2^-e (reading the (K,) vector KSmoothInv; fused into the producer's
elementwise kernel where the lower phase's fusion applies: a norm's scale multiply) and a Gemm of it with the
weight scaled offline (KSmoothW, exact in FP32). Both are ordinary e-classes, so the precision phase gives
the Gemm every variant and the smoothed weight every storage format. Gemms reading one activation (Q/K/V,
gate/up) name one group (SmoothOf's `grp`): one s over their weights, one scaled activation. The alias
KSmoothed carries the choice (tag "smooth:<variant>"); views come from search/encode.py (SmoothOf), which
offers it only for a weight read K-major as B by an FP32 Gemm over static shapes.
"""
from __future__ import annotations

from egglog import eq, i64, rule, ruleset, union, vars_

from ...hlir.ops import Op
from ...hlir.smoothing import SMOOTHINGS
from .. import egraph as E

smooth = ruleset(name="smooth")

t, x, w = vars_("t x w", E.T)
vx, vy, lay, slot, grp, vplain, vvec, vmain = vars_("vx vy lay slot grp vplain vvec vmain", i64)


@smooth.register
def _smooth_k():
    for variant in SMOOTHINGS:
        # sound: (x diag(2^-e))(W diag(2^e))^T = x diag(2^-e) diag(2^e) W^T = x W^T; the scaled activation and
        # weight differ from x 2^-e and W 2^e by their roundings only (exact in FP32: powers of two; static bounds)
        scaled = E.Ew(E.FBINARY[Op.MUL](E.Load(x, vplain), E.Load(E.CTOR["KSmoothInv"](grp, variant), vvec)), "f32")
        weight = E.CTOR["KSmoothW"](slot, grp, variant)
        smoothed = E.KGemm(scaled, vmain, weight, vy, lay, "f32", "f32")
        yield rule(eq(t).to(E.KGemm(x, vx, w, vy, lay, "f32", "f32")), eq(w).to(E.KExt(slot, "f32")), E.MatrixWeight(w),
                   E.SmoothOf(slot, vx, vy, lay, grp, vplain, vvec, vmain)).then(
            union(t).with_(E.CTOR["KSmoothed"](smoothed, variant)),
            E.IsWeight(weight))  # a compile-time value: static weight scales apply
