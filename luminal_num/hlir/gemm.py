"""When is Mul-over-broadcast-views + SumReduce a matrix multiply? The layout math, in one place.

A Mul of shape S read through views va, vb and reduced over axis k is C = sum_k A*B. Classify every
other axis by which operand advances along it:
  only va (vb has stride 0)  -> an M axis   (rows of A / C)
  only vb (va has stride 0)  -> an N axis   (columns of B / C)
  both (or neither)          -> a batch axis
A Gemm needs both operands to advance along k and single unmasked views (a strided read per
operand). Several M axes that are contiguous in A can be flattened into one M (x(b,s,k) @ W(k,n) ->
(b*s,k) @ (k,n)); otherwise the extra M/N axes become batch axes. Each valid layout is one variant.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .shape import ShapeTracker
from .symbolic import Dim, encode, is_const, prod


@dataclass(frozen=True)
class GemmLayout:
    full_shape: tuple[Dim, ...]   # the Mul's shape (before reduction)
    k_axis: int
    batch_axes: tuple[int, ...]
    m_axes: tuple[int, ...]       # flattened together into M (one axis unless variant == "flattened")
    n_axes: tuple[int, ...]
    variant: str                  # "batched" | "flattened"

    @property
    def out_axes(self) -> tuple[int, ...]:
        return tuple(i for i in range(len(self.full_shape)) if i != self.k_axis)

    @property
    def m(self) -> Dim:
        return prod(self.full_shape[i] for i in self.m_axes)

    @property
    def n(self) -> Dim:
        return prod(self.full_shape[i] for i in self.n_axes)

    @property
    def k(self) -> Dim:
        return self.full_shape[self.k_axis]

    @property
    def batch(self) -> Dim:
        return prod(self.full_shape[i] for i in self.batch_axes)

    def encode(self) -> tuple:
        return (tuple(encode(d) for d in self.full_shape), self.k_axis, self.batch_axes, self.m_axes,
                self.n_axes, self.variant)


def split_operand(st: ShapeTracker) -> tuple[ShapeTracker | None, ShapeTracker]:
    """(lower views to materialise first or None, the single top view the Gemm reads with)."""
    if len(st.views) == 1:
        return None, st
    return ShapeTracker(st.views[:-1]), ShapeTracker((st.views[-1],))


def read_operand(st: ShapeTracker, buffer, bindings):
    """An operand over the Mul shape: materialise stacked lower views, then a strided top-view read."""
    inner, top = split_operand(st)
    if inner is not None:
        buffer = inner.realize(buffer, bindings)
    return top.realize(buffer, bindings)


def _single_unmasked(st: ShapeTracker) -> bool:
    return len(st.views) == 1 and st.views[0].mask is None


def gemm_layouts(va: ShapeTracker, vb: ShapeTracker, k_axis: int) -> tuple[GemmLayout, ...]:
    """All Gemm layouts of sum_k(va * vb) (empty when it is not a matrix multiply)."""
    if not (_single_unmasked(va) and _single_unmasked(vb)) or va.shape != vb.shape:
        return ()
    shape = va.shape
    if not 0 <= k_axis < len(shape):
        return ()
    sa, sb = va.views[0].strides, vb.views[0].strides
    if sa[k_axis] == 0 or sb[k_axis] == 0:
        return ()
    m_type = [i for i in range(len(shape)) if i != k_axis and sa[i] != 0 and sb[i] == 0]
    n_type = [i for i in range(len(shape)) if i != k_axis and sa[i] == 0 and sb[i] != 0]
    batch = [i for i in range(len(shape)) if i != k_axis and i not in m_type and i not in n_type]
    if not m_type and not n_type:
        return ()  # a batched dot product: no matrix structure to exploit
    out = [GemmLayout(shape, k_axis, tuple(sorted(batch + m_type[:-1] + n_type[:-1])),
                      tuple(m_type[-1:]), tuple(n_type[-1:]), "batched")]
    if len(m_type) > 1 and _mergeable(shape, sa, m_type) and _mergeable_out(shape, k_axis, m_type):
        out.append(GemmLayout(shape, k_axis, tuple(sorted(batch + n_type[:-1])), tuple(m_type),
                              tuple(n_type[-1:]), "flattened"))
    return tuple(out)


def reads_k_major(st: ShapeTracker, k_axis: int, shape) -> bool:
    """Whether a Gemm operand view reads a whole 2-D (rows, K) tensor with its last axis along the Gemm's
    K, its rows along one other axis and every other axis broadcast: then the tensor's storage groups run
    along the Gemm's K and each of its rows meets every row of the other operand (what a calibration
    Hessian of the other operand's K columns describes)."""
    if len(st.views) != 1 or len(shape) != 2:
        return False
    v = st.views[0]
    rows, k = shape
    if v.mask is not None or v.offset != 0 or v.shape[k_axis] != k or v.strides[k_axis] != 1:
        return False
    others = [i for i in range(len(v.shape)) if i != k_axis and v.strides[i] != 0]
    return len(others) == 1 and v.shape[others[0]] == rows and v.strides[others[0]] == k


def _mergeable(shape, strides, axes) -> bool:
    """Adjacent axes whose strides nest (stride_i == size_{i+1} * stride_{i+1}) form one strided axis."""
    if any(b != a + 1 for a, b in zip(axes, axes[1:])):
        return False
    return all(strides[a] == shape[b] * strides[b] for a, b in zip(axes, axes[1:]))


def _mergeable_out(shape, k_axis, axes) -> bool:
    """The merged M axes must also be adjacent in C (contiguous output: adjacency suffices)."""
    out_pos = [a - (a > k_axis) for a in axes]
    return all(b == a + 1 for a, b in zip(out_pos, out_pos[1:])) and all(is_const(shape[a]) or True for a in axes)


def gemm_operand_a(a_full, layout: GemmLayout):
    """A over the full Mul shape (strided, stride 0 along N axes) -> contiguous (batch, M, K)."""
    return _operand(a_full, layout, layout.n_axes, (*layout.batch_axes, *layout.m_axes, layout.k_axis), True)


def gemm_operand_b(b_full, layout: GemmLayout):
    """B over the full Mul shape (strided, stride 0 along M axes) -> contiguous (batch, K, N)."""
    return _operand(b_full, layout, layout.m_axes, (*layout.batch_axes, layout.k_axis, *layout.n_axes), False)


def gemm_operand_b_view(b_full, layout: GemmLayout):
    """B over the full Mul shape as a (batch, K, N) VIEW (gemm_operand_b's values, nothing copied), or None
    where that shape needs a copy: a caller can then copy a block of columns at a time."""
    x, size = _ordered(b_full, layout, layout.m_axes, (*layout.batch_axes, layout.k_axis, *layout.n_axes))
    try:
        return x.reshape(size(layout.batch_axes), b_full.shape[layout.k_axis], size(layout.n_axes), copy=False)
    except ValueError:
        return None


def _ordered(full_arr, layout: GemmLayout, drop, order):
    """The operand's view with the `drop` (broadcast) axes taken at 0 and the rest in `order`; and the size of
    a group of the full shape's axes."""
    full = full_arr.shape
    x = full_arr[tuple(0 if ax in drop else slice(None) for ax in range(len(full)))]
    keep = [ax for ax in range(len(full)) if ax not in drop]
    return (np.transpose(x, [keep.index(ax) for ax in order]),
            lambda axes: int(np.prod([full[ax] for ax in axes], dtype=np.int64)))


def _operand(full_arr, layout: GemmLayout, drop, order, is_a: bool):
    """Which operand is said by the caller: with no N axis (a mat-vec) B's order also ends in K."""
    full = full_arr.shape
    x, size = _ordered(full_arr, layout, drop, order)
    first = size(layout.batch_axes)
    if is_a:  # A: (batch, M, K)
        return contiguous(x).reshape(first, size(layout.m_axes), full[layout.k_axis])
    return contiguous(x).reshape(first, full[layout.k_axis], size(layout.n_axes))


COPY_TILE = 512  # rows and columns of one tile of a blocked copy (source and destination tiles stay in cache)


def contiguous(x: np.ndarray, tile: int = COPY_TILE) -> np.ndarray:
    """A C-contiguous copy of `x` (itself when it is one), the same values bit for bit. Why blocked: B of a
    Gemm is the transpose of its (N, K) weight, and numpy copies a transposed view element by element across
    the whole matrix, missing the cache on every read: a 128256 x 2048 LM head took 6.4 s, tile by tile ~2-4x
    less (most of a 1B compile's time was spent here, re-making operands its weight cache had evicted)."""
    if x.flags.c_contiguous or x.ndim < 2 or x.size < tile * tile or x.strides[-1] == x.itemsize:
        return np.ascontiguousarray(x)
    out = np.empty(x.shape, x.dtype)
    rows, cols = x.shape[-2:]
    for i in range(0, rows, tile):
        for j in range(0, cols, tile):
            out[..., i:i + tile, j:j + tile] = x[..., i:i + tile, j:j + tile]
    return out


def gemm_result(c, layout: GemmLayout, full_shape) -> "np.ndarray":
    """(batch, M, N) -> the output tensor in the SumReduce's axis order."""
    order = (*layout.batch_axes, *layout.m_axes, *layout.n_axes)
    c = np.asarray(c).reshape([full_shape[ax] for ax in order])
    out_axes = [ax for ax in range(len(full_shape)) if ax != layout.k_axis]
    return np.transpose(c, [order.index(ax) for ax in out_axes])


def gemm_apply(a_full, b_full, layout: GemmLayout, matmul) -> "np.ndarray":
    """C = sum_k a*b for operands given over the full Mul shape (strided, broadcast axes stride 0)."""
    return gemm_result(matmul(gemm_operand_a(a_full, layout), gemm_operand_b(b_full, layout)), layout, a_full.shape)
