"""Exact CPU emulation of the precision variants (numpy): the reference executor of the numerics gate.

What a GemmPrecision computes, step by step (every rounding below is round-to-nearest-even):
1. Operands. Unscaled: rounded to their format (F32 operands pass through: the graph's values are
   FP32). Scaled: x / s in FP32, then rounded to the format (luminal_num.quant), under the overflow
   policy. Products of operands are exact (<= 12-bit significands, or TF32's 11: <= 24 bits).
2. Accumulation of one chunk of K (the whole of K, a promotion interval, or a scale block):
   - FP32 accumulator: FP32 BLAS (sgemm) over the chunk. IEEE leaves a dot product's summation order
     open and so do GPUs; the error bound (gamma_n) holds for every order. This is the one step whose
     bits depend on the BLAS library.
   - INT32 accumulator: exact integer sum (two's complement wrap past 2^31, as the hardware does).
   - narrow accumulator (acc_mantissa_bits, or F16): one MMA instruction adds a group of mma_k
     products (32 bytes of K) to the accumulator: acc = RN_acc(acc + exact group sum). The group sum
     is formed in FP64 (exact for E4M3/INT8 operands; for F16/E5M2 exact unless the group's products
     span more than 2^(53 - 22) resp. 2^(53 - 6)), and acc + group is exact or rounds innocuously.
3. Scales. Constant along K (tensor/channel): once, y = fl32(fl32(acc) * fl32(sa * sb)). Varying
   along K with promote_every: at each promotion the chunk is scaled and added into an FP32
   accumulator in K order, out = fl32(out + fl32(partial * fl32(sa * sb))) (no FMA contraction).
   Varying along K without promotion: applied inside the MMA, to every product: power-of-two (E8M0)
   scales exactly on the operands then one FP32 accumulation (MX; where a scaled operand or partial sum
   could leave FP32's range, the exact products summed in FP64 and rounded once); with a narrow accumulator each
   group enters as fl32(fl32(group) * fl32(sa * sb)) (no promotion: one accumulator over all of K).
"""
from __future__ import annotations

from typing import Callable, Sequence

import math

import numpy as np

from ..dtypes.codec import to_float32
from ..dtypes.formats import BF16, F16, F32, INT32, Format, get
from ..dtypes.rounding import Overflow, round_to
from ..dtypes.variants import ElementwisePrecision, GemmPrecision, ScaleSpec
from ..quant import QuantOverflow, convert, expand_scales, quantize_tensor, resolved_block
from . import blas_f16
from .fixed_gemm import FixedOrderUnavailable, fixed_matmul
from .gemm_operand import Operand as _Operand
from .tile_threads import for_each_tile


def _operand(x: np.ndarray, fmt: Format, spec: ScaleSpec | None, scales, overflow: QuantOverflow) -> _Operand:
    if spec is not None:
        quantized = quantize_tensor(x, fmt, spec, overflow, scales)
        return _Operand(quantized.values, quantized.scales, spec)
    if fmt is F32:  # no conversion happens on the device; wider inputs become the FP32 graph values
        return _Operand(x if x.dtype == np.float32 else round_to(x, F32, Overflow.INF), None, None)
    return _Operand(convert(x, fmt, overflow), None, None)


def _scale_vector(op: _Operand, k_block_index: int, k_axis: int, extent: int) -> np.ndarray | None:
    """The operand's scales for one K-block, expanded along its M (A) or N (B) axis: shape (..., extent)."""
    if op.scales is None:
        return None
    return op.derived(f"scales{k_block_index},{k_axis},{extent}", lambda: _expanded_scales(op, k_block_index, k_axis, extent))


def _expanded_scales(op: _Operand, k_block_index: int, k_axis: int, extent: int) -> np.ndarray:
    vector = np.take(op.scales, min(k_block_index, op.scales.shape[k_axis] - 1), axis=k_axis)
    if vector.shape[-1] > 1:
        block = resolved_block(op.spec, op.values.shape)[1 + k_axis]  # A: rows (k_axis -1), B: cols (-2)
        vector = np.repeat(vector, block, axis=-1)[..., :extent]
    return vector


def _chunk_scale(a: _Operand, b: _Operand, k_block_index: int, rows: slice = slice(None),
                 cols: slice = slice(None)) -> np.ndarray | None:
    """fl32(sa * sb) for the outputs of one K-block (those in `rows` x `cols`), broadcastable to (..., M, N)."""
    sa = _scale_vector(a, k_block_index, -1, a.values.shape[-2])
    if sa is not None and sa.shape[-1] > 1:
        sa = sa[..., rows]
    sb = _scale_vector(b, k_block_index, -2, b.values.shape[-1])
    if sb is not None and sb.shape[-1] > 1:
        sb = sb[..., cols]
    if sa is None and sb is None:
        return None
    if sa is None:
        return sb[..., None, :]
    if sb is None:
        return sa[..., :, None]
    return sa[..., :, None] * sb[..., None, :]


EXACT_BLOCK_BYTES = 32 << 20  # B's columns widened to FP64 at a time by an exact integer sum


def _exact_integer_sum(qa: np.ndarray, qb: np.ndarray) -> np.ndarray:
    """The int32 accumulator: exact in FP32 BLAS while K * 128^2 <= 2^24, else in FP64 (exact to 2^53),
    B widened a block of columns at a time (a 1B model's int8 head widened whole was a 2 GB temporary;
    every sum is exact, so the blocks give its bits)."""
    k = qa.shape[-1]
    if k * 128 * 128 <= 2 ** 24:
        return np.matmul(qa, qb)
    a64 = qa.astype(np.float64)
    out = np.empty((*np.broadcast_shapes(qa.shape[:-2], qb.shape[:-2]), qa.shape[-2], qb.shape[-1]), np.float32)
    step = max(1, EXACT_BLOCK_BYTES // (8 * k * max(1, int(np.prod(qb.shape[:-2], dtype=np.int64)))))
    for s in range(0, qb.shape[-1], step):
        sums = np.matmul(a64, qb[..., s:s + step].astype(np.float64))
        if np.abs(sums).max(initial=0.0) > INT32.max_finite:  # int32 wraps around, as the GPU's accumulator
            sums = np.mod(sums + 2.0 ** 31, 2.0 ** 32) - 2.0 ** 31
        out[..., s:s + step] = sums
    return out


_TILE_ELEMENTS = 1 << 15  # outputs per elementwise step: ~256 KB of float64 stays in cache
# OpenBLAS runs a GEMM with M*N*K at most this on one thread; the group sums' many small calls stay
# under it, because on a busy machine waking the other threads cost more than the calls themselves
# (measured 2-5x slower for the 128-block FP8 variants on MiniLM's shapes).
_BLAS_SINGLE_THREAD_MNK = 1 << 18


def _round_acc_inplace(x: np.ndarray, acc: Format, tmp: np.ndarray) -> None:
    """x (float64) <- RN_acc(x) in place, for values in acc's normal range (checked by the caller).

    F16: numpy's float64 -> float16 cast rounds once, to nearest even (subnormals and overflow to
    inf included), the same as round_to(x, F16, INF); tmp is then a float16 scratch array.
    FP32-range accumulators: the half-ulp bit trick of dtypes.rounding.round_significand on the
    float64 bits, with a preallocated uint64 temporary.
    """
    if acc is F16:
        with np.errstate(over="ignore"):  # overflow to inf is the IEEE result being emulated
            if tmp.dtype == np.float16:
                np.copyto(tmp, x, casting="unsafe")
                np.copyto(x, tmp)
            else:
                np.copyto(x, x.astype(np.float16))
        return
    drop = 53 - acc.p
    bits = x.view(np.uint64)
    np.right_shift(bits, np.uint64(drop), out=tmp)
    tmp &= np.uint64(1)
    tmp += np.uint64((1 << (drop - 1)) - 1)
    bits += tmp
    bits &= np.uint64(~((1 << drop) - 1) & 0xFFFFFFFFFFFFFFFF)


_EXPONENT_BITS = np.uint64(0x7FF0000000000000)
_F16_MAGIC = 1.5 * 2.0 ** 42  # 2^e times this has an ulp of 2^(e - 10): F16's quantum in binade e


def _round_f16_magic(x: np.ndarray, out: np.ndarray, tmp: np.ndarray) -> None:
    """out <- RN_f16(x) for float64 x with |x| <= 65504 (no overflow: the caller proves it), with
    float64 arithmetic instead of numpy's slow float64 -> float16 cast: C = max(2^e(x), 2^-14) *
    1.5 * 2^42 has an ulp equal to F16's quantum at x (2^(e-10); the subnormal 2^-24 below 2^-14)
    and x + C stays in C's binade, so fl64(x + C) - C is x rounded there, ties to even (C / ulp is
    even), and the subtraction is exact; copysign restores the sign of a zero result."""
    np.bitwise_and(x.view(np.uint64), _EXPONENT_BITS, out=tmp.view(np.uint64))
    np.maximum(tmp, 2.0 ** -14, out=tmp)
    tmp *= _F16_MAGIC
    np.add(x, tmp, out=out)
    out -= tmp
    np.copysign(out, x, out=out)


def _round_f16_magic_inplace(x: np.ndarray, tmp: np.ndarray) -> None:
    """x <- RN_f16(x) as _round_f16_magic computes it, in place and without the copysign, so a result
    that rounds to zero is +0 whatever the sign of x (twice as fast: in-place passes, no copysign).
    Exact for every MMA step but a chunk's last: the next step adds a group sum g to it, and
    (+0) + g == (-0) + g unless g is -0, which the FP64 matmul never returns (BLAS and numpy's own
    loops start their sums at +0, so a sum of zero products is +0; tests/test_f16_accumulation.py
    checks the matmul shapes used). The chunk's last step keeps the sign (_round_f16_magic)."""
    np.bitwise_and(x.view(np.uint64), _EXPONENT_BITS, out=tmp.view(np.uint64))
    np.maximum(tmp, 2.0 ** -14, out=tmp)
    tmp *= _F16_MAGIC
    x += tmp
    x -= tmp


def _f16_in_range(qa: _Operand, qb: _Operand, k: int, groups: int) -> bool:
    """Whether every partial sum of an F16 accumulation provably stays at most F16's max_finite:
    |partials| <= sum_k |a_mk| |b_kn| <= min(k max|a| max|b|, max_m |a_m|_1 max|b|, max|a| max_n |b_n|_1),
    grown by (1 + 2^-10) per rounding."""
    if qa.values.shape[-1] > 1 << 20:
        return False
    growth = (1 + 2.0 ** -10) ** groups
    if k * qa.amax() * qb.amax() * growth <= F16.max_finite:  # enough alone: no pass over A for its L1 norms
        return True
    bounds = (lambda: qa.amax() * qb.l1max(-2), lambda: qa.l1max(-1) * qb.amax())  # either; B's first: cached
    return any(dot() * growth <= F16.max_finite for dot in bounds)  # for a weight, A's would cost a pass


def _fast_accumulation(qa: _Operand, qb: _Operand, acc: Format, k: int, groups: int) -> bool:
    """Whether every partial sum of `groups` group sums over k products provably stays in acc's
    normal range (no subnormal, no overflow), so _round_acc_inplace equals round_to. Every float32
    value is a multiple of ulp32(its magnitude) >= ulp32(min nonzero |v|), so partial sums are
    integer multiples of q = ulp32(min|qa|) * ulp32(min|qb|), hence 0 or >= q; and |partials| <=
    k * max|qa| * max|qb| grown by (1 + 2u) per rounding."""
    if acc is F16:
        return True  # the cast handles the whole range itself
    if acc.min_normal != F32.min_normal:
        return False
    mags = qa.magnitudes(), qb.magnitudes()
    if mags[0] is None or mags[1] is None:
        return True
    if not all(map(math.isfinite, mags[0] + mags[1])):
        return False  # NaN / inf operands: round_to's path handles them
    quantum = math.prod(2.0 ** (math.floor(math.log2(lo)) - 23) for lo, _ in mags)
    huge = k * mags[0][1] * mags[1][1] * (1 + 2.0 ** (1 - acc.p)) ** groups
    return quantum >= acc.min_normal and huge <= acc.max_finite / 2


def _fast_scaled_accumulation(qa: _Operand, qb: _Operand, acc: Format, k: int, groups: int) -> bool:
    """_fast_accumulation for per-product scales: terms t = fl32(fl32(group) * fl32(sa * sb)) are
    float32 values with |t| >= q * s_min (1 - 2^-23) when nonzero (q as in _fast_accumulation,
    s_min the least nonzero scale product), so they and all partial sums are multiples of
    2^-126 when q * s_min >= 2^-102 (t is then normal); |partials| <= k max|qa| max|qb| s_max, grown."""
    if acc.min_normal != F32.min_normal or qa.scales is None or qb.scales is None:
        return False
    mags = qa.magnitudes(), qb.magnitudes()
    if mags[0] is None or mags[1] is None:
        return True
    if not all(map(math.isfinite, mags[0] + mags[1])):
        return False  # NaN / inf operands: round_to's path handles them
    scales = [np.abs(op.scales[op.scales != 0]) for op in (qa, qb)]
    if any(x.size == 0 for x in scales):
        return True
    quantum = math.prod(2.0 ** (math.floor(math.log2(lo)) - 23) for lo, _ in mags)
    s_min, s_max = float(scales[0].min()) * float(scales[1].min()), float(scales[0].max()) * float(scales[1].max())
    huge = k * mags[0][1] * mags[1][1] * s_max * (1 + 2.0 ** -22) * (1 + 2.0 ** (1 - acc.p)) ** groups
    return quantum * s_min >= 2.0 ** -102 and huge <= acc.max_finite / 2


def _tiling(lead: int, m: int, n: int, group: int) -> tuple[int, int, int]:
    """(rows, item_cols, items) of an output tile of rows x (items * item_cols) outputs (times `lead`
    batch matrices), about _TILE_ELEMENTS of them. A group sum over the tile is ONE matmul call over
    `items` column blocks (numpy loops the BLAS calls in C), each block's call under
    _BLAS_SINGLE_THREAD_MNK and square-ish, so the packing of B's K-slice is spread over many rows.
    item_cols divides n where a useful divisor exists; else tiles are one block with a ragged last."""
    per_call = max(1, _BLAS_SINGLE_THREAD_MNK // group)
    elements = max(1, _TILE_ELEMENTS // max(1, lead))
    side = max(1, min(n, math.isqrt(min(per_call, elements))))
    item_cols = max(d for d in range(1, side + 1) if n % d == 0)
    divides = 4 * item_cols >= side
    item_cols = item_cols if divides else side
    rows = max(1, min(m, per_call // item_cols, elements // item_cols))
    items = max(1, min(n // item_cols, elements // (rows * item_cols))) if divides else 1
    return rows, item_cols, items


def _blocks(x: np.ndarray, items: int) -> np.ndarray:
    """(..., R, items * c) -> the view (..., items, R, c); a last axis of 1 broadcasts as (..., 1, R, 1)."""
    if x.shape[-1] == 1 and items > 1:
        return x[..., None, :, :]
    lead = tuple(range(x.ndim - 2))
    return x.reshape(x.shape[:-1] + (items, x.shape[-1] // items)).transpose(lead + (x.ndim - 1, x.ndim - 2, x.ndim))


def _grouped_gemm(qa: _Operand, qb: _Operand, acc: Format, group: int, chunk: int, k_block: int,
                  per_product: bool, fixed_order: bool = False) -> np.ndarray:
    """acc = RN_acc(acc + group sum), one rounding per MMA group of mma_k products along K (module
    doc, step 2), with promotion every `chunk` and the scales of step 3 (per K-block of k_block;
    per product when per_product) applied per output tile.

    One output tile at a time (_tiling), all of K for that tile before the next, so its group sums
    (one FP64 matmul call per group), adds, roundings and promotions stay in cache. Per promotion
    chunk: out = term or fl32(out + term), term = fl32(acc) [* fl32(sa * sb)]. With every partial
    sum provably in acc's normal range the rounding is done in place (_round_acc_inplace; for F16
    with no overflow possible, _round_f16_magic_inplace, and _round_f16_magic at a chunk's last
    step; for one matrix, blas_f16's steps where numpy's BLAS is callable), else by round_to. Tiles hold their outputs as
    (..., items, rows, item_cols): elementwise steps do not care.
    """
    from . import jit_gemm  # imported here: numba's import costs ~0.5 s, paid only where a grouped Gemm runs
    jit = jit_gemm.grouped_gemm(qa, qb, acc, group, chunk, k_block, per_product, f16_in_range=_f16_in_range,
                                for_each_tile=for_each_tile)
    if jit is not None:
        return jit
    if fixed_order:  # the numpy path's FP64 group sums are BLAS's order: not an order a plan can fix
        raise FixedOrderUnavailable(f"a batch-invariant plan needs the jit kernel for its {acc.name}-accumulated "
                                    "Gemm (numba installed, LUMINAL_NUM_JIT not 0)")
    k = qa.values.shape[-1]
    groups = -(-chunk // group)
    in_place = (_fast_scaled_accumulation if per_product else _fast_accumulation)(qa, qb, acc, chunk, groups)
    magic16 = acc is F16 and not per_product and _f16_in_range(qa, qb, chunk, groups)
    qa64, qb64 = qa.values.astype(np.float64), qb.values.astype(np.float64)
    lead = np.broadcast_shapes(qa64.shape[:-2], qb64.shape[:-2])
    m, n = qa64.shape[-2], qb64.shape[-1]
    out = np.empty(lead + (m, n), np.float32)
    tile_rows, item_cols, items = _tiling(math.prod(lead), m, n, group)
    use_cblas = magic16 and blas_f16.DGEMM is not None and math.prod(lead) == 1  # one matrix: blas_f16's steps
    a2, b2 = (np.ascontiguousarray(qa64.reshape(m, k)), np.ascontiguousarray(qb64.reshape(k, n))) if use_cblas \
        else (None, None)  # row-major, as blas_f16 passes them (astype keeps a transposed view's layout)

    def run_tile(row: int, col: int) -> None:
        rows = slice(row, row + tile_rows)
        a_rows = qa64[..., None, rows, :]  # (..., 1, R, K): broadcast over the column blocks
        cols = slice(col, col + items * item_cols)
        width = min(n, col + items * item_cols) - col
        parts = max(1, width // item_cols) if width % item_cols == 0 else 1
        b_blocks, target = _blocks(qb64[..., :, cols], parts), _blocks(out[..., rows, cols], parts)
        cblas = use_cblas and min(target.shape[-2:]) > 1 and blas_f16.subnormals_kept()  # GEMM, not GEMV
        if cblas:  # the scaled accumulator and its two scratch arrays, (parts, R, c)
            scaled, spare, sign = (np.empty(target.shape[-3:]) for _ in range(3))
        tile, group_sum = np.empty(target.shape), np.empty(target.shape)
        narrow = np.empty(target.shape, np.float32) if per_product else None
        tmp = np.empty(target.shape, np.float64 if magic16 else np.float16 if acc is F16 else np.uint64)
        scales: dict[int, np.ndarray | None] = {}

        def scale(block: int) -> np.ndarray | None:
            if block not in scales:
                s = _chunk_scale(qa, qb, block, rows, cols)
                scales[block] = None if s is None else _blocks(s, parts)
            return scales[block]
        for start in range(0, k, chunk):
            stop = min(start + chunk, k)
            if cblas:
                blas_f16.f16_chunk(a2, b2, row, col, start, stop, group, scaled, spare, sign)
            else:
                for g in range(start, stop, group):
                    np.matmul(a_rows[..., g:g + group], b_blocks[..., g:g + group, :], out=group_sum)
                    if per_product:  # fl32(fl32(group) * s), widened again so acc + term stays exact
                        np.copyto(narrow, group_sum, casting="same_kind")
                        np.multiply(narrow, scale(g // k_block), out=narrow)
                        np.copyto(group_sum, narrow)
                    if g > start:
                        group_sum += tile
                    if magic16 and g + group < stop:  # not the chunk's last step: the sign of a zero can go
                        _round_f16_magic_inplace(group_sum, tmp)
                        tile, group_sum = group_sum, tile
                    elif magic16:
                        _round_f16_magic(group_sum, tile, tmp)
                    elif in_place:
                        _round_acc_inplace(group_sum, acc, tmp)
                        tile, group_sum = group_sum, tile
                    else:
                        tile[...] = round_to(group_sum, acc, Overflow.INF)
            partial = (scaled * blas_f16.UNSCALE).astype(np.float32).reshape(target.shape) if cblas \
                else tile.astype(np.float32)
            chunk_scale = None if per_product else scale(start // k_block)
            term = partial if chunk_scale is None else partial * chunk_scale
            target[...] = term if start == 0 else target + term

    for_each_tile(run_tile, range(0, m, tile_rows), range(0, n, items * item_cols), lead, m, n, k)
    return out


def _grouped_sum(qa: np.ndarray, qb: np.ndarray, acc: Format, group: int) -> np.ndarray:
    """The narrow accumulation alone over all of K (no scales): float32 (..., M, N)."""
    k = qa.shape[-1]
    return _grouped_gemm(_Operand(qa, None, None), _Operand(qb, None, None), acc, group, k, k, False)


def _chunk_sum(qa: np.ndarray, qb, variant: GemmPrecision, fixed_order: bool = False) -> np.ndarray:
    """One chunk's FP32 (or exact integer) sum; `qb` may be an Operand of fixed_matmul (its panels kept).
    An integer sum is exact, so any order gives its bits."""
    if variant.acc_format is INT32:
        return _exact_integer_sum(qa, qb.values if isinstance(qb, _Operand) else qb)
    return fixed_matmul(qa, qb) if fixed_order else np.matmul(qa, qb)


def _prequantized(a_quantized, variant: GemmPrecision) -> _Operand:
    """A as a QUANTIZE kernel left it: q (values in the A format) and the scales beside it."""
    if variant.a_scale is None:
        raise ValueError(f"{variant.name}: A is not scaled, so it cannot arrive quantized")
    q, scales = (to_float32(x) for x in a_quantized)  # float8 codes widened by dtypes.codec's table
    expand_scales(scales, q.shape, variant.a_scale)  # raises unless the scales fit q
    return _Operand(q, scales, variant.a_scale)


def prepare_b(b, variant: GemmPrecision, b_scales: np.ndarray | None = None,
              overflow: QuantOverflow = QuantOverflow.SATURATE) -> _Operand:
    """Step 1 for B alone (rounded or quantized to its format): a weight's is computed once and
    passed to emulate_gemm as b_prepared for every later run."""
    return _operand(np.asarray(b), variant.b_format, variant.b_scale, b_scales, overflow)


def emulate_gemm(a, b, variant: GemmPrecision, b_scales: np.ndarray | None = None,
                 overflow: QuantOverflow = QuantOverflow.SATURATE,
                 a_quantized: tuple[np.ndarray, np.ndarray] | None = None,
                 b_prepared: _Operand | None = None, fixed_order: bool = False) -> np.ndarray:
    """a (..., M, K) @ b (..., K, N) computed exactly as `variant` defines it (module doc); float32.
    fixed_order: every FP32 accumulation in runtime/fixed_gemm.py's order (a batch-invariant plan), the
    narrow ones in the jit kernel's (which has one), never BLAS's.

    b_scales: static weight scales computed at compile time (else computed from b, like A's).
    overflow: what an operand value that does not fit its format becomes (SATURATE) or raises (REJECT).
    a_quantized: (q, scales) of A already quantized (a QUANTIZE kernel: quantize_tensor with the
    variant's A format and scale); then `a` must be None. Step 1 for A is then done, and the result
    is bit-identical to passing the raw A, because quantizing is the same function either way.
    b_prepared: prepare_b(b, variant, b_scales, overflow) computed earlier; then `b` must be None.
    """
    if (b is None) == (b_prepared is None):
        raise ValueError("pass either the raw B or b_prepared=prepare_b(...), not both or neither")
    if (a is None) == (a_quantized is None):
        raise ValueError("pass either the raw A or a_quantized=(q, scales), not both or neither")
    prequantized = None if a_quantized is None else _prequantized(a_quantized, variant)
    a = np.asarray(a) if prequantized is None else prequantized.values
    b = np.asarray(b) if b_prepared is None else b_prepared.values
    if a.ndim < 2 or b.ndim < 2 or a.shape[-1] != b.shape[-2]:
        raise ValueError(f"cannot multiply shapes {a.shape} and {b.shape}")
    qa = prequantized if prequantized is not None else _operand(a, variant.a_format, variant.a_scale, None, overflow)
    qb = b_prepared if b_prepared is not None else prepare_b(b, variant, b_scales, overflow)
    k = a.shape[-1]
    if k == 0:
        return np.zeros(np.broadcast_shapes(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], b.shape[-1]), np.float32)
    k_block = variant.scale_k_block or k
    if variant.grouped:
        chunk = k if variant.scales_per_product else min(variant.promote_every or k_block, k)
        return _grouped_gemm(qa, qb, variant.accumulator, variant.mma_k, chunk, k_block, variant.scales_per_product,
                             fixed_order)
    if variant.scales_per_product:
        return _per_product_scaled(qa, qb, fixed_order)
    chunk = min(variant.promote_every or k_block, k)
    out = None
    for start in range(0, k, chunk):
        b_chunk = qb.values[..., start:start + chunk, :]
        if fixed_order:  # B's unscaled chunk as fixed_matmul's operand, kept with a prepared weight
            b_chunk = qb.derived(f"fixed{start},{chunk}", lambda b_chunk=b_chunk: _Operand(np.ascontiguousarray(b_chunk),
                                                                                            None, None))
        partial = _chunk_sum(qa.values[..., start:start + chunk], b_chunk, variant, fixed_order)
        scale = None if _outer_scaled(partial, qa, qb, start // k_block) else _chunk_scale(qa, qb, start // k_block)
        in_place = scale is not None and np.broadcast_shapes(partial.shape, scale.shape) == partial.shape
        term = np.multiply(partial, scale, out=partial) if in_place else partial if scale is None else partial * scale
        out = term if out is None else np.add(out, term, out=out)  # partial is fresh from the matmul: no copies
    return out


def _outer_scaled(partial: np.ndarray, qa: _Operand, qb: _Operand, k_block_index: int) -> bool:
    """partial *= fl32(sa * sb), the scales of _chunk_scale applied as emulate_gemm's multiply does, in one
    numba pass where both operands have vector scales (jit_gemm.scale_outer: no (M, N) scale matrix
    built, then multiplied); False, and partial untouched, elsewhere."""
    from . import jit_gemm  # imported here: numba's import costs ~0.5 s, paid only where it runs
    m, n = partial.shape[-2:]
    sa, sb = _scale_vector(qa, k_block_index, -1, m), _scale_vector(qb, k_block_index, -2, n)
    if jit_gemm.kernel() is None or sa is None or sb is None or partial.dtype != np.float32 \
            or sa.dtype != np.float32 or sb.dtype != np.float32 or not partial.flags.c_contiguous \
            or np.broadcast_shapes(partial.shape, sa.shape[:-1] + (m, 1), sb.shape[:-1] + (1, n)) != partial.shape:
        return False
    lead = partial.shape[:-2]
    sa = np.broadcast_to(sa, lead + (m,)).reshape(-1, m)  # a per-tensor scale (shape (..., 1)) widens here
    sb = np.broadcast_to(sb, lead + (n,)).reshape(-1, n)
    jit_gemm.scale_outer(partial.reshape(-1, m, n), sa, sb)
    return True


def _per_product_scaled(qa: _Operand, qb: _Operand, fixed_order: bool = False) -> np.ndarray:
    """Power-of-two scales applied to every product (MX). Where max|a s|, max|b s| <= F32 max and
    k max|a s| max|b s| <= F32 max / 2 (every dequantized operand, product and partial sum provably
    finite), q * 2^e is exact in FP32 and so is
    every product: one FP32 BLAS accumulation of the scaled operands. Beyond that, an operand alone may
    exceed FP32 (256 * 2^120 = 2^128) where the result does not: the exact products are summed in FP64
    and rounded once to FP32 (error <= u32 |y| + gamma_k(u64) sum|p|, within the FP32 accumulation's
    gamma_k(u32) sum|p|), so the Gemm is inf only where the result itself is beyond FP32's range."""
    k = qa.values.shape[-1]
    wide = [op.derived("scaled64", lambda op=op: _dequantized64(op)) for op in (qa, qb)]  # exact: 8-bit q, 2^e
    amax = [op.derived("scaled_amax", lambda x=x: float(np.max(np.abs(x), initial=0.0))) for op, x in zip((qa, qb), wide)]
    if max(amax) <= F32.max_finite and k * amax[0] * amax[1] <= F32.max_finite / 2:  # NaN fails: FP64 path
        # a prepared weight's scaled values are made once (derived), not per run
        operands = [op.values if op.scales is None else op.derived("scaled", lambda op=op: op.values * expand_scales(
            op.scales, op.values.shape, op.spec)) for op in (qa, qb)]
        if fixed_order:
            return fixed_matmul(operands[0], qb.derived("fixed_scaled", lambda: _Operand(operands[1], None, None)))
        return np.matmul(*operands)
    with np.errstate(over="ignore"):  # an FP32 overflow of the rounded result is the inf being emulated
        return (_sequential64(*wide) if fixed_order else np.matmul(*wide)).astype(np.float32)


def _sequential64(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a @ b in FP64 summed in k order from +0 (vectorized over the outputs): a batch-invariant plan's
    order for the exact-product path of _per_product_scaled, which BLAS would sum in its own."""
    out = np.zeros(np.broadcast_shapes(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], b.shape[-1]))
    for k in range(a.shape[-1]):
        out += a[..., :, k:k + 1] * b[..., k:k + 1, :]
    return out


def _dequantized64(op: _Operand) -> np.ndarray:
    values = op.values.astype(np.float64)
    return values if op.scales is None else values * expand_scales(op.scales, op.values.shape, op.spec)


def emulate_reduce_sum(x, axis: int, acc: Format | str) -> np.ndarray:
    """Sum along `axis`, strictly sequentially in index order, rounding to `acc` after every add.

    The values are the stored FP32 tensor (wider inputs are rounded to FP32 first). For an FP32
    accumulator this is np.cumsum in float32, which numpy computes sequentially (np.sum would use
    pairwise blocks); for F16/BF16 accumulators, inputs already representable in the accumulator use
    numpy's float16 / ml_dtypes' bfloat16 cumsum (each add is an FP32 add rounded once, an innocuous
    double rounding for p <= 11); other inputs go through an explicit loop with FP64 adds.
    """
    acc = get(acc)
    x = np.asarray(x)
    values = x if x.dtype == np.float32 else round_to(x, F32, Overflow.INF)
    axis = axis % values.ndim
    if values.shape[axis] == 0:
        return round_to(np.zeros(values.shape[:axis] + values.shape[axis + 1:], np.float32), acc)
    if acc is F32:
        return np.take(np.cumsum(values, axis=axis, dtype=np.float32), -1, axis=axis)
    representable = np.array_equal(round_to(values, acc, Overflow.INF), values, equal_nan=True)
    if representable:
        with np.errstate(over="ignore"):
            sums = np.cumsum(values.astype(acc.storage), axis=axis, dtype=acc.storage)
        return np.take(sums, -1, axis=axis).astype(np.float32)
    moved = np.ascontiguousarray(np.moveaxis(values, axis, 0), dtype=np.float64)  # each step reads one block
    if _fast_reduction(values, axis, acc):
        total, tmp = moved[0].copy(), np.empty(moved.shape[1:], np.uint64)
        _round_acc_inplace(total, acc, tmp)
        for row in moved[1:]:
            total += row
            _round_acc_inplace(total, acc, tmp)
        return total.astype(np.float32)
    total = round_to(moved[0], acc, Overflow.INF)
    for row in moved[1:]:
        total = round_to(total + row, acc, Overflow.INF)
    return total


def _fast_reduction(values: np.ndarray, axis: int, acc: Format) -> bool:
    """Whether every partial sum of FP32 `values` provably stays in acc's normal range: inputs are
    integer multiples of q = ulp32(min nonzero |x|), so are the (rounded) partial sums, which are
    then 0 or >= q; |partials| <= sum|x| grown by (1 + 2u) per rounding."""
    if acc is F16:
        return True  # the float16 cast covers subnormals and overflow itself
    if acc.p >= 24 or acc.min_normal < F32.min_normal:
        return False
    mags = np.abs(values[values != 0]).astype(np.float64)
    if mags.size == 0:
        return True
    quantum = 2.0 ** (np.floor(np.log2(mags.min())) - 23)
    n = values.shape[axis]
    return quantum >= acc.min_normal and float(mags.sum()) * (1 + 2.0 ** (1 - acc.p)) ** n <= acc.max_finite / 2


def emulate_elementwise(fn: Callable[..., np.ndarray], inputs: Sequence, precision: ElementwisePrecision,
                        overflow: Overflow = Overflow.INF) -> np.ndarray:
    """fn applied the way `precision` computes it, returned as float32 values in the storage format.

    F32 compute: inputs as FP32, fn evaluated in numpy float32 (each numpy op one IEEE rounding; fn
    must keep float32). BF16 compute: inputs rounded to BF16, fn evaluated in float64 and rounded once
    to BF16, the model of a fused kernel with correctly rounded bf16 arithmetic. Then stored: rounded to
    the storage format under `overflow` (INF: the plain non-saturating store).
    """
    compute = precision.compute
    operands = [round_to(x, compute, Overflow.INF) for x in inputs]
    if compute is BF16:
        result = round_to(fn(*(op.astype(np.float64) for op in operands)), BF16, Overflow.INF)
    else:
        result = np.asarray(fn(*operands))
        if result.dtype != np.float32:
            raise TypeError(f"fn must compute in float32 under {precision.name}; it returned {result.dtype}")
    return round_to(result, precision.storage, overflow)
