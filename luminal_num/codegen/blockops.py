"""Block ops: how each LLIR kernel kind splits into thread-block tiles, declared once per kind.

Why one table: the cost model quantizes a kernel's roofline time into waves of tiles over the SMs
(runtime/cost.py), the megakernel's work queue holds one entry per op with its tile count
(codegen/megakernel.py) and the emulated scheduler runs those tiles (runtime/megakernel_emulator.py);
all three must agree on what a tile is.

Two shapes of partition:
- flat: tile t writes the contiguous elements [t * E, (t + 1) * E) of the kernel's output (row-major),
  E symbolic. Elementwise kernels (ELEMENTWISE_THREADS elements per block, as cuda_kernels launches
  them), row kernels (one block per row: E = the row length) and last-axis reductions (one output
  element per body row: E = 1). A consumer reading such a producer through an identity view waits only
  on the producer tiles covering its own range.
- opaque: tiles whose regions are not contiguous ranges (Gemm tiles, GEMV rows of W, attention split-K
  tiles, quantize, scatters); the op counts as written when all its tiles are, and it reads its inputs
  whole.
Tile counts are symbolic (`TileCount`): evaluated with the run's bindings, so a new sequence length
rebuilds nothing.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Mapping

from ..hlir.symbolic import Dim, evaluate, prod
from .attention import score_shape
from .cuda_source import ELEMENTWISE_THREADS
from .llir import Kernel, KernelKind

GEMV_MAX_ROWS = 16    # a Gemm with at most this many output rows (batch * M) runs as a GEMV
GEMV_COLS = 32        # GEMV: at most this many output columns (rows of W) per block, 4 per warp of 8 warps ...
FILL_SMS = 132        # ... and fewer where that fills one wave of this many blocks (an H100/H200's SMs)
GEMM_TILE = 64        # Gemm: square output tiles of 64 x 64


class Partition(enum.Enum):
    FLAT = "flat"
    OPAQUE = "opaque"


@dataclass(frozen=True)
class TileCount:
    """prod(ceil(extent / per)) over the factors, times `times`: a symbolic number of tiles."""

    factors: tuple[tuple[Dim, int], ...]
    times: int = 1

    def evaluate(self, bindings: Mapping[str, int]) -> int:
        return self.times * math.prod(max(1, -(-evaluate(d, bindings) // per)) for d, per in self.factors)


@dataclass(frozen=True)
class BlockOp:
    """One kernel's tiles: the block-op kind (which device body runs them), the partition and, for a
    flat partition, `elements` per tile (the last tile may be short)."""

    kernel: int
    kind: str
    partition: Partition
    tiles: TileCount
    elements: Dim | None = None

    def __post_init__(self):
        if (self.partition is Partition.FLAT) != (self.elements is not None):
            raise ValueError(f"kernel {self.kernel}: a flat partition needs elements per tile, an opaque one has none")


def _flat(k: Kernel, kind: str, elements: Dim, per: int = 1) -> BlockOp:
    return BlockOp(k.id, kind, Partition.FLAT, TileCount(((prod(k.shape) if k.shape else 1, per),)), elements)


def _elementwise(k: Kernel) -> BlockOp:
    return _flat(k, "elementwise", ELEMENTWISE_THREADS, ELEMENTWISE_THREADS)


def _row_kernel(k: Kernel) -> BlockOp:
    """One block per row of the output's last axis (ROWS, a last-axis softmax)."""
    if not k.shape or (k.axis is not None and k.axis != len(k.shape) - 1):
        others = [d for i, d in enumerate(k.shape) if i != k.axis]
        return _opaque(k, "rows", TileCount(((prod(others) if others else 1, 1),)))
    return BlockOp(k.id, "rows", Partition.FLAT, TileCount(((prod(k.shape[:-1]) if k.shape[:-1] else 1, 1),)),
                   k.shape[-1])


def _reduction(k: Kernel) -> BlockOp:
    """SUM / MAX: one block per body row; over the last body axis that is one output element per tile."""
    if k.axis == len(k.body_shape) - 1:
        return _flat(k, "reduce_rows", 1)
    return _opaque(k, "reduce_rows", TileCount(((prod(k.shape) if k.shape else 1, 1),)))


def _opaque(k: Kernel, kind: str, tiles: TileCount) -> BlockOp:
    return BlockOp(k.id, kind, Partition.OPAQUE, tiles)


def _gemm(k: Kernel) -> BlockOp:
    """GEMV rows (few output rows: blocks over N only) or 64 x 64 Gemm tiles, per batch."""
    lay = k.layout
    rows = lay.m
    if all(isinstance(d, int) for d in (lay.batch, rows)) and lay.batch * rows <= GEMV_MAX_ROWS:
        return _opaque(k, "gemv", TileCount(((lay.n, gemv_cols(lay.n)),)))
    return _opaque(k, "gemm", TileCount(((lay.batch, 1), (rows, GEMM_TILE), (lay.n, GEMM_TILE))))


def gemv_cols(n: Dim) -> int:
    """Output columns per GEMV block: GEMV_COLS, or fewer (down to 1) so that N columns fill one wave of
    FILL_SMS blocks: a 576-column projection in 18 blocks would leave 114 SMs without weights to load."""
    if not isinstance(n, int):
        return GEMV_COLS
    return max(1, min(GEMV_COLS, -(-n // FILL_SMS)))


def _attention(k: Kernel) -> BlockOp:
    """One tile per score row (a query of a head) and key split (flash decoding's split-K)."""
    rows = score_shape(k)[:-1]
    return _opaque(k, "attention", TileCount(((prod(rows) if rows else 1, 1),), times=k.value.splits))


def _single(kind: str):
    return lambda k: _opaque(k, kind, TileCount(()))


def _rows_of(kind: str):
    """QUANTIZE (a (batch, M, K) buffer: one block per row, scales need whole rows) and in-place
    scatters (one block per written row)."""
    def block_op(k: Kernel) -> BlockOp:
        shape = k.shape if k.kind is KernelKind.QUANTIZE else k.inputs[1].view.shape
        rows = prod(shape[:-1]) if k.kind is KernelKind.QUANTIZE else prod(shape)
        return _opaque(k, kind, TileCount(((rows if shape else 1, 1),)))
    return block_op


# The partition of each launching kernel kind, one entry per kind.
BLOCK_OPS = {
    KernelKind.ELEMENTWISE: _elementwise, KernelKind.CONST: _single("const"), KernelKind.IOTA: _elementwise,
    KernelKind.GATHER: _elementwise, KernelKind.SCATTER: _single("scatter"),
    KernelKind.SUM: _reduction, KernelKind.MAX: _reduction, KernelKind.SOFTMAX: _row_kernel,
    KernelKind.ROWS: _row_kernel, KernelKind.GEMM: _gemm, KernelKind.GEMM_EPILOGUE: _gemm,
    KernelKind.QUANTIZE: _rows_of("quantize"), KernelKind.ATTENTION: _attention,
    KernelKind.SCATTER_NOCOPY: _rows_of("scatter_rows"), KernelKind.SCATTER_EW: _rows_of("scatter_rows"),
}
assert set(BLOCK_OPS) == {k for k in KernelKind if k.launches}, "every launching kernel kind has a partition"


def block_op(k: Kernel) -> BlockOp:
    return BLOCK_OPS[k.kind](k)


def tile_count(k: Kernel, bindings: Mapping[str, int]) -> int:
    return block_op(k).tiles.evaluate(bindings)
