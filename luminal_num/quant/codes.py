"""A dynamic quantization straight into float8 codes: quantize_tensor + dtypes.codec.encode_into in two
numba passes (dtypes.jit_loops: block amax; divide, round and encode), no float32 values in between.

Why: a QUANTIZE kernel of MiniLM's block-FP8 plans spent ~55 ms per batch in eight numpy passes per
tensor (|x|, block maxima, scales repeated over their blocks, the division, the rounding, the code)
while the Gemm it feeds took ~50. Same bits by construction: the amax is quant.scales.block_amax's
(finite entries only), the scales are scales_from_amax's own (called here on the maxima), and the
per-element steps are quant.quantize's float32 division, dtypes.rounding.round_to's steps under
SATURATE and codec's encoding; tests/test_quant_codes.py compares the codes and scales with that
path over formats, granularities, ragged blocks and magnitudes at the formats' limits. Inputs with a
NaN or inf, or an output that is not a contiguous float8 buffer, take the numpy path (None here).
"""
from __future__ import annotations

import numpy as np

from ..dtypes.codec import code_layout, same_order
from ..dtypes.formats import Format
from ..dtypes.jit import loops
from ..dtypes.variants import Granularity, ScaleSpec
from .scales import resolved_block, scale_shape, scales_from_amax

_MIN_SIZE = 4096  # below this numba's call costs more than numpy's passes


def quantize_into_codes(x: np.ndarray, fmt: Format, spec: ScaleSpec, out: np.ndarray) -> np.ndarray | None:
    """Write the codes of quantize_tensor(x, fmt, spec) (dynamic scales, SATURATE) into `out` (a C-contiguous
    float8 array of x's size and element order) and return the scales; None, out untouched or partly
    written, where the numpy path must run instead."""
    jit = loops()
    layout = code_layout(out.dtype)
    if jit is None or layout is None or x.ndim != 3 or x.size < _MIN_SIZE or not out.flags.c_contiguous \
            or out.size != x.size or not same_order(x.shape, out.shape):
        return None
    x = np.ascontiguousarray(x, dtype=np.float32)
    rows_per, cols_per = resolved_block(spec, x.shape)
    if spec.granularity is Granularity.TENSOR:
        rows_per, cols_per = x.shape[1], x.shape[2]
    grid = (x.shape[0], -(-x.shape[1] // rows_per), -(-x.shape[2] // cols_per))
    amax_bits = np.zeros(grid, np.uint32)
    if not jit.block_amax(x.view(np.uint32), rows_per, cols_per, amax_bits):
        return None  # a NaN or inf: the overflow policy's numpy path
    amax = amax_bits.view(np.float32)
    if spec.granularity is Granularity.TENSOR:
        amax = amax.max(axis=0, keepdims=True)
    scales = scales_from_amax(amax, fmt, spec)
    if scales.shape != scale_shape(spec, x.shape):
        return None
    mant, bias, inv_sub, _ = layout
    jit.quantize_codes(x, scales, rows_per, cols_per, out.reshape(x.shape).view(np.uint8), 24 - fmt.p,
                       _bits(fmt.min_normal), _bits(fmt.max_finite), mant, bias, inv_sub)
    return scales


def _bits(value: float) -> int:
    """The float32 bits of a value float32 holds exactly (a format's min normal and max finite)."""
    return int(np.array(value, np.float32).view(np.uint32))
