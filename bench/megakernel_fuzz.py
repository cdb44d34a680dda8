"""Emulated-scheduler fuzzing of the megakernel's work queue (issue 33).

Per model and genome the fused plan is lowered to its work queue (codegen/megakernel.py) and run by
runtime/megakernel_emulator.py in seeded random interleavings on N simulated SMs (N drawn from 2, 8,
32, 132 per interleaving). Counted: barrier violations (a tile reading an element no tile has written),
deadlocks, and interleavings whose outputs differ bit for bit from the kernel-by-kernel CPU plan of the
same program. Once per genome the unfused plan of the same precision choices (the space built with
fusion off) is run too: `unfused_bit_identical` says whether its outputs equal the fused plan's bit for
bit (fusion keeps FP32 plans bit-exact; a low-precision fused kernel may round once where the unfused
plan rounds per kernel). Models: SmolLM2-135M truncated to 1 layer from the shipped GGUF (a one-sequence
decode step with a 64-row cache) and all-MiniLM-L6-v2 (one sentence batch). Writes
reports/bench/megakernel_fuzz.csv.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import pandas as pd

from luminal_num.codegen.megakernel import build_queue
from luminal_num.runtime.cpu import CpuRuntime
from luminal_num.runtime.megakernel_emulator import MegakernelEmulator, bit_identical
from luminal_num.search.recipes import BF16_WEIGHTS, STORAGE_RECIPES, pick
from luminal_num.search.space import SearchSpace

OUT = Path("reports/bench")
SM_CHOICES = (2, 8, 32, 132)
GENOMES = {"FP32": frozenset(), "BF16 + fused attention": BF16_WEIGHTS | {"attn:flash_bf16"},
           "W4A16 INT4 group 128": STORAGE_RECIPES["W4A16 INT4 group 128"],
           # FP8 W8A8: static per-channel weight scales (written at load), per-token A scales its GEMVs compute
           "FP8 W8A8 dynamic per-token": STORAGE_RECIPES["FP8 W8A8 dynamic per-token"]}


def _jobs(which: tuple[str, ...]):
    from luminal_num.models.registry import llm_job, minilm_job
    if "smollm2" in which:
        yield "SmolLM2-135M 1 layer decode", llm_job("smollm2", workload="decode:1@64", layers=1)
    if "minilm" in which:
        yield "MiniLM-L6 encoder", minilm_job(batch=1)


def fuzz(name: str, job, genome: str, interleavings: int, seed0: int) -> dict:
    start = time.perf_counter()
    inputs, weights = job.calibration[0], job.graph.weights
    fused = SearchSpace.build(job.graph, fusion=True)
    program = fused.program(pick(fused, GENOMES[genome].__contains__))
    queue = build_queue(program)
    reference = CpuRuntime(program, weights).run(inputs).outputs
    unfused_space = SearchSpace.build(job.graph, fusion=False)
    unfused = CpuRuntime(unfused_space.program(pick(unfused_space, GENOMES[genome].__contains__)), weights).run(inputs).outputs
    emulator = MegakernelEmulator(program, queue, weights, inputs)
    rng = np.random.default_rng(seed0)
    violations = deadlocks = mismatches = tiles = 0
    for i in range(interleavings):
        run = emulator.run(seed0 + i, int(rng.choice(SM_CHOICES)))
        violations += len(run.violations)
        deadlocks += run.deadlock is not None
        mismatches += not bit_identical(run.outputs, reference)
        tiles = run.tiles_run
    row = dict(model=name, genome=genome, ops=len(queue.ops), tiles=tiles,
               aligned_waits=sum(w.read_elements is not None for op in queue.ops for w in op.waits),
               interleavings=interleavings, violations=violations, deadlocks=deadlocks,
               outputs_not_bit_identical=mismatches, unfused_bit_identical=bit_identical(reference, unfused),
               seconds=round(time.perf_counter() - start, 1))
    print(row, flush=True)
    return row


def run(interleavings: int = 500, which: tuple[str, ...] = ("smollm2", "minilm"),
        genomes: tuple[str, ...] = ("FP32", "BF16 + fused attention")) -> dict:
    rows = []
    for name, job in _jobs(which):
        for g, genome in enumerate(genomes):
            rows.append(fuzz(name, job, genome, interleavings, seed0=1000 * g))
    df = pd.DataFrame(rows)
    OUT.mkdir(parents=True, exist_ok=True)
    df.to_csv(OUT / "megakernel_fuzz.csv", index=False)
    per_model = df.groupby("model")[["interleavings", "violations", "deadlocks", "outputs_not_bit_identical"]].sum()
    return {f"megakernel fuzz {m}: interleavings / violations / deadlocks / not bit-identical":
            f"{r.interleavings} / {r.violations} / {r.deadlocks} / {r.outputs_not_bit_identical}"
            for m, r in per_model.iterrows()}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--interleavings", type=int, default=500, help="per model and genome")
    ap.add_argument("--models", nargs="+", default=["smollm2", "minilm"])
    ap.add_argument("--genomes", nargs="+", default=["FP32", "BF16 + fused attention"], choices=sorted(GENOMES))
    args = ap.parse_args(argv)
    return run(args.interleavings, tuple(args.models), tuple(args.genomes))


if __name__ == "__main__":
    print(main())
