"""ShapeTracker.realize's stride-trick paths (single views and stacked ones, masks included) against
the index-array gather of index_map, on random chains of movement ops."""
from __future__ import annotations

import numpy as np
import pytest

from luminal_num.hlir.shape import ShapeTracker


def _gather(st: ShapeTracker, buffer: np.ndarray) -> np.ndarray:
    """The reference read: flat positions and validity from index_map, masked elements +0."""
    pos, valid = st.index_map({})
    flat = buffer.reshape(-1)
    return np.where(valid, flat[np.where(valid, pos, 0)], 0.0)


def _random_chain(rng, shape):
    st = ShapeTracker.contiguous(shape)
    for _ in range(int(rng.integers(1, 6))):
        cur = [int(d) for d in st.shape]
        move = rng.integers(5)
        if move == 0:
            st = st.permute(rng.permutation(len(cur)))
        elif move == 1:
            n = int(np.prod(cur))
            split = [d for d in (2, 3, 4, 5, 6) if n % d == 0]
            st = st.reshape((n // split[0], split[0]) if split else (n,))
        elif move == 2:
            st = st.slice([(int(rng.integers(0, d)), d) if d > 1 else (0, d) for d in cur])
        elif move == 3:
            st = st.pad([(int(rng.integers(0, 2)), int(rng.integers(0, 2))) for _ in cur])
        else:
            st = st.expand_dim(int(rng.integers(0, len(cur) + 1)), int(rng.integers(1, 4)))
    return st


@pytest.mark.parametrize("seed", range(60))
def test_strided_reads_equal_the_index_gather(seed):
    rng = np.random.default_rng(seed)
    shape = tuple(int(d) for d in rng.integers(1, 6, int(rng.integers(1, 4))))
    buffer = rng.standard_normal(shape).astype(np.float32)
    st = _random_chain(rng, shape)
    got = st.realize(buffer)
    want = _gather(st, buffer)
    assert got.shape == want.shape and np.array_equal(got, want), str(st)
    assert not np.signbit(got[want == 0]).any()  # masked elements read +0, as the gather does
