"""How each storage format looks in CUDA C: its element type, the header that declares it, and the
expressions that convert it to and from `float`.

Why one table: the CPU emulator and the CUDA kernels must agree bit for bit on every cast, and a
cast written by hand in several kernel templates is where they drift apart. Every kernel template
asks this module for its casts; the table below declares each format once and the functions derive
the rest (saturating variants, clamp bounds, includes) from it and from the `Format` record.

Saturation means what PTX `.satfinite` means: NaN stays NaN, every other value (infinities included)
is clamped to [-max_finite, max_finite] of the target. Without saturation a cast rounds to nearest
even and overflows the way the hardware does (fp16/bf16/e5m2 -> inf, e4m3 -> NaN, int8 wraps).
"""
from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from luminal_num.dtypes.formats import (BF16, F8E4M3, F8E5M2, F16, F32, F64, INT8, INT32, TF32,
                                        FORMATS, Format)


class Saturation(enum.Enum):
    """How a format's float -> storage conversion is made saturating."""

    INTRINSIC = "intrinsic"    # the conversion takes a mode argument ({mode}: __NV_SATFINITE/__NV_NOSAT)
    CLAMP_INPUT = "clamp"      # clamp the input to +-max_finite (NaN kept), then round
    CLAMP_INTEGER = "clamp_int"  # round to int32 first, then clamp to the type's integer range
    INHERENT = "inherent"      # the conversion saturates by definition (cvt.rni.s32.f32; NaN -> 0)


@dataclass(frozen=True)
class CudaFormat:
    """One storage format in CUDA C. Templates use `{x}` for the operand; INTRINSIC ones also `{mode}`."""

    fmt: Format
    c_type: str
    header: str | None  # CUDA header declaring c_type (NVRTC needs it on its include path)
    to_float: str
    from_float: str
    saturation: Saturation
    clamp_c_type: str = "float"  # C type the CLAMP_INPUT clamp is done in


_FP8_FROM_FLOAT = "ln_fp8_from_bits<{c_type}>(__nv_cvt_float_to_fp8({{x}}, {{mode}}, {interpretation}))"


def _fp8(fmt: Format, c_type: str, interpretation: str) -> CudaFormat:
    """fp8 goes through the intrinsic because only it takes the saturation mode explicitly."""
    return CudaFormat(fmt, c_type, "cuda_fp8.h", "static_cast<float>({x})",
                      _FP8_FROM_FLOAT.format(c_type=c_type, interpretation=interpretation),
                      Saturation.INTRINSIC)


_TABLE: tuple[CudaFormat, ...] = (
    CudaFormat(F64, "double", None, "static_cast<float>({x})", "static_cast<double>({x})",
               Saturation.CLAMP_INPUT, clamp_c_type="double"),
    CudaFormat(F32, "float", None, "({x})", "({x})", Saturation.CLAMP_INPUT),
    CudaFormat(F16, "__half", "cuda_fp16.h", "__half2float({x})", "__float2half_rn({x})",
               Saturation.CLAMP_INPUT),
    CudaFormat(BF16, "__nv_bfloat16", "cuda_bf16.h", "__bfloat162float({x})", "__float2bfloat16_rn({x})",
               Saturation.CLAMP_INPUT),
    _fp8(F8E4M3, "__nv_fp8_e4m3", "__NV_E4M3"),
    _fp8(F8E5M2, "__nv_fp8_e5m2", "__NV_E5M2"),
    # int8_t needs <cstdint>, which NVRTC does not ship: `signed char` is the same type on CUDA.
    # Non-saturating int8 keeps the low byte of the rounded int32 (wraps), as a narrowing store does.
    CudaFormat(INT8, "signed char", None, "static_cast<float>({x})",
               "static_cast<signed char>({x})", Saturation.CLAMP_INTEGER),
    CudaFormat(INT32, "int", None, "__int2float_rn({x})", "__float2int_rn({x})", Saturation.INHERENT),
)

CUDA_FORMATS: Mapping[Format, CudaFormat] = MappingProxyType({entry.fmt: entry for entry in _TABLE})
# Formats with no per-element CUDA type here, and why (a KeyError quotes this).
_UNSUPPORTED_REASONS: Mapping[str, str] = MappingProxyType({
    TF32.name: "tf32 is a compute-only rounding (stored as float); use cuda_body.round_expr(TF32, x)",
    "f4e2m1": "f4e2m1 packs two values per byte; kernels address it as packed bytes, not elements",
    "e8m0": "e8m0 block scales are unpacked to float by the quantization kernels",
    "int4": "int4 packs two values per byte (luminal_num.quant.pack); kernels address packed bytes",
    "uint4": "uint4 packs two values per byte (luminal_num.quant.pack); kernels address packed bytes",
})


def cuda_format(fmt: Format | str) -> CudaFormat:
    """The table entry for `fmt` (a Format or its name)."""
    if isinstance(fmt, str):
        fmt = FORMATS.get(fmt, fmt)
    if isinstance(fmt, Format) and fmt in CUDA_FORMATS:
        return CUDA_FORMATS[fmt]
    name = fmt.name if isinstance(fmt, Format) else str(fmt)
    reason = _UNSUPPORTED_REASONS.get(name, "unknown format")
    supported = ", ".join(entry.fmt.name for entry in _TABLE)
    raise KeyError(f"no CUDA element type for {name!r}: {reason} (supported: {supported})")


def cuda_type(fmt: Format | str) -> str:
    """The CUDA C element type a buffer of `fmt` is declared with."""
    return cuda_format(fmt).c_type


def headers_for(formats: Iterable[Format | str]) -> tuple[str, ...]:
    """CUDA headers the given formats need, deduplicated, in table order (so sources are stable)."""
    needed = {cuda_format(fmt).header for fmt in formats}
    return tuple(dict.fromkeys(entry.header for entry in _TABLE if entry.header in needed and entry.header))


def include_directives(formats: Iterable[Format | str]) -> str:
    """`#include` lines for headers_for(formats), one per line (empty for f32-only kernels)."""
    return "".join(f"#include <{header}>\n" for header in headers_for(formats))


def c_float_literal(value: float, c_type: str = "float") -> str:
    """An exact C literal for `value` (hex float, no decimal rounding); inf/NaN through bit patterns."""
    if c_type not in ("float", "double"):
        raise ValueError(f"c_type must be 'float' or 'double', got {c_type!r}")
    if math.isnan(value):
        return "__int_as_float(0x7fffffff)" if c_type == "float" else "__longlong_as_double(0x7fffffffffffffffLL)"
    if math.isinf(value):
        sign = "-" if value < 0 else ""
        bits = "__int_as_float(0x7f800000)" if c_type == "float" else "__longlong_as_double(0x7ff0000000000000LL)"
        return f"({sign}{bits})"
    if c_type == "float" and float(F32.storage.type(value)) != value:
        raise ValueError(f"{value!r} is not exactly representable as a float literal")
    literal = float.hex(value)
    return f"{literal}f" if c_type == "float" else literal


def to_float_expr(fmt: Format | str, expr: str) -> str:
    """C expression converting `expr` (of cuda_type(fmt)) to float."""
    return cuda_format(fmt).to_float.format(x=expr)


def from_float_expr(fmt: Format | str, expr: str, saturate: bool) -> str:
    """C expression rounding the float `expr` to nearest even in `fmt`, saturating or not (module doc)."""
    entry = cuda_format(fmt)
    if entry.saturation is Saturation.INTRINSIC:
        return entry.from_float.format(x=expr, mode="__NV_SATFINITE" if saturate else "__NV_NOSAT")
    if entry.saturation is Saturation.INHERENT:
        return entry.from_float.format(x=expr)
    if entry.saturation is Saturation.CLAMP_INPUT:
        if not saturate:
            return entry.from_float.format(x=expr)
        bound = c_float_literal(entry.fmt.max_finite, entry.clamp_c_type)
        return entry.from_float.format(x=f"ln_sat_finite(static_cast<{entry.clamp_c_type}>({expr}), {bound})")
    rounded = f"__float2int_rn({expr})"  # CLAMP_INTEGER: round to int32, then narrow
    if saturate:
        high = int(entry.fmt.max_finite)  # two's complement: [-(max+1), max]
        rounded = f"ln_clamp_int({rounded}, {-high - 1}, {high})"
    return entry.from_float.format(x=rounded)
