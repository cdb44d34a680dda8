"""Which KV-cache bytes a megakernel attention tile may stream before its barrier wait (issue 33).

Why: a decode step's attention reads the whole KV cache, and all of it but the rows this step's scatter
writes was written before the kernel started (an in-place scatter over an EXTERNAL cache buffer), so
those rows depend on no barrier of this step. The tile can start loading them into L2 as soon as its
block pops it, and only the query, the bias and the new rows wait on the producers (the Gemm tiles
stream their weight rows likewise: codegen/weight_stream.py). One declaration, read by both sides: the
CUDA loop (codegen/megakernel_cuda.py) prefetches exactly these byte spans into L2 before the wait, and
the cost model (runtime/megakernel_cost.py) charges their bytes, less the rows the scatter writes,
before `ready`.

What a tile reads: the attention body (codegen/cuda_attention.py) runs one block per score row srow
(the megakernel's grid is the row count, so tile t is row t) and reads K at (row, j, d) and V at
(row, c, j) through their views, for every key j < T and every d < D (c < Dv). Where the view is one
unmasked affine view contiguous along D (Dv), that is one span of D (Dv) elements per key, at
offset + sum(coord * stride over the row's coordinates) + j * key_stride. The spans include the row the
scatter writes this step: an L2 prefetch is only a hint, and L2 is the device's point of coherence, so a
line prefetched before the scatter's store holds the stored bytes once it lands (correctness never depends
on the prefetch); the cost model charges those bytes after the wait. Only a cache operand streams: the
buffer of an in-place scatter (SCATTER_NOCOPY, SCATTER_EW) whose destination is EXTERNAL and held in no
KV storage format and whole bytes per element (a formatted cache's bytes per element are not its dtype's:
not declared here).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from ..hlir.symbolic import Dim, evaluate, prod
from .llir import Kernel, KernelKind, Program

# (input slot, axis of the keys, axis read contiguously) of each attention operand a cache can feed:
# K is read over score shape + (D,), V over score shape[:-1] + (Dv, T) (codegen/attention.py)
CACHE_OPERANDS = ((1, -2, -1), (3, -1, -2))
SCATTER_INDEX_SLOT = {KernelKind.SCATTER_NOCOPY: 2, KernelKind.SCATTER_EW: 1}  # runtime/cpu.py's _scatter*


@dataclass(frozen=True)
class CacheOperand:
    """One attention input read from a KV cache: `buffer` the scatter's value (its bufs[] slot, the cache's
    memory), `itemsize` bytes per element; the view as element offsets: `offset` plus `row_strides` per
    score-row axis, `key_stride` per key; `width` elements read contiguously per key; `written` the
    elements of the cache this step's scatter writes."""

    slot: int
    buffer: int
    itemsize: int
    offset: Dim
    row_strides: tuple[Dim, ...]
    key_stride: Dim
    width: Dim
    distinct: Dim
    written: Dim


@dataclass(frozen=True)
class CacheStream:
    """An attention kernel's cache reads a tile can issue before its wait: the score-row shape (tile t is
    row t), the keys T per row and the cache operands."""

    kernel: int
    rows: tuple[Dim, ...]
    keys: Dim
    operands: tuple[CacheOperand, ...]

    def tiles(self, bindings: Mapping[str, int]) -> int:
        return int(evaluate(prod(self.rows), bindings)) if self.rows else 1

    def tile_spans(self, tile: int, bindings: Mapping[str, int]) -> list[tuple[CacheOperand, int, int, int, int]]:
        """(operand, first byte, bytes between keys, keys, bytes per key) the tile of score row `tile` reads."""
        coords, rest = [], tile
        for d in reversed(self.rows):
            size = int(evaluate(d, bindings))
            coords.append(rest % size)
            rest //= size
        coords.reverse()
        keys = int(evaluate(self.keys, bindings))
        out = []
        for o in self.operands:
            base = int(evaluate(o.offset, bindings)) + sum(c * int(evaluate(s, bindings))
                                                            for c, s in zip(coords, o.row_strides))
            out.append((o, base * o.itemsize, int(evaluate(o.key_stride, bindings)) * o.itemsize, keys,
                        int(evaluate(o.width, bindings)) * o.itemsize))
        return out

    def bytes_streamed(self, bindings: Mapping[str, int]) -> int:
        """What the cost model charges before the wait: each operand's distinct elements (as the kernel's
        bytes_loaded counts them) less every element the scatter writes this step, at their bytes."""
        return sum(o.itemsize * max(0, int(evaluate(o.distinct, bindings)) - int(evaluate(o.written, bindings)))
                   for o in self.operands)


def cache_stream(kernel: Kernel, program: Program) -> CacheStream | None:
    """The cache stream of an attention kernel reading a KV cache through affine views (module doc), else None."""
    if kernel.kind is not KernelKind.ATTENTION:
        return None
    rows = tuple(kernel.shape[:-1])
    dtypes = program.dtypes()
    operands = []
    for slot, key_axis, width_axis in CACHE_OPERANDS:
        inp = kernel.inputs[slot]
        scatter = program.kernel(inp.buffer)
        if scatter.kind not in SCATTER_INDEX_SLOT or scatter.storage is not None \
                or dtypes[scatter.id].itemsize != int(dtypes[scatter.id].itemsize):
            continue
        dest = program.kernel(scatter.inputs[0].buffer)
        if dest.kind is not KernelKind.EXTERNAL or len(inp.view.views) != 1:
            continue
        v = inp.view.views[0]
        if v.mask is not None or v.strides[width_axis] != 1 or len(v.shape) != len(rows) + 2:
            continue
        index = scatter.inputs[SCATTER_INDEX_SLOT[scatter.kind]].view
        written = prod(index.shape) * prod(dest.shape[1:]) if index.shape else prod(dest.shape[1:])
        distinct = prod(d for d, s in zip(v.shape, v.strides) if s != 0)
        operands.append(CacheOperand(slot, scatter.id, int(dtypes[scatter.id].itemsize), v.offset, tuple(v.strides[:-2]),
                                     v.strides[key_axis], v.shape[width_axis], distinct, written))
    if not operands:
        return None
    return CacheStream(kernel.id, rows, kernel.inputs[1].view.shape[-2], tuple(operands))
