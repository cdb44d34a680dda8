"""MiniLM's baseline programs priced with and without the tensor-core Gemm (codegen/cuda_gemm_tc.py): the
modelled latency bench.strict_budget compares (runtime/launch_form.program_latency, kernel by kernel) on the
H200 roofline and on the H200 measured-class target, once as the dispatch decides today and once with
every tensor-core kernel refused (what ran before: the tiled SIMT kernel). No search, no judging: each
baseline genome is lowered and priced, and its Gemms counted by implementation.

`python -m bench.tensor_core_baselines [--batch 4]` prints the table (a few CPU seconds after the model loads).
"""
from __future__ import annotations

import argparse
import collections
from unittest import mock

from luminal_num.codegen import cuda_dispatch
from luminal_num.models.registry import minilm_job
from luminal_num.runtime.cost import UnsupportedOnTarget
from luminal_num.runtime.latency import kernel_works
from luminal_num.runtime.launch_form import program_latency
from luminal_num.search.recipes import baseline_genomes
from luminal_num.search.space import SearchSpace

TARGETS = ("h200", "h200-measured")
BASELINES = ("FP32 everywhere", "TF32 flag", "BF16 autocast", "FP8 everywhere", "FP8 W8A8 dynamic per-token")


def price(program, bindings) -> dict:
    out = {}
    for target in TARGETS:
        try:
            out[target] = program_latency(program, target, bindings).total_s * 1e6
        except UnsupportedOnTarget as e:
            out[target] = f"unsupported ({e})"
    gemms = collections.Counter(w.implementation for w, k in zip(kernel_works(program, bindings), program.launched())
                                if k.kind.is_gemm)
    out["gemms"] = dict(sorted(gemms.items()))
    return out


def run(batch: int) -> list[dict]:
    job = minilm_job(batch)
    space = SearchSpace.build(job.graph)
    bindings = job.graph.bind_symbols(job.calibration[0])
    genomes = baseline_genomes(space)
    rows = []
    for name in BASELINES:
        if name not in genomes:
            rows.append({"baseline": name, "missing": sorted(genomes)})
            continue
        program = space.program(genomes[name])
        after = price(program, bindings)
        with mock.patch.object(cuda_dispatch, "tensor_core_refusal", lambda k, p: "disabled: the tiled kernel as before"):
            before = price(program, bindings)
        rows.append({"baseline": name, "before": before, "after": after})
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batch", type=int, default=4)
    for row in run(ap.parse_args(argv).batch):
        print(row)


if __name__ == "__main__":
    main()
