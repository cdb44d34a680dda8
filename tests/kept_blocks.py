"""Test data for the formats that only keep a GGUF file's blocks (quant/gguf_blocks.py): they refuse to
quantize, so a sample of one is random valid blocks of its GGML type, K rounded up to whole blocks."""
import numpy as np

from luminal_num.quant import from_gguf
from luminal_num.quant.gguf_blocks import block_type, random_blocks


def kept_k(fmt, k: int) -> int:
    return -(-k // fmt.block) * fmt.block


def kept_sample(fmt, rows: int, k: int, seed: int = 0):
    """A Quantized of `fmt` (rows, K rounded up to its block) from random blocks."""
    t = block_type(fmt.name)
    return from_gguf(random_blocks(t, rows, kept_k(fmt, k), np.random.default_rng(seed)), t.ggml)
