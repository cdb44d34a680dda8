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
