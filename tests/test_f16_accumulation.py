"""The F16-accumulator fast path (f16acc16: one FP16 rounding per MMA k-step) against an independent slow
loop, at the edges the fast path's proofs rest on: partial sums near FP16's max and min normal, zeros
and tiny negatives that round to -0 (the in-place rounding drops a zero's sign on all but a chunk's
last step), running sums that overflow FP16 (inf, the hardware contract), and mat-vec shapes.

The reference is written separately: the exact FP64 group sums (the operands are built so that every
group sum is exact in FP64, hence independent of the summation order) added to the running value in
FP64 and rounded by numpy's float64 -> float16 cast (one RNE rounding, subnormals and overflow to inf).
"""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

from luminal_num.dtypes import F16, GEMM_VARIANTS
from luminal_num.runtime import blas_f16, jit_gemm, numerics, tile_threads
from luminal_num.runtime.numerics import emulate_gemm

VARIANT = GEMM_VARIANTS["f16acc16"]
GROUP = VARIANT.mma_k  # 16
# the numba kernel (runtime.jit_gemm), numpy's BLAS called with alpha/beta in the scaled domain, numpy alone
PATHS = ["jit", "blas_f16", "numpy"]


@pytest.fixture(autouse=True, params=PATHS)
def path(request, monkeypatch):
    """Every test runs on each F16 step implementation (jit where numba is installed, blas_f16 where
    numpy's BLAS was found)."""
    if request.param == "jit":
        if jit_gemm.kernel() is None:
            pytest.skip("the kernel is off (numba missing or LUMINAL_NUM_JIT=0): the numpy paths run here")
        return request.param
    monkeypatch.setattr(jit_gemm, "ENABLED", False)
    if request.param == "numpy":
        monkeypatch.setattr(blas_f16, "DGEMM", None)
    elif blas_f16.DGEMM is None:
        pytest.skip("numpy's bundled OpenBLAS was not found: only the numpy path runs here")
    return request.param


def slow_f16_accumulation(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """acc = RN_f16(acc + group sum) group by group, for F16-valued float32 a (..., M, K) @ b (..., K, N)."""
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    acc = None
    for g in range(0, a.shape[-1], GROUP):
        part = np.matmul(a64[..., g:g + GROUP], b64[..., g:g + GROUP, :])
        with np.errstate(over="ignore", invalid="ignore"):
            acc = (part if acc is None else acc + part).astype(np.float16).astype(np.float64)
    return acc.astype(np.float32)


def f16_values(rng, shape, exponents: tuple[int, int], zero_fraction: float = 0.0) -> np.ndarray:
    """Random signed F16 values with binades in [lo, hi): 11-bit significands, some exact zeros."""
    lo, hi = exponents
    x = rng.uniform(1, 2, shape) * 2.0 ** rng.integers(lo, hi, shape) * rng.choice([-1.0, 1.0], shape)
    x[rng.random(shape) < zero_fraction] = 0.0
    return x.astype(np.float16).astype(np.float32)


def same_bits(x: np.ndarray, y: np.ndarray) -> bool:
    return x.dtype == y.dtype == np.float32 and np.array_equal(x.view(np.uint32), y.view(np.uint32))


def fast_path_taken(a: np.ndarray, b: np.ndarray) -> bool:
    ops = numerics._Operand(a, None, None), numerics._Operand(b, None, None)
    k = a.shape[-1]
    return numerics._f16_in_range(*ops, k, -(-k // GROUP))


@pytest.mark.parametrize("shape", [((37, 200), (200, 29)),  # ragged K, ragged tiles
                                   ((1, 96), (96, 50)), ((40, 96), (96, 1)), ((1, 48), (48, 1)),  # mat-vec
                                   ((3, 1, 80), (3, 80, 7)), ((2, 9, 64), (64, 1))])  # batched, broadcast B
def test_near_the_max_normal(shape):
    """Partial sums up to just under 65504 (the fast path's range proof holds, barely); a few negative
    products so that the sums also shrink across binades."""
    rng = np.random.default_rng(1)
    a, b = np.abs(f16_values(rng, shape[0], (4, 8))), f16_values(rng, shape[1], (0, 2))
    positive = rng.random(b.shape) < 0.85  # mostly positive products: the sums grow
    b[positive] = np.abs(b[positive])
    k = shape[0][-1]
    bound = float(np.abs(a).sum(axis=-1).max() * np.abs(b).max())
    a = (a * np.float32(0.9 * 65504 / bound)).astype(np.float16).astype(np.float32)  # l1 bound ~ 0.9 * 65504
    assert fast_path_taken(a, b), k
    got = emulate_gemm(a, b, VARIANT)
    assert np.abs(got).max() > 2.0 ** 10  # large partial sums: coarse FP16 quanta
    assert same_bits(got, slow_f16_accumulation(a, b))


def test_operands_in_any_memory_layout():
    """Transposed views (a Linear weight read as W^T) give the bits of C-ordered copies."""
    rng = np.random.default_rng(5)
    a, b = f16_values(rng, (50, 96), (-3, 2)), f16_values(rng, (96, 70), (-5, 0))
    want = emulate_gemm(a, b, VARIANT)
    assert same_bits(want, slow_f16_accumulation(a, b))
    assert same_bits(emulate_gemm(np.asfortranarray(a), np.asfortranarray(b), VARIANT), want)
    assert same_bits(emulate_gemm(np.ascontiguousarray(a.T).T, np.ascontiguousarray(b.T).T, VARIANT), want)


@pytest.mark.parametrize("shape", [((33, 160), (160, 41)), ((1, 160), (160, 400)), ((400, 160), (160, 1)),
                                   ((60, 1, 64), (60, 64, 7))])
def test_near_the_min_normal_with_zeros_and_negative_zeros(shape):
    """Products around 2^-14 (FP16's min normal) and below, half of them exact zeros: partial sums in
    FP16's subnormal range, tiny products that round to +-0 mid-way (signed zeros at the last step:
    the next test)."""
    rng = np.random.default_rng(2)
    a, b = f16_values(rng, shape[0], (-12, -6), 0.75), f16_values(rng, shape[1], (-14, -8), 0.75)
    assert fast_path_taken(a, b)
    got = emulate_gemm(a, b, VARIANT)
    want = slow_f16_accumulation(a, b)
    assert same_bits(got, want)
    nonzero = np.abs(want[want != 0])
    assert (nonzero < 2.0 ** -14).any() and (nonzero >= 2.0 ** -14).any()  # both sides of the min normal


def test_the_sign_of_a_zero_at_the_last_step_and_mid_way():
    """Row 0: one tiny negative product per group, each rounding to -0 (mid-way: dropped, then
    -0 + tiny -> -0 again at the end); row 1: -0 mid-way then a group of zeros (+0 + +0 = +0);
    row 2: a value that cancels to an exact +0 at the last step; row 3: x - x then a tiny negative."""
    k = 3 * GROUP
    a = np.zeros((4, k), np.float32)
    b = np.full((k, 2), -2.0 ** -14, np.float32)  # two equal columns: a GEMM-shaped tile
    a[0, ::GROUP] = 2.0 ** -12  # -2^-26 per group: below half the smallest subnormal
    a[1, 0] = 2.0 ** -12  # -0 after the first group, then only zero products
    a[2, 0], a[2, 2 * GROUP] = 1.0, -1.0  # -2^-14, held, then +2^-14: exact zero
    a[3, 0], a[3, GROUP], a[3, 2 * GROUP] = 1.0, -1.0, 2.0 ** -12
    got = emulate_gemm(a, b, VARIANT)[:, 0]
    want = slow_f16_accumulation(a, b)[:, 0]
    assert same_bits(got, want)
    assert np.signbit(want).tolist() == [True, False, False, True] and (want == 0).all()


@pytest.mark.parametrize("shape", [((5, 64), (64, 6)), ((1, 64), (64, 6)), ((5, 64), (64, 1))])
def test_running_sums_that_overflow_are_inf(shape):
    """Past 65504 the running sum is inf and stays inf (or NaN where +inf meets -inf); no fast path."""
    rng = np.random.default_rng(3)
    a, b = np.abs(f16_values(rng, shape[0], (7, 9))), f16_values(rng, shape[1], (7, 9))
    b[: GROUP] = np.abs(b[: GROUP])  # the first group alone overflows for some outputs
    assert not fast_path_taken(a, b)
    got = emulate_gemm(a, b, VARIANT)
    want = slow_f16_accumulation(a, b)
    assert np.isinf(want).any()
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("shape", [((128, 16), (16, 128)), ((1, 16), (16, 128)), ((64, 16), (16, 1)),
                                   ((1, 16), (16, 1)), ((3, 1, 7, 16), (3, 16, 5)), ((5, 3), (3, 4))])
def test_a_float64_matmul_of_zero_products_is_plus_zero(shape):
    """What _round_f16_magic_inplace's proof needs: a group sum of zero products (every one -0 here) is
    +0, for the matmul shapes the emulator makes (GEMM, GEMV either way, dot, batched, broadcast)."""
    a = np.full(shape[0], -0.0)
    b = np.ones(shape[1])
    for x, y in ((a, b), (np.zeros(shape[0]), -b)):
        sums = np.matmul(x, y)
        assert (sums == 0).all() and not np.signbit(sums).any()
        out = np.empty_like(sums)
        np.matmul(x, y, out=out)
        assert not np.signbit(out).any()


@pytest.mark.parametrize("name", ["f16acc16", "f8e4m3_block", "f8e5m2_block", "f8e4m3_block_nopromote"])
def test_tiles_on_threads_give_the_same_bits(name, monkeypatch, path):
    """A large grouped Gemm spreads its output tiles over threads: the bits are those of one thread, and
    an error in a tile reaches the caller."""
    variant = GEMM_VARIANTS[name]
    rng = np.random.default_rng(4)
    a = (rng.standard_normal((2, 70, 300)) * 2.0 ** rng.integers(-6, 3, (2, 70, 300))).astype(np.float32)
    b = rng.standard_normal((300, 90)).astype(np.float32)
    monkeypatch.setattr(numerics, "_TILE_ELEMENTS", 600)  # many small tiles
    monkeypatch.setattr(jit_gemm, "ROW_BLOCK", 2 * jit_gemm.MR)
    monkeypatch.setattr(tile_threads, "TILE_THREADS", 1)
    alone = emulate_gemm(a, b, variant)
    monkeypatch.setattr(tile_threads, "TILE_THREADS", 3)
    monkeypatch.setattr(tile_threads, "PARALLEL_MNK", 0)
    assert same_bits(emulate_gemm(a, b, variant), alone)

    def broken(*args):
        raise FloatingPointError("a tile failed")
    monkeypatch.setattr(*(jit_gemm, "grouped_tile") if path == "jit" else (numerics, "_blocks"), broken)  # every tile
    with pytest.raises(FloatingPointError, match="a tile failed"):
        emulate_gemm(a, b, variant)


def test_the_blas_self_check_rejects_another_summation_order(path):
    """blas_f16 uses numpy's BLAS only if it reproduces np.matmul's bits: a GEMM summing K backwards
    (the same values, other roundings) is refused."""
    def backwards(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc):
        view = lambda ptr, rows, cols, ld: np.lib.stride_tricks.as_strided(
            np.ctypeslib.as_array((ctypes.c_double * (rows * ld)).from_address(ptr)), (rows, cols), (8 * ld, 8))
        x, y, out = view(a, m, k, lda), view(b, k, n, ldb), view(c, m, n, ldc)
        out[...] = alpha * (x[:, ::-1] @ y[::-1, :]) + beta * out
    assert not blas_f16._same_as_matmul(backwards)
    if blas_f16.DGEMM is not None:
        assert blas_f16._same_as_matmul(blas_f16.DGEMM)


def test_this_process_keeps_subnormals(path):
    """The scaled domain relies on FP64 subnormals (blas_f16 checks per tile and falls back if not)."""
    assert blas_f16.subnormals_kept()
