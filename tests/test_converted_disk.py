"""Converted weights cached on disk beside the verdict cache (issue 29, item 1): a later compile (or a cache
whose memory entries were evicted) reads a conversion back instead of quantizing again.

Truths: the storage format's own quantize/dequantize run here (ml_dtypes-checked elsewhere), compared bit
for bit; files damaged on purpose."""
from __future__ import annotations

import warnings

import numpy as np
import pytest

from luminal_num.hlir.store import keyed
from luminal_num.quant.converted_disk import ConvertedCacheWarning, ConvertedDisk
from luminal_num.quant.storage import storage_format
from luminal_num.quant.stored import ConvertedWeights

FORMATS = ["int8_channel", "int4_g128", "f8e4m3_channel", "nvfp4", "bf16"]


def _weight(seed: int = 0, shape=(64, 256)) -> np.ndarray:
    return keyed(np.random.default_rng(seed).standard_normal(shape).astype(np.float32))


def _direct(w, fmt):
    q = storage_format(fmt).quantize(np.asarray(w, np.float32))
    return q, q.dequantize().astype(np.float32)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_conversion_written_by_one_cache_is_read_back_by_another(tmp_path, fmt):
    w = _weight()
    first = ConvertedWeights()
    with first.on_disk(tmp_path):
        first.get(w, storage_format(fmt))
    assert first.conversions == 1 and len(list(tmp_path.glob("*.safetensors"))) == 1
    second = ConvertedWeights()  # a new process's cache: nothing in memory
    with second.on_disk(tmp_path):
        got = second.get(w, storage_format(fmt))
        assert second.disk.hits == 1
    assert second.conversions == 0
    q, wide = _direct(w, fmt)
    np.testing.assert_array_equal(got.widened.view(np.uint32), wide.view(np.uint32))
    for part, v in q.values.items():
        np.testing.assert_array_equal(np.asarray(got.quantized().values[part]), np.asarray(v), err_msg=str(part))


def test_equal_content_shares_an_entry_and_other_content_does_not(tmp_path):
    w = _weight(0)
    same = keyed(np.array(w, copy=True))  # another array, the same bytes
    other = _weight(1)
    cache = ConvertedWeights()
    fmt = storage_format("int8_channel")
    with cache.on_disk(tmp_path):
        cache.get(w, fmt)
        cache.clear()
        cache.get(same, fmt)
        assert cache.disk.hits == 1 and cache.conversions == 1
        cache.get(other, fmt)
    assert cache.conversions == 2 and len(list(tmp_path.glob("*.safetensors"))) == 2


def test_a_damaged_file_is_reported_in_one_line_converted_again_and_rewritten(tmp_path):
    w, fmt = _weight(), storage_format("int4_g128")
    with ConvertedWeights().on_disk(tmp_path):
        pass
    writer = ConvertedWeights()
    with writer.on_disk(tmp_path):
        writer.get(w, fmt)
    (path,) = tmp_path.glob("*.safetensors")
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF  # one flipped bit pattern in the packed codes
    path.write_bytes(bytes(data))
    reader = ConvertedWeights()
    with reader.on_disk(tmp_path), pytest.warns(ConvertedCacheWarning, match="content hash"):
        wide = reader.get(w, fmt).widened
    assert reader.conversions == 1
    np.testing.assert_array_equal(wide, _direct(w, "int4_g128")[1])
    again = ConvertedWeights()
    with again.on_disk(tmp_path), warnings.catch_warnings():
        warnings.simplefilter("error", ConvertedCacheWarning)  # rewritten: read back without a warning
        again.get(w, fmt)
    assert again.conversions == 0


def test_the_folder_keeps_within_its_byte_budget_dropping_the_least_recently_used(tmp_path):
    fmt = storage_format("bf16")
    weights = [_weight(i) for i in range(4)]
    cache = ConvertedWeights()
    with cache.on_disk(tmp_path):
        cache.get(weights[0], fmt)
    (one,) = tmp_path.glob("*.safetensors")
    budget = int(2.5 * one.stat().st_size)  # room for two entries
    disk = ConvertedDisk(tmp_path, max_bytes=budget)
    cache = ConvertedWeights()
    cache.disk = disk
    for i, w in enumerate(weights[1:], 1):
        cache.get(w, fmt)
        if i == 2:
            cache.clear()
            cache.get(weights[1], fmt)  # a hit: weight 1 is now used more recently than weight 2
    assert sum(p.stat().st_size for p in tmp_path.glob("*.safetensors")) <= budget
    cache.clear()
    before = disk.hits
    cache.get(weights[1], fmt)
    cache.get(weights[3], fmt)
    assert disk.hits == before + 2  # kept: the most recently used
    assert disk.evicted >= 2


def test_a_folder_that_cannot_be_written_warns_once_and_the_conversions_go_on(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    cache = ConvertedWeights()
    with cache.on_disk(blocker / "converted"), pytest.warns(ConvertedCacheWarning) as caught:
        for i in range(3):
            wide = cache.get(_weight(i), storage_format("int8_channel")).widened
    assert len([c for c in caught if issubclass(c.category, ConvertedCacheWarning)]) == 1
    np.testing.assert_array_equal(wide, _direct(_weight(2), "int8_channel")[1])
    assert cache.conversions == 3


def test_a_second_compile_with_the_cache_folder_converts_nothing_and_chooses_the_same_plan(tmp_path):
    from luminal_num.compiler import compile as compile_plan
    from luminal_num.error.budget import Budget
    from luminal_num.models.registry import load_job
    from luminal_num.quant.stored import CONVERTED
    from luminal_num.search.search import SearchOptions
    job = load_job("llama-tiny")

    def run():
        CONVERTED.clear()  # as a new process would start
        before = CONVERTED.conversions
        result = compile_plan(job.graph, Budget.parse(job.default_budget), "h200", job.calibration,
                              SearchOptions(max_candidates=12, progress=False, workers=1), cache_dir=tmp_path)
        return result.search.chosen.genome, CONVERTED.conversions - before

    first_plan, first_conversions = run()
    files = list((tmp_path / "converted").glob("*.safetensors"))
    assert first_conversions > 0 and len(files) == first_conversions
    second_plan, second_conversions = run()
    assert second_conversions == 0
    assert second_plan == first_plan  # the same chosen genome (the plan's stats differ: verdicts reused)
