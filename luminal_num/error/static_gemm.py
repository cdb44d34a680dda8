"""The Gemm transfer of the static analysis (error/static.py): the exact product's interval in center/radius
form, the operands' propagated errors, the variant's a-priori rounding bound, the convex-combination bound
of a softmax-weighted A, and the row-norm channel (error/static_ball.py): where A's rows carry a ball and B
is a compile-time point (a weight), ||e_A B|| <= ||e_A|| ||B||_2 and |(e_A B)_n| <= ||e_A|| ||B[:, n]||_2.
"""
from __future__ import annotations

import numpy as np

from ..codegen.llir import Kernel, KernelKind
from ..dtypes.variants import GEMM_VARIANTS
from ..hlir.gemm import gemm_operand_a, gemm_operand_b, gemm_result, read_operand
from ..hlir.symbolic import evaluate as eval_dim
from .interval import Interval
from .rounding_bounds import nan_as_unbounded
from .static_ball import NORM_SLACK, operand_a_ball, row_norm
from .static_values import SLACK, BoundedValue


def gemm_operand(an, k: Kernel, i: int):
    """(lo, hi, err) of a Gemm (or QUANTIZE) operand as (batch, M, K) / (batch, K, N) arrays: the
    broadcast axes are dropped before any elementwise work, so nothing of the Mul's full size is
    materialised."""
    inp = k.inputs[i]
    src = an.vals[inp.buffer]
    pick = gemm_operand_a if i == 0 else gemm_operand_b
    shape = src.iv.lo.shape
    read = lambda x: pick(read_operand(inp.view, np.ascontiguousarray(x), an.bindings), k.layout)  # noqa: E731
    lo = read(src.iv.lo)
    hi = lo if np.array_equal(src.iv.lo, src.iv.hi) else read(src.iv.hi)  # a point (a weight): one copy, not two
    if not np.any(src.err):  # an exact operand (an FP32 weight): its zero error as a view, not a copy
        return lo, hi, np.broadcast_to(0.0, lo.shape)
    return lo, hi, read(np.broadcast_to(src.err, shape))


def softmax_rows_of_a(an, k: Kernel):
    """(rel, abs) per (batch, M, 1) row of A when the Gemm reads, along K, each full row of a SOFTMAX
    output once (checked on index probes through A's view and operand layout: a masked or partial
    read fails it); else None."""
    src = an.norm.by_id.get(k.inputs[0].buffer)
    if src is None or src.kind is not KernelKind.SOFTMAX:
        return None
    shape = np.shape(an.vals[src.id].iv.lo)
    row, pos = _softmax_rows(shape, src.axis)
    view = k.inputs[0].view
    rows = gemm_operand_a(read_operand(view, row, an.bindings), k.layout)
    at = gemm_operand_a(read_operand(view, pos, an.bindings), k.layout)
    n = shape[src.axis]
    if not (at.shape[-1] == n and bool(np.all(rows == rows[..., :1])) and bool(np.all(rows > 0))
            and np.array_equal(np.sort(at, axis=-1), np.broadcast_to(np.arange(1, n + 1), at.shape))):
        return None
    rel, absolute = an.softmax_rel[src.id]
    rel_rows = np.broadcast_to(rel, _keep(shape, src.axis)).reshape(-1)
    return rel_rows[rows[..., :1].astype(np.int64) - 1], absolute


def _a_ball(an, k: Kernel, aerr: np.ndarray):
    """A's ball per (batch, M) row along K: its source rows' where they map, cut at the norm of A's
    elementwise bound."""
    src = an.vals[k.inputs[0].buffer]
    own = operand_a_ball(k.inputs[0].view, k.layout, src.iv.lo.shape, src.ball, an.bindings)
    box = row_norm(aerr, aerr.shape)
    return box if own is None else np.minimum(own, box)


def _ball_of_result(ball: np.ndarray, c_shape: tuple[int, ...], lay, full) -> np.ndarray | None:
    """C's row balls on the result buffer's rows, when each of its rows (last axis) is one row of C along
    N in order (checked on an index probe through gemm_result); else None."""
    n = c_shape[-1]
    if not n:
        return None
    probe = np.arange(int(np.prod(c_shape, dtype=np.int64)), dtype=np.float64).reshape(c_shape)
    out = gemm_result(probe, lay, full)
    if not out.ndim or out.shape[-1] != n:
        return None
    rows = out.reshape(-1, n)
    first = rows[:, :1]
    if not np.array_equal(rows, first + np.arange(n)) or np.any(first % n):
        return None
    return ball.reshape(-1)[(first[:, 0] // n).astype(np.int64)].reshape(out.shape[:-1])


def _b_parts(an, k: Kernel) -> list[tuple[int, int]] | None:
    """(start, stop) along N of each part of a B read from weights concatenated along N (q|k|v, gate|up),
    checked on a probe of part ids through B's view and layout; None for any other B."""
    src = an.norm.by_id.get(k.inputs[1].buffer)
    if src is None or src.kind is not KernelKind.EXTERNAL or len(src.concat) < 2:
        return None
    by_name = {p.external: p for p in an.p.kernels if p.kind is KernelKind.EXTERNAL and not p.concat}
    if not all(n in by_name for n in src.concat):
        return None
    shape = an.vals[src.id].iv.lo.shape
    sizes = [an._shape(by_name[n])[src.concat_axis] for n in src.concat]
    ids = np.repeat(np.arange(1, len(sizes) + 1, dtype=np.float64), sizes)
    probe = np.ascontiguousarray(np.broadcast_to(
        ids.reshape([-1 if a == src.concat_axis else 1 for a in range(len(shape))]), shape))
    b = gemm_operand_b(read_operand(k.inputs[1].view, probe, an.bindings), k.layout)
    col = b[..., :1, :]
    if not np.all(b == col) or not np.all(col == col[:1]):
        return None
    col = col[0, 0]
    edges = [0] + [i for i in range(1, col.size) if col[i] != col[i - 1]] + [col.size]
    if len(edges) - 1 != len(set(col.tolist())):  # a part in two places
        return None
    return list(zip(edges[:-1], edges[1:]))


def gemm_value(an, k: Kernel) -> BoundedValue:
    lay = k.layout
    variant = GEMM_VARIANTS[k.precision or "f32"]
    (alo, ahi, aerr), (blo, bhi, berr) = gemm_operand(an, k, 0), gemm_operand(an, k, 1)
    full = [eval_dim(d, an.bindings) for d in lay.full_shape]
    b_point = bool(np.array_equal(blo, bhi)) and bool(np.all(np.isfinite(blo)))
    a_ball = _a_ball(an, k, aerr)
    with np.errstate(all="ignore"):
        a_iv, b_iv = Interval(alo, ahi), Interval(blo, bhi)
        mid_a, rad_a = _mid_rad(a_iv)
        mm = np.matmul
        scale = 1.0 + 2.0 ** -30  # BLAS rounding in these non-negative bound products
        # a point B with exact entries (an FP32 weight) and a finite A: the terms of rad_B and e_B are exact
        # zeros, left out (a weight the size of SmolLM2's LM head is 226 MB per FP64 copy)
        finite_a = bool(np.all(np.isfinite(rad_a))) and bool(np.all(np.isfinite(aerr)))
        exact_b = b_point and finite_a and not np.any(berr)
        if b_point and finite_a:
            mid_b, mag_b = blo, np.abs(blo)
            center = mm(mid_a, mid_b)
            radius = mm(rad_a, mag_b) * scale + np.abs(center) * 2.0 ** -50
        else:
            mid_b, rad_b = _mid_rad(b_iv)
            center = mm(mid_a, mid_b)
            radius = (mm(np.abs(mid_a), rad_b) + mm(rad_a, np.abs(mid_b)) + mm(rad_a, rad_b)) * scale \
                + np.abs(center) * 2.0 ** -50
            mag_b = b_iv.magnitude
        lo, hi = center - radius, center + radius
        mag_a = a_iv.magnitude
        # |e_A| |B|, and |e_A . B[:, n]| <= ||e_A row|| || |B|[:, n] ||
        through_b = np.minimum(mm(aerr, mag_b), a_ball[..., None] * _col_norms(mag_b))
        rest = np.zeros(through_b.shape) if exact_b else mm(mag_a, berr) + mm(aerr, berr)
        prop = (rest + through_b) * scale
        wa, wb = mag_a + aerr, (mag_b if exact_b else mag_b + berr)
        abs_dot = mm(wa, wb) * scale
        rows = softmax_rows_of_a(an, k)
        if rows is not None:
            # A's rows are softmax rows along K (p >= 0, sum p = 1 exactly): C is a convex combination
            # of B's rows; with |p^ - p| <= rel p + abs: sum_k |p^_k - p_k| w_k <= (rel + n abs) max w
            n_k = alo.shape[-1]
            rel, absolute = rows
            lo = np.maximum(lo, np.min(blo, axis=-2, keepdims=True))
            hi = np.minimum(hi, np.max(bhi, axis=-2, keepdims=True))
            a_total = rel + n_k * absolute  # >= sum_k err_A over the row
            prop = (np.minimum(mm(mag_a, berr), np.max(berr, axis=-2, keepdims=True))
                    + np.minimum(mm(aerr, mag_b), a_total * np.max(mag_b, axis=-2, keepdims=True))
                    + np.minimum(mm(aerr, berr), a_total * np.max(berr, axis=-2, keepdims=True))) * scale
            total = (1 + np.minimum(np.sum(aerr, axis=-1, keepdims=True), a_total)) \
                * np.max(wb, axis=-2, keepdims=True)
            abs_dot = np.minimum(abs_dot, total * scale)
        rounding = variant.a_priori_bound(alo.shape[-1], abs_dot, float(np.max(wa)) if wa.size else 0.0,
                                          float(np.max(wb)) if wb.size else 0.0)
        err = nan_as_unbounded(prop + rounding) * SLACK
        ball, parts = None, None
        if b_point and k.id in an.read_by_kernels:  # ||e_A B + A e_B + e_A e_B + rounding|| over C's rows (and parts)
            other = nan_as_unbounded(rest * scale + rounding)
            ball = _ball(an, k, a_ball, blo, other, err, scale, lay, full, (0, err.shape[-1]))
            cuts = _b_parts(an, k) if ball is not None else None
            if cuts:
                parts = tuple((s0, s1, _ball(an, k, a_ball, blo, other, err, scale, lay, full, (s0, s1)))
                              for s0, s1 in cuts)
                parts = None if any(p[2] is None for p in parts) else parts
    lo = gemm_result(np.where(np.isnan(lo), -np.inf, lo), lay, full)
    hi = gemm_result(np.where(np.isnan(hi), np.inf, hi), lay, full)
    return BoundedValue(Interval(lo, hi), gemm_result(err, lay, full), ball=ball, parts=parts)


def _ball(an, k: Kernel, a_ball, blo, other, err, scale, lay, full, cols: tuple[int, int]):
    """The ball of C's rows over columns [start, stop) on the result's rows: ||e_A B|| <= ||e_A|| ||B||_2 plus
    the norm of the other terms (A e_B, e_A e_B, rounding); None where the result's rows are not C's."""
    s0, s1 = cols
    part = () if (s0, s1) == (0, err.shape[-1]) else cols
    sub = err[..., s0:s1]
    with np.errstate(all="ignore"):
        ball = (a_ball * an.spectral_norm(k, blo[..., s0:s1], part)[..., 0] * scale
                + row_norm(other[..., s0:s1], sub.shape)) * SLACK * NORM_SLACK
        ball = np.minimum(np.where(np.isnan(ball), np.inf, ball), row_norm(sub, sub.shape))
    return _ball_of_result(ball, err.shape, lay, full)


def _col_norms(b: np.ndarray) -> np.ndarray:
    """||B[:, n]||_2 per column of each (K, N) matrix, as (batch, 1, N)."""
    with np.errstate(all="ignore"):  # no b * b temporary (B may be a 226 MB LM head)
        return np.sqrt(np.einsum("...kn,...kn->...n", b, b))[..., None, :] * NORM_SLACK


def _keep(shape: tuple[int, ...], axis: int) -> tuple[int, ...]:
    return tuple(1 if i == axis else d for i, d in enumerate(shape))


def _softmax_rows(shape: tuple[int, ...], axis: int) -> tuple[np.ndarray, np.ndarray]:
    """(row id, position in the row) of every element of a softmax output, numbered from 1."""
    index = np.indices(shape)
    pos = index[axis].astype(np.float64) + 1
    rest = [index[i] for i in range(len(shape)) if i != axis]
    sizes = [shape[i] for i in range(len(shape)) if i != axis]
    row = (np.ravel_multi_index(rest, sizes) if rest else np.zeros(shape, dtype=np.int64)).astype(np.float64) + 1
    return row, pos


def _mid_rad(iv: Interval) -> tuple[np.ndarray, np.ndarray]:
    """Center/radius form; an unbounded interval is centred at 0 with infinite radius."""
    finite = np.isfinite(iv.lo) & np.isfinite(iv.hi)
    with np.errstate(all="ignore"):
        mid = np.where(finite, iv.lo / 2 + iv.hi / 2, 0.0)
        rad = np.where(finite, np.maximum(iv.hi - mid, mid - iv.lo), np.inf)
    return mid, rad
