"""Quantization: scales per tensor / channel / block / MX, and quantize / dequantize under an overflow policy."""
from .quantize import (QuantizedTensor, QuantOverflow, QuantOverflowError, convert, dequantize, quantize,
                       quantize_tensor)
from .scales import (block_amax, compute_scales, expand_scales, resolved_block, scale_shape,
                     scales_from_amax)

__all__ = ["QuantizedTensor", "QuantOverflow", "QuantOverflowError", "convert", "dequantize", "quantize",
           "quantize_tensor", "block_amax", "compute_scales", "expand_scales", "resolved_block", "scale_shape",
           "scales_from_amax"]
