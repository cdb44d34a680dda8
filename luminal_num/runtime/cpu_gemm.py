"""The CPU backend's Gemm: C = A @ B over a Gemm layout, FP32 by numpy's matmul (BLAS), the other
variants emulated bit-exactly by runtime/numerics.py.

An FP32 operand that numpy can hand to BLAS as it lies is not copied (attention reads its heads
through strided views, each copy a pass over the activations): numpy passes the contiguous copy
and such a view to the same BLAS routine with the same transpose flags, only the leading dimension
differs, which changes no value. A view that would take another route (a transposed operand: other
flags; a vector: numpy's gemv path; an unaccepted row stride: numpy's own loop) is copied as before.

A Gemm over concatenated weights (horizontal fusion) runs one call per part on that part's columns as a
C-contiguous (K, N_part) copy: the call the unfused Gemm makes, so fused and unfused FP32 plans agree bit
for bit whatever summation order the BLAS kernel takes for a shape or a leading dimension.
"""
from __future__ import annotations

import math

import numpy as np

from ..codegen.llir import Kernel
from ..dtypes.variants import GEMM_VARIANTS
from ..hlir.gemm import GemmLayout, contiguous, gemm_operand_a, gemm_operand_b, gemm_operand_b_view, gemm_result
from ..hlir.weightcache import WEIGHTS
from ..quant import quantize_tensor
from .cpu_compiled import read_view
from .fixed_gemm import fixed_matmul
from .gemm_operand import Operand
from .numerics import emulate_gemm, prepare_b


def _operand(k: Kernel, i: int, stored, bindings, reads=(None, None)) -> np.ndarray:
    """A Gemm operand over the full Mul shape as a strided view of its buffer (no broadcast copies)."""
    inp = k.inputs[i]
    return read_view(inp.view, reads[i], stored[inp.buffer], bindings)


def quantize_input(k: Kernel, stored, bindings) -> np.ndarray:
    """A QUANTIZE kernel's input: its Gemm's A operand as (batch, M, K) float32."""
    return np.asarray(gemm_operand_a(_operand(k, 0, stored, bindings), k.layout), dtype=np.float32)


def run_quantize(k: Kernel, stored, bindings):
    """A QUANTIZE kernel: its Gemm's A operand as (batch, M, K), quantized with scales from itself."""
    return quantize_tensor(quantize_input(k, stored, bindings), k.dtype, k.scale_spec)


def _f32(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float32, copy=False)


def _size(full, axes) -> int:
    return math.prod(int(full[ax]) for ax in axes)  # np.prod of a short list costs ~10 us


def blas_view(full: np.ndarray, lay: GemmLayout, is_a: bool) -> np.ndarray | None:
    """A float32 operand over the Mul shape as (*batch, M, K) for A or (*batch, K, N) for B, a view that
    numpy's matmul hands to BLAS as it would hand its contiguous copy; None where a copy is needed."""
    if full.dtype != np.float32 or _size(full.shape, lay.m_axes) <= 1 or _size(full.shape, lay.n_axes) <= 1:
        return None  # M or N of 1: numpy's vector paths, which read strides differently
    drop = lay.n_axes if is_a else lay.m_axes
    order = (*lay.batch_axes, *lay.m_axes, lay.k_axis) if is_a else (*lay.batch_axes, lay.k_axis, *lay.n_axes)
    x = full[tuple(0 if ax in drop else slice(None) for ax in range(full.ndim))]
    keep = [ax for ax in range(full.ndim) if ax not in drop]
    x = np.transpose(x, [keep.index(ax) for ax in order])
    rows, cols = (_size(full.shape, lay.m_axes), full.shape[lay.k_axis]) if is_a else \
        (full.shape[lay.k_axis], _size(full.shape, lay.n_axes))
    try:
        x = x.reshape(*(full.shape[ax] for ax in lay.batch_axes), rows, cols, copy=False)
    except ValueError:
        return None
    size = x.itemsize
    row = x.strides[-2]
    if x.strides[-1] != size or row % size or row // size < cols:
        return None  # numpy's test for a matrix BLAS reads without transposing it
    return x


def column_parts(b: np.ndarray, widths: tuple[int, ...]) -> tuple[np.ndarray, ...] | None:
    """B (..., K, N)'s columns per concatenated part, each a C-contiguous copy laid out as the part's own
    Gemm operand (gemm_operand_b's), or None when N is not the parts' total (a part read alone)."""
    if len(widths) < 2 or sum(widths) != b.shape[-1]:
        return None
    starts = np.cumsum((0,) + widths[:-1])
    return tuple(np.ascontiguousarray(b[..., s:s + w]) for s, w in zip(starts, widths))


PREPARE_BLOCK_BYTES = 256 << 20  # a variant's B operand wider than this is prepared a block of columns at a time


def prepared_blocks(full: np.ndarray, lay: GemmLayout, variant, b_scales, b_parts: tuple[int, ...]):
    """A large B's prepared operand as blocks of at most PREPARE_BLOCK_BYTES of columns (each part's columns
    from its own first column, so a part alone and the same part in a concatenation get the same blocks),
    or None where B is small or its scales do not split at block edges. Why: preparing B whole holds its
    contiguous FP32 copy beside the prepared one; a 1B model's 1 GB LM head made two such transients at once,
    past the memory plan. The blocks are what a concatenation's parts are: one Gemm call per block."""
    spec = variant.b_scale
    if spec is not None and b_scales is None and not spec.varies_along(1):
        return None  # scales computed from B itself over all its columns (per tensor): B whole
    view = gemm_operand_b_view(full, lay)
    if view is None:
        return None
    batch, k_extent, n = view.shape
    widths = b_parts if b_parts and sum(b_parts) == n else (n,)
    if b_scales is None:  # none, or computed from each block itself: column-local, so the same values
        block = 1 if spec is None else spec.block[1]
    else:
        block = 1 if b_scales.shape[-1] == 1 else -(-n // b_scales.shape[-1])
    step = max(block, PREPARE_BLOCK_BYTES // max(4 * k_extent * batch, 1) // block * block)
    if max(widths) <= step:
        return None
    cols = [w for width in widths for w in [step] * (width // step) + ([width % step] if width % step else [])]
    scales = _scale_parts(b_scales, tuple(cols), n)
    if scales is None:
        return None
    starts = np.cumsum((0,) + tuple(cols[:-1]))
    return tuple(prepare_b(_f32(contiguous(view[..., s:s + w])), variant, sc)
                 for s, w, sc in zip(starts, cols, scales))


def _scale_parts(scales: np.ndarray | None, widths: tuple[int, ...], n: int) -> list | None:
    """Static B scales (..., K blocks, N blocks) split at the parts' columns; None where a block spans two."""
    if scales is None or scales.shape[-1] == 1:
        return [scales] * len(widths)
    block = -(-n // scales.shape[-1])
    starts = np.cumsum((0,) + widths)
    if any(s % block for s in starts[:-1]):
        return None
    return [scales[..., s // block:-(-e // block)] for s, e in zip(starts[:-1], starts[1:])]


def run_gemm(k: Kernel, stored, bindings, b_scales: np.ndarray | None = None,
             a_scales: np.ndarray | None = None, b_cache_key: tuple | None = None, reads=(None, None),
             out: np.ndarray | None = None, b_parts: tuple[int, ...] = (), fixed_order: bool = False) -> np.ndarray:
    """C as float32 in the output's axis order; one BLAS call per batch matrix.

    a_scales: given when input 0 is a QUANTIZE kernel's q (its side output); else A is raw.
    b_cache_key: (weight array, key) when B reads a weight: its (batch, K, N) operand, and its
    quantized form for a variant, are then computed once per process (hlir.weightcache).
    reads: the operands' compiled views (cpu_compiled.StridedRead), if any.
    out: the kernel's FP32 output buffer, which an FP32 Gemm may write C into (then C is `out`).
    b_parts: the column widths of B's concatenated parts (a horizontally fused Gemm): one call per part.
    fixed_order: a batch-invariant program: every FP32 sum in runtime/fixed_gemm.py's order, never BLAS's.
    """
    a_full = _operand(k, 0, stored, bindings, reads)
    lay = k.layout
    variant = None if k.precision in (None, "f32") else GEMM_VARIANTS[k.precision]
    if variant is None:
        return _fp32_gemm(k, a_full, stored, bindings, b_cache_key, reads, out, b_parts, fixed_order)
    a = gemm_operand_a(a_full, lay)

    def b_operand():
        full = _operand(k, 1, stored, bindings, reads)
        blocks = prepared_blocks(full, lay, variant, b_scales, b_parts)
        if blocks is not None:
            return blocks
        b = _f32(gemm_operand_b(full, lay))
        parts = column_parts(b, b_parts)
        scales = None if parts is None else _scale_parts(b_scales, b_parts, b.shape[-1])
        if scales is None:
            return (prepare_b(b, variant, b_scales),)
        return tuple(prepare_b(p, variant, s) for p, s in zip(parts, scales))
    bs = b_operand() if b_cache_key is None else WEIGHTS.get(b_cache_key[0], (*b_cache_key[1], b_parts), b_operand)
    a32 = None if a_scales is not None else _f32(a)

    def part(b):
        if a_scales is not None:
            return emulate_gemm(None, None, variant, a_quantized=(a, a_scales), b_prepared=b, fixed_order=fixed_order)
        return emulate_gemm(a32, None, variant, b_prepared=b, fixed_order=fixed_order)
    c = part(bs[0]) if len(bs) == 1 else np.concatenate([part(b) for b in bs], axis=-1)
    return gemm_result(c, lay, a_full.shape)


def _fp32_gemm(k: Kernel, a_full, stored, bindings, b_cache_key, reads, out, b_parts=(), fixed_order=False) -> np.ndarray:
    lay = k.layout
    full = a_full.shape
    batch = tuple(full[ax] for ax in lay.batch_axes)
    a = blas_view(a_full, lay, True)
    if a is None:
        a = _f32(gemm_operand_a(a_full, lay)).reshape(*batch, _size(full, lay.m_axes), full[lay.k_axis])

    def b_copy():
        return _f32(gemm_operand_b(_operand(k, 1, stored, bindings, reads), lay))
    if b_cache_key is not None:
        b = WEIGHTS.get(b_cache_key[0], b_cache_key[1], b_copy)
    else:
        b = blas_view(_operand(k, 1, stored, bindings, reads), lay, False)
        if b is None or np.may_share_memory(a, b):  # one array read twice: numpy may take another route
            b = b_copy()
    b = b.reshape(*batch, full[lay.k_axis], _size(full, lay.n_axes))
    parts = None
    if b_parts:
        parts = column_parts(b, b_parts) if b_cache_key is None else \
            WEIGHTS.get(b_cache_key[0], (*b_cache_key[1], b_parts), lambda: column_parts(b, b_parts))
    if fixed_order:
        return gemm_result(_fixed_fp32(a, b, parts, b_cache_key, b_parts), lay, full)
    if parts is not None:
        return gemm_result(np.concatenate([np.matmul(a, p) for p in parts], axis=-1), lay, full)
    order = (*lay.batch_axes, *lay.m_axes, *lay.n_axes)
    out_axes = [ax for ax in range(len(full)) if ax != lay.k_axis]
    if out is not None and out_axes == list(order) and out.shape == tuple(full[ax] for ax in out_axes) \
            and out.dtype == np.float32 and out.flags.c_contiguous:  # C in the output's axis order: computed there
        np.matmul(a, b, out=out.reshape(*batch, a.shape[-2], b.shape[-1]))
        return out
    return gemm_result(np.matmul(a, b), lay, full)


def _fixed_fp32(a: np.ndarray, b: np.ndarray, parts, b_cache_key, b_parts) -> np.ndarray:
    """C in the fixed order (runtime/fixed_gemm.py); a weight's operands (and their packed panels) are kept
    per process. Per concatenated part or over all of B: the same bits (each output's sum reads only its
    own column), so the parts are one call."""
    def operand() -> Operand:
        return Operand(np.ascontiguousarray(b, dtype=np.float32), None, None)
    b_op = operand() if b_cache_key is None else WEIGHTS.get(b_cache_key[0], (*b_cache_key[1], b_parts, "fixed"),
                                                                operand)
    return fixed_matmul(a, b_op)
