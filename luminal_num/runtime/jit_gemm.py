"""The narrow-accumulator Gemm (numerics._grouped_gemm's semantics, module doc of runtime.numerics) as one
numba kernel, same bits: numpy spends each of K / mma_k steps on a small BLAS call and several
elementwise passes over the tile; here an MR x NR register tile of outputs keeps its group sums and
its accumulator in registers over a whole slice of K (explicit <8 x double> LLVM IR: numba's own
loops did not keep them in registers, 2-3 GMAC/s instead of 10-18 per thread on MiniLM's shapes).

Why these bits are numerics' bits:
- Group sums: NR / VW <8 x double> per row of the tile, k in order from +0, by llvm.fma (products of
  float32 values are exact in FP64, so fma(a, b, s) = fl64(a * b + s) = fl64(fl64(a * b) + s)). The
  group sum is then exact wherever numerics' is (its module doc), so the order does not matter; a
  zero sum is +0 (never -0), as for np.matmul.
- acc = RN_acc(fl64(acc + group)), or the group alone at a chunk's first: the magic-number rounding
  of _vector_round, exact RNE to acc.p bits with acc's subnormal quantum and +-inf past max_finite,
  i.e. round_to(x, acc, Overflow.INF) and numpy's float64 -> float16 cast. A NaN stays NaN (its
  payload and sign may differ from numpy's, as they do across BLAS builds). Where numerics' range
  proofs hold (_bounded) the inf / NaN selects are skipped.
- Scales and promotion in float32, each operation rounded once (fastmath off: LLVM contracts nothing),
  in numerics' order: term = fl32(fl32(acc) * fl32(sa * sb)); out = term, then fl32(out + term).
  Per product: fl64(fl32(fl32(group) * fl32(sa * sb))) enters the accumulator.

Without numba (or with LUMINAL_NUM_JIT=0, or for a case takes() refuses) numerics runs its numpy path,
which tests/test_jit_gemm.py fuzzes this kernel against. First use in a process costs numba's import
(~0.7 s) and the compile (several seconds, once: numba caches the machine code on disk; a cached load
is ~1 s); a process forked after that inherits the compiled kernel. The kernel is single-threaded and
nogil: tile_threads.for_each_tile runs tiles on threads of the call (numba's parallel layer is not fork-safe,
and the compiler forks workers).
"""
from __future__ import annotations

import math
import os
from typing import Callable

import numpy as np

from ..dtypes.formats import F16, Format
from ..quant import resolved_block

ENABLED = os.environ.get("LUMINAL_NUM_JIT", "1") != "0"  # LUMINAL_NUM_JIT=0 forces numerics' numpy path

try:
    import numba
    from llvmlite import binding, ir
    from numba import types
    from numba.core import cgutils
    from numba.extending import intrinsic
except ImportError:  # the numpy path of numerics runs instead
    numba = None

VW = 8  # FP64 lanes of one vector (a zmm; two ymm without AVX-512)
# register tile: with AVX-512's 32 zmm, 8 rows x 24 FP64 columns (24 zmm of group sums; 8 x 16 ran 5-20%
# slower on MiniLM's shapes, 4 x 16 25%); with AVX2's 16 ymm, 4 x 8 (8 ymm)
MR, NR = (8, 24) if numba is None or binding.get_host_cpu_features().get("avx512f", False) else (4, 8)
ROW_BLOCK = 64  # rows per task (a multiple of MR): 64 x K FP64 of A stays in L2 while every B panel passes by
K_STEP = 128  # K per pass of a row block's tiles over a panel: 128 x NR FP64 of B (24 KB) stays in L1


def kernel() -> Callable | None:
    """The kernel (compiled at its first call), or None without numba or with LUMINAL_NUM_JIT=0."""
    return grouped_tile if ENABLED and numba is not None else None


def takes(acc: Format, *scales: np.ndarray | None) -> bool:
    """Whether the kernel computes this accumulator and these scales (float32 ones) exactly."""
    return (acc.p < 53 and acc.has_inf and acc.min_normal >= 2.0 ** -1022 and acc.max_finite < 2.0 ** 1023
            and all(s is None or s.dtype == np.float32 for s in scales))


def operand_a(qa, lead: tuple) -> np.ndarray:
    """A's values as float32 (L or 1, M, K) for grouped_tile, which packs each task's rows to FP64 itself,
    in cache and on the task's thread (a whole FP64 copy of A was a pass over memory per Gemm)."""
    a = qa.values
    m, k = a.shape[-2:]
    if a.flags.c_contiguous:  # its max |a| for _bounded, in one integer pass
        qa.derived("amax", lambda: abs_max(a.reshape(-1).view(np.uint32)))
    lead_a = math.prod(a.shape[:-2])
    if lead_a in (1, math.prod(lead)):
        return a.reshape(lead_a, m, k)
    return np.ascontiguousarray(np.broadcast_to(a, lead + (m, k))).reshape(-1, m, k)


def pack_b(b: np.ndarray, lead: tuple) -> np.ndarray:
    """B (..., K, N) -> FP64 panels (L, N_pad / NR, K, NR), each panel NR columns contiguous per k."""
    k, n = b.shape[-2:]
    b3 = np.broadcast_to(b, lead + (k, n)).reshape(-1, k, n)
    full, rest = divmod(n, NR)
    out = np.zeros((b3.shape[0], full + (rest > 0), k, NR))
    out[:, :full] = b3[:, :, :full * NR].reshape(b3.shape[0], k, full, NR).transpose(0, 2, 1, 3)
    if rest:
        out[:, full, :, :rest] = b3[:, :, full * NR:]
    return out


def _scales(op, lead: tuple, blocks: int, k_axis: int, extent: int, padded: int) -> np.ndarray | None:
    """fl32 scales of one operand per K-block, (L, blocks, padded) float32 (ones past `extent`), or None:
    numerics._scale_vector of every K-block (its take, repeat and crop) at once, for all blocks in
    three numpy calls instead of three per block; a weight's once per process (derived)."""
    if op.scales is None:
        return None
    return op.derived(f"jit_scales{lead},{blocks},{k_axis},{extent},{padded}",
                      lambda: _all_block_scales(op, lead, blocks, k_axis, extent, padded))


def _all_block_scales(op, lead: tuple, blocks: int, k_axis: int, extent: int, padded: int) -> np.ndarray:
    index = np.minimum(np.arange(blocks), op.scales.shape[k_axis] - 1)  # one K-block of scales serves all
    vectors = np.take(op.scales, index, axis=k_axis)  # A: (..., M-blocks, blocks); B: (..., blocks, N-blocks)
    if k_axis == -1:
        vectors = np.swapaxes(vectors, -1, -2)
    if vectors.shape[-1] > 1:  # per block of rows (A) or columns (B): repeated over them, cropped
        block = resolved_block(op.spec, op.values.shape)[1 + k_axis]
        vectors = np.repeat(vectors, block, axis=-1)[..., :extent]
    out = np.ones((math.prod(lead), blocks, padded), np.float32)
    out[:, :, :extent] = np.broadcast_to(vectors, lead + (blocks, extent)).reshape(out.shape[0], blocks, extent)
    return out


def _bounded(qa, qb, acc: Format, chunk: int, groups: int, per_product: bool, f16_in_range: Callable) -> bool:
    """Whether every running sum is provably finite and within acc.max_finite (subnormals need no proof:
    _vector_round handles them). F16: numerics._f16_in_range (with its L1-norm refinement). Otherwise
    |partials| <= chunk max|a| max|b| [max|sa| max|sb| (1 + 2^-22) per product: two fl32 roundings]
    grown by (1 + 2^(1 - p)) per rounding; NaN / inf magnitudes fail the comparison. Only maxima: no
    pass over the operands for their least magnitude, which numerics' normal-range proofs need."""
    if acc is F16 and not per_product:
        return f16_in_range(qa, qb, chunk, groups)
    scale = 1.0
    if per_product:
        if qa.scales is None or qb.scales is None:
            return False
        scale = math.prod(op.derived("scale_amax", lambda op=op: float(np.max(np.abs(op.scales), initial=0.0)))
                          for op in (qa, qb)) * (1 + 2.0 ** -22)
    bound = chunk * qa.amax() * qb.amax() * scale * (1 + 2.0 ** (1 - acc.p)) ** groups
    return bound <= acc.max_finite / 2


def grouped_gemm(qa, qb, acc: Format, group: int, chunk: int, k_block: int, per_product: bool, *,
                 f16_in_range: Callable, for_each_tile: Callable) -> np.ndarray | None:
    """numerics._grouped_gemm's result (same arguments), or None where the kernel does not apply. numerics
    hands in its F16 range proof and tile runner (this module never imports it)."""
    run = kernel()
    if run is None or not takes(acc, qa.scales, qb.scales) or qa.values.dtype != np.float32:
        return None  # (grouped_tile reads A as float32: the operand's values always are)
    (m, k), n = qa.values.shape[-2:], qb.values.shape[-1]
    lead = np.broadcast_shapes(qa.values.shape[:-2], qb.values.shape[:-2])
    m_pad, panels = -(-m // MR) * MR, -(-n // NR)
    blocks = -(-k // k_block)
    sa = _scales(qa, lead, blocks, -1, m, m_pad)
    sb = _scales(qb, lead, blocks, -2, n, panels * NR)
    mode = 0 if sa is None and sb is None else 2 if per_product else 1
    if per_product and mode == 0:
        return None  # per-product scaling without scales: not a variant numerics computes either
    ones = np.ones((1, blocks, 1), np.float32)
    sa = np.broadcast_to(ones, (1, blocks, m_pad)) if sa is None else sa
    sb = np.broadcast_to(ones, (1, blocks, panels * NR)) if sb is None else sb
    sa, sb = np.ascontiguousarray(sa), np.ascontiguousarray(sb)
    a3 = operand_a(qa, lead)
    bp = qb.derived(f"jit_panels{lead}", lambda: pack_b(qb.values, lead))  # a weight's: packed once per process
    out = np.empty(lead + (m, n), np.float32)
    flat = out.reshape(-1, m, n)
    bounded = _bounded(qa, qb, acc, chunk, -(-chunk // group), per_product, f16_in_range)

    matrices = math.prod(lead)
    per_task = 1 if m_pad > ROW_BLOCK else -(-matrices // 8)  # small matrices (attention heads): several per call

    def run_tile(first: int, row: int) -> None:
        run(a3, bp, flat, sa, sb, first, min(first + per_task, matrices), row, min(row + ROW_BLOCK, m_pad), group,
            chunk, k_block, mode, bounded, 53 - acc.p, acc.min_normal, acc.max_finite)
    for_each_tile(run_tile, range(0, matrices, per_task), range(0, m_pad, ROW_BLOCK), lead, m, n, k)
    return out


if numba is not None:
    def _splat(builder, value, vec):
        lanes0 = ir.Constant(ir.VectorType(ir.IntType(32), vec.count), [0] * vec.count)
        first = builder.insert_element(ir.Constant(vec, ir.Undefined), value, ir.Constant(ir.IntType(32), 0))
        return builder.shuffle_vector(first, ir.Constant(vec, ir.Undefined), lanes0)

    def _vector_round(builder, x, drop, min_normal, magic, max_finite, bounded):
        """RN_acc of each lane of x (<VW x double>) in explicit vector IR, with selects and no branches:
        C = max(2^e(x), min_normal) * 1.5 * 2^drop has an ulp equal to acc's quantum at x (the fixed
        subnormal quantum below min_normal) and fl64(x + C) stays in C's binade, so fl64(x + C) - C is x
        rounded there, ties to even (C / ulp is even), exactly (numerics._round_f16_magic, for any p);
        copysign restores a zero's sign; past max_finite (or for an inf x, where C - C is NaN) +-inf;
        a NaN x stays itself. `magic` is 1.5 * 2^drop. bounded: the caller proved every x finite and
        its rounding at most max_finite, so the last two selects go (half the operations)."""
        vec, lanes = x.type, x.type.count
        ivec = ir.VectorType(ir.IntType(64), lanes)
        module = builder.module
        fabs = cgutils.get_or_insert_function(module, ir.FunctionType(vec, [vec]), f"llvm.fabs.v{lanes}f64")
        binary = ir.FunctionType(vec, [vec, vec])
        copysign = cgutils.get_or_insert_function(module, binary, f"llvm.copysign.v{lanes}f64")
        exponent = ir.Constant(ivec, [0x7FF0000000000000] * lanes)
        binade = builder.bitcast(builder.and_(builder.bitcast(x, ivec), exponent), vec)
        floor = _splat(builder, min_normal, vec)
        # max(binade, min_normal) as a select, one vmaxpd (llvm.maxnum adds NaN handling; binade is never NaN)
        c = builder.fmul(builder.select(builder.fcmp_ordered("<", binade, floor), floor, binade),
                         _splat(builder, magic, vec))
        r = builder.call(copysign, [builder.fsub(builder.fadd(x, c), c), x])
        if bounded:
            return r
        over = builder.fcmp_unordered(">", builder.call(fabs, [r]), _splat(builder, max_finite, vec))
        r = builder.select(over, builder.call(copysign, [ir.Constant(vec, [math.inf] * lanes), x]), r)
        return builder.select(builder.fcmp_unordered("uno", x, x), x, r)

    def _make_groups(bounded: bool):
        """_groups, with the rounding of _vector_round(bounded)."""
        def groups(typingctx, a, a_off, lda, b, b_off, kcount, group, acc, first, scale, scaled, drop, min_normal,
                   magic, max_finite):
            return _groups_typed(bounded, a, a_off, lda, b, b_off, kcount, group, acc, first, scale, scaled, drop,
                                 min_normal, magic, max_finite)
        groups.__name__ = "_groups_bounded" if bounded else "_groups"
        return intrinsic(groups)

    def _groups_typed(bounded, a, a_off, lda, b, b_off, kcount, group, acc, first, scale, scaled, drop, min_normal,
                      magic, max_finite):
        """The MMA groups of kcount products along K (group by group, the last one short) on the MR x NR
        register tile, its accumulators in registers throughout: per group, sums[i, j] = sum_t
        a[a_off + i * lda + t] * b[b_off + t * NR + j] (NR / VW <VW x double> per row, t in order from +0, by
        llvm.fma: products are exact); if scaled, sums = fl64(fl32(fl32(sums) * scale)); then acc =
        RN_acc(fl64(acc + sums)), acc starting at -0 if first (so the first group enters as it is).
        a, b, acc: 1-D FP64 (A's padded rows, one packed panel of B, the tile's accumulators, read and
        written once); scale: the tile's fl32(sa * sb), float32 (MR * NR). kcount >= 1."""
        sig = types.void(a, a_off, lda, b, b_off, kcount, group, acc, first, scale, scaled, drop, min_normal, magic,
                         max_finite)

        def codegen(context, builder, signature, args):
            def data(index):
                return context.make_array(signature.args[index])(context, builder, args[index]).data
            pa, pb, pacc, pscale = data(0), data(3), data(7), data(9)
            a_off_, lda_, b_off_, kc, group_ = args[1], args[2], args[4], args[5], args[6]
            i64, f64 = ir.IntType(64), ir.DoubleType()
            vec, fvec = ir.VectorType(f64, VW), ir.VectorType(ir.FloatType(), VW)
            parts = [(i, v) for i in range(MR) for v in range(NR // VW)]  # row i, columns v * VW .. (v + 1) * VW
            pa, pb = builder.gep(pa, [a_off_]), builder.gep(pb, [b_off_])
            fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vec, [vec] * 3), f"llvm.fma.v{VW}f64")
            zero, izero = ir.Constant(vec, [0.0] * VW), ir.Constant(i64, 0)
            is_scaled = builder.icmp_signed("!=", args[10], ir.Constant(args[10].type, 0))
            is_first = builder.icmp_signed("!=", args[8], ir.Constant(args[8].type, 0))
            slots = [builder.bitcast(builder.gep(pacc, [ir.Constant(i64, i * NR + v * VW)]), vec.as_pointer())
                     for i, v in parts]
            # a chunk's first group enters as it is: -0 + x = x for every x (signed zeros and NaN included),
            # so starting from -0 spares a select per group
            acc_in = [builder.select(is_first, ir.Constant(vec, [-0.0] * VW), builder.load(slot, align=8))
                      for slot in slots]
            entry = builder.block
            outer, inner, done = (builder.append_basic_block(name) for name in ("groups", "group_k", "groups_done"))
            builder.branch(outer)
            builder.position_at_end(outer)
            g = builder.phi(i64)
            g.add_incoming(izero, entry)
            accs = [builder.phi(vec) for _ in parts]
            for phi, value in zip(accs, acc_in):
                phi.add_incoming(value, entry)
            rest = builder.sub(kc, g)
            width = builder.select(builder.icmp_signed("<", rest, group_), rest, group_)
            builder.branch(inner)
            builder.position_at_end(inner)
            t = builder.phi(i64)
            t.add_incoming(izero, outer)
            sums = [builder.phi(vec) for _ in parts]
            for phi in sums:
                phi.add_incoming(zero, outer)
            k_at = builder.add(g, t)
            row = builder.gep(pb, [builder.mul(k_at, ir.Constant(i64, NR))])
            bvs = [builder.load(builder.bitcast(builder.gep(row, [ir.Constant(i64, v * VW)]), vec.as_pointer()),
                                align=8) for v in range(NR // VW)]
            splats = [_splat(builder, builder.load(builder.gep(pa, [builder.add(builder.mul(ir.Constant(i64, i), lda_),
                                                                                 k_at)])), vec) for i in range(MR)]
            new = [builder.call(fma, [splats[i], bvs[v], s]) for (i, v), s in zip(parts, sums)]
            t_next = builder.add(t, ir.Constant(i64, 1))
            t.add_incoming(t_next, inner)
            for phi, value in zip(sums, new):
                phi.add_incoming(value, inner)
            after = builder.append_basic_block("group_round")
            builder.cbranch(builder.icmp_signed("<", t_next, width), inner, after)
            builder.position_at_end(after)
            with builder.if_else(is_scaled) as (then, otherwise):  # one branch per group, for the whole tile
                with then:
                    products = [builder.fpext(builder.fmul(builder.fptrunc(total, fvec), builder.load(
                        builder.bitcast(builder.gep(pscale, [ir.Constant(i64, i * NR + v * VW)]), fvec.as_pointer()),
                        align=4)), vec) for (i, v), total in zip(parts, new)]
                    scaled_block = builder.block
                with otherwise:
                    plain_block = builder.block
            terms = [builder.phi(vec) for _ in parts]  # phis first, at the top of the merge block
            for term, total, product in zip(terms, new, products):
                term.add_incoming(product, scaled_block)
                term.add_incoming(total, plain_block)
            rounded = []
            for term, acc_now in zip(terms, accs):
                running = builder.fadd(acc_now, term)
                rounded.append(_vector_round(builder, running, args[11], args[12], args[13], args[14], bounded))
            g_next = builder.add(g, group_)
            latch = builder.block
            g.add_incoming(g_next, latch)
            for phi, value in zip(accs, rounded):
                phi.add_incoming(value, latch)
            builder.cbranch(builder.icmp_signed("<", g_next, kc), outer, done)
            builder.position_at_end(done)
            for slot, value in zip(slots, rounded):
                builder.store(value, slot, align=8)
            return context.get_dummy_value()
        return sig, codegen

    _groups = _make_groups(False)
    _groups_bounded = _make_groups(True)

    @numba.njit(inline="always")
    def _tile_scale(sa2, sb2, blk, i0, j0, scale):
        """scale[i * NR + j] = fl32(sa[blk, i0 + i] * sb[blk, j0 + j]) for the register tile."""
        for i in range(MR):
            s_a = sa2[blk, i0 + i]
            for j in range(NR):
                scale[i * NR + j] = s_a * sb2[blk, j0 + j]

    @numba.njit(inline="always")
    def _promote(acc, total, scale, scaled, first):
        """total = term, or fl32(total + term) after the first chunk: term = fl32(acc) [* scale]. Four
        loops without a select or a branch inside, so that each vectorizes."""
        if scaled and first:
            for t in range(acc.size):
                total[t] = np.float32(acc[t]) * scale[t]
        elif scaled:
            for t in range(acc.size):
                total[t] = total[t] + np.float32(acc[t]) * scale[t]
        elif first:
            for t in range(acc.size):
                total[t] = np.float32(acc[t])
        else:
            for t in range(acc.size):
                total[t] = total[t] + np.float32(acc[t])

    @numba.njit(nogil=True, cache=True)
    def scale_outer(p, sa, sb):
        """p[l, i, j] = fl32(p[l, i, j] * fl32(sa[l, i] * sb[l, j])), float32 throughout (numerics._outer_scaled)."""
        for lead in range(p.shape[0]):
            for i in range(p.shape[1]):
                a = sa[lead, i]
                for j in range(p.shape[2]):
                    p[lead, i, j] = p[lead, i, j] * (a * sb[lead, j])

    @numba.njit(nogil=True, cache=True)
    def abs_max(bits):
        """max |x| over float32 values given as their bits (uint32), as float(np.max(np.abs(x), initial=0)):
        with the sign bit cleared the bits order like the magnitudes and every NaN is above inf, so an
        integer max (which vectorizes without fastmath) finds it; NaN if there is one."""
        top = np.uint32(0)
        for i in range(bits.size):
            top = np.uint32(max(top, bits[i] & np.uint32(0x7FFFFFFF)))
        word = np.empty(1, np.uint32)
        word[0] = top
        return np.nan if top > np.uint32(0x7F800000) else np.float64(word.view(np.float32)[0])

    @numba.njit(inline="always")
    def _pack_rows(a2, i_lo, i_hi, packed):
        """packed = rows i_lo..i_hi of a2 (M, K) in FP64, rows past M zero."""
        k = a2.shape[1]
        for r in range(i_hi - i_lo):
            if i_lo + r < a2.shape[0]:
                for kk in range(k):
                    packed[r * k + kk] = a2[i_lo + r, kk]
            else:
                packed[r * k:(r + 1) * k] = 0.0

    @numba.njit(nogil=True, cache=True)
    def grouped_tile(a3, bp, out, sa, sb, l_lo, l_hi, i_lo, i_hi, group, chunk, k_block, mode, bounded, drop,
                     min_normal, max_finite):
        """Outputs rows i_lo..i_hi (multiples of MR, in A's padded rows) x all columns of matrices l_lo..l_hi:
        a3 (1 or L, M, K) float32 as operand_a gives it (each matrix's rows i_lo..i_hi are packed to FP64
        here, zero past M), bp (L, panels, K, NR) as pack_b makes it, out (L, M, N) float32;
        sa (1 or L, K-blocks, M_pad), sb (1 or L, K-blocks, N_pad) float32 scales (ones for an
        unscaled side), used by mode 1 (per promotion chunk) and 2 (per product); 0: no scales.
        bounded: every running sum is proved finite and within max_finite (_vector_round).

        Loop order: per panel of NR columns, per K_STEP slice of K, every register tile of the rows in
        turn (each tile's accumulators wait in `acc` / `total` between slices), so that the slice of
        the B panel (K_STEP x NR FP64) stays in L1 while the rows' tiles pass over it."""
        k, m, n = a3.shape[2], out.shape[1], out.shape[2]
        single = mode != 1 and chunk >= k  # one chunk and no per-chunk scale: the outputs are fl32(acc)
        magic = 1.5 * 2.0 ** drop
        size = MR * NR
        tiles = (i_hi - i_lo) // MR
        a = np.empty((i_hi - i_lo) * k)  # the task's rows of A in FP64 (padding rows zero), per matrix
        acc = np.empty((tiles, size))
        total = np.empty((tiles, size), np.float32)
        scale = np.empty(size, np.float32)
        for lead in range(l_lo, l_hi):
            _pack_rows(a3[lead if a3.shape[0] > 1 else 0], i_lo, i_hi, a)
            sa2 = sa[lead if sa.shape[0] > 1 else 0]
            sb2 = sb[lead if sb.shape[0] > 1 else 0]
            step = max(group, K_STEP // group * group)
            for p in range(bp.shape[1]):
                b = bp[lead, p].reshape(-1)
                j0 = p * NR
                for k0 in range(0, k, step):
                    for tile in range(tiles):
                        i0 = i_lo + tile * MR
                        tile_acc, tile_total = acc[tile], total[tile]
                        g = k0
                        end = min(k0 + step, k)
                        while g < end:  # segments of whole groups within one chunk (and, per product, one K-block)
                            start = g // chunk * chunk
                            stop = min(start + chunk, k)
                            seg_end = min(end, stop)
                            if mode == 2:
                                seg_end = min(seg_end, (g // k_block + 1) * k_block)
                                _tile_scale(sa2, sb2, g // k_block, i0, j0, scale)
                            at, count, first = (i0 - i_lo) * k + g, seg_end - g, g == start
                            if bounded:
                                _groups_bounded(a, at, k, b, g * NR, count, group, tile_acc, first, scale, mode == 2,
                                                drop, min_normal, magic, max_finite)
                            else:
                                _groups(a, at, k, b, g * NR, count, group, tile_acc, first, scale, mode == 2, drop,
                                        min_normal, magic, max_finite)
                            g = seg_end
                            if g == stop and not single:  # the chunk is complete: promote
                                if mode == 1:
                                    _tile_scale(sa2, sb2, start // k_block, i0, j0, scale)
                                _promote(tile_acc, tile_total, scale, mode == 1, start == 0)
                for tile in range(tiles):
                    i0 = i_lo + tile * MR
                    for i in range(min(MR, m - i0)):
                        for j in range(min(NR, n - j0)):  # one unscaled chunk: out = fl32(acc), as promoted
                            out[lead, i0 + i, j0 + j] = np.float32(acc[tile, i * NR + j]) if single else \
                                total[tile, i * NR + j]

