"""Bytes a SmolLM2-135M decode step's Gemms read on CUDA vs the bytes the cost model prices (issue 35, item 2).

Per storage genome (bench/fusion.py's GENOMES, Gemm fusion on: q|k|v and gate|up concatenated, residual and
GLU epilogues), for the weights' readers:
- `priced_mb`: runtime/latency.kernel_works' bytes read, summed over every launched kernel;
- `read_mb`: the same kernels' bytes as the CUDA runtime reads them: a weight held in a storage format at its
  stored bytes where the launch reads its stored parts, at its widened FP32 buffer's bytes where it does not.
  "before" is the runtime of main f886dc9 (only a plain Gemm's dedicated dequantize-on-load kernel read the
  parts: codegen/cuda_weight_only.weight_only_gemm), "after" this branch's (every Gemm reading the weight as
  W^T: codegen/cuda_weight_only.stored_operand), both with main's pricing and with this branch's;
- `b_scale_pass_mb`: the per-run static B-scale launches' second read of the weights (0 since they run at load);
- `weights_*_mb`: the stored weights' share of those bytes alone.
Modelled, no device: the runtime's decision functions name what each launch reads; the byte counts are
Kernel.bytes_loaded's. Writes reports/bench/stored_reads.csv.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Callable

import pandas as pd

from bench.fusion import GENOMES
from bench.storage_decode import SMOLLM2
from luminal_num.codegen.cuda_kernels import render_kernel
from luminal_num.codegen.cuda_weight_only import stored_operand, weight_only_gemm
from luminal_num.codegen.llir import Kernel, KernelKind, Program
from luminal_num.hlir.symbolic import evaluate
from luminal_num.models.llama import build_decode, random_weights
from luminal_num.runtime.latency import kernel_works, stored_weights
from luminal_num.search.recipes import pick
from luminal_num.search.space import SearchSpace

OUT = Path("reports/bench")
STORED_GENOMES = ("BF16", "W8A16 INT8 per-channel", "W4A16 INT4 group 128", "FP8 W8A8 dynamic per-token")


def bytes_read(program: Program, bindings, reads_parts: Callable[[Kernel, Program], bool],
               weights_only: bool = False) -> float:
    """Every launched kernel's bytes loaded, a stored weight at its stored bytes only for a kernel that
    reads its parts (else its FP32 buffer's), KV caches at their format's (unchanged by this item);
    `weights_only`: the stored weights' share alone."""
    dtypes = program.dtypes()
    every = program.element_bytes(bindings)
    weights = stored_weights(program)
    others = {b: v for b, v in every.items() if b not in weights}
    scales = {k.id: k.scales_bytes(bindings) for k in program.kernels if k.kind is KernelKind.QUANTIZE}
    total = 0.0
    for k in program.launched():
        read_as = every if reads_parts(k, program) else others
        total += k.bytes_loaded(bindings, dtypes, read_as) + sum(scales.get(i.buffer, 0) for i in k.inputs)
        if weights_only:  # less the same kernel with every stored weight weighing nothing
            total -= k.bytes_loaded(bindings, dtypes, {**read_as, **dict.fromkeys(weights, 0.0)}) + sum(
                scales.get(i.buffer, 0) for i in k.inputs)
    return total


def b_scale_pass(program: Program, bindings) -> float:
    """Bytes per-run B-scale launches read: a variant with static B scales (FP8 / INT8 per channel, blocks, MX)
    recomputed them on the device each run from all of B, reading the weight once more. Since issue 33 they
    are at-load launches (KernelSource.at_load: once per preparation), so no run's launches hold one and this
    is 0; it stays as the check that none comes back."""
    dtypes, every = program.dtypes(), program.element_bytes(bindings)
    total = 0.0
    for k in program.launched():
        if k.kind.is_gemm and any(launch.entry.endswith("_scale1") for launch in render_kernel(k, program).launches):
            b = program.kernel(k.inputs[1].buffer)
            per = every.get(b.id, dtypes[b.id].itemsize) if stored_operand(k, program) is not None else b.dtype.itemsize
            total += per * float(evaluate(k.layout.k * k.layout.n, bindings))
    return total


def main_pricing(program: Program, bindings) -> float:
    """main's kernel_works: every stored weight charged its stored bytes, whoever reads it."""
    return bytes_read(program, bindings, lambda k, p: True)


def measure(layers: int, max_cache: int) -> pd.DataFrame:
    start = time.perf_counter()
    config = SMOLLM2.with_layers(layers)
    model = build_decode(config, random_weights(config), max_cache)
    bindings = model.graph.bind_symbols(model.make_inputs([1], [3]))
    space = SearchSpace.build(model.graph, fusion=True)
    print(f"built {layers} layers in {time.perf_counter() - start:.1f} s")
    rows = []
    for label in STORED_GENOMES:
        program = space.program(pick(space, GENOMES[label].__contains__))
        gemms = [k for k in program.launched() if k.kind.is_gemm and stored_operand(k, program) is not None]
        before = bytes_read(program, bindings, lambda k, p: weight_only_gemm(k, p) is not None)
        after = bytes_read(program, bindings, lambda k, p: stored_operand(k, p) is not None)
        priced = sum(w.bytes_read for w in kernel_works(program, bindings))
        rows.append(dict(genome=label, layers=layers, stored_weight_gemms=len(gemms),
                         dedicated_kernel_gemms=sum(weight_only_gemm(k, program) is not None for k in gemms),
                         read_before_mb=before / 1e6, priced_before_mb=main_pricing(program, bindings) / 1e6,
                         read_after_mb=after / 1e6, priced_after_mb=priced / 1e6,
                         b_scale_pass_mb=b_scale_pass(program, bindings) / 1e6,
                         weights_read_before_mb=bytes_read(program, bindings, lambda k, p: weight_only_gemm(k, p) is not None,
                                                           True) / 1e6,
                         weights_priced_before_mb=bytes_read(program, bindings, lambda k, p: True, True) / 1e6,
                         weights_read_after_mb=bytes_read(program, bindings, lambda k, p: stored_operand(k, p) is not None,
                                                          True) / 1e6))
        r = rows[-1]
        print(f"{label:28s} {len(gemms):4d} Gemms on stored weights: before read {r['read_before_mb']:8.2f} MB, "
              f"priced {r['priced_before_mb']:8.2f} MB; after read {r['read_after_mb']:8.2f} MB, "
              f"priced {r['priced_after_mb']:8.2f} MB; B-scale launches {r['b_scale_pass_mb']:7.2f} MB; weights alone: "
              f"before read {r['weights_read_before_mb']:8.2f} MB, priced {r['weights_priced_before_mb']:8.2f} MB, "
              f"after read {r['weights_read_after_mb']:8.2f} MB")
    return pd.DataFrame(rows)


def main(argv=None) -> pd.DataFrame:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--layers", type=int, default=SMOLLM2.num_hidden_layers)
    ap.add_argument("--max-cache", type=int, default=256)
    args = ap.parse_args(argv)
    df = measure(args.layers, args.max_cache)
    OUT.mkdir(parents=True, exist_ok=True)
    df.to_csv(OUT / "stored_reads.csv", index=False)
    return df


if __name__ == "__main__":
    main()
