"""Which weight bytes a megakernel tile may stream before its barrier wait (issue 33).

Why: a Gemm tile's weight rows depend on no barrier (weights are written before the kernel starts), so the
persistent kernel can start loading them as soon as the block pops the tile, and only the activations wait
on the producers (Hazy Research's Llama-1B megakernel overlaps the next instruction's weight loads with the
current one: hazyresearch.stanford.edu/blog/2025-05-27-no-bubbles). One declaration, read by both sides:
the CUDA source (codegen/megakernel_cuda.py) prefetches exactly these byte ranges into L2 before the wait,
and the cost model (runtime/megakernel_cost.py) charges exactly these bytes before `ready`.

What a tile reads: every Gemm body the megakernel inlines (the tiled kernel of codegen/cuda_gemm.py, its
decode path, the dequantize-on-load kernel of codegen/cuda_weight_only.py) gives block (bx, by, bz) the
output columns [b * BAND, (b + 1) * BAND) of N for each of its bands b = by, by + gridDim.y, ... (one band
where the grid covers N_out in one pass; several where codegen/blockops.body_bands gives a GEMV fewer tiles;
or of a GLU's n_out, each column also read at the GLU's column offsets), so it reads those rows of an (N, K)
weight read as W^T, in each of the weight's parts: a contiguous byte range per part where the part is row-major over the weight's rows. Only such Gemms stream:
B an EXTERNAL weight (not a KV cache), (N, K) row-major read whole as W^T, N and K concrete, at most
GRID_LIMIT bands. Anything else (a (K, N) weight, whose tile columns are strided; norm weights read
whole by every row tile; an embedding Gather, whose rows depend on the tokens) streams nothing here.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..hlir.symbolic import is_const
from ..quant.layout import Layout, Part
from ..quant.storage import STORAGE_FORMATS
from .cuda_gemm_epilogue import glu_offsets
from .cuda_weight_only import row_major_view, stored_operand
from .llir import Kernel, KernelKind, Program

BAND = 16        # weight rows per block along grid y: the Gemm bodies' TILE (cuda_gemm.TILE, cuda_weight_only.TILE)
GRID_LIMIT = 65535  # grid y beyond this loops (grid-stride): a tile would read more than its first band
LINE = 128       # bytes per L2 prefetch (one cache line)


@dataclass(frozen=True)
class StreamPart:
    """One contiguous-per-row array a tile reads a band of: a stored weight's part (`part` its index in
    StorageFormat.parts) or the weight's own buffer (`part` None). Weight row r lies in part row
    r // rows_per_part_row (1; a 128 x 128 tile layout's block; the weight's rows for a one-row part)."""

    weight: int
    part: int | None
    rows: int
    row_bytes: int
    rows_per_part_row: int

    def byte_range(self, first_row: int, end_row: int) -> tuple[int, int]:
        """[begin, end) bytes of the part holding weight rows [first_row, end_row)."""
        lo = first_row // self.rows_per_part_row
        hi = min((end_row - 1) // self.rows_per_part_row + 1, self.rows)
        return lo * self.row_bytes, hi * self.row_bytes


@dataclass(frozen=True)
class WeightStream:
    """A Gemm's weight reads that a tile can issue before its wait: the parts, the weight's rows N, the
    output columns n_out its grid y bands BAND at a time, and each column's row offsets (a GLU's)."""

    kernel: int
    parts: tuple[StreamPart, ...]
    n: int
    n_out: int
    offsets: tuple[int, ...] = (0,)

    @property
    def bands(self) -> int:
        return -(-self.n_out // BAND)

    def tile_bands(self, y: int, grid_y: int) -> range:
        """The bands the block at grid y `y` of a `grid_y`-wide grid reads: y, y + grid_y, ... (grid-stride)."""
        return range(y, self.bands, grid_y)

    def tile_ranges(self, band: int) -> list[tuple[StreamPart, int, int]]:
        """(part, begin byte, end byte) a block at grid y `band` reads, per part and column offset."""
        out = []
        first = band * BAND
        for off in self.offsets:
            rows = (first + off, min(first + BAND, self.n_out) + off)
            out += [(p, *p.byte_range(*rows)) for p in self.parts]
        return out

    def bytes_streamed(self) -> int:
        """What all the bands prefetch together (a part row shared by two bands counts for each)."""
        return sum(end - begin for band in range(self.bands) for _, begin, end in self.tile_ranges(band))


def weight_stream(kernel: Kernel, program: Program) -> WeightStream | None:
    """The weight stream of a Gemm whose body reads an (N, K) weight band by band (module doc), else None."""
    if kernel.kind not in (KernelKind.GEMM, KernelKind.GEMM_EPILOGUE):
        return None
    w = program.kernel(kernel.inputs[1].buffer)
    if w.kind is not KernelKind.EXTERNAL or w.id in program.cache_buffers():
        return None
    lay = kernel.layout
    if not (is_const(lay.n) and is_const(lay.k)) or len(w.shape) != 2 or not all(is_const(d) for d in w.shape):
        return None
    n, k = int(lay.n), int(lay.k)
    if (int(w.shape[0]), int(w.shape[1])) != (n, k):
        return None
    offsets = glu_offsets(kernel) if kernel.kind is KernelKind.GEMM_EPILOGUE else ()
    n_out = int(kernel.shape[-1]) if offsets else n
    if -(-n_out // BAND) > GRID_LIMIT:
        return None
    if w.storage is None:
        full = lay.full_shape
        if not all(is_const(full[a]) for a in (*lay.n_axes, lay.k_axis)) or \
                not row_major_view(kernel.inputs[1].view, (*lay.n_axes, lay.k_axis), full):
            return None
        parts = (StreamPart(w.id, None, n, k * w.dtype.storage.itemsize, 1),)
    else:
        stored = stored_operand(kernel, program)
        if stored is None or not stored.k_last:
            return None
        fmt = STORAGE_FORMATS[w.storage]
        parts = tuple(_stored_part(w.id, i, fmt, p, (n, k)) for i, p in enumerate(fmt.parts))
    return WeightStream(kernel.id, parts, n, n_out, offsets or (0,))


def _stored_part(weight: int, index: int, fmt, part, shape: tuple[int, int]) -> StreamPart:
    """A stored part as the runtime uploads it (its container, row-major): rows and bytes per row."""
    container = fmt.container_shape(part, shape)
    nbytes = int(fmt.container(part).itemsize)
    for d in container:
        nbytes *= int(d)
    if not container:  # one value for the whole tensor (an NVFP4 tensor scale): every band reads it
        return StreamPart(weight, index, 1, nbytes, shape[0])
    rows = int(container[0])
    per = fmt.block if fmt.layout is Layout.TILE and part is not Part.Q else 1
    if -(-shape[0] // per) != rows:
        raise ValueError(f"weight {weight}: stored part {part.value} has {rows} rows, not one per {per} of {shape[0]}")
    return StreamPart(weight, index, rows, nbytes // rows, per)


WHOLE_READ_BYTES = 16 * 1024  # at most this many bytes of an input each tile prefetches whole


@dataclass(frozen=True)
class WholeRead:
    """A small input a kernel reads that is written before the kernel starts (a norm's weight, a rope table, an
    attention mask, a scatter's index): all `nbytes` bytes of bufs[buffer] (what its tiles read together: one
    tile may read only its row of a table) are prefetched into L2 by each tile before its wait, so the tile's
    first DRAM load is not after the wait (issue 33). At most WHOLE_READ_BYTES: the prefetch is per tile."""

    slot: int
    buffer: int
    nbytes: int


_SCATTERS = (KernelKind.SCATTER, KernelKind.SCATTER_NOCOPY, KernelKind.SCATTER_EW)


def whole_reads(program: Program) -> dict[int, tuple[WholeRead, ...]]:
    """Launched kernel id -> the inputs its tiles may prefetch whole before their wait (WholeRead; kernels with
    none left out): EXTERNAL values in no storage format, of concrete size up to WHOLE_READ_BYTES, whose view
    touches every element, and which are no KV cache (no scatter's destination: a cache is read row by row,
    codegen/cache_stream.py). A Gemm's operands are left out: its tiles read their own bands of a weight
    (WeightStream), not the whole of it; so is a Gather: its first DRAM load is the table row its index names,
    which prefetching the index does not move before the wait. One pass over the program: the caches and dtypes
    are the program's, found once for every kernel."""
    caches = program.cache_buffers() | {k.inputs[0].buffer for k in program.kernels if k.kind in _SCATTERS}
    dtypes = program.dtypes()
    out = {}
    for kernel in program.launched():
        if not (kernel.kind.is_gemm or kernel.kind is KernelKind.GATHER):
            reads = _whole_reads(kernel, program, caches, dtypes)
            if reads:
                out[kernel.id] = reads
    return out


def _whole_reads(kernel: Kernel, program: Program, caches: frozenset[int], dtypes) -> tuple[WholeRead, ...]:
    out = []
    for slot, inp in enumerate(kernel.inputs):
        value = program.kernel(inp.buffer)
        if value.kind is not KernelKind.EXTERNAL or value.storage is not None or value.id in caches \
                or not all(is_const(d) for d in value.shape):
            continue
        numel = 1
        for d in value.shape:
            numel *= int(d)
        nbytes = int(numel * dtypes[value.id].itemsize)
        if nbytes > WHOLE_READ_BYTES or kernel.input_bytes(slot, {}, dtypes) != nbytes:
            continue  # too large to prefetch per tile, or a view that skips elements
        out.append(WholeRead(slot, value.id, nbytes))
    return tuple(out)
