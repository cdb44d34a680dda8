"""Registry of numeric formats: one frozen record per format, every constant derived from (bits, p, emax).

Why derive: a hand-typed table of max/min values is where mislabelled formats come from; deriving
them from the encoding parameters and checking against ml_dtypes' finfo in tests catches that.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

import ml_dtypes
import numpy as np


class Kind(enum.Enum):
    FLOAT = "float"
    INT = "int"
    SCALE = "scale"  # exponent-only formats (E8M0) used for MX block scales


@dataclass(frozen=True)
class Format:
    """A number format. `p` is the significand precision including the implicit bit."""

    name: str
    kind: Kind
    bits: int
    p: int  # significand bits incl. implicit bit (floats); value bits excl. sign (ints)
    max_finite: float
    min_normal: float
    min_subnormal: float
    has_inf: bool
    storage: np.dtype  # numpy dtype a buffer of this format is stored in
    compute_only: bool = False  # TF32: a tensor-core input rounding, never a storage format
    signed: bool = True  # integers: two's complement (int4/int8/int32) or unsigned codes (uint4)

    @property
    def unit_roundoff(self) -> float:
        """u = 2^-p for round-to-nearest floats; half a step (0.5) for integers (scaled by the quant scale)."""
        if self.kind is Kind.INT:
            return 0.5
        return 2.0 ** -self.p

    @property
    def is_float(self) -> bool:
        return self.kind is Kind.FLOAT

    @property
    def itemsize(self) -> float:
        """Bytes per element as stored on a GPU (F4 packs two per byte)."""
        return self.bits / 8

    def __repr__(self) -> str:  # short, for graph printers and plan tables
        return self.name

    def __str__(self) -> str:
        return self.name


def _ieee(name: str, bits: int, mant: int, exp: int, storage, *, has_inf: bool = True,
          max_finite: float | None = None, compute_only: bool = False) -> Format:
    """An IEEE-like binary format with `mant` stored mantissa bits and `exp` exponent bits."""
    bias = 2 ** (exp - 1) - 1
    emin = 1 - bias
    emax = 2 ** exp - 2 - bias
    if max_finite is None:
        max_finite = (2.0 - 2.0 ** -mant) * 2.0 ** emax
    return Format(name=name, kind=Kind.FLOAT, bits=bits, p=mant + 1, max_finite=float(max_finite),
                  min_normal=2.0 ** emin, min_subnormal=2.0 ** (emin - mant), has_inf=has_inf,
                  storage=np.dtype(storage), compute_only=compute_only)


F64 = _ieee("f64", 64, 52, 11, np.float64)
F32 = _ieee("f32", 32, 23, 8, np.float32)
TF32 = _ieee("tf32", 19, 10, 8, np.float32, compute_only=True)  # FP32 range, 10 stored mantissa bits
F16 = _ieee("f16", 16, 10, 5, np.float16)
BF16 = _ieee("bf16", 16, 7, 8, ml_dtypes.bfloat16)
# E4M3 "fn": no infinities, the all-ones exponent holds normal numbers up to 448 (only S.1111.111 is NaN).
F8E4M3 = _ieee("f8e4m3", 8, 3, 4, ml_dtypes.float8_e4m3fn, has_inf=False, max_finite=448.0)
F8E4M3 = Format(**{**F8E4M3.__dict__, "min_normal": 2.0 ** -6, "min_subnormal": 2.0 ** -9})
F8E5M2 = _ieee("f8e5m2", 8, 2, 5, ml_dtypes.float8_e5m2)
# E2M1: no inf/NaN, all exponents are finite: max = 1.5 * 2^2 = 6.
F4E2M1 = Format(name="f4e2m1", kind=Kind.FLOAT, bits=4, p=2, max_finite=6.0, min_normal=1.0,
                min_subnormal=0.5, has_inf=False, storage=np.dtype(ml_dtypes.float4_e2m1fn))
INT8 = Format(name="int8", kind=Kind.INT, bits=8, p=7, max_finite=127.0, min_normal=1.0,
              min_subnormal=1.0, has_inf=False, storage=np.dtype(np.int8))
# 4-bit integers: the codes of group-wise weight formats (GPTQ/AWQ, llama.cpp Q4), two per byte.
INT4 = Format(name="int4", kind=Kind.INT, bits=4, p=3, max_finite=7.0, min_normal=1.0, min_subnormal=1.0,
              has_inf=False, storage=np.dtype(ml_dtypes.int4))
UINT4 = Format(name="uint4", kind=Kind.INT, bits=4, p=4, max_finite=15.0, min_normal=1.0, min_subnormal=1.0,
               has_inf=False, storage=np.dtype(ml_dtypes.uint4), signed=False)
INT32 = Format(name="int32", kind=Kind.INT, bits=32, p=31, max_finite=float(2 ** 31 - 1), min_normal=1.0,
               min_subnormal=1.0, has_inf=False, storage=np.dtype(np.int32))
# Raw bytes: the container of llama.cpp blocks kept as the file holds them (quant/gguf_blocks.py); no arithmetic.
UINT8 = Format(name="uint8", kind=Kind.INT, bits=8, p=8, max_finite=255.0, min_normal=1.0, min_subnormal=1.0,
               has_inf=False, storage=np.dtype(np.uint8), signed=False)
# E8M0: unsigned powers of two 2^-127 .. 2^127 (MX block scales); 0xFF is NaN.
E8M0 = Format(name="e8m0", kind=Kind.SCALE, bits=8, p=1, max_finite=2.0 ** 127, min_normal=2.0 ** -127,
              min_subnormal=2.0 ** -127, has_inf=False, storage=np.dtype(ml_dtypes.float8_e8m0fnu))

FORMATS: dict[str, Format] = {f.name: f for f in (F64, F32, TF32, F16, BF16, F8E4M3, F8E5M2, F4E2M1, INT4, UINT4, INT8, INT32,
                                                E8M0)}
FLOAT_FORMATS = tuple(f for f in FORMATS.values() if f.is_float)


def get(name: str | Format) -> Format:
    """Look a format up by name; raises a KeyError listing the known names."""
    if isinstance(name, Format):
        return name
    try:
        return FORMATS[name]
    except KeyError:
        raise KeyError(f"unknown format {name!r}; known: {', '.join(FORMATS)}") from None
