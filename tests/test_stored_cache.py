"""The conversions of weights to their storage formats are cached per (format, content) within a byte
budget: a model with more matrix weights than the old 64-entry LRU held (32 weights) converts each
weight once, a fresh copy finds the original's entry, and the budget bounds the memory."""
from __future__ import annotations

import gc

import numpy as np
import pytest

from luminal_num.quant import stored
from luminal_num.quant.storage import storage_format
from luminal_num.quant.stored import ConvertedWeights, storage_error, widened


@pytest.fixture
def fresh(monkeypatch):
    cache = ConvertedWeights()
    monkeypatch.setattr(stored, "CONVERTED", cache)
    return cache


def weights(n: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((8, 64)).astype(np.float32) for _ in range(n)]


def test_a_model_with_many_weights_converts_each_once(fresh):
    ws = weights(150)  # SmolLM2-135M has 210 matrix weights
    first = [widened(w, "int4_g32_asym") for w in ws]
    for _ in range(2):  # every later reader (static bounds, CUDA uploads) finds them
        again = [widened(w, "int4_g32_asym") for w in ws]
        assert all(a is b for a, b in zip(first, again))
        for w in ws:
            storage_error(w, "int4_g32_asym")
    assert fresh.conversions == 150
    fmt = storage_format("int4_g32_asym")
    assert all(np.array_equal(a, fmt.quantize(w).dequantize().astype(np.float32)) for a, w in zip(first, ws))


def test_formats_and_copies(fresh):
    w = weights(1)[0]
    a, b = widened(w, "int8_channel"), widened(w, "bf16")
    assert fresh.conversions == 2 and not np.array_equal(a, b)
    assert widened(w.copy(), "int8_channel") is a and fresh.conversions == 2  # same content: same entry
    w64 = w.astype(np.float64)
    storage_error(w64, "int8_channel")  # a float64 weight: its FP32 rounding (here w itself) by content
    assert fresh.conversions == 2
    other = w.copy()
    other[0, 0] += 1
    assert not np.array_equal(widened(other, "int8_channel"), a) and fresh.conversions == 3


def test_the_byte_budget_evicts_least_recently_used(fresh):
    ws = weights(6, seed=1)
    widened(ws[0], "bf16")
    entry = fresh.bytes
    fresh.budget_bytes = 3 * entry
    for w in ws[:3]:
        widened(w, "bf16")
    assert fresh.conversions == 3 and fresh.bytes == 3 * entry
    widened(ws[0], "bf16")  # most recent now; ws[1] is the oldest
    widened(ws[3], "bf16")
    assert fresh.bytes == 3 * entry and fresh.conversions == 4
    widened(ws[0], "bf16")
    assert fresh.conversions == 4
    widened(ws[1], "bf16")  # evicted: converted again
    assert fresh.conversions == 5


def test_a_weight_is_hashed_once_and_its_copy_finds_its_entry(fresh, monkeypatch):
    """A weight (hlir/store.py WeightArray) computes its content key once, whatever the number of
    readers; the conversion is kept by content, so an equal copy finds it after the weight is gone."""
    from luminal_num.hlir import store
    hashed = []
    real = store.digest
    monkeypatch.setattr(store, "digest", lambda a, *p: hashed.append(a.shape) or real(a, *p))
    raw = weights(1, seed=2)[0]
    w = store.keyed(raw)
    first = widened(w, "f16")
    for _ in range(3):
        assert widened(w, "f16") is first
    assert hashed == [w.shape]
    del w
    gc.collect()
    assert widened(raw.copy(), "f16") is first and fresh.conversions == 1


def test_a_pool_worker_shrinks_both_weight_caches_to_its_budget(fresh, monkeypatch):
    """A worker keeps at most WORKER_CACHE_BYTES per cache, evicting least recently used entries
    (inherited from the parent included); the rest stay and are still hits."""
    from luminal_num.error import tasks
    from luminal_num.hlir.weightcache import WeightCache
    cache = WeightCache()
    monkeypatch.setattr(tasks, "WEIGHTS", cache)
    monkeypatch.setattr(tasks, "CONVERTED", fresh)
    from luminal_num.hlir.store import keyed
    ws = [keyed(w) for w in weights(4, seed=2)]  # weights: the cache keeps values derived from weights only
    for w in ws:
        widened(w, "bf16")
        cache.get(w, "copy", lambda w=w: w.astype(np.float64))
    per_conv, per_copy = fresh.bytes // 4, cache.bytes // 4  # bf16 codes + widened FP32: 6 bytes; float64: 8
    budget = 2 * max(per_conv, per_copy)  # room for two entries of either cache, not three
    assert 3 * min(per_conv, per_copy) > budget
    monkeypatch.setattr(tasks, "WORKER_CACHE_BYTES", budget)
    tasks.worker_init({})
    assert cache.budget_bytes == fresh.budget_bytes == budget
    assert (cache.bytes, fresh.bytes) == (2 * per_copy, 2 * per_conv)
    kept = [cache.holds(w, "copy") for w in ws]
    assert kept == [False, False, True, True]  # the two least recently used were evicted
    before = fresh.conversions
    widened(ws[3], "bf16")
    assert fresh.conversions == before  # kept
    widened(ws[0], "bf16")
    assert fresh.conversions == before + 1  # evicted: converted again


@pytest.mark.parametrize("fmt", ["bf16", "f8e4m3_channel", "int8_channel", "int4_g128", "int4_g32_asym", "mxfp4",
                                 "nvfp4"])
def test_an_entry_holds_the_packed_codes_and_one_read_only_widened_array(fresh, fmt):
    """The codes are held in the format's own bytes, not as FP32 (a 1 GB FP32 head's int8 codes are 0.26 GB
    packed), and unpack to the conversion's codes bit for bit; the widened array is the one every reader
    shares, so it must not be writable."""
    w = np.random.default_rng(3).standard_normal((16, 256)).astype(np.float32)
    f = storage_format(fmt)
    entry = fresh.get(w, f)
    direct = f.quantize(w)
    assert entry.packed.nbytes == f.pack(direct).nbytes < w.nbytes
    assert fresh.bytes == entry.widened.nbytes + entry.packed.nbytes
    for part, v in direct.values.items():
        np.testing.assert_array_equal(np.asarray(entry.quantized().values[part]).view(np.uint32),
                                      np.asarray(v, np.float32).view(np.uint32), err_msg=str(part))
    np.testing.assert_array_equal(entry.widened.view(np.uint32),
                                  direct.dequantize().astype(np.float32).view(np.uint32))
    assert not entry.widened.flags.writeable
    assert widened(w, f) is entry.widened


def test_a_conversion_is_made_after_the_entries_it_evicts_are_gone(fresh, monkeypatch):
    """With the cache full, converting a new weight first evicts what its entry needs: while the conversion
    allocates, the cache holds at most its budget minus the new entry (else a 1 GB head's conversion sat
    on top of a full cache)."""
    ws = weights(4, seed=5)
    widened(ws[0], "int8_channel")
    entry = fresh.bytes
    fresh.budget_bytes = 2 * entry
    widened(ws[1], "int8_channel")
    held_while_converting = []
    real = stored.convert
    monkeypatch.setattr(stored, "convert", lambda *a, **k: held_while_converting.append(fresh.bytes) or real(*a, **k))
    widened(ws[2], "int8_channel")
    assert held_while_converting == [entry]  # one of the two entries evicted before, not after
    assert fresh.bytes == 2 * entry
