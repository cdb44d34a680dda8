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
