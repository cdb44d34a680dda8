"""The F16 accumulator's MMA steps through numpy's own BLAS, called with alpha and beta: each group sum
lands on the running value inside the GEMM call, in a domain scaled by 2^-1009 where FP64's
subnormals clamp F16's quantum by themselves. Two elementwise passes fewer per step than the numpy
path of runtime.numerics (no separate add, no max), same bits (tests/test_f16_accumulation.py).

Why the scaled domain is exact. F16 values are multiples of 2^-24, so every product of two is a
multiple of 2^-48, and so is every partial sum of them in FP64 (exact, or rounded to a coarser
grid). Scaled by 2^-1009 they are multiples of 2^-1057: representable even as FP64 subnormals
(quantum 2^-1074), so x' = x * 2^-1009 is exact, and BLAS's epilogue C = alpha * (A B) + beta * C
with alpha = 2^-1009 gives fl(g + t) * 2^-1009 for the group sum g (accumulated from zero, as with
beta = 0) and the scaled running value t'. The rounding to F16 is then the magic-number addition of
numerics._round_f16_magic with C' = 1.5 * 2^(E + 42) for x's exponent field E: for a normal x' (x in
binade e >= -13) its ulp is 2^(e - 10) * 2^-1009, F16's quantum at x; for a subnormal x' (E = 0,
|x| < 2^-13: F16's subnormals and its first binade, both of quantum 2^-24) it is 2^-1033 =
2^-24 * 2^-1009. So C' is two integer operations on the bits, and the max of the numpy path goes.

numpy's BLAS is found as the bundled OpenBLAS (numpy.libs/libscipy_openblas64_*) and used only if
it reproduces np.matmul's bits on sums that round (_same_as_matmul); otherwise (another numpy build)
DGEMM is None and numerics keeps its numpy path. np.matmul calls GEMM only for matrices of at least
2 x 2 outputs (GEMV or a dot product otherwise, which sum in another order): numerics uses f16_chunk
only for tiles of at least 2 rows and 2 columns, and only while the thread keeps FP64 subnormals
(subnormals_kept: a flush-to-zero mode would silently break the scaled domain).
"""
from __future__ import annotations

import ctypes
from typing import Callable

import numpy as np

from ..blas_threads import bundled_openblas

SCALE = 2.0 ** -1009  # F16's min normal 2^-14 -> 2^-1023, just under FP64's: F16's 2^-24 -> 2^-1033
UNSCALE = 2.0 ** 1009
_EXPONENT_BITS = np.uint64(0x7FF0000000000000)
_MAGIC_OFFSET = np.uint64((42 << 52) | (1 << 51))  # exponent + 42, significand 1.5
_ROW_MAJOR, _NO_TRANS = 101, 111
_SYMBOL = "scipy_cblas_dgemm64_"  # cblas_dgemm in numpy's bundled ILP64 OpenBLAS (what np.matmul calls)


def _load() -> Callable | None:
    lib = bundled_openblas(_SYMBOL)
    if lib is not None:
        fn = getattr(lib, _SYMBOL)
        fn.restype = None
        fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                       ctypes.c_double, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                       ctypes.c_double, ctypes.c_void_p, ctypes.c_int64]
        if _same_as_matmul(fn):
            return fn
    return None


def _same_as_matmul(fn: Callable) -> bool:
    """Whether fn is the GEMM np.matmul runs, as f16_chunk calls it: fn(alpha = 2^-1009, beta = 1,
    C = t') gives (np.matmul(a, b) + t) * 2^-1009 bit for bit on random FP64 sums, which round (so a
    different summation order would show), and with beta = 0 np.matmul's own bits, scaled."""
    rng = np.random.default_rng(0)
    for m, k, n in ((64, 16, 48), (2, 16, 2), (37, 7, 5), (128, 16, 128)):
        a, b, t = rng.standard_normal((m, k)), rng.standard_normal((k, n)), rng.standard_normal((m, n))
        for beta in (0.0, 1.0):
            got = t * SCALE
            fn(_ROW_MAJOR, _NO_TRANS, _NO_TRANS, m, n, k, SCALE, a.ctypes.data, k, b.ctypes.data, n, beta,
               got.ctypes.data, n)
            want = (np.matmul(a, b) + t * beta) * SCALE
            if not np.array_equal(got.view(np.uint64), want.view(np.uint64)):
                return False
    return True


DGEMM = _load()


def subnormals_kept() -> bool:
    """Whether this thread's arithmetic keeps FP64 subnormals (no flush-to-zero / denormals-are-zero
    mode, which a library built with fast-math may switch on): the scaled domain needs them."""
    x = np.array([2.0 ** -1060, 2.0 ** -1073])
    return bool(((x * 4.0) / 4.0 == x).all() and x[0] + x[1] > x[0])


def round_scaled_f16(x: np.ndarray, tmp: np.ndarray) -> None:
    """x' <- RN_f16(x) * 2^-1009 in place for x' = x * 2^-1009, |x| <= 65504 (module doc); a result
    that rounds to zero is +0 (the caller restores the sign where it matters)."""
    bits = tmp.view(np.uint64)
    np.bitwise_and(x.view(np.uint64), _EXPONENT_BITS, out=bits)
    bits += _MAGIC_OFFSET
    x += tmp
    x -= tmp


def f16_chunk(a: np.ndarray, b: np.ndarray, row: int, col: int, start: int, stop: int, group: int,
              acc: np.ndarray, tmp: np.ndarray, sign: np.ndarray) -> None:
    """acc (parts, R, c) <- the F16 accumulation of K[start:stop], scaled by 2^-1009, for the outputs
    rows row..row+R, columns col + p*c .. (p < parts) of a (M, K) @ b (K, N) (float64, C-contiguous):
    acc = RN_f16(acc + group sum) per group of `group` along K, the first group alone. A chunk's
    last step keeps the sign of a zero (copysign from the unrounded sum, in `sign`); earlier steps
    need not (numerics._round_f16_magic_inplace). tmp and sign: scratch shaped like acc."""
    parts, rows, cols = acc.shape
    k, n = a.shape[1], b.shape[1]
    a0, b0, c0 = a.ctypes.data + 8 * row * k, b.ctypes.data + 8 * col, acc.ctypes.data
    for g in range(start, stop, group):
        width, beta = min(group, stop - g), 0.0 if g == start else 1.0
        for p in range(parts):
            DGEMM(_ROW_MAJOR, _NO_TRANS, _NO_TRANS, rows, cols, width, SCALE, a0 + 8 * g, k,
                  b0 + 8 * (g * n + p * cols), n, beta, c0 + 8 * p * rows * cols, cols)
        last = g + group >= stop
        if last:
            np.copyto(sign, acc)
        round_scaled_f16(acc, tmp)
        if last:
            np.copysign(acc, sign, out=acc)
