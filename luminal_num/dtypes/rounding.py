"""Bit-exact rounding of arrays to any number format: round to nearest, ties to even, explicit overflow.

Why bit operations instead of ml_dtypes casts: ml_dtypes converts float64 through float32, which
rounds twice (1 + 2^-8 + 2^-40 -> bf16 gives 1.0 instead of 1 + 2^-7), its float8 casts are ~10x
slower than the integer arithmetic below, and its overflow behaviour differs per format (e4m3 -> NaN,
e5m2 -> inf, e2m1 clamps) where a plan needs one explicit policy. ml_dtypes stays the independent
oracle the tests compare against.

Overflow is decided on the ROUNDED magnitude, never on the input: in f16, 65519 rounds to 65504
(finite) while 65520 rounds to 65536 (overflow); in e4m3, 464 is a tie that rounds down to 448 and 465
overflows.
"""
from __future__ import annotations

import enum
from functools import lru_cache

import numpy as np

from .formats import F64, Format, Kind, get
from .jit import loops


class Overflow(enum.Enum):
    """What a value whose rounded magnitude exceeds the format's max_finite becomes.

    SATURATE: what PTX `.satfinite` does (and what the CUDA backend's saturating casts do, so the two
        agree bit for bit): NaN stays NaN, every other value, infinities included, is clamped to
        [-max_finite, max_finite].
    NAN: overflow is marked with NaN; an infinite input stays infinite where the format has infinities.
    INF: IEEE behaviour, i.e. the hardware's non-saturating cast: +-inf where the format has
        infinities, NaN where it has none (e4m3, e2m1, integers).
    """

    SATURATE = "saturate"
    NAN = "nan"
    INF = "inf"


# The IEEE containers a rounding is computed in: float dtype -> (same-width unsigned dtype, stored mantissa bits).
_CONTAINERS = {np.dtype(np.float32): (np.uint32, 23), np.dtype(np.float64): (np.uint64, 52)}


def _as_container(x: np.ndarray) -> np.ndarray:
    """float32 when that holds every input value exactly (narrow floats, small ints), else float64."""
    dt = x.dtype
    if dt in _CONTAINERS:
        return x
    if dt.kind in "iub":
        return x.astype(np.float32 if dt.itemsize <= 2 else np.float64)
    if dt.itemsize <= 2:  # float16 and the ml_dtypes formats (bfloat16, float8, float4) widen exactly
        return x.astype(np.float32)
    return x.astype(np.float64)  # longdouble: the one lossy case (rounds once to float64 first)


def round_significand(x: np.ndarray, p: int, min_normal: float, min_subnormal: float) -> np.ndarray:
    """Round a float32/float64 array to `p` significand bits with RNE, ignoring the upper range.

    Normal range: add half an ulp (minus one, plus the kept last bit: the ties-to-even trick) to the
    integer view and clear the dropped bits; a carry into the exponent field is exactly the rounding
    up to the next binade (or to infinity). Below `min_normal` the quantum is fixed at `min_subnormal`,
    so adding and subtracting 1.5 * 2^mant * quantum (whose ulp is that quantum) rounds there, in the
    container's own RNE arithmetic. Infinities survive; NaN payloads may not (callers restore NaN).
    """
    uint, mant = _CONTAINERS[x.dtype]
    drop = mant + 1 - p
    if drop <= 0:
        out = x.copy()
    else:
        bits = x.view(uint)
        rounded = bits >> uint(drop)
        rounded &= uint(1)
        rounded += uint((1 << (drop - 1)) - 1)
        rounded += bits
        rounded &= uint(~((1 << drop) - 1) & np.iinfo(uint).max)
        out = rounded.view(x.dtype)
    if min_normal > np.finfo(x.dtype).smallest_normal:
        small = np.abs(x) < min_normal
        if small.any():
            magic = x.dtype.type(1.5 * 2.0 ** mant * min_subnormal)
            tiny = x[small]
            out[small] = np.copysign((tiny + magic) - magic, tiny)  # copysign keeps -0 for negative underflow
    return out


def _clamp_bounds(fmt: Format) -> tuple[float, float]:
    """Smallest and largest finite value: two's complement (or unsigned) range for integers, symmetric for floats."""
    if fmt.kind is Kind.INT:
        return (-fmt.max_finite - 1.0 if fmt.signed else 0.0), fmt.max_finite
    return -fmt.max_finite, fmt.max_finite


def _apply_overflow(x: np.ndarray, rounded: np.ndarray, fmt: Format, overflow: Overflow) -> np.ndarray:
    """Enforce the overflow policy on `rounded` (the unbounded-range rounding of x); see Overflow."""
    low, high = _clamp_bounds(fmt)
    if rounded.size == 0 or (rounded.max() <= high and rounded.min() >= low):  # NaN fails both: slow path
        return rounded
    out = rounded.copy() if np.shares_memory(rounded, x) else rounded
    nan_in, inf_in = np.isnan(x), np.isinf(x)
    finite_over = ((rounded > high) | (rounded < low)) & ~inf_in & ~nan_in
    has_inf = fmt.kind is Kind.FLOAT and fmt.has_inf
    if overflow is Overflow.SATURATE:
        out[finite_over | inf_in] = np.where(x[finite_over | inf_in] > 0, high, low)
    else:
        out[finite_over] = np.copysign(np.inf, x[finite_over]) if (overflow is Overflow.INF and has_inf) else np.nan
        out[inf_in] = x[inf_in] if has_inf else np.nan
    out[nan_in] = np.nan
    return out


_JIT_MIN_SIZE = 4096  # smaller arrays keep the numpy steps: numba's call costs more than it saves there


def _round_f32_jit(x: np.ndarray, fmt: Format, overflow: Overflow) -> np.ndarray | None:
    """round_significand then _apply_overflow in one numba pass over float32 x (dtypes.jit_loops: ~1 ns
    per element; numpy's ~8 passes cost 2-3 ns per element, with an operand conversion or quantization
    before most emulated Gemms), or None where the numpy steps run."""
    jit = loops() if x.dtype == np.float32 and fmt.p < 24 and x.size >= _JIT_MIN_SIZE else None
    if jit is None:
        return None
    drop = 24 - fmt.p
    sub = fmt.min_normal > np.finfo(np.float32).smallest_normal
    magic = np.float32(1.5 * 2.0 ** 23 * fmt.min_subnormal)
    low, high = _clamp_bounds(fmt)
    flat = np.ascontiguousarray(x).reshape(-1)
    out = np.empty(flat.shape, np.float32)
    jit.round_f32(flat, out, drop, fmt.min_normal if sub else 0.0, magic, high, low, overflow is Overflow.SATURATE,
                  overflow is Overflow.NAN, fmt.has_inf)
    return out.reshape(x.shape)


def _policy(overflow) -> Overflow:
    """The overflow policy, refused unless it is an Overflow (its string value would be misread)."""
    if not isinstance(overflow, Overflow):
        raise TypeError(f"overflow must be an Overflow member ({', '.join(f'Overflow.{m.name}' for m in Overflow)}), "
                        f"got {overflow!r}")
    return overflow


def round_to(x, fmt: Format | str, overflow: Overflow = Overflow.SATURATE) -> np.ndarray:
    """`x` rounded to nearest (ties to even) in `fmt`, as float32 values exactly representable in fmt.

    Returns float64 for F64 and INT32 (whose values float32 cannot hold). Float inputs wider than
    float32 are rounded once, directly (no double rounding through float32). Integer formats: round
    half to even, then the overflow policy on the two's complement range. E8M0 is a scale format:
    use `luminal_num.quant.scales`, which computes power-of-two scales exactly.
    """
    fmt, overflow = get(fmt), _policy(overflow)
    if fmt.kind is Kind.SCALE:
        raise ValueError(f"{fmt} holds scales, not values: compute them with luminal_num.quant.scales")
    given = _as_container(np.asarray(x))
    values = given.reshape(1) if given.ndim == 0 else given  # numpy turns 0-d arithmetic into scalars
    if fmt.kind is Kind.INT:
        result = _apply_overflow(values, np.rint(values), fmt, overflow)
        out_dtype = np.float32 if fmt.p < 24 else np.float64
    elif fmt.p >= 53:
        result, out_dtype = values, np.float64
    elif (result := _round_f32_jit(values, fmt, overflow)) is not None:
        out_dtype = np.float32
    else:
        rounded = round_significand(values, fmt.p, fmt.min_normal, fmt.min_subnormal)
        result, out_dtype = _apply_overflow(values, rounded, fmt, overflow), np.float32
    return result.astype(out_dtype, copy=False).reshape(given.shape)


@lru_cache(maxsize=None)
def _storage_holds_nan(fmt: Format) -> bool:
    with np.errstate(invalid="ignore"):
        return bool(np.isnan(np.array(np.nan, np.float32).astype(fmt.storage).astype(np.float32)))


def to_storage(x, fmt: Format | str, overflow: Overflow = Overflow.SATURATE) -> np.ndarray:
    """`x` as an array of fmt.storage (ml_dtypes types for bf16/float8/float4; float32 for TF32).

    Rounding is done here (bit-exactly), so the final cast is exact. E8M0 accepts only exact powers
    of two in [2^-127, 2^127]; a NaN that the storage type cannot hold (integers, e2m1) is an error.
    """
    fmt, overflow = get(fmt), _policy(overflow)
    if fmt.kind is Kind.SCALE:
        values = np.asarray(x, dtype=np.float64)
        mantissa, _ = np.frexp(values)
        if not (np.all(mantissa == 0.5) and np.all(values >= fmt.min_normal) and np.all(values <= fmt.max_finite)):
            raise ValueError(f"{fmt} stores powers of two in [{fmt.min_normal!r}, {fmt.max_finite!r}] only")
        return values.astype(fmt.storage)
    rounded = round_to(x, fmt, overflow)
    if not _storage_holds_nan(fmt) and np.isnan(rounded).any():
        raise ValueError(f"{fmt} cannot store NaN (overflow policy {overflow.name} produced one)")
    return rounded.astype(fmt.storage)


def from_storage(stored: np.ndarray, fmt: Format | str) -> np.ndarray:
    """The values of a fmt.storage array as float32 (float64 for F64 and INT32); exact."""
    fmt = get(fmt)
    stored = np.asarray(stored)
    if stored.dtype != fmt.storage:
        raise TypeError(f"expected a {fmt.storage} array for {fmt}, got {stored.dtype}")
    wide = fmt is F64 or (fmt.kind is Kind.INT and fmt.p >= 24)
    return stored.astype(np.float64 if wide else np.float32)


def store(x, fmt: Format) -> np.ndarray:
    """x (any float array) as a kernel stores it in `fmt`, returned as float64 values; integers pass.

    The one store policy every executor shares: 16/32-bit stores are plain IEEE conversions
    (overflow -> inf, which the numerics gate then rejects), 8-bit ones saturate (PTX .satfinite).
    """
    if fmt.kind is not Kind.FLOAT or fmt.name == "f64":
        return x
    x = np.asarray(x, dtype=np.float64)
    if fmt.name == "f32":  # the common case: numpy's own IEEE conversion, no bit manipulation
        return x.astype(np.float32).astype(np.float64)
    policy = Overflow.SATURATE if fmt.bits <= 8 else Overflow.INF
    return np.asarray(round_to(x, fmt, policy), dtype=np.float64)
