"""The numba loops of dtypes (loaded by dtypes.jit): float8 codes (dtypes.codec says why and why the same
bits) and the rounding of float32 arrays (dtypes.rounding.round_to)."""
from __future__ import annotations

import numba
import numpy as np


@numba.njit(nogil=True, cache=True)
def encode(values, bits, codes, mant, bias, inv_sub, max_code):
    """codes[i] = values[i]'s code (bits: the float32 bits of values); False if some value has none.
    Normal: the biased exponent and the top `mant` mantissa bits, the dropped bits zero and the code
    at most max_code (the largest finite: NaN and inf fail here). Below the normal range: |v| /
    min_subnormal, an integer exactly for the format's subnormals and zeros. No branch and no table
    lookup, so LLVM vectorizes the loop (~0.5 ns per element instead of 3.5 with a table check)."""
    shift = 23 - mant
    low = (1 << shift) - 1
    bad = 0
    for i in range(bits.size):
        u = np.int64(bits[i])
        e = ((u >> 23) & 0xFF) - 127 + bias
        normal = (e << mant) | ((u & 0x7FFFFF) >> shift)
        normal_ok = (e >= 1) & ((u & low) == 0) & (normal <= max_code)
        f = min(abs(np.float64(values[i])), 1.0) * inv_sub
        sub = np.int64(f)
        sub_ok = (e < 1) & (np.float64(sub) == f)
        bad |= ~(normal_ok | sub_ok) & 1
        c = sub + (normal - sub) * normal_ok
        codes[i] = np.uint8((c & 0x7F) | ((u >> 24) & 0x80))
    return bad == 0


@numba.njit(nogil=True, cache=True)
def decode(codes, table):
    """The float32 bits of every code (uint32)."""
    out = np.empty(codes.size, np.uint32)
    for i in range(codes.size):
        out[i] = table[codes[i]]
    return out


@numba.njit(nogil=True, cache=True)
def round_f32(x, out, drop, min_normal, magic, high, low, saturate, overflow_nan, has_inf):
    """out = rounding.round_to(x, fmt, policy) for float32 x (1-D), element by element: the same steps
    as round_significand then _apply_overflow. Normal range: the half-ulp bit trick on the uint32 bits
    (wrapping mod 2^32 as numpy's uint32 does); below min_normal (0 where the format's subnormals are
    float32's): fl32(fl32(x + magic) - magic) with x's sign. Then NaN -> the float32 NaN numpy assigns;
    an infinite x or a rounded value past [low, high] -> the policy (saturate: clamp by x's sign;
    else inf of x's sign, where the format has infinities and the policy is not overflow_nan, else NaN)."""
    bits, out_bits = x.view(np.uint32), out.view(np.uint32)  # out_bits: the same memory as out
    half = (1 << (drop - 1)) - 1
    keep = ~((1 << drop) - 1) & 0xFFFFFFFF
    nan = np.float32(np.nan)
    for i in range(x.size):
        b = np.int64(bits[i])
        out_bits[i] = np.uint32(((b + ((b >> drop) & 1) + half) & keep) & 0xFFFFFFFF)
        v = x[i]
        r = out[i]
        if abs(v) < min_normal:
            r = np.float32(np.copysign(np.float32(np.float32(v + magic) - magic), v))
        if np.isnan(v):
            r = nan
        elif np.isinf(v):
            r = (np.float32(high) if v > 0 else np.float32(low)) if saturate else v if has_inf else nan
        elif r > high or r < low:
            if saturate:
                r = np.float32(high) if v > 0 else np.float32(low)
            else:
                r = np.float32(np.copysign(np.inf, v)) if has_inf and not overflow_nan else nan
        out[i] = r




@numba.njit(nogil=True, cache=True)
def block_amax(bits, rows_per, cols_per, out):
    """out[l, r, c] = max |x| over block (r, c) of matrix l (out zeroed; float32 viewed as uint32; bits:
    x's float32 bits, (L, M, K)): with the sign bit cleared the bits order like the magnitudes. Returns
    whether every entry is finite (below inf's bits); only then is out quant.scales.block_amax's (which
    leaves non-finite entries out), and only then do callers use it. The inner loop runs over a 1-D
    slice with a select for the max (numba's max() and 3-D indexing kept it scalar: 10x slower)."""
    worst = np.uint32(0)
    for lead in range(bits.shape[0]):
        for i in range(bits.shape[1]):
            row = bits[lead, i]
            dest = out[lead, i // rows_per]
            for c in range(dest.size):
                block = row[c * cols_per:(c + 1) * cols_per]
                top = np.uint32(0)
                for j in range(block.size):
                    v = block[j] & np.uint32(0x7FFFFFFF)
                    top = v if v > top else top
                dest[c] = top if top > dest[c] else dest[c]
                worst = top if top > worst else worst
    return worst < np.uint32(0x7F800000)


@numba.njit(nogil=True, cache=True)
def quantize_codes(x, scales, rows_per, cols_per, codes, drop, min_normal_bits, max_bits, mant, bias, inv_sub):
    """codes (L, M, K) uint8 = the float8 codes of round_to(fl32(x / s), fmt, SATURATE) for finite
    float32 x (L, M, K), s = scales[l or 0, i // rows_per, j // cols_per] (float32, positive, finite).
    Per block: the float32 quotients (quant.quantize's division), then each code from the quotient's
    bits u (a = |u|): at or above the format's min normal, round_f32's half-ulp trick on a, clamped to
    max_finite's bits (SATURATE; the quotient is finite), as exponent and top mantissa bits (codec's
    encoding); below it, |q| / min_subnormal rounded to nearest even, which is the subnormal's code
    (and min normal's, 2^mant, where it rounds up) as round_f32's magic-number step gives its value;
    then the sign bit (-0 included). Both loops are branch-free over 1-D slices, so they vectorize."""
    half = (1 << (drop - 1)) - 1
    keep = ~((1 << drop) - 1) & 0xFFFFFFFF
    shift = 23 - mant
    q = np.empty(cols_per, np.float32)
    q_bits = q.view(np.uint32)
    for lead in range(x.shape[0]):
        s_lead = scales[lead if scales.shape[0] > 1 else 0]
        for i in range(x.shape[1]):
            row, dest, s_row = x[lead, i], codes[lead, i], s_lead[i // rows_per]
            for c in range(s_row.size):
                block, out = row[c * cols_per:(c + 1) * cols_per], dest[c * cols_per:(c + 1) * cols_per]
                s = s_row[c]
                for t in range(block.size):
                    q[t] = block[t] / s
                for t in range(block.size):
                    u = np.int64(q_bits[t])
                    a = u & 0x7FFFFFFF
                    r = (a + ((a >> drop) & 1) + half) & keep
                    r = max_bits if r > max_bits else r
                    normal = (((r >> 23) - 127 + bias) << mant) | ((r & 0x7FFFFF) >> shift)
                    sub = np.int64(np.rint(abs(np.float64(q[t])) * inv_sub))
                    code = sub if a < min_normal_bits else normal
                    out[t] = np.uint8(code | ((u >> 24) & 0x80))
