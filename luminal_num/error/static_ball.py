"""The row-norm channel of the static analysis: beside the elementwise bound |e_i| <= err_i, a bound on the
2-norm of each row's error vector (rows along the last axis), `BoundedValue.ball`.

Why: elementwise bounds take the worst sign at every element, so a Gemm's propagated error |e| |W| assumes
every error conspires with every weight, and two Gemms in a row compound that (|e| |W1| |W2|: 20-90x per
Gemm on Llama layers, infinite bounds from the second SmolLM2 layer on). A norm keeps the geometry:
||e W||_2 <= ||e||_2 ||W||_2 (spectral norm of the exact weights) and |(e W)_n| <= ||e||_2 ||W[:, n]||_2.
Every rule here is an upper bound of the row norm given the inputs' bounds; where a rule does not apply the
ball is rebuilt from the elementwise bound (||err row||_2), and the elementwise bound is cut at the ball
(|e_i| <= ||e||_2): both channels stay sound whichever is tighter.
- a read through a view keeps its source row's ball when each row of the read takes distinct positions of
  one source row (a subset's norm is at most the row's); padding reads exact zeros;
- e_a + e_b: ||e_a|| + ||e_b||; a*b: max|a| ||e_b|| + max|b| ||e_a|| + max|e_a| ||e_b||; f(a): max|f'| ||e_a||;
- a rounding adds the norm of its elementwise rounding term.
"""
from __future__ import annotations

import numpy as np

from ..hlir.gemm import gemm_operand_a, read_operand
from ..hlir.ops import Op

NORM_SLACK = 1.0 + 2.0 ** -40  # FP64 rounding of these norm computations (sums of squares, square roots)
MAX_GRAM = 1024  # the largest Gram matrix whose top eigenvalue bounds a spectral norm (hidden sizes up to 1024)


def row_norm(x, shape: tuple[int, ...]) -> np.ndarray:
    """||x row||_2 of x broadcast to `shape` (rows along the last axis), scaled so squares cannot overflow;
    an infinite element gives an infinite norm."""
    x = np.abs(np.broadcast_to(np.asarray(x, dtype=np.float64), shape))
    if not shape:
        return x
    top = float(np.max(x)) if x.size else 0.0
    if top < 1e150 and not np.any(np.asarray(x) < 1e-150 * top):  # squares neither overflow nor lose a term
        with np.errstate(all="ignore"):
            return np.sqrt(np.einsum("...i,...i->...", x, x)) * NORM_SLACK
    with np.errstate(all="ignore"):
        scale = np.max(x, axis=-1, keepdims=True) if shape[-1] else np.zeros(shape[:-1] + (1,))
        safe = np.where((scale == 0) | ~np.isfinite(scale), 1.0, scale)
        out = np.sqrt(np.sum((x / safe) ** 2, axis=-1)) * scale[..., 0] * NORM_SLACK
    return np.where(np.isfinite(scale[..., 0]), out, np.inf)


def ball_in(v, shape: tuple[int, ...]) -> np.ndarray:
    """The row-norm bound of a value used in a result of `shape`: its own ball where its rows are the
    result's rows (same last axis), else the norm of its elementwise bound broadcast to the result."""
    own = v.iv.lo.shape
    if v.ball is not None and own and shape and own[-1] == shape[-1] and np.shape(v.ball) == own[:-1]:
        try:
            return np.minimum(np.broadcast_to(v.ball, shape[:-1]), row_norm(v.err, shape))
        except ValueError:
            pass
    return row_norm(v.err, shape)


def weighted(scale, err, ball: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """sup ||scale * e||_2 over each row's e with |e_i| <= err_i and ||e||_2 <= ball: the row's error mass
    goes to the largest |scale_i| first, each up to err_i (a fractional knapsack, solved exactly by sorting);
    at most both max|scale| ball and ||scale * err||."""
    with np.errstate(all="ignore"):
        box = row_norm(np.asarray(scale, dtype=np.float64) * np.asarray(err, dtype=np.float64), shape)
        if np.all(np.asarray(ball) >= row_norm(err, shape)):  # the ball cuts nothing: the box's norm is the sup
            return np.where(np.isnan(box), np.inf, box) * NORM_SLACK
    s2 = np.broadcast_to(np.asarray(scale, dtype=np.float64) ** 2, shape)
    e2 = np.broadcast_to(np.asarray(err, dtype=np.float64) ** 2, shape)
    with np.errstate(all="ignore"):
        order = np.argsort(-s2, axis=-1, kind="stable")
        s2, e2 = np.take_along_axis(s2, order, -1), np.take_along_axis(e2, order, -1)
        total = np.cumsum(e2, axis=-1)
        before = np.concatenate([np.zeros(total.shape[:-1] + (1,)), total[..., :-1]], axis=-1)  # mass placed before
        room = np.clip(np.asarray(ball, dtype=np.float64)[..., None] ** 2 - before, 0.0, e2)
        room = np.where(np.isnan(room), e2, room)  # inf - inf: take the element's whole box
        out = np.sqrt(np.sum(np.where((room > 0) & (s2 > 0), s2 * room, 0.0), axis=-1)) * NORM_SLACK * NORM_SLACK
    return np.where(np.isnan(out), np.inf, out)


def apply_ball(op: Op, args: list, slope, shape: tuple[int, ...]) -> np.ndarray | None:
    """The result's row-norm bound before its rounding (None: rebuild it from the elementwise bound)."""
    if not shape or op in (Op.LESS_THAN, Op.MOD):
        return None
    try:
        return _apply_ball(op, args, slope, shape)
    except ValueError:  # an operand whose bound does not broadcast to the result's rows: rebuilt from err
        return None


def _apply_ball(op: Op, args: list, slope, shape: tuple[int, ...]) -> np.ndarray | None:
    balls = [ball_in(a, shape) for a in args]
    with np.errstate(all="ignore"):
        if op is Op.ADD:
            out = balls[0] + balls[1]
        elif op is Op.MUL:  # |a| |e_b| + |b| |e_a| + |e_a| |e_b|, each term's norm over the box and the ball
            (a, b), (ba, bb) = args, balls
            out = weighted(a.iv.magnitude, b.err, bb, shape) + weighted(b.iv.magnitude, a.err, ba, shape) \
                + weighted(a.err, b.err, bb, shape)
        elif len(args) == 1:
            out = weighted(np.where(np.asarray(args[0].err) > 0, slope, 0.0), args[0].err, balls[0], shape)
        else:
            return None
        return np.where(np.isnan(out), np.inf, out) * NORM_SLACK


def rounded_ball(ball: np.ndarray | None, rounding: np.ndarray, err: np.ndarray, shape) -> np.ndarray | None:
    """The ball after a rounding whose elementwise term is `rounding`, cut at the rounded elementwise bound."""
    if ball is None or not shape or np.shape(ball) != shape[:-1]:
        return None
    with np.errstate(all="ignore"):
        out = (ball + row_norm(rounding, shape)) * NORM_SLACK
    return np.where(np.isnan(out), np.inf, out)  # ball_in cuts it at the elementwise bound's norm where used


def cut(err: np.ndarray, ball: np.ndarray | None, shape) -> np.ndarray:
    """|e_i| <= ||e row||_2: the elementwise bound cut at the ball."""
    if ball is None or not shape:
        return err
    return np.minimum(np.broadcast_to(err, shape), np.asarray(ball)[..., None])


def _row_probes(shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """(row id, position) of each element of `shape`, numbered from 1 (a padded read gives 0)."""
    rows = int(np.prod(shape[:-1], dtype=np.int64))
    row = np.broadcast_to((np.arange(rows, dtype=np.float64) + 1).reshape(shape[:-1] + (1,)), shape)
    pos = np.broadcast_to(np.arange(shape[-1], dtype=np.float64) + 1, shape)
    return np.ascontiguousarray(row), np.ascontiguousarray(pos)


def _rows_read(row: np.ndarray, pos: np.ndarray) -> np.ndarray | None:
    """Per row of a read (last axis): the one source row it reads (0: only padding), or None when a row
    reads several source rows or one position twice."""
    if not row.ndim or not row.shape[-1]:
        return None
    top = np.max(row, axis=-1)
    low = np.min(np.where(row > 0, row, np.inf), axis=-1)
    if not np.all((top == low) | (top == 0)):
        return None
    p = np.sort(np.where(row > 0, pos, 0), axis=-1)
    if np.any((p[..., 1:] == p[..., :-1]) & (p[..., 1:] > 0)):
        return None
    return top.astype(np.int64)


def _pick(src_ball: np.ndarray, src_shape, rows: np.ndarray) -> np.ndarray:
    flat = np.broadcast_to(src_ball, src_shape[:-1]).reshape(-1)
    return np.where(rows > 0, flat[np.maximum(rows, 1) - 1], 0.0)


def view_ball(view, src_shape: tuple[int, ...], src_ball, bindings, parts=None) -> np.ndarray | None:
    """The ball of a read of a value with `src_ball` through `view` (None where the rows do not map); a read
    row whose positions all lie in one of the source's `parts` (start, stop, ball) takes that part's ball."""
    if src_ball is None or not src_shape or not src_shape[-1]:
        return None
    row, pos = _row_probes(src_shape)
    read_pos = view.realize(pos, bindings)
    rows = _rows_read(view.realize(row, bindings), read_pos)
    if rows is None:
        return None
    ball = _pick(src_ball, src_shape, rows)
    if parts:
        live = view.realize(row, bindings) > 0
        first = np.min(np.where(live, read_pos, np.inf), axis=-1) - 1
        last = np.max(np.where(live, read_pos, -np.inf), axis=-1) - 1
        for start, stop, part_ball in parts:
            inside = (rows > 0) & (first >= start) & (last < stop)
            ball = np.where(inside, np.minimum(ball, _pick(part_ball, src_shape, rows)), ball)
    return ball


def rounded_parts(parts, rounding: np.ndarray, err: np.ndarray, shape) -> tuple | None:
    """Each part's ball after a rounding (rounded_ball over the part's positions)."""
    if not parts or not shape:
        return None
    rounding, err = np.broadcast_to(rounding, shape), np.broadcast_to(err, shape)
    out = []
    for start, stop, ball in parts:
        if np.shape(ball) != shape[:-1]:
            return None
        with np.errstate(all="ignore"):
            b = (ball + row_norm(rounding[..., start:stop], shape[:-1] + (stop - start,))) * NORM_SLACK
        out.append((start, stop, np.minimum(np.where(np.isnan(b), np.inf, b),
                                            row_norm(err[..., start:stop], shape[:-1] + (stop - start,)))))
    return tuple(out)


def cut_parts(err: np.ndarray, parts, shape) -> np.ndarray:
    """|e_i| <= the ball of i's part."""
    if not parts or not shape:
        return err
    err = np.array(np.broadcast_to(err, shape))
    for start, stop, ball in parts:
        err[..., start:stop] = np.minimum(err[..., start:stop], np.asarray(ball)[..., None])
    return err


def operand_a_ball(view, layout, src_shape: tuple[int, ...], src_ball, bindings) -> np.ndarray | None:
    """The ball of each (batch, M) row of a Gemm's A operand along K (None where the rows do not map)."""
    if src_ball is None or not src_shape or not src_shape[-1]:
        return None
    row, pos = _row_probes(src_shape)
    rows = _rows_read(*(gemm_operand_a(read_operand(view, x, bindings), layout) for x in (row, pos)))
    return None if rows is None else _pick(src_ball, src_shape, rows)


def spectral_norm(b: np.ndarray) -> float:
    """A sound upper bound of ||b||_2 for each (K, N) matrix of b (batch, K, N), as (batch, 1, 1).

    lambda_max of the smaller Gram matrix G = b b^T, computed in FP64: |fl(G) - G| <= gamma_N |b| |b|^T,
    whose 2-norm is at most gamma_N ||b||_F^2, and a symmetric eigensolver's eigenvalues are exact for a
    matrix within p(n) u ||G||_2 <= p(n) u ||b||_F^2: 1e-9 ||b||_F^2 covers both for N, p(n) up to 10^6. Past
    MAX_GRAM the Frobenius norm stands for it (an upper bound, looser by up to sqrt(rank))."""
    b = np.asarray(b, dtype=np.float64)
    frob = np.einsum("...kn,...kn->...", b, b)  # no b * b temporary
    if min(b.shape[-2:]) > MAX_GRAM:  # an eigensolver of that size costs seconds: ||b||_2 <= ||b||_F
        return (np.sqrt(frob) * (1 + 2.0 ** -40))[..., None, None]
    gram = b @ np.swapaxes(b, -1, -2) if b.shape[-2] <= b.shape[-1] else np.swapaxes(b, -1, -2) @ b
    top = np.linalg.eigvalsh(gram)[..., -1]
    return (np.sqrt(np.maximum(top, 0.0) + 1e-9 * frob) * (1 + 2.0 ** -40))[..., None, None]
