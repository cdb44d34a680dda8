"""The judge's inner loop: the FP64 reference of a SmolLM2-shaped decoder against the FP64 BLAS time of
its own matmuls, and seconds per measured candidate (lowering + CPU emulation + comparison) on MiniLM
and the SmolLM2-shaped model.

SmolLM2-135M's shapes (30 layers, hidden 576, 9 heads / 3 KV heads, FFN 1536, vocab 49152, tied
embeddings, rope_theta 1e5) with seeded random weights: the timings depend on shapes, not values.
The script only uses APIs that predate issue 18, so the same file times an older tree
(`PYTHONPATH=<old tree> python -m bench.judge_loop --label before`); each run appends its rows,
labelled, to reports/bench/judge_loop.csv, with the 1-minute load average at start and end (the
machine is shared: seconds taken at different loads are not comparable).
"""
from __future__ import annotations

import argparse
import os
import time
import warnings
from pathlib import Path

import numpy as np
import pandas as pd

from luminal_num.error.budget import Budget
from luminal_num.error.judge import Judge
from luminal_num.hlir import evaluate
from luminal_num.hlir.graph import Graph
from luminal_num.hlir.ops import Op
from luminal_num.hlir.symbolic import evaluate as eval_dim
from luminal_num.models.llama import LlamaConfig, build_decode, build_prefill, random_weights
from luminal_num.search.space import SearchSpace

OUT = Path("reports/bench")
CSV = "judge_loop.csv"
SMOLLM2_SHAPED = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                             num_key_value_heads=3, vocab_size=49152, rms_norm_eps=1e-5, rope_theta=1e5,
                             max_position_embeddings=2048, tie_word_embeddings=True)
CANDIDATE_TAGS = ("f32", "gemm:bf16", "gemm:f8e4m3_tensor", "gemm:f8e4m3_block", "gemm:f16acc16")


def best_of(fn, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def matmul_shapes(graph: Graph, bindings) -> list[tuple[int, int, int, int]]:
    """(batch, M, K, N) of every matmul-shaped Mul+SumReduce in the graph (the Gemms of the model)."""
    from luminal_num.hlir.gemm import gemm_layouts, split_operand
    consumers = graph.consumers()
    out = []
    for node in graph.nodes:
        if node.op is not Op.SUM_REDUCE:
            continue
        mul = graph.nodes[node.srcs[0].node]
        if mul.op is not Op.MUL or consumers[mul.id] != [node.id]:
            continue
        lays = gemm_layouts(split_operand(mul.srcs[0].view)[1], split_operand(mul.srcs[1].view)[1], node.attr("axis"))
        if lays:
            lay = lays[-1]
            out.append(tuple(int(eval_dim(d, bindings)) for d in (lay.batch, lay.m, lay.k, lay.n)))
    return out


def blas_seconds(shapes, rounds: int) -> float:
    """FP64 BLAS time of those matmuls alone, on contiguous float64 operands made up front."""
    rng = np.random.default_rng(0)
    operands = {s: (rng.standard_normal((s[0], s[1], s[2])), rng.standard_normal((s[0], s[2], s[3])))
                for s in set(shapes)}
    return best_of(lambda: [np.matmul(*operands[s]) for s in shapes], rounds)


def smollm2_models(prompt: int, max_cache: int):
    weights = random_weights(SMOLLM2_SHAPED, seed=0)
    rng = np.random.default_rng(1)
    prefill = build_prefill(SMOLLM2_SHAPED, weights, seq=prompt, max_cache=max_cache)
    decode = build_decode(SMOLLM2_SHAPED, weights, max_cache=max_cache)
    p_in = prefill.make_inputs(rng.integers(0, SMOLLM2_SHAPED.vocab_size, prompt), np.arange(prompt))
    d_in = decode.make_inputs(rng.integers(0, SMOLLM2_SHAPED.vocab_size, 1), np.array([prompt]),
                              cached_rows=prompt)
    return {"smollm2_prefill": (prefill.graph, p_in), "smollm2_decode": (decode.graph, d_in)}


def reference_rows(models, rounds: int) -> list[dict]:
    rows = []
    for name, (graph, inputs) in models.items():
        evaluate(graph, inputs)  # warm: converted weights are cached from here on (where the tree caches)
        ref = best_of(lambda: evaluate(graph, inputs), rounds)
        shapes = matmul_shapes(graph, graph.bind_symbols(inputs))
        blas = blas_seconds(shapes, rounds)
        rows.append(dict(measure="fp64_reference", model=name, seconds=ref, blas_seconds=blas,
                         ratio_vs_fp64_blas=ref / blas, matmuls=len(shapes),
                         gflop=2 * sum(np.prod(s) for s in shapes) / 1e9))
    return rows


def candidate_rows(name: str, graph: Graph, calibration, budget: str, rounds: int, tags) -> list[dict]:
    """Seconds per measured candidate: lowering its genome, then the judge's measured verdict."""
    t0 = time.perf_counter()
    space = SearchSpace.build(graph)
    build = time.perf_counter() - t0
    t0 = time.perf_counter()
    judge = Judge(graph, Budget.parse(budget), list(calibration), use_static=False)
    refs = time.perf_counter() - t0
    rows = []
    for tag in tags:
        genome = frozenset((gk, k.cls, tag) for gk, ks in space.knobs.items() for k in ks if tag in k.tags)
        if tag != "f32" and not genome:
            continue

        def one():
            space._extracted.clear()  # lower from scratch, as for a new genome
            judge.runner.measure(space.program(genome))
        one()  # warm (caches that persist across candidates stay warm, as in a search)
        rows.append(dict(measure="seconds_per_candidate", model=name, candidate=tag, seconds=best_of(one, rounds),
                         space_build_seconds=build, reference_seconds=refs, batches=len(calibration)))
    return rows


def run(label: str, rounds: int = 2, prompt: int = 5, max_cache: int = 64, with_minilm: bool = True,
        tags=CANDIDATE_TAGS) -> pd.DataFrame:
    warnings.filterwarnings("ignore", category=RuntimeWarning)
    load_start = os.getloadavg()[0]
    models = smollm2_models(prompt, max_cache)
    rows = reference_rows(models, rounds)
    graph, inputs = models["smollm2_prefill"]
    rows += candidate_rows("smollm2_prefill", graph, [inputs], "atol=5e-2,rtol=5e-2,outputs=logits", rounds, tags)
    if with_minilm:
        from luminal_num.models.registry import minilm_job
        job = minilm_job()
        rows += candidate_rows("minilm", job.graph, job.calibration[:1], job.default_budget, rounds, tags)
    df = pd.DataFrame(rows)
    df.insert(0, "tree", label)
    df["load_1min_start"], df["load_1min_end"] = load_start, os.getloadavg()[0]  # the shared machine's load
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / CSV
    old = pd.read_csv(path) if path.exists() else pd.DataFrame()
    if "tree" in old:
        old = old[old.tree != label]
    pd.concat([old, df], ignore_index=True).to_csv(path, index=False)
    return df


def main(argv=None) -> pd.DataFrame:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--label", default="after", help="names this tree's rows in the CSV (e.g. before / after)")
    ap.add_argument("--rounds", type=int, default=2, help="best of this many runs per figure")
    ap.add_argument("--no-minilm", action="store_true", help="only the SmolLM2-shaped model")
    ap.add_argument("--tags", default=",".join(CANDIDATE_TAGS), help="candidate genomes (precision tags)")
    args = ap.parse_args(argv)
    df = run(args.label, args.rounds, with_minilm=not args.no_minilm, tags=tuple(args.tags.split(",")))
    with pd.option_context("display.width", 200, "display.max_columns", 20):
        print(df.to_string(index=False))
    return df


if __name__ == "__main__":
    main()
