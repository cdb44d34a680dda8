"""The judging caches' arrays past their memory budget live in a scratch file (error/held.py, issue 29): what
comes back is the same bits, so per-chunk verdicts do not depend on where their arrays were kept.

Truths: the arrays handed in (bit patterns compared, NaN payloads included), and the same ChunkEffects kept
wholly in memory."""
from __future__ import annotations

import numpy as np
import pytest

from luminal_num.error import held as held_module
from luminal_num.error.chunks import ChunkEffects, Propagation
from luminal_num.error.held import HeldArrays, Spilled, load
from luminal_num.error.reference import references
from luminal_num.models.registry import load_job
from luminal_num.search.space import SearchSpace


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint8)


def test_spilled_arrays_come_back_bit_for_bit():
    rng = np.random.default_rng(0)
    f32 = rng.standard_normal((300, 129)).astype(np.float32)
    f32.ravel()[:6] = [-0.0, np.inf, -np.inf, np.float32(1e-45), np.finfo(np.float32).max, 0.0]
    payload = np.array([0x7FC01234, 0xFF800001], np.uint32).view(np.float32)  # NaNs with payloads
    f32.ravel()[6:8] = payload
    arrays = [f32, rng.standard_normal((64, 200)),            # float32, float64
              rng.standard_normal((200, 300)).T,              # not contiguous
              np.zeros((0, 7), np.float32),                   # empty
              rng.integers(-5, 5, (50_000,), dtype=np.int64),
              np.float32(3.5) * np.ones((4, 4), np.float32)]  # small: stays in memory
    store = HeldArrays(budget_bytes=0)
    handles = [store.hold(a) for a in arrays]
    assert all(isinstance(h, Spilled) for h in handles[:3]) and not isinstance(handles[-1], Spilled)
    for a, h in zip(reversed(arrays), reversed(handles)):  # read back in another order than written
        got = load(h)
        assert got.dtype == a.dtype and got.shape == a.shape
        np.testing.assert_array_equal(_bits(got), _bits(a))
    assert store.spilled == sum(a.nbytes for a in arrays[:5] if a.nbytes >= held_module.SMALL_BYTES)


def test_arrays_stay_in_memory_up_to_the_budget_then_spill():
    a = np.ones(100_000, np.float32)  # 400 KB
    store = HeldArrays(budget_bytes=900_000)
    first, second, third = store.hold(a), store.hold(a), store.hold(a)
    assert first is a and second is a and isinstance(third, Spilled)
    assert store.in_memory == 800_000 and store.spilled == 400_000
    unlimited = HeldArrays()
    assert all(unlimited.hold(a) is a for _ in range(5))


def test_chunk_verdicts_composed_from_spilled_arrays_equal_those_kept_in_memory(monkeypatch):
    """llama-tiny (its layer chunks export their KV cache, the arrays that grew the compile): single knobs per
    layer, pairs composed from them, whole genomes composed from the chunks' effects; SCALED and EXACT."""
    job = load_job("llama-tiny")
    space = SearchSpace.build(job.graph)
    refs = references(job.graph, job.calibration)
    ref_outputs = [r.outputs(job.graph) for r in refs]
    base = space.candidates(frozenset())
    layer_group = next(g for g in space.part.groups if len(g.chunks) > 1)
    gemm_knobs = sorted({k.cls for k in space.knobs[layer_group.key] if "gemm:bf16" in k.tags})
    assert len(gemm_knobs) >= 2
    genomes = [frozenset({(layer_group.key, cls, "gemm:bf16")}) for cls in gemm_knobs]
    genomes += [frozenset({(layer_group.key, a, "gemm:bf16"), (layer_group.key, b, "gemm:bf16")})
                for j, a in enumerate(gemm_knobs) for b in gemm_knobs[j + 1:]]
    genomes.append(frozenset((gk, k.cls, "store:int8_channel") for gk, ks in space.knobs.items() for k in ks
                             if "store:int8_channel" in k.tags))

    def composed(held: HeldArrays | None):
        out = []
        for mode in (Propagation.SCALED, Propagation.EXACT):
            ce = ChunkEffects(job.graph, space.part, refs, space.lower_chunk, base, mode, changes_of=space.knobs_of,
                              held=held)
            out += [ce.compose(space.candidates(g), ref_outputs) for g in genomes]
        return out

    want = composed(None)
    monkeypatch.setattr(held_module, "SMALL_BYTES", 0)  # this model's arrays are small: spill every one
    store = HeldArrays(budget_bytes=0)
    got = composed(store)
    assert store.spilled > 0 and store.reads > 0 and store.in_memory == 0
    for g, w in zip(got, want):
        for gb, wb in zip(g, w):
            assert gb.keys() == wb.keys()
            for k in wb:
                np.testing.assert_array_equal(_bits(gb[k]), _bits(wb[k]), err_msg=k)


@pytest.mark.parametrize("budget", ["4G", "12G"])
def test_the_memory_plan_gives_the_judging_caches_a_share_of_the_budget(budget):
    from luminal_num.memory import parse_size, plan_memory
    job = load_job("llama-tiny")
    plan = plan_memory(job.graph.weights, parse_size(budget))
    assert 256 << 20 <= plan.judging <= plan.budget // 8


@pytest.mark.parametrize("genome_tag", ["gemm:bf16", "gemm:tf32"])
def test_the_weight_cache_holds_no_more_than_its_budget_of_prepared_gemm_operands(genome_tag):
    """Measured by tracemalloc, not by the cache's own count: a BF16/TF32 Gemm's prepared B (a tuple of
    Operand records) counted as 0 bytes, so the cache held every variant's operands past its budget
    (SmolLM2 worker: 0.3 GB over a 0.2 GB budget after the headroom's four probes)."""
    import gc
    import tracemalloc
    from luminal_num.hlir.weightcache import WEIGHTS
    from luminal_num.runtime.cpu import CpuRuntime
    job = load_job("llama-tiny")
    space = SearchSpace.build(job.graph)
    genome = frozenset((gk, k.cls, genome_tag) for gk, ks in space.knobs.items() for k in ks if genome_tag in k.tags)
    assert genome
    program = space.program(genome)
    old = WEIGHTS.budget_bytes
    WEIGHTS.clear()
    budget = 64 << 10
    try:
        WEIGHTS.resize(budget)
        gc.collect()
        tracemalloc.start()
        CpuRuntime(program, job.graph.weights).run(job.calibration[0])
        gc.collect()
        held = tracemalloc.get_traced_memory()[0]
        WEIGHTS.clear()
        gc.collect()
        cache_bytes = held - tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        assert cache_bytes <= budget + (16 << 10), (cache_bytes, budget)  # + the entries' small records
    finally:
        WEIGHTS.clear()
        WEIGHTS.resize(old)
