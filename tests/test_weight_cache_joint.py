"""WeightCache.get_joint: a value derived from several weight arrays (a horizontally fused Gemm's
concatenated B) is made once while all its parts live, and external_value returns that one read-only
array to every runtime, so the Gemm operands derived from it are kept too."""
import gc

import numpy as np
import pytest

from luminal_num.codegen.llir import external_value
from luminal_num.hlir.weightcache import WeightCache


def test_made_once_while_the_parts_live_and_again_for_other_parts():
    cache, made = WeightCache(1 << 20), []
    a, b, c = (np.full((2, 3), v, np.float32) for v in (1, 2, 3))

    def concat(*parts):
        made.append(parts)
        return np.concatenate(parts)
    first = cache.get_joint([a, b], "k", lambda: concat(a, b))
    assert cache.get_joint([a, b], "k", lambda: concat(a, b)) is first and len(made) == 1
    other = cache.get_joint([a, c], "k", lambda: concat(a, c))  # another second part: another value
    assert len(made) == 2 and np.array_equal(other[2:], c)
    assert np.array_equal(first[2:], b)


def test_a_freed_part_whose_id_is_reused_does_not_return_the_old_value():
    cache = WeightCache(1 << 20)
    a = np.zeros(4)
    b = np.ones(4)
    old = cache.get_joint([a, b], "k", lambda: a + b)
    key_id = id(b)
    del b
    gc.collect()
    # a new array may land on the freed id; either way the value must be made from the new one
    for _ in range(100):
        b2 = np.full(4, 7.0)
        if id(b2) == key_id:
            break
    got = cache.get_joint([a, b2], "k", lambda: a + b2)
    assert np.array_equal(got, a + b2) and not np.array_equal(got, old)


def test_a_concatenated_external_is_shared_and_read_only():
    w1, w2 = np.ones((2, 4), np.float32), np.zeros((3, 4), np.float32)
    feed = {"w1": w1, "w2": w2}

    class K:  # the two fields external_value reads
        concat, concat_axis, external = ("w1", "w2"), 0, "w12"
    got = external_value(K, feed)
    assert external_value(K, dict(feed)) is got and np.array_equal(got, np.concatenate([w1, w2]))
    with pytest.raises(ValueError):
        got[0, 0] = 5.0
