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
- opaque: tiles whose regions are not contiguous ranges (Gemm tiles, GEMV rows of W, attention score
  rows, quantize, scatters); the op counts as written when all its tiles are, and it reads its inputs
  whole.
Tile counts are symbolic (`TileCount`): evaluated with the run's bindings, so a new sequence length
rebuilds nothing. Each count is the number of blocks the CUDA launch of that kind runs (the renderers of
attention and the scatters take their grid from here; tests/test_megakernel_tiles.py checks every op of the
benchmarked queues against the megakernel's table). A Gemm has two: kernel by kernel it runs a library call
or the tensor-core kernel, whose tiles the 64 x 64 / GEMV partition models; inlined in the megakernel it runs
its tiled body (`inlined=True`: the body's TILE x TILE output blocks; a GEMV's tile takes several TILE-column
bands where N_out has more than FILL_SMS of them: body_bands).
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Mapping

from ..hlir.symbolic import Dim, evaluate, prod
from ..quant.storage import STORAGE_FORMATS
from .attention import score_shape
from .gemm_scales import GEMV_MAX_ROWS, scale_blocks, staged_a_bytes, step_scales
from .cuda_gemm_epilogue import glu_offsets
from .cuda_source import ELEMENTWISE_THREADS
from .cuda_weight_only import TILE as BODY_TILE
from .llir import Kernel, KernelKind

GEMV_COLS = 32        # GEMV: at most this many output columns (rows of W) per block, 4 per warp of 8 warps ...
FILL_SMS = 132        # ... and fewer where that fills one wave of this many blocks (an H100/H200's SMs)
GEMM_TILE = 64        # Gemm: square output tiles of 64 x 64
KV_ROUNDED = ("bf16", "f16")  # KV formats a scatter writes rounded, element by element (no scales to find)


class Partition(enum.Enum):
    FLAT = "flat"
    OPAQUE = "opaque"


@dataclass(frozen=True)
class TileCount:
    """prod(ceil(extent / per)) over the factors: a symbolic number of tiles; `factors` is also the grid
    extent (cuda_source.Extent) of the launches that take their grid from here."""

    factors: tuple[tuple[Dim, int], ...]

    def evaluate(self, bindings: Mapping[str, int]) -> int:
        return math.prod(max(1, -(-evaluate(d, bindings) // per)) for d, per in self.factors)


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
    if _is_gemv(k):
        return _opaque(k, "gemv", TileCount(((lay.n, gemv_cols(lay.n)),)))
    return _opaque(k, "gemm", TileCount(((lay.batch, 1), (lay.m, GEMM_TILE), (lay.n, GEMM_TILE))))


def gemv_cols(n: Dim) -> int:
    """Output columns per GEMV block: GEMV_COLS, or fewer (down to 1) so that N columns fill one wave of
    FILL_SMS blocks: a 576-column projection in 18 blocks would leave 114 SMs without weights to load."""
    if not isinstance(n, int):
        return GEMV_COLS
    return max(1, min(GEMV_COLS, -(-n // FILL_SMS)))


def _attention(k: Kernel) -> BlockOp:
    """One tile per score row (a query of a head): the block walks the row's key splits itself, dealt to up
    to MAX_SPLIT_LANES lanes of its threads (codegen/cuda_attention.py), so splits add no tiles."""
    rows = score_shape(k)[:-1]
    return _opaque(k, "attention", TileCount(((prod(rows) if rows else 1, 1),)))


def _single(kind: str):
    return lambda k: _opaque(k, kind, TileCount(()))


def _quantize(k: Kernel) -> BlockOp:
    """QUANTIZE, a (batch, M, K) buffer: one block per row (its scales need the whole row)."""
    return _opaque(k, "quantize", TileCount(((prod(k.shape[:-1]) if k.shape[:-1] else 1, 1),)))


def _scatter_elements(k: Kernel) -> BlockOp:
    """Scatters run one thread per element, ELEMENTWISE_THREADS per block (codegen/cuda_kernels.py,
    cuda_rows.py): a copying scatter over its output, an in-place one over its source rows (index rows x
    the destination's row), a fused one over its body; an in-place scatter into a scaled KV cache (FP8) runs
    one block per (source row, scale group), as the group's amax needs a block reduction."""
    if k.kind is KernelKind.SCATTER:
        return _opaque(k, "scatter", TileCount(((prod(k.shape) if k.shape else 1, ELEMENTWISE_THREADS),)))
    if k.kind is KernelKind.SCATTER_EW:
        return _opaque(k, "scatter_rows", TileCount(((prod(k.body_shape), ELEMENTWISE_THREADS),)))
    index_shape = k.inputs[2].view.shape
    if k.storage is not None and k.storage not in KV_ROUNDED:
        fmt, width = STORAGE_FORMATS[k.storage], k.shape[-1]  # (rows, width) by a 1-D index: the CUDA form's
        group = width if fmt.block == 0 else fmt.block          # per token: the whole row; per head: `block`
        return _opaque(k, "scatter_rows", TileCount(((prod(index_shape), 1), (width, group))))
    return _opaque(k, "scatter_rows", TileCount(((prod(tuple(index_shape) + tuple(k.shape[1:])), ELEMENTWISE_THREADS),)))


def _gemm_body(k: Kernel) -> BlockOp:
    """The tiled Gemm body inlined in the megakernel (codegen/cuda_gemm.py, cuda_weight_only.py): BODY_TILE x
    BODY_TILE output blocks per batch, over N (a GLU epilogue: over its output columns)."""
    lay = k.layout
    glu = k.kind is KernelKind.GEMM_EPILOGUE and bool(glu_offsets(k))
    n_out = k.shape[-1] if glu else lay.n
    if not _is_gemv(k):
        return _opaque(k, "gemm", TileCount(((lay.m, BODY_TILE), (n_out, BODY_TILE), (lay.batch, 1))))
    return _opaque(k, "gemv", TileCount(((lay.m, BODY_TILE), (n_out, BODY_TILE * body_bands(n_out)), (lay.batch, 1))))


def body_bands(n_out: Dim) -> int:
    """BODY_TILE-column bands per inlined GEMV tile: 1, or, where N_out has more bands than FILL_SMS, as few
    tiles as one wave of FILL_SMS holds (the bodies loop grid-stride, so tile y runs bands y, y + tiles, ...).
    Why: a tile pays its pop and first DRAM load once (runtime/megakernel_cost.PRE_WAIT_S); SmolLM2's
    49152-row LM head in 3072 one-band tiles paid them 3072 times for 9 KB of weight each (issue 33)."""
    if not isinstance(n_out, int):
        return 1
    bands = -(-n_out // BODY_TILE)
    return -(-bands // FILL_SMS)


@dataclass(frozen=True)
class ScaleLaunch:
    """One of a Gemm's own operand-scale launches as the megakernel runs it: the operand `slot`, its `tiles`,
    whether that operand is written before the kernel starts (`ready`: an input), so the launch waits on
    nothing, and whether the body's tiles each compute it privately (`private`: A's scales under a GEMV, whose
    every tile reads all of A; `tiles` is then the one virtual block each runs, over every scale block), and
    whether they do so inside their own pass over A (`staged`: the Gemm's `_staged` body loads A once into shared
    memory, taking the amax as it loads: gemm_scales.staged_a_bytes), not as a second pass before the body."""

    slot: int
    tiles: TileCount
    ready: bool = False
    private: bool = False  # no tiles of its own: every body tile runs it first into its block's own copy
    staged: bool = False   # private, and folded into the body's one pass over A (no run of the launch's body)

    def __post_init__(self):
        if self.staged and not self.private:
            raise ValueError(f"scale launch over operand {self.slot}: only a private launch folds into its body")

    @property
    def second_pass(self) -> bool:
        """Each body tile runs the launch's body itself, into its block's second copy, before the Gemm body."""
        return self.private and not self.staged


def scale_launches(k: Kernel, prequantized: tuple[bool, ...], ready: tuple[bool, ...]) -> tuple[ScaleLaunch, ...]:
    """A Gemm's own operand-scale launches as the megakernel runs them, in launch order; `ready[slot]`: that
    input is written before the kernel starts. Kernel by kernel each is a block per scale block
    (codegen/gemm_scales.scale_blocks); the body loops grid-stride over them, so inlined it runs at most FILL_SMS
    tiles where the count is concrete, each scale still one block's reduction (the same bits): a 49152-channel
    weight's per-channel scales were 49152 tiles, each paying a tile's pop and overheads for one row (issue 33).
    A static scale (a weight's: gemm_scales.static_scales) is no launch of the step: written once at load. Under a
    GEMV (at most GEMV_MAX_ROWS rows, every tile reading all of them) A's scales are `private`: each body tile
    runs the launch's body as one virtual block, every scale block in turn, into its block's own copy (the same
    block reduction per scale block, so the same bits), as a one-row norm is recomputed (QueueOp.recomputes):
    no tiles, and no barrier hop in front of the Gemm. Where A's staged copy fits (gemm_scales.staged_a_bytes) the
    launch is also `staged`: the body's own pass over A computes the scales (an exact max, the same expression:
    the same bits), so a tile reads A once, not twice."""
    out = []
    gemv = _is_gemv(k)
    for slot in step_scales(k, prequantized):
        blocks = TileCount(scale_blocks(k, slot))
        if slot == 0 and gemv:  # A's scales read only A, all of which every GEMV tile reads: each computes them
            out.append(ScaleLaunch(slot, TileCount(((1, 1),)), ready[slot], private=True,
                                   staged=staged_a_bytes(k, prequantized) is not None))
            continue
        if all(isinstance(d, int) for d, _ in blocks.factors):
            blocks = TileCount(((min(blocks.evaluate({}), FILL_SMS), 1),))
        out.append(ScaleLaunch(slot, blocks, ready[slot]))
    return tuple(out)


def _is_gemv(k: Kernel) -> bool:
    lay = k.layout
    return all(isinstance(d, int) for d in (lay.batch, lay.m)) and lay.batch * lay.m <= GEMV_MAX_ROWS


# The partition of each launching kernel kind, one entry per kind.
BLOCK_OPS = {
    KernelKind.ELEMENTWISE: _elementwise, KernelKind.CONST: _single("const"), KernelKind.IOTA: _elementwise,
    KernelKind.GATHER: _elementwise, KernelKind.SCATTER: _scatter_elements,
    KernelKind.SUM: _reduction, KernelKind.MAX: _reduction, KernelKind.SOFTMAX: _row_kernel,
    KernelKind.ROWS: _row_kernel, KernelKind.GEMM: _gemm, KernelKind.GEMM_EPILOGUE: _gemm,
    KernelKind.QUANTIZE: _quantize, KernelKind.ATTENTION: _attention,
    KernelKind.SCATTER_NOCOPY: _scatter_elements, KernelKind.SCATTER_EW: _scatter_elements,
}
assert set(BLOCK_OPS) == {k for k in KernelKind if k.launches}, "every launching kernel kind has a partition"


def block_op(k: Kernel, inlined: bool = False) -> BlockOp:
    """`inlined`: the op as the megakernel runs it (a Gemm runs its tiled body, not a library call)."""
    if inlined and k.kind.is_gemm:
        return _gemm_body(k)
    return BLOCK_OPS[k.kind](k)


def tile_count(k: Kernel, bindings: Mapping[str, int], inlined: bool = False) -> int:
    return block_op(k, inlined).tiles.evaluate(bindings)
