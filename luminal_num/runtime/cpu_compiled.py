"""What the CPU backend derives once per runtime from a kernel under one binding of the symbolic dims,
so that a run only executes: a view's read as strided geometry (one ndarray over the buffer's memory:
no index arrays, no dims evaluated per run), a fused body as a flat list of its distinct values.

Python work per kernel and run was most of the time of the small kernels of a transformer layer
(a layer norm's ROWS kernel: 0.7 ms of numpy in 1.8 ms), so it is done here, once.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Hashable, Mapping

import numpy as np

from ..codegen.llir import FApply, FAt, FConstV, FExpr, FLoad, FRoundTo, FRowSum, Kernel
from ..hlir.shape import ShapeTracker
from ..hlir.symbolic import evaluate as eval_dim


@dataclass(frozen=True)
class StridedRead:
    """A single unmasked view under fixed bindings: its read is one read-only ndarray over the buffer
    (the values ShapeTracker.realize gives, after the same bounds check)."""
    view: ShapeTracker
    shape: tuple[int, ...]
    strides: tuple[int, ...]  # in elements
    offset: int
    lo: int                   # the lowest and highest element read
    hi: int
    f32_strides: tuple[int, ...] = ()  # in bytes for 4-byte elements (most reads): no tuple built per read

    @classmethod
    def of(cls, st: ShapeTracker, bindings: Mapping[str, int]) -> StridedRead | None:
        """None where realize needs its general path (stacked views, masks, an empty read)."""
        if len(st.views) != 1 or st.views[0].mask is not None:
            return None
        v = st.views[0]
        shape = tuple(int(eval_dim(d, bindings)) for d in v.shape)
        strides = tuple(int(eval_dim(s, bindings)) for s in v.strides)
        offset = int(eval_dim(v.offset, bindings))
        if any(d == 0 for d in shape):
            return None
        lo = offset + sum((d - 1) * s for d, s in zip(shape, strides) if s < 0)
        hi = offset + sum((d - 1) * s for d, s in zip(shape, strides) if s > 0)
        return cls(st, shape, strides, offset, lo, hi, tuple(4 * s for s in strides))

    def read(self, buffer: np.ndarray) -> np.ndarray:
        if not buffer.flags.c_contiguous:
            buffer = np.ascontiguousarray(buffer)
        if self.lo < 0 or self.hi >= buffer.size:
            raise IndexError(f"view {self.view} reads outside a buffer of {buffer.size} elements")
        size = buffer.itemsize
        strides = self.f32_strides if size == 4 else tuple(s * size for s in self.strides)
        out = np.ndarray(self.shape, buffer.dtype, buffer, self.offset * size, strides)
        out.flags.writeable = False
        return out


def read_view(view: ShapeTracker, read: StridedRead | None, buffer: np.ndarray, bindings) -> np.ndarray:
    """The view's read of the buffer: strided when compiled, else ShapeTracker.realize (one-byte
    ml_dtypes floats through their bytes: numpy's as_strided cannot describe those dtypes)."""
    if read is not None:
        return read.read(buffer)
    if buffer.dtype.itemsize == 1 and buffer.dtype.kind not in "biu":
        return view.realize(buffer.view(np.uint8), bindings).view(buffer.dtype)
    return view.realize(buffer, bindings)


@dataclass(frozen=True)
class Step:
    """One value of a compiled body: `node` says what it computes from the values at `args`."""
    node: FExpr
    args: tuple[int, ...]
    key: int                       # the value's id within the runtime (KernelCache.keys)
    shape: tuple[int, ...] = ()    # a row sum's space, FAt's source shape
    const: object = None           # a constant's float32 value
    read: StridedRead | None = None  # a load's (or FAt's) view


@dataclass(frozen=True)
class CompiledBody:
    steps: tuple[Step, ...]  # the body's distinct values in evaluation order; the last is the body's
    loads: tuple[int, ...]   # the input slots it reads


def body_constant(e: FConstV, bindings) -> float:
    return e.value if isinstance(e.value, float) else float(eval_dim(e.value, bindings))


class KernelCache:
    """A runtime's compiled reads and bodies, and the ids of the values bodies compute: two steps of
    any kernels computing the same thing (structure, loads as buffer and view) get one id, under
    which a run shares the value. Entries hold their kernel, so an id() in a key stays its own.

    A load of a buffer into which a body kernel wrote its FP32 value is the value FAt would read
    from it, and gets FAt's id: fusion recomputes a layer norm from its stored mean and rstd in the
    next Gemm's epilogue, and those values are then the norm's own (shared, not computed again)."""

    def __init__(self):
        self.keys: dict[tuple, int] = {}
        self._entries: dict[tuple, tuple] = {}
        self._bindings: tuple[object, tuple] = (None, ())
        self._stored: dict[tuple, tuple[int, tuple[int, ...]]] = {}  # (bindings, buffer) -> (value id, shape)

    def note_stored(self, buffer: int, key: int, shape: tuple[int, ...], bindings) -> None:
        """Buffer `buffer` holds the value `key` (broadcast to `shape`, row-major) in FP32."""
        self._stored[(self._bound(bindings), buffer)] = (key, tuple(shape))

    def _stored_value(self, buffer: int, bindings) -> tuple[int, tuple[int, ...]] | None:
        return self._stored.get((self._bound(bindings), buffer))

    def _bound(self, bindings: Mapping[str, int]) -> tuple:
        if self._bindings[0] is not bindings:
            self._bindings = (bindings, tuple(sorted(bindings.items())))
        return self._bindings[1]

    def get(self, k: Kernel, what: Hashable, bindings: Mapping[str, int], make: Callable[[], object]):
        """make() once per (kernel, what, bindings)."""
        key = (id(k), what, self._bound(bindings))
        hit = self._entries.get(key)
        if hit is None or hit[0] is not k:
            hit = self._entries[key] = (k, make())
        return hit[1]

    def read(self, k: Kernel, i: int, bindings) -> StridedRead | None:
        return self.get(k, ("read", i), bindings, lambda: StridedRead.of(k.inputs[i].view, bindings))

    def body(self, e: FExpr, k: Kernel, bindings) -> CompiledBody:
        entry = self.get(k, ("body", id(e)), bindings, lambda: (e, _compile(e, k, bindings, self)))
        if entry[0] is not e:  # another body object under a reused id: compile it afresh
            entry = (e, _compile(e, k, bindings, self))
            self._entries[(id(k), ("body", id(e)), self._bound(bindings))] = (k, entry)
        return entry[1]


def _compile(e: FExpr, k: Kernel, bindings, cache: KernelCache) -> CompiledBody:
    keys = cache.keys
    steps: list[Step] = []
    at: dict[tuple, int] = {}  # structural key -> position
    seen: dict[int, int] = {}  # id of an expression node -> position (a subtree reached twice)

    def visit(e: FExpr) -> int:
        if id(e) in seen:
            return seen[id(e)]
        args, shape, const, read = (), (), None, None
        if isinstance(e, FLoad):
            inp = k.inputs[e.slot]
            stored = cache._stored_value(inp.buffer, bindings)
            skey = ("load", inp.buffer, inp.view.encode()) if stored is None else \
                (("at", inp.view.encode(), stored[1]), (stored[0],))  # what FAt of the stored value reads
            read = StridedRead.of(inp.view, bindings)
        elif isinstance(e, FConstV):
            value = body_constant(e, bindings)
            const, skey = np.float32(value), ("const", float(value).hex())  # hex: -0.0 is not 0.0
        else:
            if isinstance(e, FApply):
                args, what = tuple(visit(a) for a in e.args), (e.op, e.kind)
            elif isinstance(e, FRoundTo):
                args, what = (visit(e.x),), ("round", e.fmt.name)
            elif isinstance(e, FRowSum):
                shape = tuple(int(eval_dim(d, bindings)) for d in e.shape)
                args, what = (visit(e.body),), ("rowsum", e.acc.name, e.dt.name, shape)
            elif isinstance(e, FAt):
                shape = tuple(int(eval_dim(d, bindings)) for d in e.src_shape)
                args, what = (visit(e.x),), ("at", e.view.encode(), shape)
                read = StridedRead.of(e.view, bindings)
            else:
                raise TypeError(f"not a body expression: {e!r}")
            skey = (what, tuple(steps[a].key for a in args))
        if skey not in at:
            steps.append(Step(e, args, keys.setdefault(skey, len(keys)), shape, const, read))
            at[skey] = len(steps) - 1
        seen[id(e)] = at[skey]
        return at[skey]
    visit(e)
    loads = tuple(sorted({st.node.slot for st in steps if isinstance(st.node, FLoad)}))
    return CompiledBody(tuple(steps), loads)
