"""SmolLM2's "GGUF source blocks kept" baseline priced beside FP32 and W8A16 (issue 32, item 4): the demo's
decode step (decode:8@64) built, its space saturated, each plan lowered and its latency modelled kernel by
kernel (runtime/launch_form.program_latency on the first calibration batch). No search, no judging, no run:
the kept plan's error is the FP32 plan's (tests/test_gguf_baseline.py), so only its price is in question.
The last row keeps the blocks with BF16 Gemms: not a baseline (it rounds activations), a reference point.

`python -m bench.gguf_kept --layers 2` (a few seconds); without --layers, all 30 layers (~35 s, 1.6-2.0 GB).
"""
from __future__ import annotations

import argparse

from luminal_num.models.registry import llm_job
from luminal_num.runtime.launch_form import program_latency
from luminal_num.search.recipes import GGUF_KEPT_BASELINE, KEPT_TAGS, baselines, pick
from luminal_num.search.space import SearchSpace

ROWS = ("FP32 everywhere", "W8A16 INT8 per-channel", GGUF_KEPT_BASELINE, "BF16 autocast")
KEPT_BF16 = "GGUF blocks kept + BF16 Gemms (not a baseline)"


def run(layers: int | None, targets: tuple[str, ...]) -> list[dict]:
    job = llm_job("smollm2", layers=layers, positions_minimum=0)
    space = SearchSpace.build(job.graph)
    genomes, refused = baselines(space)
    if GGUF_KEPT_BASELINE not in genomes:
        raise SystemExit(f"{GGUF_KEPT_BASELINE} refused: {refused.get(GGUF_KEPT_BASELINE, 'no GGUF weights')}")
    genomes[KEPT_BF16] = pick(space, (KEPT_TAGS | {"gemm:bf16"}).__contains__)
    bindings = job.graph.bind_symbols(job.calibration[0])
    rows = []
    for name in (*ROWS, KEPT_BF16):
        program = space.program(genomes[name])
        for target in targets:
            lat = program_latency(program, target, bindings, job.graph.weights, job.calibration[0])
            gemm_s = sum(s for label, s in lat.per_kernel if "KGemm" in label)
            rows.append({"plan": name, "target": target, "latency_us": round(lat.total_s * 1e6, 2),
                         "gemm_kernels_us": round(gemm_s * 1e6, 2), "kernels": len(lat.per_kernel)})
    return rows


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--targets", default="h200,h200-measured")
    args = ap.parse_args(argv)
    rows = run(args.layers, tuple(args.targets.split(",")))
    for r in rows:
        print(f"{r['target']:14s} {r['plan']:48s} {r['latency_us']:9.2f} us  (Gemm kernels {r['gemm_kernels_us']:.2f} us,"
              f" {r['kernels']} kernels)")
    return rows


if __name__ == "__main__":
    main()
