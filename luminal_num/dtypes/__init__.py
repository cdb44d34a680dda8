"""Number formats, bit-exact rounding to them, and the catalogue of precision variants."""
from .formats import (BF16, E8M0, F4E2M1, F8E4M3, F8E5M2, F16, F32, F64, FLOAT_FORMATS, FORMATS, INT4, INT8, INT32,
                      TF32, UINT4, Format, Kind, get)
from .rounding import Overflow, from_storage, round_significand, round_to, to_storage
from .variants import (ELEMENTWISE_VARIANTS, GEMM_VARIANTS, MX_BLOCK, REDUCE_VARIANTS, WHOLE,
                       ElementwisePrecision, GemmPrecision, Granularity, ReducePrecision, ScaleSpec,
                       limited_accumulator)

__all__ = ["BF16", "E8M0", "F4E2M1", "F8E4M3", "F8E5M2", "F16", "F32", "F64", "FLOAT_FORMATS", "FORMATS", "INT4", "INT8",
           "INT32", "TF32", "UINT4", "Format", "Kind", "get", "Overflow", "from_storage", "round_significand", "round_to",
           "to_storage", "ELEMENTWISE_VARIANTS", "GEMM_VARIANTS", "MX_BLOCK", "REDUCE_VARIANTS", "WHOLE",
           "ElementwisePrecision", "GemmPrecision", "Granularity", "ReducePrecision", "ScaleSpec",
           "limited_accumulator"]
