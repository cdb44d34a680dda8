"""ShapeTracker: immutable, canonicalizing views (shape, strides, offset, mask), as in tinygrad.

A view maps a logical index to a position in a contiguous buffer: pos = offset + sum(i_k * stride_k),
valid only inside `mask` (elements outside read as 0: that is how pad works). Movement ops edit views
and never create graph nodes. When a reshape cannot be expressed as one strided view, a new view is
stacked on top: the outer view then indexes the *contiguous layout* of the view below it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from .symbolic import Dim, Poly, as_dim, encode, evaluate, is_const, prod

Mask = tuple[tuple[Dim, Dim], ...]


def contiguous_strides(shape: Sequence[Dim]) -> tuple[Dim, ...]:
    strides: list[Dim] = []
    acc: Dim = 1
    for d in reversed(shape):
        strides.append(0 if d == 1 else acc)
        acc = acc * d
    return tuple(reversed(strides))


def _dmin(a: Dim, b: Dim) -> Dim:
    if is_const(a) and is_const(b):
        return min(a, b)
    if a == b:
        return a
    raise ValueError(f"cannot order symbolic bounds {a} and {b}")


def _dmax(a: Dim, b: Dim) -> Dim:
    if is_const(a) and is_const(b):
        return max(a, b)
    if a == b:
        return a
    raise ValueError(f"cannot order symbolic bounds {a} and {b}")


@dataclass(frozen=True)
class View:
    shape: tuple[Dim, ...]
    strides: tuple[Dim, ...]
    offset: Dim = 0
    mask: Mask | None = None

    @staticmethod
    def create(shape: Sequence[Dim], strides: Sequence[Dim] | None = None, offset: Dim = 0,
               mask: Mask | None = None) -> "View":
        """Canonical form: size-1 dims get stride 0, a mask that covers everything is dropped."""
        shape = tuple(as_dim(d) for d in shape)
        strides = contiguous_strides(shape) if strides is None else tuple(strides)
        if len(strides) != len(shape):
            raise ValueError(f"strides {strides} do not match shape {shape}")
        strides = tuple(0 if d == 1 else s for d, s in zip(shape, strides))
        if mask is not None:
            mask = tuple((lo, hi) for lo, hi in mask)
            if all(lo == 0 and hi == d for (lo, hi), d in zip(mask, shape)):
                mask = None
            elif any(is_const(lo) and is_const(hi) and lo >= hi for lo, hi in mask):
                # nothing valid: canonical empty mask, offset irrelevant
                mask = tuple((0, 0) for _ in shape)
                strides, offset = tuple(0 for _ in shape), 0
        return View(shape, strides, offset, mask)

    @property
    def contiguous(self) -> bool:
        return self.offset == 0 and self.mask is None and self.strides == contiguous_strides(self.shape)

    def encode(self) -> tuple:
        m = None if self.mask is None else tuple((encode(a), encode(b)) for a, b in self.mask)
        return (tuple(encode(d) for d in self.shape), tuple(encode(s) for s in self.strides),
                encode(self.offset), m)


@dataclass(frozen=True)
class ShapeTracker:
    views: tuple[View, ...]

    @staticmethod
    def contiguous(shape: Sequence[Dim]) -> "ShapeTracker":
        return ShapeTracker((View.create(shape),))

    # -- queries ------------------------------------------------------------------------------
    @property
    def shape(self) -> tuple[Dim, ...]:
        return self.views[-1].shape

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def is_contiguous(self) -> bool:
        return len(self.views) == 1 and self.views[0].contiguous

    def encode(self) -> tuple:
        return tuple(v.encode() for v in self.views)

    def _replace_top(self, v: View) -> "ShapeTracker":
        return ShapeTracker(self.views[:-1] + (v,))

    def _axis(self, axis: int) -> int:
        n = self.ndim
        if not -n <= axis < n:
            raise IndexError(f"axis {axis} out of range for shape {self.shape}")
        return axis % n

    # -- movement ops -------------------------------------------------------------------------
    def expand_dim(self, axis: int, size: Dim) -> "ShapeTracker":
        """Insert a broadcast dimension (stride 0) at `axis` (0..ndim)."""
        v = self.views[-1]
        if not 0 <= axis <= len(v.shape):
            raise IndexError(f"expand_dim axis {axis} out of range for shape {v.shape}")
        size = as_dim(size)
        mask = None if v.mask is None else v.mask[:axis] + ((0, size),) + v.mask[axis:]
        return self._replace_top(View.create(v.shape[:axis] + (size,) + v.shape[axis:],
                                             v.strides[:axis] + (0,) + v.strides[axis:], v.offset, mask))

    def expand(self, axis: int, size: Dim) -> "ShapeTracker":
        """Broadcast an existing size-1 dimension to `size`."""
        axis = self._axis(axis)
        v = self.views[-1]
        if v.shape[axis] != 1:
            raise ValueError(f"can only expand a size-1 dim, dim {axis} of {v.shape} has size {v.shape[axis]}")
        size = as_dim(size)
        shape = v.shape[:axis] + (size,) + v.shape[axis + 1:]
        mask = None
        if v.mask is not None:
            lo, hi = v.mask[axis]
            mask = v.mask[:axis] + (((0, size) if (lo, hi) == (0, 1) else (0, 0)),) + v.mask[axis + 1:]
        return self._replace_top(View.create(shape, v.strides, v.offset, mask))

    def permute(self, order: Sequence[int]) -> "ShapeTracker":
        v = self.views[-1]
        order = tuple(int(o) for o in order)
        if sorted(order) != list(range(len(v.shape))):
            raise ValueError(f"permute order {order} is not a permutation of {len(v.shape)} dims")
        mask = None if v.mask is None else tuple(v.mask[o] for o in order)
        return self._replace_top(View.create(tuple(v.shape[o] for o in order),
                                             tuple(v.strides[o] for o in order), v.offset, mask))

    def slice(self, ranges: Sequence[tuple[Dim, Dim]]) -> "ShapeTracker":
        """Keep [start, stop) on each axis (ranges given for leading axes; the rest are kept whole)."""
        v = self.views[-1]
        ranges = tuple(ranges) + tuple((0, d) for d in v.shape[len(ranges):])
        if len(ranges) != len(v.shape):
            raise ValueError(f"slice {ranges} has more axes than shape {v.shape}")
        offset = v.offset
        for (start, _), st in zip(ranges, v.strides):
            offset = offset + as_dim(start) * st
        shape = tuple(as_dim(b) - as_dim(a) for a, b in ranges)
        for (a, b), d in zip(ranges, v.shape):
            if is_const(a) and is_const(b) and is_const(d) and not (0 <= a <= b <= d):
                raise ValueError(f"slice {ranges} out of bounds for shape {v.shape}")
        mask = None
        if v.mask is not None:
            mask = tuple((_dmax(lo - a, 0), _dmin(hi - a, b - a)) for (lo, hi), (a, b) in zip(v.mask, ranges))
        return self._replace_top(View.create(shape, v.strides, offset, mask))

    def pad(self, pads: Sequence[tuple[Dim, Dim]]) -> "ShapeTracker":
        """Zero-pad (before, after) on each axis: a mask marks the original region."""
        v = self.views[-1]
        pads = tuple(pads) + tuple((0, 0) for _ in v.shape[len(pads):])
        if len(pads) != len(v.shape):
            raise ValueError(f"pad {pads} has more axes than shape {v.shape}")
        offset = v.offset
        for (before, _), st in zip(pads, v.strides):
            offset = offset - as_dim(before) * st
        shape = tuple(d + as_dim(a) + as_dim(b) for d, (a, b) in zip(v.shape, pads))
        old = v.mask if v.mask is not None else tuple((0, d) for d in v.shape)
        mask = tuple((lo + as_dim(a), hi + as_dim(a)) for (lo, hi), (a, _) in zip(old, pads))
        return self._replace_top(View.create(shape, v.strides, offset, mask))

    def reshape(self, new_shape: Sequence[Dim]) -> "ShapeTracker":
        new_shape = tuple(as_dim(d) for d in new_shape)
        v = self.views[-1]
        if prod(new_shape) != prod(v.shape):
            raise ValueError(f"cannot reshape {v.shape} to {new_shape}: element counts differ")
        if new_shape == v.shape:
            return self
        if v.mask is None:
            if v.strides == contiguous_strides(v.shape):
                return self._replace_top(View.create(new_shape, None, v.offset))
            strides = _nocopy_strides(v.shape, v.strides, new_shape)
            if strides is not None:
                return self._replace_top(View.create(new_shape, strides, v.offset))
        return ShapeTracker(self.views + (View.create(new_shape),))

    # -- evaluation ---------------------------------------------------------------------------
    def bind(self, bindings: Mapping[str, int]) -> tuple[int, ...]:
        return tuple(evaluate(d, bindings) for d in self.shape)

    def index_map(self, bindings: Mapping[str, int] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Flat buffer positions and validity for every logical element (int64 array, bool array)."""
        bindings = bindings or {}
        pos: np.ndarray | None = None
        valid: np.ndarray | None = None
        for level, v in enumerate(reversed(self.views)):
            shape = tuple(evaluate(d, bindings) for d in v.shape)
            strides = [evaluate(s, bindings) for s in v.strides]
            offset = evaluate(v.offset, bindings)
            if level == 0:
                idx = np.indices(shape, dtype=np.int64) if shape else np.zeros((0,), np.int64)
                coords = [idx[k] for k in range(len(shape))]
                base_shape = shape
            else:
                n = int(np.prod(shape)) if shape else 1
                if n == 0:  # an empty lower view: nothing is readable
                    valid = np.zeros(pos.shape, dtype=bool)
                    pos = np.zeros(pos.shape, dtype=np.int64)
                    continue
                flat = np.clip(pos, 0, n - 1)
                coords = list(np.unravel_index(flat, shape)) if shape else []
            out = np.full(base_shape if level == 0 else pos.shape, offset, dtype=np.int64)
            ok = np.ones(out.shape, dtype=bool)
            for k, c in enumerate(coords):
                out = out + c * strides[k]
                if v.mask is not None:
                    lo, hi = (evaluate(b, bindings) for b in v.mask[k])
                    ok &= (c >= lo) & (c < hi)
            valid = ok if valid is None else (valid & ok)
            pos = out
        assert pos is not None and valid is not None
        return pos, valid

    def realize(self, buffer: np.ndarray, bindings: Mapping[str, int] | None = None) -> np.ndarray:
        """Read the logical tensor out of a contiguous buffer (masked elements are 0)."""
        flat = np.ascontiguousarray(buffer).reshape(-1)
        fast = self._strided(flat, bindings or {})
        if fast is None:
            fast = self._stacked(flat, bindings or {})
        if fast is not None:
            return fast
        pos, valid = self.index_map(bindings)
        if flat.size == 0:
            return np.zeros(pos.shape, dtype=buffer.dtype)
        safe = np.where(valid, pos, 0)
        if np.any(valid & ((pos < 0) | (pos >= flat.size))):
            raise IndexError(f"view {self} reads outside a buffer of {flat.size} elements")
        out = flat[safe]
        return np.where(valid, out, np.zeros((), dtype=buffer.dtype)) if not valid.all() else out

    def _strided(self, flat: np.ndarray, bindings: Mapping[str, int]) -> np.ndarray | None:
        """A read-only strided view (no index arrays) for one unmasked view, after a bounds check."""
        if len(self.views) != 1 or self.views[0].mask is not None:
            return None
        v = self.views[0]
        shape = [evaluate(d, bindings) for d in v.shape]
        strides = [evaluate(s, bindings) for s in v.strides]
        offset = evaluate(v.offset, bindings)
        if any(d == 0 for d in shape):
            return np.zeros(shape, dtype=flat.dtype)
        lo = offset + sum((d - 1) * s for d, s in zip(shape, strides) if s < 0)
        hi = offset + sum((d - 1) * s for d, s in zip(shape, strides) if s > 0)
        if lo < 0 or hi >= flat.size:
            raise IndexError(f"view {self} reads outside a buffer of {flat.size} elements")
        return np.lib.stride_tricks.as_strided(flat[offset:], shape=shape,
                                               strides=[s * flat.itemsize for s in strides], writeable=False)

    def _stacked(self, flat: np.ndarray, bindings: Mapping[str, int]) -> np.ndarray | None:
        """Views read bottom-up with stride tricks, each copied contiguous for the view above it; a mask
        is a zero-filled result with the valid box read strided. The same values as index_map's
        gather (masked elements read +0); None when a view's valid box would leave its buffer, which
        index_map then handles (it clips those reads)."""
        values = flat
        for level, v in enumerate(self.views):
            shape = [evaluate(d, bindings) for d in v.shape]
            strides = [evaluate(st, bindings) for st in v.strides]
            offset = evaluate(v.offset, bindings)
            box = [(0, d) for d in shape] if v.mask is None else \
                [(max(0, evaluate(lo, bindings)), min(d, evaluate(hi, bindings))) for (lo, hi), d in zip(v.mask, shape)]
            out = np.zeros(shape, dtype=flat.dtype)
            if all(hi > lo for lo, hi in box):
                start = offset + sum(lo * st for (lo, _), st in zip(box, strides))
                extent = [hi - lo for lo, hi in box]
                low = start + sum((d - 1) * st for d, st in zip(extent, strides) if st < 0)
                high = start + sum((d - 1) * st for d, st in zip(extent, strides) if st > 0)
                if low < 0 or high >= values.size:
                    return None
                src = np.lib.stride_tricks.as_strided(values[start:], shape=extent, writeable=False,
                                                      strides=[st * values.itemsize for st in strides])
                out[tuple(slice(lo, hi) for lo, hi in box)] = src
            values = out if level == len(self.views) - 1 else out.reshape(-1)
        return values

    def __str__(self) -> str:
        return " <- ".join(
            f"View(shape={tuple(map(str, v.shape))}, strides={tuple(map(str, v.strides))}"
            + (f", offset={v.offset}" if v.offset != 0 else "")
            + (f", mask={v.mask}" if v.mask is not None else "") + ")"
            for v in reversed(self.views))


def _nocopy_strides(old_shape, old_strides, new_shape) -> tuple[int, ...] | None:
    """numpy's attempt_nocopy_reshape: strides for new_shape over the same memory, or None.

    Only for concrete shapes; size-1 dims are dropped first and get stride 0 back (canonical form).
    """
    if not all(is_const(d) for d in (*old_shape, *old_strides, *new_shape)):
        return None
    olddims = [(d, s) for d, s in zip(old_shape, old_strides) if d != 1]
    newdims = list(new_shape)
    if any(d == 0 for d in newdims):
        return None
    out = [0] * len(newdims)
    oi = ni = 0
    new_nz = [i for i, d in enumerate(newdims) if d != 1]
    oi_end, ni_end = len(olddims), len(new_nz)
    while oi < oi_end and ni < ni_end:
        np_, op_ = newdims[new_nz[ni]], olddims[oi][0]
        nj, oj = ni + 1, oi + 1
        while np_ != op_:
            if np_ < op_:
                if nj >= ni_end:
                    return None
                np_ *= newdims[new_nz[nj]]
                nj += 1
            else:
                if oj >= oi_end:
                    return None
                op_ *= olddims[oj][0]
                oj += 1
        for k in range(oi, oj - 1):  # the merged old dims must be laid out contiguously
            if olddims[k][1] != olddims[k + 1][0] * olddims[k + 1][1]:
                return None
        out[new_nz[nj - 1]] = olddims[oj - 1][1]
        for k in range(nj - 1, ni, -1):
            out[new_nz[k - 1]] = out[new_nz[k]] * newdims[new_nz[k]]
        ni, oi = nj, oj
    if ni != ni_end or oi != oi_end:
        return None
    return tuple(out)
