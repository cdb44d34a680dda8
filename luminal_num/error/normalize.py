"""A correlated bound for normalisation, y = a * rsqrt(c * sum_j(b_j^2) + eps) (layer_norm, rms_norm).

Why: intervals forget that the numerator and the variance come from the same row. Over a declared
input range the variance can be 0, so rsqrt's slope at eps (~1e7) multiplied the variance's whole
absolute error and the bound went infinite (every layer_norm candidate of the numerics benchmark).
What the math allows instead (a, b: the executed numerator and squared values of the same exact x_i;
|a_i - x_i| <= E_i, |b_j - x_j| <= F_j; sigma = sqrt(c sum x^2 + eps), sigma_b the same of b):

- |sigma_b - sigma| <= D = sqrt(c sum_j F_j^2)            (triangle inequality of the 2-norm)
- |x_i| / sigma <= K = 1/sqrt(c), |b_i| / sigma_b <= K    (one square is at most the sum of them)
- sigma_b >= sigma_min = max(sqrt(eps), sqrt(c sum lo(x^2) + eps) - D)
- the executed rsqrt is (1/sigma_b)(1 + rho): a product of N roundings of positive terms, |rho| <= gamma_N,
  plus underflow (absolute, at most eta / eps relative since sigma_b^2 >= eps)
so |a_i r^ - x_i / sigma| <= (E_i + K D) / sigma_min + (K + (E_i + F_i) / sigma_min) rho.
Where a is b (the same executed values: rms_norm, a layer_norm whose centred row is squared), the map
f(z) = z / sqrt(c ||z||^2 + eps) has Jacobian (I - c z z^T / s^2) / s, s = sqrt(c ||z||^2 + eps), whose
eigenvalues are 1/s and eps/s^3: ||J||_2 = 1/s. Along the segment from x to a, s >= sqrt(c (||x|| - ||a - x||)^2
+ eps) >= sigma_min (the triangle inequality on (sqrt(c) z, sqrt(eps))), so ||f(a) - f(x)|| <= ||a - x|| /
sigma_min for each row and |f_i(a) - f_i(x)| too (a row of J has norm <= ||J||_2): the rsqrt's rounding is
one factor per row, f(a)(1 + rho), and the row's error is at most ||a - x|| / sigma_min + ||f(a)|| rho, half
of the triangle bound's (||E|| + sqrt(n) K D) / sigma_min when the numerator's error is the squares'.
The pattern is matched on the LLIR (kernel chain and views) and refused (generic bound) unless every
piece is checked: same exact numerator and squared values, rows mapped by the views, constants c, eps > 0.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..codegen.llir import FApply, FConstV, FExpr, FLoad, FRoundTo, Kernel, KernelKind
from ..dtypes.formats import F32, Format, Kind
from ..hlir.ops import Op
from .interval import Interval, transfer
from .rounding_bounds import gamma, nan_as_unbounded
from .static_ball import NORM_SLACK, ball_in, row_norm


@dataclass(frozen=True)
class _Chain:
    """rsqrt(c * s + eps): the SUM kernel of s, the constants, and every rounding on the way."""

    sum_kernel: Kernel
    c: float
    eps: float
    formats: tuple[Format, ...]  # one entry per rounding between the exact s and the executed rsqrt


def _strip(e: FExpr, formats: list) -> FExpr:
    while isinstance(e, FRoundTo):
        formats.append(e.fmt)
        e = e.x
    return e


def _unrounded(e: FExpr) -> FExpr:
    """The exact value an expression stands for: roundings do not change it."""
    if isinstance(e, FRoundTo):
        return _unrounded(e.x)
    if isinstance(e, FApply):
        return FApply(e.op, tuple(_unrounded(a) for a in e.args), e.kind)
    return e


def _loads(e: FExpr, k: Kernel) -> tuple:
    """The expression with every load replaced by (buffer, view): equal means the same exact values."""
    if isinstance(e, FLoad):
        inp = k.inputs[e.slot]
        return ("load", inp.buffer, inp.view.encode())
    if isinstance(e, FApply):
        return (e.op, e.kind, tuple(_loads(a, k) for a in e.args))
    if isinstance(e, FConstV):
        return ("const", repr(e.value))
    raise AssertionError("roundings are stripped first")


def _executed(e: FExpr, k: Kernel) -> tuple:
    """The expression with every load replaced by (buffer, view), roundings kept: equal means the same
    executed values (elementwise FP32 arithmetic is deterministic)."""
    if isinstance(e, FRoundTo):
        return ("round", e.fmt.name, _executed(e.x, k))
    if isinstance(e, FLoad):
        inp = k.inputs[e.slot]
        return ("load", inp.buffer, inp.view.encode())
    if isinstance(e, FApply):
        return (e.op, e.kind, tuple(_executed(a, k) for a in e.args))
    return ("const", repr(getattr(e, "value", e)))


class NormBound:
    """Recognises the pattern for a StaticAnalyzer and computes the correlated bound."""

    def __init__(self, analyzer):
        self.an = analyzer
        self.by_id = {k.id: k for k in analyzer.p.kernels}

    def _const(self, e: FExpr, k: Kernel, formats: list) -> float | None:
        e = _strip(e, formats)
        if isinstance(e, FConstV):
            return e.value if isinstance(e.value, float) else None
        if isinstance(e, FLoad):
            src = self.by_id[k.inputs[e.slot].buffer]
            if src.kind is KernelKind.CONST and isinstance(src.value, float):
                formats.append(src.dtype)
                return src.value
        return None

    def _through(self, e: FExpr, k: Kernel, formats: list, hops: list) -> tuple[FExpr, Kernel]:
        """Strip roundings and follow loads into elementwise kernels (each store is a rounding, each load
        a hop whose view _rows_match checks); stop at an op, a constant, or a load of another kind."""
        while True:
            e = _strip(e, formats)
            if not isinstance(e, FLoad):
                return e, k
            src = self.by_id[k.inputs[e.slot].buffer]
            if src.kind is not KernelKind.ELEMENTWISE:
                return e, k
            hops.append((k, e))
            formats.append(src.dtype)
            e, k = src.body, src

    def _chain(self, e: FExpr, k: Kernel, formats: list):
        """(chain, hops from the kernel reading s out to k, innermost first) for
        e = Recip(Sqrt(c * s + eps)), with roundings and kernel boundaries anywhere in between."""
        hops: list = []
        rec, k1 = self._through(e, k, formats, hops)
        if not (isinstance(rec, FApply) and rec.op is Op.RECIP):
            return None
        sq, k2 = self._through(rec.args[0], k1, formats, hops)
        if not (isinstance(sq, FApply) and sq.op is Op.SQRT):
            return None
        add, k3 = self._through(sq.args[0], k2, formats, hops)
        if not (isinstance(add, FApply) and add.op is Op.ADD):
            return None
        formats += [F32] * 4  # the Recip, Sqrt, Add and Mul themselves (FP32 arithmetic)
        for mul_e, eps_e in ((add.args[0], add.args[1]), (add.args[1], add.args[0])):
            eps = self._const(eps_e, k3, formats)
            if eps is None or not eps > 0:
                continue
            mul_hops: list = []
            mul, k4 = self._through(mul_e, k3, formats, mul_hops)
            if not (isinstance(mul, FApply) and mul.op is Op.MUL):
                continue
            for s_e, c_e in ((mul.args[0], mul.args[1]), (mul.args[1], mul.args[0])):
                c = self._const(c_e, k4, formats)
                s_hops: list = []
                s_load, k5 = self._through(s_e, k4, formats, s_hops)
                if c is None or not c > 0 or not isinstance(s_load, FLoad):
                    continue
                ks = self.by_id[k5.inputs[s_load.slot].buffer]
                if ks.kind is KernelKind.SUM:
                    formats.append(ks.dtype)
                    path = [*hops, *mul_hops, *s_hops, (k5, s_load)]  # outermost first
                    return _Chain(ks, c, eps, tuple(formats)), path[::-1]
        return None

    def _rows_match(self, ks: Kernel, hops, pre: tuple[int, ...]) -> bool:
        """Element e of k reads the s of e's own row: follow the views from s to k on an index probe
        (indices from 1: a masked read gives 0 and fails the match)."""
        s_shape = np.shape(self.an.vals[ks.id].iv.lo)
        probe = np.arange(1, int(np.prod(s_shape)) + 1, dtype=np.float64).reshape(s_shape)
        value = probe
        for kernel, load in hops:  # innermost first: the kernel reading s, then each kernel reading that
            value = kernel.inputs[load.slot].view.realize(value, self.an.bindings)
            try:  # an elementwise kernel broadcasts each load to its own shape
                value = np.broadcast_to(value, self.an._shape(kernel) if kernel is not hops[-1][0] else pre)
            except ValueError:
                return False
        if len(s_shape) == len(pre) - 1:
            expected = np.expand_dims(probe, ks.axis)
        elif len(s_shape) == len(pre) and s_shape[ks.axis] == 1:
            expected = probe
        else:
            return False
        try:
            expected = np.broadcast_to(expected, pre)
        except ValueError:
            return False
        return value.shape == pre and np.array_equal(value, expected)

    def bound(self, e: FApply, k: Kernel):
        """(interval, error, row-norm bound or None) of the product before its own rounding, or None when it
        is not the pattern."""
        if not (e.op is Op.MUL and len(e.args) == 2):
            return None
        for p_e, r_e in ((e.args[0], e.args[1]), (e.args[1], e.args[0])):
            found = self._chain(r_e, k, [])
            if found is None:
                continue
            chain, hops = found
            if hops[-1][0] is not k or not 0 < chain.c <= 1:
                continue
            out = self._bound(p_e, r_e, k, chain, hops)
            if out is not None:
                return out
        return None

    def _bound(self, p_e, r_e, k: Kernel, chain: _Chain, hops):
        ks = chain.sum_kernel
        body_formats: list = []
        body = _strip(ks.body, body_formats)
        if not (isinstance(body, FApply) and body.op is Op.MUL and body.args[0] == body.args[1]):
            return None
        q_e = body.args[0]
        if _loads(_unrounded(q_e), ks) != _loads(_unrounded(p_e), k):
            return None
        an = self.an
        if not np.all(np.isfinite(an.vals[ks.id].err)):  # the sum of squares may overflow
            return None
        a, b = an.body(p_e, k), an.body(q_e, ks)
        shape = np.shape(b.iv.lo)
        if np.broadcast_shapes(np.shape(a.iv.lo), shape) != shape or not self._rows_match(ks, hops, shape):
            return None
        axis, n = ks.axis, shape[ks.axis]
        c, eps = chain.c, chain.eps
        acc = ks.acc or F32
        # each term of the sum passes a square (FP32) and at most n - 1 adds (acc); then one rounding per
        # entry of `formats` on the way to the rsqrt: the product of (1 + gamma) per format bounds them all
        formats = [f for f in (*chain.formats, *body_formats) if f.kind is Kind.FLOAT]
        counts: dict[float, int] = {}
        for f in formats:
            counts[f.unit_roundoff] = counts.get(f.unit_roundoff, 0) + 1
        u_sum = max(acc.unit_roundoff, F32.unit_roundoff)
        counts[u_sum] = counts.get(u_sum, 0) + n + 1
        # underflow is absolute: each square and each add of the sum may lose half a subnormal (of FP32
        # and of the accumulator), scaled by c; every other rounding at most half the largest subnormal
        sub = max(f.min_subnormal for f in (*formats, acc, F32))
        eta = c * n * (acc.min_subnormal + F32.min_subnormal) + len(formats) * sub / 2
        with np.errstate(all="ignore"):
            growth = 1.0
            for unit, count in counts.items():
                growth *= 1.0 + float(gamma(count, unit))
            big_k = 1.0 / math.sqrt(c) * (1 + 2.0 ** -50)
            E = np.broadcast_to(a.err, shape)
            F = np.broadcast_to(b.err, shape)
            # every executed value on the chain (the sum of squares, c s + eps) is at most sum (|b| + F)^2 growth
            # + eps: past a format's max it may overflow (inf -> rsqrt 0), which no relative rounding term covers
            largest = float(np.max(np.sum((b.iv.magnitude + F) ** 2, axis=axis) * growth * (1 + 2.0 ** -40) + eps,
                                   initial=0.0))
            if not np.isfinite(largest) or any(largest > f.max_finite for f in (*formats, acc)):
                return None
            D = np.sqrt(c * np.sum(F * F, axis=axis, keepdims=True)) * (1 + 2.0 ** -50)
            last = axis in (-1, len(shape) - 1)
            if last and b.ball is not None:  # D bounds sqrt(c) ||b^ - x|| over the row: so does the row's ball
                D = np.minimum(D, (np.sqrt(c) * ball_in(b, shape) * (1 + 2.0 ** -50))[..., None])
            lo, hi = np.broadcast_to(a.iv.lo, shape), np.broadcast_to(a.iv.hi, shape)
            sq_lo = np.where((lo <= 0) & (hi >= 0), 0.0, np.minimum(lo * lo, hi * hi))
            sigma = np.sqrt(c * np.sum(sq_lo, axis=axis, keepdims=True) + eps) * (1 - 2.0 ** -50)
            sigma_min = np.maximum(math.sqrt(eps) * (1 - 2.0 ** -50), sigma - D)
            rho_s = (growth - 1.0) * (1 + 2.0 ** -40) + eta / (sigma_min * sigma_min) * (1 + 2.0 ** -40)
            # (1 + phi)^(-1/2) - 1 <= phi / (1 - phi) for |phi| < 1; past 0.9 the bound is not worth having
            rho = np.where(rho_s < 0.9, rho_s / (1 - rho_s), np.inf)
            worst = float(np.max(np.where(np.isfinite(rho), rho, 0.0)))
            if any((1 + worst) / math.sqrt(eps) > f.max_finite for f in formats):
                return None  # the executed rsqrt itself may overflow a format on its way
            mag = np.maximum(np.abs(lo), np.abs(hi))
            ratio = np.minimum(big_k, mag / sigma * (1 + 2.0 ** -50))  # |x_i| / sigma
            executed = np.minimum(big_k + (E + F) / sigma_min, (mag + E) / sigma_min)  # |a_i| / sigma_b
            same = _executed(p_e, k) == _executed(q_e, ks)
            if same:  # a is b: |a_i| / sqrt(c sum a^2 + eps) <= K
                executed = np.minimum(executed, big_k)
            err = ((E + ratio * D) / sigma_min + executed * rho) * (1 + 2.0 ** -50)
            lipschitz = None
            if same and last:  # ||f(a) - f(x)|| <= ||a - x|| / sigma_min (module docstring): each element too
                lipschitz = ball_in(a, shape) / sigma_min[..., 0] * (1 + 2.0 ** -50)
                err = np.minimum(err, (lipschitz[..., None] + executed * rho) * (1 + 2.0 ** -50))
            # |executed - exact| <= |executed| + |exact|: a row whose error passes its values stays bounded
            err = np.minimum(err, (ratio + executed * (1 + rho)) * (1 + 2.0 ** -50))
            ball = None
            if last:  # the same terms as row norms: ||E|| <= the numerator's ball (error/static_ball.py)
                moved = ball_in(a, shape) / sigma_min[..., 0] * (1 + 2.0 ** -50) if lipschitz is None else lipschitz
                if lipschitz is None:
                    moved = moved + row_norm(ratio, shape) * D[..., 0] / sigma_min[..., 0]
                ball = (moved + row_norm(executed, shape) * rho[..., 0]) * (1 + 2.0 ** -50) * NORM_SLACK
                ball = np.minimum(np.where(np.isnan(ball), np.inf, ball), row_norm(err, shape))
        generic = an.body(r_e, k)
        product = transfer(Op.MUL, Interval(lo, hi), generic.iv)
        iv = Interval(np.maximum(product.lo, -big_k), np.minimum(product.hi, big_k), product.nan)
        return iv, nan_as_unbounded(err), ball
