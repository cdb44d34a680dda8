"""The numba loops of dtypes.codec (why and the bit-exactness argument: its module doc)."""
from __future__ import annotations

import numba
import numpy as np


@numba.njit(nogil=True, cache=True)
def encode(values, bits, codes, table, mant, bias, inv_sub):
    """codes[i] = the code whose table entry is bits[i] (values[i] as float32 bits); False if some value
    has none or is NaN / inf (what ml_dtypes makes of a NaN's payload is left to it). Normal: the biased exponent and top mantissa bits; below the normal
    range: |v| / min_subnormal, exact for a subnormal of the format (any other value fails the check)."""
    shift = 23 - mant
    bad = False
    for i in range(bits.size):
        u = np.int64(bits[i])
        e = ((u >> 23) & 0xFF) - 127 + bias
        normal = (e << mant) | ((u & 0x7FFFFF) >> shift)
        c = normal if e >= 1 else np.int64(abs(values[i]) * inv_sub)
        c = min(c, 255) | ((u >> 24) & 0x80)
        bad |= (table[c & 0xFF] != bits[i]) | ((u & 0x7F800000) == 0x7F800000)  # NaN / inf: the cast's
        codes[i] = c
    return not bad


@numba.njit(nogil=True, cache=True)
def decode(codes, table):
    """The float32 bits of every code (uint32)."""
    out = np.empty(codes.size, np.uint32)
    for i in range(codes.size):
        out[i] = table[codes[i]]
    return out
