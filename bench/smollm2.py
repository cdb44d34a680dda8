"""SmolLM2-135M decode: what judging one candidate costs end to end, what the FP64 reference costs, and
the token-level error of the uniform precision choices (FP32, TF32, BF16, FP16, INT8 weights, FP8).

The judge is the search's inner loop: its FP64 reference is paid once per calibration batch, every
candidate then pays a CPU-backend run of each batch through all layers. Both are timed here on the real
job (the bundled GGUF, the shipped calibration prompts teacher-forced on the FP64 continuation), with
each candidate's next-token top-1 agreement and KL(FP64 || plan) on the calibration and held-out sets.
The FP32 row also reports its logits' normwise error against gamma_n(FP32) of the longest dot product.
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import pandas as pd

from luminal_num.error.budget import Budget
from luminal_num.error.judge import Judge
from luminal_num.error.metrics import kl_rows, top1_agreement
from luminal_num.hlir import evaluate
from luminal_num.models.registry import SMOLLM2_WORKLOAD, llm_job
from luminal_num.runtime.cpu import CpuRuntime
from luminal_num.search.space import Genome, SearchSpace

from .summary import write_csv

U_FP32 = 2.0 ** -24
# Uniform genomes: every Gemm (and, for the autocast row, every pointwise op) takes the tag.
UNIFORM = {"FP32": (), "BF16 autocast": ("gemm:bf16", "ew:bf16"), "INT8 weights (channel)": ("gemm:int8_channel",),
           "FP8 E4M3 (tensor)": ("gemm:f8e4m3_tensor",), "FP16": ("gemm:f16",), "TF32": ("gemm:tf32",)}


def gamma(n: int, u: float = U_FP32) -> float:
    return n * u / (1 - n * u)


def uniform_genome(space: SearchSpace, tags: tuple[str, ...]) -> Genome:
    return frozenset((gk, k.cls, t) for gk, ks in space.knobs.items() for k in ks
                     for t in [next((t for t in k.tags if t in tags), None)] if t is not None)


def _metrics(rt: CpuRuntime, batches, refs) -> dict:
    ys = [np.asarray(rt.run(b).outputs["logits"]) for b in batches]
    y, ref = np.concatenate(ys), np.concatenate(refs)
    kl = kl_rows(y, ref)
    return {"top1": top1_agreement(y, ref), "kl_mean": float(kl.mean()), "kl_max": float(kl.max()),
            "rel_linf": float(np.max(np.abs(y - ref)) / np.max(np.abs(ref)))}


def run(layers: int | None = None, workload: str = SMOLLM2_WORKLOAD, genomes=tuple(UNIFORM)) -> dict:
    t0 = time.perf_counter()
    job = llm_job("smollm2", workload, layers=layers)
    build_s = time.perf_counter() - t0
    budget = Budget.parse(job.default_budget)
    t0 = time.perf_counter()
    judge = Judge(job.graph, budget.tightened(0.5), list(job.calibration), use_static=False)
    reference_s = time.perf_counter() - t0
    held_refs = [evaluate(job.graph, b)["logits"] for b in job.heldout]
    cal_refs = [r["logits"] for r in judge.ev.refs]
    t0 = time.perf_counter()
    space = SearchSpace.build(job.graph)
    space_s = time.perf_counter() - t0
    c = job.llm.model.config
    longest = max(c.hidden_size, c.intermediate_size, job.llm.workload.context)
    meta = {"workload": str(job.llm.workload), "layers": c.num_hidden_layers,
            "calibration_batches": len(job.calibration), "heldout_batches": len(job.heldout),
            "job_build_s": build_s, "fp64_reference_s_per_batch": reference_s / len(job.calibration),
            "space_build_s": space_s, "longest_dot": longest, "gamma_longest_fp32": gamma(longest),
            "budget": str(budget)}
    rows = []
    for label in genomes:
        program = space.program(uniform_genome(space, UNIFORM[label]))
        t0 = time.perf_counter()
        verdict = judge.judge(program)
        judge_s = time.perf_counter() - t0
        rt = CpuRuntime(program, job.graph.weights)
        cal, held = _metrics(rt, job.calibration, cal_refs), _metrics(rt, job.heldout, held_refs)
        rows.append({"candidate": label, "judge_s": judge_s, "passes_default_budget": verdict.passed,
                     **{f"cal_{k}": v for k, v in cal.items()}, **{f"heldout_{k}": v for k, v in held.items()}})
        print(rows[-1], flush=True)
        df = pd.DataFrame(rows).assign(**meta)
        write_csv(df, "smollm2.csv")  # after every candidate: a long run leaves what it measured
    fp32 = df[df.candidate == "FP32"]
    out = {**meta, "judge_s_per_candidate (median)": float(df.judge_s.median())}
    if len(fp32):
        out["FP32 heldout top1"] = float(fp32.heldout_top1.iloc[0])
        out["FP32 rel_linf / gamma"] = float(max(fp32.cal_rel_linf.iloc[0], fp32.heldout_rel_linf.iloc[0]) / gamma(longest))
    print(out)
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--layers", type=int, default=None, help="first N layers of the real weights (default: all 30)")
    ap.add_argument("--workload", default=SMOLLM2_WORKLOAD)
    ap.add_argument("--candidates", nargs="*", default=list(UNIFORM), choices=list(UNIFORM))
    args = ap.parse_args(argv)
    return run(args.layers, args.workload, tuple(args.candidates))


if __name__ == "__main__":
    main()
