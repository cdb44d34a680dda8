"""WeightCache: values derived from weights are kept by the weights' content keys (hlir/store.py), never by
array identity: a value derived from several weights (a horizontally fused Gemm's concatenated B) is made
once for the same parts' contents, and external_value returns that one read-only array to every runtime,
so the Gemm operands derived from it are kept too."""
import numpy as np
import pytest

from luminal_num.codegen.llir import external_value
from luminal_num.hlir.store import WeightArray, content_key, keyed
from luminal_num.hlir.weightcache import WeightCache


def test_made_once_for_the_same_contents_and_again_for_other_parts():
    cache, made = WeightCache(1 << 20), []
    a, b, c = (keyed(np.full((2, 3), v, np.float32)) for v in (1, 2, 3))

    def concat(*parts):
        made.append(parts)
        return np.concatenate(parts)
    first = cache.get_joint([a, b], "k", lambda: concat(a, b))
    assert cache.get_joint([a, b], "k", lambda: concat(a, b)) is first and len(made) == 1
    copies = [keyed(np.array(a)), keyed(np.array(b))]  # other arrays, the same bytes: the same entry
    assert cache.get_joint(copies, "k", lambda: concat(*copies)) is first and len(made) == 1
    other = cache.get_joint([a, c], "k", lambda: concat(a, c))  # another second part: another value
    assert len(made) == 2 and np.array_equal(other[2:], c)
    assert np.array_equal(first[2:], b)


def test_arrays_that_are_not_weights_are_never_cached():
    """A plain array has no content key: caching it by identity could return a freed array's value."""
    cache, made = WeightCache(1 << 20), []
    a = np.zeros(4)
    for _ in range(2):
        cache.get(a, "k", lambda: made.append(1) or a + 1)
        cache.get_joint([keyed(a), a], "j", lambda: made.append(2) or a + 2)
    assert made == [1, 2, 1, 2] and cache.bytes == 0


def test_equal_contents_share_one_key_and_a_changed_value_gets_another():
    w = np.arange(12, dtype=np.float32).reshape(3, 4)
    one, two = keyed(w), keyed(w.copy())
    assert one is not two and one.content_key == two.content_key == content_key(w.copy())
    changed = w.copy()
    changed[1, 2] = np.nextafter(changed[1, 2], np.float32(np.inf))  # one ulp
    assert keyed(changed).content_key != one.content_key
    assert content_key(w.astype(np.float64)) != one.content_key  # the same values in another dtype
    assert content_key(w.reshape(4, 3)) != one.content_key       # or another shape: other weights
    assert keyed(w, "from-file").content_key == "from-file"      # a key the source gives is kept


def test_a_weight_is_read_only_and_what_is_derived_from_it_is_a_plain_array():
    w = keyed(np.ones((2, 2), np.float32))
    with pytest.raises(ValueError):
        w[0, 0] = 2.0
    for derived in (w * 2, w + w, np.exp(w)):
        assert type(derived) is np.ndarray and derived.flags.writeable
    t = keyed(np.arange(4, dtype=np.float32).reshape(2, 2))
    assert t.T.content_key != t.content_key  # a view is another value, keyed by its own contents


def test_a_weight_sent_to_another_process_keeps_its_key():
    import pickle
    w = keyed(np.arange(6, dtype=np.float32), "k1")
    back = pickle.loads(pickle.dumps(w))
    assert isinstance(back, WeightArray) and back.content_key == "k1" and np.array_equal(back, w)


def test_a_concatenated_external_is_shared_and_read_only():
    w1, w2 = keyed(np.ones((2, 4), np.float32)), keyed(np.zeros((3, 4), np.float32))
    feed = {"w1": w1, "w2": w2}

    class K:  # the fields external_value reads (no rotation, no smoothing: a concatenation)
        concat, concat_axis, external, rotation, smoothing = ("w1", "w2"), 0, "w12", None, None
    got = external_value(K, feed)
    assert external_value(K, dict(feed)) is got and np.array_equal(got, np.concatenate([w1, w2]))
    assert isinstance(got, WeightArray)  # itself a weight: its Gemm operands are cached by its key
    with pytest.raises(ValueError):
        got[0, 0] = 5.0
