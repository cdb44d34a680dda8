"""Quantization: scales per tensor / channel / block / MX, and quantize / dequantize under an overflow policy;
storage formats of weights (packed 4-bit, GGUF blocks) and the weights file."""
from .quantize import (QuantizedTensor, QuantOverflow, QuantOverflowError, convert, dequantize, quantize,
                       quantize_tensor)
from .scales import (block_amax, compute_scales, expand_scales, resolved_block, scale_shape,
                     scales_from_amax)
from .storage import (STORAGE_FORMATS, Layout, Part, Quantized, Scheme, StorageFormat, StoredTensor, from_gguf,
                      storage_format, to_gguf)

__all__ = ["QuantizedTensor", "QuantOverflow", "QuantOverflowError", "convert", "dequantize", "quantize",
           "quantize_tensor", "block_amax", "compute_scales", "expand_scales", "resolved_block", "scale_shape",
           "scales_from_amax", "STORAGE_FORMATS", "Layout", "Part", "Quantized", "Scheme", "StorageFormat",
           "StoredTensor", "from_gguf", "storage_format", "to_gguf"]
