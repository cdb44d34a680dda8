"""What a CPU run holds at once: a weight's stored form only from its first reader until its last has run, and a
concatenation of weights (a horizontally fused Gemm's B) never in the run's own state, so a whole-model
run of a model whose derived weights exceed the weight cache stays within the cache's budget."""
from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest

from luminal_num.codegen.llir import KernelKind
from luminal_num.models.testnets import all_test_models
from luminal_num.runtime import cpu
from luminal_num.runtime.cpu import CpuRuntime
from luminal_num.search.extract import BASE
from luminal_num.search.space import SearchSpace


def _low_precision(space: SearchSpace) -> frozenset:
    return frozenset((gk, k.cls, [t for t in k.tags if t != BASE][-1])
                     for gk, ks in space.knobs.items() for k in ks if any(t != BASE for t in k.tags))


# matmul_chain: weights read only in a storage format (unread FP32 externals); attention_kv: fused q/k/v
@pytest.mark.parametrize("model", [m for m in all_test_models() if m.name in ("matmul_chain", "attention_kv")],
                         ids=lambda m: m.name)
def test_a_run_holds_no_external_past_its_last_reader_and_no_concatenation(model, monkeypatch):
    space = SearchSpace.build(model.graph)
    for genome in (frozenset(), _low_precision(space)):
        program = space.program(genome)
        last: dict[int, int] = {}
        first: dict[int, int] = {}
        for pos, k in enumerate(program.kernels):
            for inp in k.inputs:
                last[inp.buffer] = pos
                first.setdefault(inp.buffer, pos)
        position = {k.id: pos for pos, k in enumerate(program.kernels)}
        externals = {k.id for k in program.kernels if k.kind is KernelKind.EXTERNAL}
        weights = {k.id for k in program.kernels if k.kind is KernelKind.EXTERNAL
                   and (k.external in model.graph.weights or k.concat)}
        outputs = {kid for _, kid in program.outputs}
        concats = {k.external for k in program.kernels if k.concat}
        seen = []

        def watching(kind, fn):
            def run(rt, k, state):
                stale = [b for b in state.stored if b in externals and b not in outputs
                         and last.get(b, -1) < position[k.id]]
                early = [b for b in state.stored if b in weights and first.get(b, 1 << 30) > position[k.id]]
                seen.append((k.id, stale + early, [n for n in concats if dict.__contains__(state.feed, n)]))
                return fn(rt, k, state)
            return run
        monkeypatch.setattr(cpu, "KERNELS", {kind: watching(kind, fn) for kind, fn in cpu.KERNELS.items()})
        got = CpuRuntime(program, model.graph.weights).run(model.make_inputs(1))
        monkeypatch.undo()
        assert seen and all(not stale for _, stale, _ in seen), (model.name, [s for s in seen if s[1]][:3])
        assert all(not held for _, _, held in seen), model.name  # fused weights: read from the cache
        want = CpuRuntime(program, model.graph.weights).run(model.make_inputs(1))
        for name, value in want.outputs.items():
            assert np.array_equal(got.outputs[name], value, equal_nan=True)


@pytest.mark.parametrize("model", [m for m in all_test_models() if m.name in ("matmul_chain", "attention_kv")],
                         ids=lambda m: m.name)
def test_a_finished_run_is_freed_without_the_cyclic_gc(model):
    """A run's state (every buffer it wrote) and its runtime go when the last reference does: the stored
    forms' makers closed over the state, a cycle that kept a whole-model run's GBs in a pool worker until
    a full collection came by (issue 29: 1.8 GB per SmolLM2 worker after the headroom probes)."""
    space = SearchSpace.build(model.graph)
    gc.collect()
    gc.disable()
    try:
        for genome in (frozenset(), _low_precision(space)):
            rt = CpuRuntime(space.program(genome), model.graph.weights)
            states = []
            real = cpu.KERNELS

            def watching(fn):
                def run(rt_, k, state):
                    if not states:
                        states.append(weakref.ref(state))
                    return fn(rt_, k, state)
                return run
            cpu.KERNELS = {kind: watching(fn) for kind, fn in real.items()}
            try:
                rt.run(model.make_inputs(1))
            finally:
                cpu.KERNELS = real
            assert states and states[0]() is None, "the run's state outlived the run"
            freed = weakref.ref(rt)
            del rt
            assert freed() is None, "the runtime outlived its last reference"
    finally:
        gc.enable()


@pytest.mark.parametrize("model", ["llama-tiny", "transformer"])
def test_a_run_gives_no_buffer_slot_to_a_weight_it_reads_from_the_weight_cache(model, monkeypatch):
    """Each weight EXTERNAL had a slot the size of the weight that the CPU backend never wrote (its value comes
    from the weight cache): the plan was the model's weights again, and a SmolLM2 whole-model run's heap held
    ~0.5 GB of them. Truths: the program's own kernel list (which kernels are weights) and the same outputs
    from a runtime whose plan gives every kernel a slot."""
    from luminal_num.models.registry import load_job
    from luminal_num.runtime import buffers
    job = load_job(model)
    space = SearchSpace.build(job.graph)
    batch = job.calibration[0]
    bindings = job.graph.bind_symbols(batch)
    for genome in (frozenset(), _low_precision(space)):
        program = space.program(genome)
        weights = {k.id for k in program.kernels if k.kind is KernelKind.EXTERNAL and k.external in job.graph.weights}
        assert weights
        lean = CpuRuntime(program, job.graph.weights).run(batch)
        assert not weights & set(lean.plan.slot_of)
        others = sum(max(int(k.numel(bindings) * k.dtype.storage.itemsize), 1)
                     for k in program.kernels if k.id not in weights)
        assert lean.plan.total_bytes <= others
        with monkeypatch.context() as m:  # every kernel a slot, as before
            m.setattr(cpu, "plan_buffers", lambda prog, b, unbacked=frozenset(): buffers.plan_buffers(prog, b))
            full = CpuRuntime(program, job.graph.weights).run(batch)
        assert weights <= set(full.plan.slot_of) and full.plan.total_bytes > lean.plan.total_bytes
        for name in full.outputs:
            np.testing.assert_array_equal(lean.outputs[name], full.outputs[name], err_msg=name)
