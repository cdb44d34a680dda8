"""The compile's memory plan (luminal_num/memory.py): sizes parsed as users write them, caches bounded by
what the model can use and by the budget, fewer workers when two do not fit, and a budget that cannot
hold the model refused up front with one line."""
from __future__ import annotations

import numpy as np
import pytest

from luminal_num.cli import EXIT_INPUT, main
from luminal_num.hlir.weightcache import WEIGHTS
from luminal_num.memory import (GiB, KEPT_MIN, MIN_CACHE, PROCESS_BASE, TRANSIENT, WORKER_BASE, MemoryBudgetError, parse_size, plan_memory,
                                weight_bytes)
from luminal_num.quant.stored import CONVERTED


class Shapes(dict):
    """Weights known by shape only: the plan never reads a value."""

    def __init__(self, **shapes):
        super().__init__({n: np.lib.stride_tricks.as_strided(np.zeros(1, np.float32), s, [0] * len(s))
                          for n, s in shapes.items()})


@pytest.mark.parametrize("text,value", [("16G", 16 * GiB), ("512M", 512 << 20), ("2.5G", int(2.5 * GiB)),
                                        ("1024", 1024), ("3GiB", 3 * GiB), ("7t", 7 << 40)])
def test_sizes(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "G", "-1G", "0", "12Q", "1e3G"])
def test_bad_sizes_are_refused(text):
    with pytest.raises(ValueError):
        parse_size(text)


def test_caches_hold_what_the_model_can_use_within_the_budget():
    w = Shapes(embed=(50_000, 1000), a=(1000, 1000), b=(4000, 1000))  # 220 MB as FP32
    total, largest = weight_bytes(w)
    assert (total, largest) == (220_000_000, 200_000_000)
    big = plan_memory(w, 64 * GiB)
    assert big.workers == 2 and big.weight_cache == 3 * total and big.converted_cache == 2 * total
    assert big.worker_cache == 2 * largest
    assert plan_memory(w, 64 * GiB, rotation=True).weight_cache == 5 * total  # rotated weights and their stored forms
    tight = plan_memory(w, PROCESS_BASE + total + 2 * (WORKER_BASE + 2 * big.worker_cache) + 5 * largest)
    assert tight.workers == 2 and tight.weight_cache + tight.converted_cache <= 5 * largest
    assert PROCESS_BASE + total + 2 * (WORKER_BASE + 2 * tight.worker_cache) + tight.weight_cache \
        + tight.converted_cache <= tight.budget  # the plan adds up within its budget
    solo = plan_memory(w, PROCESS_BASE + total + (MIN_CACHE + TRANSIENT) * largest + 2 * KEPT_MIN + (1 << 20))
    assert solo.workers == 1 and solo.worker_cache == 0 and "no worker pool" in solo.describe()


def test_a_budget_below_the_model_is_refused_naming_what_it_needs():
    w = Shapes(embed=(50_000, 1000))
    with pytest.raises(MemoryBudgetError, match=r"needs at least .* GB .*the memory budget is 1\.0 GB"):
        plan_memory(w, 10 ** 9)


def test_a_plan_sizes_the_process_caches_while_applied_and_restores_them():
    old = WEIGHTS.budget_bytes, CONVERTED.budget_bytes
    plan = plan_memory(Shapes(a=(1000, 1000)), 64 * GiB)
    assert plan.weight_cache != old[0]
    with plan.applied():
        assert (WEIGHTS.budget_bytes, CONVERTED.budget_bytes) == (plan.weight_cache, plan.converted_cache)
    assert (WEIGHTS.budget_bytes, CONVERTED.budget_bytes) == old


def test_the_cli_refuses_a_budget_that_cannot_hold_the_model_with_one_line(tmp_path, capsys):
    rc = main(["compile", "--model", "transformer", "--max-memory", "10M", "--candidates", "1", "--quiet",
               "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert rc == EXIT_INPUT and "the compile needs at least" in err and err.count("\n") == 1
    assert not (tmp_path / "r" / "plan.json").exists()
    with pytest.raises(SystemExit) as usage:  # argparse's usage error, naming the expected form
        main(["compile", "--model", "transformer", "--max-memory", "lots"])
    assert usage.value.code == 2 and "e.g. 16G" in capsys.readouterr().err


def test_a_compile_leaves_the_process_caches_as_it_found_them():
    """A compile of a small model plans small caches; what the process does next keeps its own (a
    later FP64 reference re-deriving every weight was the symptom)."""
    from luminal_num.compiler import compile
    from luminal_num.error.budget import Budget
    from luminal_num.models.testnets import transformer
    from luminal_num.search.search import SearchOptions
    model = transformer(2)
    old = WEIGHTS.budget_bytes, CONVERTED.budget_bytes
    plan = plan_memory(model.graph.weights, 64 * GiB, workers=1)
    assert plan.weight_cache < old[0]
    compile(model.graph, Budget.parse("atol=1e-3,rtol=1e-3"), "h200", [model.make_inputs(0)],
            SearchOptions(seed=0, max_candidates=2, progress=False, headroom=0.5), memory=plan)
    assert (WEIGHTS.budget_bytes, CONVERTED.budget_bytes) == old


def test_a_cache_makes_room_before_it_makes_a_value_and_counts_views_of_the_weight_as_nothing():
    """The cache and the value being made stay within the budget together; an entry that is the weight
    itself (an FP32 weight stored as is) holds no bytes of its own."""
    from luminal_num.hlir.store import keyed
    from luminal_num.hlir.weightcache import WeightCache
    ws = [keyed(np.full((100, 10), i, np.float32)) for i in range(4)]  # 4000 bytes each
    cache = WeightCache(3 * 4000)
    seen = []

    def make(w):
        seen.append(cache.bytes)  # what the cache holds while the new value is made
        return w * 2.0
    for w in ws:
        cache.get(w, "doubled", lambda w=w: make(w).astype(np.float32))
    assert seen == [0, 4000, 8000, 8000]  # the 4th made after evicting the 1st, not beside it
    assert cache.bytes == 3 * 4000 and not cache.holds(ws[0], "doubled") and cache.holds(ws[3], "doubled")
    cache.get(ws[1], "as is", lambda: ws[1].view(np.ndarray))  # room made (one entry out), then 0 bytes held
    assert cache.bytes == 2 * 4000 and cache.holds(ws[1], "as is")


def test_a_scan_keeps_what_the_cache_holds_instead_of_evicting_it_before_its_next_read():
    """Whole-model runs read every weight in order, run after run. Least-recently-used eviction with a cache
    of 2 of 3 operands misses every read; inside scanning() the first run's 2 stay and every later run hits
    them, and entries made outside the scan (the search's) survive it."""
    from luminal_num.hlir.store import keyed
    from luminal_num.hlir.weightcache import WeightCache
    ws = [keyed(np.full((100, 10), i, np.float32)) for i in range(3)]  # 4000 bytes each

    def runs(cache, n, scanning):
        made = []
        for _ in range(n):
            for i, w in enumerate(ws):
                if scanning:
                    with cache.scanning():
                        cache.get(w, "op", lambda i=i, w=w: made.append(i) or w * 2.0)
                else:
                    cache.get(w, "op", lambda i=i, w=w: made.append(i) or w * 2.0)
        return made
    assert runs(WeightCache(2 * 4000), 4, scanning=False) == [0, 1, 2] * 4  # every read a miss
    cache = WeightCache(2 * 4000)
    assert runs(cache, 4, scanning=True) == [0, 1, 2] + [2] * 3  # after the first run, 2 of 3 reads hit
    assert cache.uncached == 4 and cache.bytes == 2 * 4000
    searched = WeightCache(2 * 4000)
    searched.get(ws[2], "op", lambda: ws[2] * 2.0)  # the search's entry
    runs(searched, 2, scanning=True)
    assert searched.holds(ws[2], "op") and searched.bytes <= 2 * 4000
    with searched.scanning():
        values = searched.get(ws[0], "other", lambda: ws[0] * 3.0)  # made, returned, not kept
    assert np.array_equal(values, ws[0] * 3.0) and not searched.holds(ws[0], "other")


def test_a_step_serves_what_a_scan_made_without_keeping_to_every_batch_then_drops_it():
    """Inside step() (one kernel run for several batches) a value a scan made and could not keep answers
    the later gets of its key, once made; after the step it is gone, and kept entries are untouched."""
    from luminal_num.hlir.store import keyed
    from luminal_num.hlir.weightcache import WeightCache
    ws = [keyed(np.full((100, 10), i, np.float32)) for i in range(3)]  # 4000 bytes each
    cache = WeightCache(4000)
    made = []

    def get(i):
        with cache.scanning():
            return cache.get(ws[i], "op", lambda: made.append(i) or ws[i] * 2.0)
    get(0)  # kept: it fits
    with cache.step():
        first = get(1)  # no room without evicting: made, not kept, held by the step
        assert get(1) is first and get(1) is first and get(0) is not None
    assert made == [0, 1] and cache.shared == 2 and cache.holds(ws[0], "op") and not cache.holds(ws[1], "op")
    get(1)  # outside a step: made again
    assert made == [0, 1, 1]
    with cache.step(), cache.step():  # nested: the outer step's values stay until it ends
        get(2)
        with cache.step():
            get(2)
        get(2)
    assert made == [0, 1, 1, 2]


def test_a_stage_that_cannot_fit_stops_with_one_line_naming_it():
    from luminal_num.memory import MemoryPlan, tree_pss
    plan = MemoryPlan(tree_pss() + 512 * (1 << 20), 0, 0, 1, 0, 0, 0)
    plan.check("partition", 0)  # what the process holds fits
    with pytest.raises(MemoryBudgetError) as stop:
        plan.check("reference", 4 * GiB)
    msg = str(stop.value)
    assert "\n" not in msg and msg.startswith("stage reference needs 4.3 GB more memory") and "--max-memory" in msg


def test_the_search_fits_the_caches_to_what_the_budget_leaves_or_stops():
    """At the search, caches planned from PROCESS_BASE's guess are shrunk to what the measured process
    leaves (with the transient reserve), and a budget that leaves not even MIN_CACHE largest weights stops."""
    from luminal_num.memory import MIN_CACHE, TRANSIENT, MemoryPlan, tree_pss
    held = tree_pss()
    largest = 10 << 20
    plan = MemoryPlan(held + 200 * (1 << 20), 0, largest, 1, 300 << 20, 200 << 20, 0)
    old = WEIGHTS.budget_bytes, CONVERTED.budget_bytes
    try:
        with plan.applied():
            plan.fit("search")
            room = WEIGHTS.budget_bytes + CONVERTED.budget_bytes
            assert room < 200 << 20 and WEIGHTS.budget_bytes > CONVERTED.budget_bytes  # shares kept (3:2)
            assert room >= (200 << 20) - TRANSIENT * largest - (64 << 20)  # what is left, give or take the pages held
            plan.fit("search", growing=50 << 20)  # a store that will still fill 50 MB: that much less for the caches
            less = WEIGHTS.budget_bytes + CONVERTED.budget_bytes
            assert abs(room - less - (50 << 20)) <= 16 << 20  # give or take the pages the process touched meanwhile
        small = MemoryPlan(held + (MIN_CACHE + TRANSIENT - 1) * largest, 0, largest, 1, 300 << 20, 200 << 20, 0)
        with small.applied(), pytest.raises(MemoryBudgetError, match=r"^stage search needs .* beside the"):
            small.fit("search")
    finally:
        assert (WEIGHTS.budget_bytes, CONVERTED.budget_bytes) == old


def test_boundary_values_past_the_spill_budget_are_held_in_files():
    from luminal_num.error.reference import SPILL, references, reference_bytes
    from luminal_num.hlir.partition import partition
    from luminal_num.models.testnets import transformer
    model = transformer(2)
    cal = [model.make_inputs(s) for s in range(3)]
    part = partition(model.graph)
    kept = references(model.graph, cal, part)
    one = kept[0].nbytes
    assert reference_bytes(model.graph, part, cal) == sum(r.nbytes for r in kept) == 3 * one
    old = SPILL.budget_bytes
    SPILL.budget_bytes = one  # the first batch in memory, the others spilled
    try:
        spilled = references(model.graph, cal, part)
    finally:
        SPILL.budget_bytes = old

    def in_file(a):
        while a is not None and not isinstance(a, np.memmap):
            a = a.base
        return a is not None
    assert [any(in_file(v) for v in r.values.values()) for r in spilled] == [False, True, True]
    for a, b in zip(kept, spilled):
        assert a.values.keys() == b.values.keys()
        assert all(np.array_equal(a.values[n], b.values[n]) for n in a.values)


def test_the_cli_reports_a_stage_that_does_not_fit_in_one_line(tmp_path, capsys, monkeypatch):
    """A compile whose process outgrows its budget between stages stops with exit 2 and one line naming
    the stage (here: the process made to look 1 TB large when the reference stage is checked)."""
    from luminal_num import memory
    real = memory.tree_pss
    calls = []

    def grown():
        calls.append(1)
        return real() + (1 << 40) * (len(calls) > 2)  # partition and saturate fit; then the process is 1 TB
    monkeypatch.setattr(memory, "tree_pss", grown)
    rc = main(["compile", "--model", "transformer", "--max-memory", "64G", "--candidates", "1", "--quiet",
               "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert rc == EXIT_INPUT and err.count("\n") == 1 and "stage reference cannot start" in err and "holds 1" in err
    assert not (tmp_path / "r" / "plan.json").exists()


def test_a_stage_over_the_budget_by_what_the_caches_hold_evicts_them_instead_of_stopping(monkeypatch):
    """The caches fill the budget by design: at the last stage the process may hold the whole budget. A stage
    check gives back cache entries (least recently used) before refusing; it refuses only what eviction
    cannot free (the SmolLM2 compile at --max-memory 8G stopped at `plan` needing 0.0 GB more)."""
    from luminal_num import memory
    from luminal_num.hlir.weightcache import WEIGHTS
    from luminal_num.quant.stored import CONVERTED
    before, converted = WEIGHTS._lru.budget_bytes, CONVERTED.budget_bytes  # later tests in this worker see them
    WEIGHTS.resize(1 << 30)
    WEIGHTS.get("evictable-content-key", "f32", lambda: np.ones(16 << 20, np.float32))  # 64 MiB in the cache
    cached = WEIGHTS.bytes
    assert cached >= 64 << 20
    base = memory.tree_pss()
    monkeypatch.setattr(memory, "tree_pss", lambda: base + WEIGHTS.bytes)  # what the cache holds is held
    plan = memory.MemoryPlan(base + cached - (32 << 20), 0, 0, 1, 0, 0, 0)
    plan.check("plan", 0)  # 32 MiB over, all of it in the cache: evicted, no error
    assert WEIGHTS.bytes <= cached - (32 << 20)
    with pytest.raises(memory.MemoryBudgetError, match="^stage plan cannot start; the compile holds"):
        memory.MemoryPlan(base - (1 << 20), 0, 0, 1, 0, 0, 0).check("plan", 0)  # over by more than the caches
    assert WEIGHTS._lru.budget_bytes == 1 << 30 and CONVERTED.budget_bytes == converted  # entries go, budgets stay
    WEIGHTS.clear()
    WEIGHTS.resize(before)
