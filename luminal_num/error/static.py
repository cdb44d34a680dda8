"""Static analysis of an LLIR program: value intervals + first-order, sound rounding-error bounds.

For every buffer we carry an interval of its *exact* value (the FP64-semantics value, per element)
and a bound on |executed - exact|. Each kernel propagates its inputs' errors through the op (a
derivative bound over the interval widened by the error) and adds its own roundings: FP32 per
fused op, the Gemm variant's a-priori bound, gamma_n of the accumulator for sums, the storage
format's half-ulp. A buffer whose exact value certainly exceeds its format's range is an overflow
verdict naming the kernel; one that only might overflow gets an infinite bound (measure instead).
A QUANTIZE kernel passes A's interval and error through unchanged (as the (batch, M, K) operand):
its Gemm's variant bound already charges A's quantization, so charging it here too would count it
twice, and the interval it carries is the exact value's, which quantizing does not change.
"""
from __future__ import annotations

import dataclasses
import hashlib
from typing import Callable, Mapping

import numpy as np

from ..codegen.llir import (FApply, FConstV, FExpr, FLoad, FRoundTo, Kernel, KernelKind, Program, epilogue_as_elementwise,
                            external_value)
from ..codegen.rows import unfused
from ..dtypes.formats import F32, Kind
from ..dtypes.formats import get as get_format
from ..quant.kv import cache_error
from ..quant.stored import MissingCalibration
from ..hlir.ops import Op
from ..hlir.rotation import rotation_error
from ..hlir.smoothing import smoothing_error
from ..hlir.store import STREAMING
from ..hlir.weightcache import WEIGHTS
from ..runtime.cpu_pages import page_releases
from ..hlir.symbolic import evaluate as eval_dim
from .indexed import Rows, gather_rows, index_range, scatter_rows
from .liveness import last_readers
from .interval import Interval, transfer
from .static_ball import apply_ball, spectral_norm, view_ball
from .static_gemm import gemm_operand, gemm_value
from .static_values import (SLACK, BoundedValue, Overflow, OverflowFound, StaticReport, custom_interval, floor_of, mag_of,
                            round_f32, slope_bound, store_known, store_rounded, stored_weight_value)
from .normalize import NormBound
from .rounding_bounds import gamma, nan_as_unbounded
from .softmax_bound import masked_softmax_error, softmax_error
from . import attention_bound
from ..codegen.attention import ATTENTION_VARIANTS
from ..hlir.gemm import gemm_layouts

_ACC = -1  # the buffer id a Gemm epilogue's accumulator is analysed under (no kernel has it)


class StaticAnalyzer:
    def __init__(self, program: Program, bindings: Mapping[str, int], weights: Mapping[str, np.ndarray] | None = None,
                 norms: dict | None = None):
        """`weights`: the graph's (a weight filled by a calibrated rounding is bounded by its own stored values,
        found from the weight itself); `norms`: spectral norms of those weights, kept by the caller across runs."""
        self.p, self.bindings = program, dict(bindings)
        self.weights = weights or {}
        self.norms = {} if norms is None else norms
        self.read_by_kernels = {inp.buffer for k in program.kernels for inp in k.inputs}  # a ball only they use
        self.vals: dict[int, BoundedValue] = {}
        self.norm = NormBound(self)
        self.softmax_rel: dict[int, tuple[np.ndarray, float]] = {}  # see _softmax
        self.caches = program.cache_buffers()  # KV-cache inputs held in a KV format
        self.softmax_fed = _read_only_by_softmax(program)  # may hold masked (-inf) entries: BoundedValue.masked
        self.in_softmax = False  # evaluating a softmax kernel's body: its roundings may mask too

    def read(self, k: Kernel, i: int) -> BoundedValue:
        inp = k.inputs[i]
        src = self.vals[inp.buffer]
        lo = inp.view.realize(np.asarray(src.iv.lo), self.bindings)
        hi = inp.view.realize(np.asarray(src.iv.hi), self.bindings)
        nan = inp.view.realize(np.broadcast_to(src.iv.nan, src.iv.lo.shape).astype(np.float64), self.bindings)
        err = inp.view.realize(np.asarray(src.err), self.bindings)
        masked = any(v.mask is not None for v in inp.view.views)  # padding reads an exact 0
        floor = None if src.floor is None else (0.0 if masked else src.floor)
        minus_inf = None if src.masked is None else inp.view.realize(
            np.broadcast_to(src.masked, src.iv.lo.shape).astype(np.float64), self.bindings) > 0
        ball = view_ball(inp.view, src.iv.lo.shape, src.ball, self.bindings, src.parts)  # error/static_ball.py
        return BoundedValue(Interval(lo, hi, nan > 0), err, floor, minus_inf, ball)

    def body(self, e: FExpr, k: Kernel) -> BoundedValue:
        if isinstance(e, FLoad):
            return self.read(k, e.slot)
        if isinstance(e, FConstV):
            c = e.value if isinstance(e.value, float) else float(eval_dim(e.value, self.bindings))
            c32 = float(np.float32(c))
            return BoundedValue(Interval.point(c), np.asarray(abs(c32 - c)), c32 if c32 >= 0 else None)
        if isinstance(e, FRoundTo):
            return store_rounded(self.body(e.x, k), e.fmt, k, e.origin, masked_ok=self.in_softmax)
        if e.op is Op.MUL and len(e.args) == 2 and e.args[0] == e.args[1]:
            return round_f32(self._square(self.body(e.args[0], k)), k)
        args = [self.body(a, k) for a in e.args]
        generic = self._apply(e, args)
        norm = self.norm.bound(e, k) if e.op is Op.MUL else None
        if norm is not None:  # x * rsqrt(c * sum(x^2) + eps): the correlated bound (error/normalize.py)
            iv, err, ball = norm  # both are sound: keep the tighter of each
            ball = generic.ball if ball is None else ball if generic.ball is None else np.minimum(ball, generic.ball)
            generic = BoundedValue(Interval(np.maximum(iv.lo, generic.iv.lo), np.minimum(iv.hi, generic.iv.hi), generic.iv.nan),
                                   np.minimum(err, generic.err), generic.floor, ball=ball)
        return round_f32(generic, k)

    @staticmethod
    def _square(a: BoundedValue) -> BoundedValue:
        """x*x of one value: never negative (a general product of [lo, hi] with itself would be), so a
        variance's interval stays off zero and its reciprocal square root stays bounded."""
        lo, hi = a.iv.lo, a.iv.hi
        with np.errstate(over="ignore"):
            sq_lo, sq_hi = lo * lo, hi * hi
            low = np.where((lo <= 0) & (hi >= 0), 0.0, np.nextafter(np.minimum(sq_lo, sq_hi), -np.inf))
            high = np.nextafter(np.maximum(sq_lo, sq_hi), np.inf)
            err = 2 * mag_of(a.iv) * a.err + a.err * a.err
        return BoundedValue(Interval(np.maximum(low, 0.0), high, a.iv.nan), nan_as_unbounded(err) * SLACK, 0.0)

    def _apply(self, e: FApply, args: list[BoundedValue]) -> BoundedValue:
        op = e.op
        with np.errstate(all="ignore"):
            if op is Op.ADD:
                a, b = args
                iv = transfer(Op.ADD, a.iv, b.iv)
                return BoundedValue(iv, (a.err + b.err) * SLACK, floor_of(op, args), _masked_through(op, a, b),
                                    apply_ball(op, args, None, iv.lo.shape))
            if op is Op.MUL:
                a, b = args
                err = mag_of(a.iv) * b.err + mag_of(b.iv) * a.err + a.err * b.err
                iv = transfer(Op.MUL, a.iv, b.iv)
                return BoundedValue(iv, nan_as_unbounded(err) * SLACK, floor_of(op, args), _masked_through(op, a, b),
                                    apply_ball(op, args, None, iv.lo.shape))
            if op is Op.LESS_THAN:
                a, b = args
                out = transfer(Op.LESS_THAN, a.iv, b.iv)
                aw, bw = a.wide, b.wide
                undecided = ~((aw.hi < bw.lo) | (aw.lo >= bw.hi))  # the executed comparison may flip
                flips = undecided & ((a.err > 0) | (b.err > 0))
                return BoundedValue(out, np.where(flips, 1.0, 0.0))
            if op is Op.MOD:
                a, b = args
                out = transfer(Op.MOD, a.iv, b.iv)
                return BoundedValue(out, np.where((a.err > 0) | (b.err > 0), np.inf, 0.0))
            (a,) = args
            iv = custom_interval(e.kind, a.iv) if op is Op.CUSTOM else transfer(op, a.iv)
            slope = slope_bound(op, e.kind, a.wide)
            err = nan_as_unbounded(np.where(a.err > 0, slope * a.err, 0.0))
            if op is Op.RECIP and a.floor is not None and a.floor > 0:  # executed in (0, 1/floor], exact in iv
                err = np.minimum(err, np.maximum(1 / a.floor * (1 + 2.0 ** -40), iv.hi) - np.minimum(iv.lo, 0.0))
            if op is Op.CUSTOM and e.kind in ("tanh", "erf"):  # both in [-1, 1] (a libm's few ulps past it)
                err = np.minimum(err, np.maximum(iv.hi, 1.0) - np.minimum(iv.lo, -1.0) + 2.0 ** -20)
            return BoundedValue(iv, err * SLACK, floor_of(op, args),
                                ball=apply_ball(op, args, slope, iv.lo.shape))

    def run(self, inputs: Mapping[str, Interval], keep: frozenset[int] = frozenset()) -> StaticReport:
        """Every kernel in order; a buffer's bound is dropped after the last kernel that may read it
        (error/liveness.py), so the analysis holds a few layers' bounds at a time, not the whole model's.
        `keep`: buffers whose bounds stay in `vals` afterwards besides the outputs' (for inspection).
        Streaming (hlir.store.STREAMING), a weight's file pages go after its last reader, as in a CPU run."""
        last = last_readers(self.p)
        keep = keep | {kid for _, kid in self.p.outputs}
        pages = page_releases(self.p, self.weights) if STREAMING.on else None
        try:
            with STREAMING.by_last_reader():
                for i, k in enumerate(self.p.kernels):
                    self.vals[k.id] = self.kernel(k, inputs)
                    for buf in last.get(i, ()):
                        if buf not in keep:
                            self.vals.pop(buf, None)
                    if pages is not None:
                        STREAMING.release(pages.after.get(k.id, ()))
        except OverflowFound as exc:
            return StaticReport({}, {}, exc.ov)
        outs = {name: self.vals[kid] for name, kid in self.p.outputs}
        return StaticReport({n: np.broadcast_to(v.err, v.iv.lo.shape).copy() for n, v in outs.items()},
                            {n: v.iv for n, v in outs.items()}, None)

    def kernel(self, k: Kernel, inputs: Mapping[str, Interval]) -> BoundedValue:
        return KERNEL_TRANSFERS[k.kind](self, k, inputs)

    def _shape(self, k: Kernel) -> tuple[int, ...]:
        return tuple(eval_dim(d, self.bindings) for d in k.shape)

    def external(self, k: Kernel, inputs: Mapping[str, Interval]) -> BoundedValue:
        shape = self._shape(k)
        if k.rotation is not None or k.smoothing is not None:  # a rotated or smoothed weight, H_b or 2^-e
            return self._rotated(k, shape)
        iv = self._concat_interval(k, inputs) if k.concat else self._range(inputs, k.external)
        if k.storage is not None and k.id in self.caches:  # a KV cache handed in, held in its format
            iv = Interval(np.broadcast_to(iv.lo, shape), np.broadcast_to(iv.hi, shape))
            low = float(np.min(iv.lo)) if iv.lo.size else 0.0
            v = store_known(BoundedValue(iv, np.zeros(shape), low if low >= 0 else None), k.dtype, k)  # FP32 first, then the rows
            return BoundedValue(iv, v.err + cache_error(mag_of(v.wide), k.storage), 0.0 if low >= 0 else None)
        if k.storage is not None:  # a weight held in a storage format: its exact storage error
            try:
                if k.concat:  # concatenated stored weights: each part's own storage error (quant/concat.py)
                    return self._stored_concat(k, inputs)
                return stored_weight_value(iv, k.storage, shape, k.fill, self._weight(k, k.external))
            except ValueError as exc:  # its scales do not fit their format: the run would refuse it too
                magnitude = float(np.max(np.abs(iv.lo))) if iv.lo.size else 0.0
                raise OverflowFound(Overflow(k.id, k.label or k.external, k.storage, magnitude, str(exc))) from None
        iv = Interval(np.broadcast_to(iv.lo, shape), np.broadcast_to(iv.hi, shape))
        if k.dtype.kind is not Kind.FLOAT:
            return BoundedValue(iv, np.zeros(shape))
        low = float(np.min(iv.lo)) if iv.lo.size else 0.0
        return store_known(BoundedValue(iv, np.zeros(shape), low if low >= 0 else None), k.dtype, k)

    def _rotated(self, k: Kernel, shape: tuple[int, ...]) -> BoundedValue:
        """x W^T = (x H)(W H)^T = (x diag(2^-e))(W diag(2^e))^T exactly, so the rotated (smoothed) weight's exact
        value is W H (W diag(2^e)): the FP32 value every kernel reads is off by at most rotation_error
        (smoothing_error), and a storage format adds its own error from that value."""
        derived = k.rotation if k.rotation is not None else k.smoothing
        if derived.source is not None and derived.source not in self.weights:
            raise KeyError(f"no value for weight {derived.source!r}, which {k.external!r} is derived from")
        w = external_value(k, self.weights)
        iv = Interval.point(np.asarray(w, dtype=np.float64))
        err = (rotation_error(k.rotation, self.weights) if k.rotation is not None
               else smoothing_error(k.smoothing, self.weights))
        if k.storage is not None:
            try:
                v = stored_weight_value(iv, k.storage, shape, k.fill, w if k.fill is not None else None)
            except ValueError as exc:
                magnitude = float(np.max(np.abs(iv.lo))) if iv.lo.size else 0.0
                raise OverflowFound(Overflow(k.id, k.label or k.external, k.storage, magnitude, str(exc))) from None
            return dataclasses.replace(v, err=v.err + err)
        return BoundedValue(iv, err)  # held in FP32 as computed (an FP32 EXTERNAL stores it exactly)

    def _stored_concat(self, k: Kernel, inputs: Mapping[str, Interval]) -> BoundedValue:
        parts = {p.external: p for p in self.p.kernels if p.kind is KernelKind.EXTERNAL and not p.concat}
        vals = [stored_weight_value(self._range(inputs, n), k.storage, self._shape(parts[n]), k.fill, self._weight(k, n))
                for n in k.concat]
        cat = lambda xs: np.concatenate(xs, axis=k.concat_axis)  # noqa: E731
        return BoundedValue(Interval(cat([v.iv.lo for v in vals]), cat([v.iv.hi for v in vals])), cat([v.err for v in vals]))

    def _range(self, inputs: Mapping[str, Interval], name: str) -> Interval:
        """An input's interval; a weight not among them is the point of its values in FP64, made when its
        kernel runs (dropped after its last reader: a model's weights are never all held in FP64 at once)."""
        if name in inputs:
            return inputs[name]
        return Interval.point(np.asarray(self.weights[name], dtype=np.float64))

    def _weight(self, k: Kernel, name: str):
        """The weight `name` itself where a fill needs it (its Hessian is found by its content key)."""
        if k.fill is None:
            return None
        if name not in self.weights:
            raise MissingCalibration(f"the static bound of weight {name!r} stored as {k.storage} filled by {k.fill} "
                                     f"needs the weight itself (static_bound(..., weights))")
        return self.weights[name]

    def _concat_interval(self, k: Kernel, inputs: Mapping[str, Interval]) -> Interval:
        """Concatenated weights: each part's interval over its own shape, concatenated along the axis."""
        parts = {p.external: p for p in self.p.kernels if p.kind is KernelKind.EXTERNAL and not p.concat}
        ivs = [(self._range(inputs, n), self._shape(parts[n])) for n in k.concat]
        return Interval(np.concatenate([np.broadcast_to(iv.lo, s) for iv, s in ivs], axis=k.concat_axis),
                        np.concatenate([np.broadcast_to(iv.hi, s) for iv, s in ivs], axis=k.concat_axis))

    def const(self, k: Kernel, inputs) -> BoundedValue:
        c = k.value if isinstance(k.value, float) else float(eval_dim(k.value, self.bindings))
        return store_rounded(BoundedValue(Interval.point(np.asarray(c)), np.asarray(0.0), c if c >= 0 else None), k.dtype, k)

    def iota(self, k: Kernel, inputs) -> BoundedValue:
        n = eval_dim(k.value, self.bindings)  # integers, exact where the format holds them: comparisons cannot flip
        return store_known(BoundedValue(Interval.point(np.arange(n, dtype=np.float64)), np.zeros(n), 0.0), k.dtype, k)

    def elementwise(self, k: Kernel, inputs) -> BoundedValue:
        v = self.body(k.body, k)
        shape = self._shape(k)
        keeps_rows = v.ball is not None and shape and v.iv.lo.shape[-1:] == shape[-1:] \
            and np.shape(v.ball) == v.iv.lo.shape[:-1]
        v = BoundedValue(Interval(np.broadcast_to(v.iv.lo, shape), np.broadcast_to(v.iv.hi, shape),
                          np.broadcast_to(v.iv.nan, shape)), np.broadcast_to(v.err, shape), v.floor,
                         None if v.masked is None else np.broadcast_to(v.masked, shape),
                         np.broadcast_to(v.ball, shape[:-1]) if keeps_rows else None)
        return store_rounded(v, k.dtype, k, masked_ok=k.id in self.softmax_fed)

    def sum(self, k: Kernel, inputs) -> BoundedValue:
        v = self.body(k.body, k)
        n = v.iv.lo.shape[k.axis]
        iv = transfer(Op.SUM_REDUCE, v.iv, axis=k.axis)
        acc = k.acc or F32
        g = gamma(n, acc.unit_roundoff)
        with np.errstate(all="ignore"):
            abs_sum = np.sum(mag_of(v.wide), axis=k.axis)
            err = np.sum(v.err, axis=k.axis) + g * abs_sum + n * acc.min_subnormal / 2
            # every running total, in any order, is at most sum|terms| (1 + gamma_n): past the
            # accumulator's max a partial sum may overflow even when the final sum is small
            err = np.where(abs_sum * (1 + g) + n * acc.min_subnormal <= acc.max_finite, err, np.inf)
        floor = None if v.floor is None else 0.0  # a sum of executed values >= 0 rounds to >= 0
        return store_rounded(BoundedValue(iv, nan_as_unbounded(err) * SLACK, floor), k.dtype, k)

    def max(self, k: Kernel, inputs) -> BoundedValue:
        v = self.body(k.body, k)
        return store_rounded(BoundedValue(transfer(Op.MAX_REDUCE, v.iv, axis=k.axis), np.max(v.err, axis=k.axis), v.floor),
                      k.dtype, k)

    def rows(self, k: Kernel, inputs) -> BoundedValue:
        """A row kernel computes its unfused chain's values exactly (codegen/rows.py): bound that chain,
        so the correlated norm bound and every rounding of the chain apply as they would unfused."""
        return self._unfused(k, inputs)

    def _unfused(self, k: Kernel, inputs) -> BoundedValue:
        mini, ext = unfused(k, [self.p.kernel(inp.buffer) for inp in k.inputs])
        sub = StaticAnalyzer(mini, self.bindings, self.weights)
        for buf, kid in ext.items():
            sub.vals[kid] = self.vals[buf]
        try:
            for mk in mini.kernels[len(ext):]:
                sub.vals[mk.id] = sub.kernel(mk, inputs)
        except OverflowFound as exc:  # name the row kernel, not a kernel of the unfused chain
            raise OverflowFound(Overflow(k.id, k.label, exc.ov.fmt, exc.ov.magnitude, exc.ov.detail)) from None
        return sub.vals[mini.outputs[0][1]]

    def quantize(self, k: Kernel, inputs) -> BoundedValue:
        lo, hi, err = gemm_operand(self, k, 0)
        return BoundedValue(Interval(lo, hi), err)

    def gather(self, k: Kernel, inputs) -> BoundedValue:
        """Table rows by index: exact rows where the index is known (error/indexed.py)."""
        table = self.read(k, 0)
        t_shape = table.iv.lo.shape
        first, last = self._index_rows(k, 1, t_shape[0])
        rows = gather_rows(_rows_of(table, t_shape), first, last)
        shape = self._shape(k)
        return BoundedValue(Interval(rows.lo.reshape(shape), rows.hi.reshape(shape)), rows.err.reshape(shape), table.floor)

    def _index_rows(self, k: Kernel, slot: int, rows: int) -> tuple[np.ndarray, np.ndarray]:
        idx = self.read(k, slot)
        return index_range(idx.iv.lo, idx.iv.hi, np.broadcast_to(idx.err, idx.iv.lo.shape), rows)

    def scatter(self, k: Kernel, inputs) -> BoundedValue:
        return self._scattered(k, self.read(k, 0), self.read(k, 1), index_slot=2)

    def scatter_ew(self, k: Kernel, inputs) -> BoundedValue:
        """The source rows as the elementwise kernel the body replaces (codegen/rows.py), then scattered."""
        return self._scattered(k, self.read(k, 0), self._unfused(k, inputs), index_slot=1)

    def _scattered(self, k: Kernel, dest: BoundedValue, src: BoundedValue, index_slot: int) -> BoundedValue:
        """Rows written at their index (error/indexed.py): a row written at a known position holds exactly
        the source row, every other row keeps its own value."""
        shape = dest.iv.lo.shape
        first, last = self._index_rows(k, index_slot, shape[0])
        floor = None if dest.floor is None or src.floor is None else min(dest.floor, src.floor)
        src_shape = (first.size,) + shape[1:]
        src_err = np.broadcast_to(src.err, src.iv.lo.shape)
        if k.storage is not None:  # rows written into a KV cache in its format: |Q(s~) - s| <= err + cache_error(|s~|)
            src_err = src_err + cache_error(mag_of(src.wide), k.storage)
            floor = None if floor is None else 0.0  # rounding keeps the sign, not the floor
        written = scatter_rows(_rows_of(dest, shape), _rows_of(BoundedValue(src.iv, src_err), src_shape), first, last)
        return BoundedValue(Interval(written.lo, written.hi), written.err, floor)

    def softmax(self, k: Kernel, inputs=None) -> BoundedValue:
        out = store_rounded(self._softmax(k), k.dtype, k)
        rel, absolute = self.softmax_rel[k.id]
        if k.dtype.kind is Kind.FLOAT and k.dtype.name != "f64":  # the store's rounding, relative to p
            u, sub = k.dtype.unit_roundoff, k.dtype.min_subnormal
            rel, absolute = rel + u * (1 + rel), absolute * (1 + u) + sub / 2
        finite = bool(np.all(np.isfinite(out.err)))
        self.softmax_rel[k.id] = (np.where(finite, rel * SLACK * SLACK, np.inf), absolute * SLACK * SLACK)
        return out

    def _softmax(self, k: Kernel) -> BoundedValue:
        """Also records (total per row, abs) with sum_i |p^_i - p_i| <= total + n abs over each row: the
        form the Gemm of attention uses. The bound itself: error/softmax_bound.py (from the row max)."""
        self.in_softmax = True
        try:
            v = self.body(k.body, k)
        finally:
            self.in_softmax = False
        iv = transfer(Op.SOFTMAX, v.iv, axis=k.axis)
        fmt = None if k.precision in (None, "f32") else get_format(k.precision)
        if v.masked is not None and np.any(v.masked):  # entries executed as -inf: error/softmax_bound.py
            bound = masked_softmax_error(v.iv, v.wide, v.err, np.broadcast_to(v.masked, v.iv.lo.shape), k.axis, fmt)
        else:
            bound = softmax_error(v.iv, v.wide, v.err, iv, k.axis, fmt)
        self.softmax_rel[k.id] = (bound.row_total * SLACK, bound.absolute * SLACK)
        return BoundedValue(iv, bound.err * SLACK, 0.0)

    def gemm(self, k: Kernel, inputs=None) -> BoundedValue:
        return store_rounded(gemm_value(self, k), k.dtype, k)

    def gemm_epilogue(self, k: Kernel, inputs=None) -> BoundedValue:
        """The Gemm's value as its FP32 accumulator holds it (the unfused Gemm's F32 store: the same value),
        then the epilogue exactly as the unfused elementwise kernel's transfer, then the one store."""
        self.vals[_ACC] = round_f32(gemm_value(self, k), k)
        self.norm.by_id[_ACC] = k  # the accumulator is this Gemm's: a norm pattern stops at it
        try:
            return self.elementwise(epilogue_as_elementwise(k, _ACC), inputs)
        finally:
            del self.vals[_ACC], self.norm.by_id[_ACC]

    def spectral_norm(self, k: Kernel, b: np.ndarray, part: tuple = ()) -> np.ndarray:
        """||B||_2 of a Gemm's point B operand (or of its columns `part`), kept in `norms` when B is read from
        the graph's weights."""
        src = self.norm.by_id.get(k.inputs[1].buffer)
        names = () if src is None or src.kind is not KernelKind.EXTERNAL else (src.concat or (src.external,))
        key = None
        if names and all(n in self.weights for n in names):
            key = (names, k.inputs[1].view.encode(), repr(k.layout), b.shape, part)
        if key is None or key not in self.norms:
            # by content (a weight's, or an operand's bytes): the same matrix in another analysis is not solved again
            content = "spectral:" + hashlib.blake2b(np.ascontiguousarray(b).data, digest_size=16).hexdigest()  # no copy
            value = WEIGHTS.get(content, b.shape, lambda: spectral_norm(b))
            if key is None:
                return value
            self.norms[key] = value
        return self.norms[key]

    def attention(self, k: Kernel, inputs=None) -> BoundedValue:
        """The fused attention kernel: error/attention_bound.py (stages (a) and (b) there)."""
        variant, spec = ATTENTION_VARIANTS[k.precision], k.value
        qk = dataclasses.replace(k, kind=KernelKind.GEMM, inputs=k.inputs[:2], precision=variant.gemm,
                                 layout=gemm_layouts(k.inputs[0].view, k.inputs[1].view, len(k.inputs[0].view.shape) - 1)[0])
        dot = gemm_value(self, qk)  # the same operand rounding and FP32 accumulation, not stored
        scale = BoundedValue(Interval.point(spec.scale), np.asarray(abs(float(np.float32(spec.scale)) - spec.scale)))
        scaled = round_f32(self._apply(FApply(Op.MUL, ()), [dot, scale]), k)
        s = round_f32(self._apply(FApply(Op.ADD, ()), [scaled, self.read(k, 2)]), k)
        shape = tuple(eval_dim(d, self.bindings) for d in k.inputs[2].view.shape)
        s = BoundedValue(Interval(*(np.broadcast_to(x, shape) for x in (s.iv.lo, s.iv.hi))), np.broadcast_to(s.err, shape))
        v = self.read(k, 3)  # over (rows..., Dv, T)
        vshape = tuple(eval_dim(d, self.bindings) for d in k.inputs[3].view.shape)
        iv, err = attention_bound.attention_error(s.iv, s.wide, s.err, Interval(*(np.broadcast_to(x, vshape) for x in (
            v.iv.lo, v.iv.hi))), np.broadcast_to(v.err, vshape), spec, variant.pv)
        out = BoundedValue(iv, nan_as_unbounded(err) * SLACK)
        return store_rounded(round_f32(out, k), k.dtype, k)  # the divide's rounding, then the store


# How each kernel kind transforms (interval, error): one entry per KernelKind (a test checks coverage).
KERNEL_TRANSFERS: dict[KernelKind, Callable[[StaticAnalyzer, Kernel, Mapping[str, Interval]], BoundedValue]] = {
    KernelKind.EXTERNAL: StaticAnalyzer.external,
    KernelKind.CONST: StaticAnalyzer.const,
    KernelKind.IOTA: StaticAnalyzer.iota,
    KernelKind.ELEMENTWISE: StaticAnalyzer.elementwise,
    KernelKind.SUM: StaticAnalyzer.sum,
    KernelKind.MAX: StaticAnalyzer.max,
    KernelKind.SOFTMAX: StaticAnalyzer.softmax,
    KernelKind.GEMM: StaticAnalyzer.gemm,
    KernelKind.QUANTIZE: StaticAnalyzer.quantize,
    KernelKind.GATHER: StaticAnalyzer.gather,
    KernelKind.SCATTER: StaticAnalyzer.scatter,
    KernelKind.SCATTER_NOCOPY: StaticAnalyzer.scatter,
    KernelKind.GEMM_EPILOGUE: StaticAnalyzer.gemm_epilogue,
    KernelKind.ATTENTION: StaticAnalyzer.attention,
    KernelKind.ROWS: StaticAnalyzer.rows,
    KernelKind.SCATTER_EW: StaticAnalyzer.scatter_ew,
}


def _read_only_by_softmax(program: Program) -> set[int]:
    """Buffers every reader of which is a softmax kernel (and no output): -inf entries there are masked keys."""
    readers: dict[int, set[KernelKind]] = {}
    for k in program.kernels:
        for inp in k.inputs:
            readers.setdefault(inp.buffer, set()).add(k.kind)
    outputs = {kid for _, kid in program.outputs}
    return {b for b, kinds in readers.items() if kinds == {KernelKind.SOFTMAX} and b not in outputs}


def _masked_through(op: Op, a: BoundedValue, b: BoundedValue) -> np.ndarray | None:
    """-inf + finite and -inf * (positive finite) stay exactly -inf: masked entries survive a scale and a bias."""
    if a.masked is None and b.masked is None:
        return None
    out = False
    for x, y in ((a, b), (b, a)):
        if x.masked is None:
            continue
        yw = y.wide
        keeps = (np.isfinite(yw.lo) & np.isfinite(yw.hi) & ~yw.nan) if op is Op.ADD else \
            ((yw.lo > 0) & np.isfinite(yw.hi) & ~yw.nan)
        out = out | (x.masked & keeps & ~(y.masked if y.masked is not None else False))
    return np.asarray(out)


def _rows_of(v: BoundedValue, shape: tuple[int, ...]) -> Rows:
    """A value's interval and error as writable arrays of `shape` (rows along axis 0)."""
    return Rows(*(np.array(np.broadcast_to(x, shape), dtype=np.float64) for x in (v.iv.lo, v.iv.hi, v.err)))


def static_bound(program: Program, input_ranges: Mapping[str, Interval], bindings: Mapping[str, int] | None = None,
                 weights: Mapping[str, np.ndarray] | None = None, norms: dict | None = None) -> StaticReport:
    """Bounds for every output given intervals of every activation input (weights are exact points);
    `norms`: a dict the caller keeps to reuse the weights' spectral norms across calls with these weights."""
    ranges = dict(input_ranges)
    missing = [n for n, _ in program.inputs if n not in ranges and n not in (weights or {})]
    if missing:
        raise KeyError(f"no value range for inputs {missing}")
    return StaticAnalyzer(program, bindings or {}, weights, norms).run(ranges)
