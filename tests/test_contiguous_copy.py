"""hlir.gemm.contiguous: the tile-by-tile copy a Gemm's operand is made with equals numpy's element-by-element
copy bit for bit (any dtype, permutation, slice, NaN payloads and signed zeros included)."""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from luminal_num.hlir.gemm import contiguous


@settings(max_examples=40, deadline=None)
@given(shape=st.lists(st.integers(1, 70), min_size=2, max_size=4), seed=st.integers(0, 2**32 - 1),
       dtype=st.sampled_from(["float32", "float64", "float16", "int8", "uint16"]), tile=st.integers(1, 9),
       step=st.integers(1, 2))
def test_a_blocked_copy_is_numpys_copy_bit_for_bit(shape, seed, dtype, tile, step):
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=int(np.prod(shape)) * np.dtype(dtype).itemsize, dtype=np.uint8)
    x = raw.view(dtype).reshape(shape)  # every bit pattern: NaN payloads, -0.0, subnormals
    view = np.transpose(x, rng.permutation(len(shape)))[..., ::step]
    got = contiguous(view, tile)  # small tiles: partial tiles at every edge
    assert got.flags.c_contiguous and got.dtype == view.dtype and got.shape == view.shape
    assert got.tobytes() == np.ascontiguousarray(view).tobytes()


def test_a_contiguous_array_is_returned_as_is_and_a_weight_operand_is_a_copy():
    x = np.arange(12.0, dtype=np.float32).reshape(3, 4)
    assert contiguous(x) is x
    w = np.random.default_rng(1).standard_normal((1100, 600)).astype(np.float32)
    b = contiguous(w.T)
    assert not np.shares_memory(b, w) and np.array_equal(b, w.T)
