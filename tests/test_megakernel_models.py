"""Model-scale megakernel checks (slow; bench/megakernel_fuzz.py runs the 1,000-interleaving version):
the work queues of SmolLM2-135M truncated to one layer from the shipped GGUF and of MiniLM-L6, run by
the emulated scheduler, with no barrier violation, no deadlock and outputs bit-identical to the
kernel-by-kernel CPU plan."""
from __future__ import annotations

import pytest

from bench.megakernel_fuzz import GENOMES
from luminal_num.codegen.megakernel import build_queue
from luminal_num.runtime.cpu import CpuRuntime
from luminal_num.runtime.megakernel_emulator import MegakernelEmulator, bit_identical
from luminal_num.search.recipes import pick
from luminal_num.search.space import SearchSpace

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=["smollm2", "minilm"])
def job(request):
    from luminal_num.models.registry import llm_job, minilm_job
    return llm_job("smollm2", workload="decode:1@64", layers=1) if request.param == "smollm2" else minilm_job(batch=1)


@pytest.mark.parametrize("genome", ["FP32", "BF16 + fused attention", "W4A16 INT4 group 128"])
def test_model_queue_interleavings(job, genome):
    space = SearchSpace.build(job.graph)
    program = space.program(pick(space, GENOMES[genome].__contains__))
    inputs = job.calibration[0]
    reference = CpuRuntime(program, job.graph.weights).run(inputs).outputs
    emulator = MegakernelEmulator(program, build_queue(program), job.graph.weights, inputs)
    for seed in range(12):
        run = emulator.run(seed, sms=(2, 8, 32, 132)[seed % 4])
        assert not run.violations and run.deadlock is None, (seed, run.violations[:2], run.deadlock)
        assert bit_identical(run.outputs, reference)
