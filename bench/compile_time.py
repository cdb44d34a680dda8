"""Compile time per stage (partition, saturate, enumerate, search) and e-graph sizes per group.

Dedupe shows as a 32-layer Llama costing about what a 2-layer one does in the front end (partition +
saturate + enumerate), because identical layers share one saturation; the search still runs the whole
model per candidate, so its time grows with depth. Each measurement is repeated and the minimum kept
(the machine is shared and noisy), except MiniLM's minutes-long search pass (see ModelCase).
"""
from __future__ import annotations

import argparse
import time
import warnings
from dataclasses import dataclass
from typing import Callable

import numpy as np
import pandas as pd

from luminal_num.compiler import compile
from luminal_num.error.budget import Budget
from luminal_num.hlir.partition import partition
from luminal_num.models.registry import ModelJob, llama_tiny_job, minilm_job
from luminal_num.search.choice import random_candidate
from luminal_num.search.search import SearchOptions
from luminal_num.search.space import SearchSpace

from .summary import write_csv

FRONT_END = ("partition_s", "saturate_s", "enumerate_s")


@dataclass(frozen=True)
class ModelCase:
    name: str
    layers: int
    load: Callable[[], ModelJob]
    # MiniLM's search pass takes minutes (its candidates run a real encoder on the CPU emulator), where
    # the machine's noise is a small share; it runs once, the sub-second stages are still repeated.
    search_once: bool = False


def cases(layers: list[int], with_minilm: bool) -> list[ModelCase]:
    out = [ModelCase(f"llama_tiny{n}", n, lambda n=n: llama_tiny_job(layers=n)) for n in layers]
    return out + ([ModelCase("minilm", 6, minilm_job, search_once=True)] if with_minilm else [])


def time_once(job: ModelJob, draws: int, search_candidates: int, seed: int,
              with_search: bool = True) -> tuple[dict, list[dict]]:
    """One pass over every stage: seconds per stage, plus one row per group (sizes and its timings).

    enumerate_s is the time to draw one random candidate for every group (one whole-model candidate),
    averaged over `draws` draws; search_s is `compile` on that freshly built space (FP64 references,
    numerics gate, the search for `search_candidates` candidates plus the four baselines, the plan),
    left out when `with_search` is False.
    """
    t0 = time.perf_counter()
    partition(job.graph)
    partition_s = time.perf_counter() - t0
    space = SearchSpace.build(job.graph)
    rng = np.random.default_rng(seed)
    groups = []
    for gi, g in enumerate(space.part.groups):
        gs = space.groups[g.key]
        t1 = time.perf_counter()
        for _ in range(draws):
            random_candidate(gs.space, rng)
        groups.append(dict(group=gi, chunks=len(g.chunks), ops_per_chunk=len(g.representative.nodes),
                           e_classes=gs.stats.e_classes, e_nodes=gs.stats.e_nodes,
                           gemm_layouts=gs.stats.gemm_candidates, knobs=len(space.knobs[g.key]),
                           encode_s=gs.stats.encode_s, saturate_s=gs.stats.saturate_s, read_s=gs.stats.read_s,
                           enumerate_s=(time.perf_counter() - t1) / draws))
    stages = dict(partition_s=partition_s,
                  saturate_s=sum(r["encode_s"] + r["saturate_s"] + r["read_s"] for r in groups),
                  enumerate_s=sum(r["enumerate_s"] for r in groups))
    if with_search:
        t2 = time.perf_counter()
        result = compile(job.graph, Budget.parse(job.default_budget), calibration=job.calibration, space=space,
                         options=SearchOptions(seed=seed, max_candidates=search_candidates, progress=False))
        stages |= dict(search_s=time.perf_counter() - t2, search_evaluated=len(result.search.evaluated))
    return stages, groups


def measure(case: ModelCase, repeats: int, draws: int, search_candidates: int) -> tuple[dict, list[dict]]:
    """Minimum of `repeats` passes, per stage and per group timing; sizes are the same in every pass."""
    job = case.load()
    passes = [time_once(job, draws, search_candidates, seed=0, with_search=i == 0 or not case.search_once)
              for i in range(repeats)]
    stages = {k: min(p[0][k] for p in passes if k in p[0]) if k.endswith("_s") else v
              for k, v in passes[0][0].items()}  # seconds: the minimum; counts: the first pass's
    groups = [{**rows[0], **{k: min(r[k] for r in rows) for k in ("encode_s", "saturate_s", "read_s", "enumerate_s")}}
              for rows in zip(*(p[1] for p in passes))]
    head = dict(model=case.name, layers=case.layers, chunks=sum(g["chunks"] for g in groups), groups=len(groups),
                e_nodes=sum(g["e_nodes"] for g in groups), e_classes=sum(g["e_classes"] for g in groups),
                passes=repeats, search_passes=1 if case.search_once else repeats)
    return {**head, **stages, "front_end_s": sum(stages[k] for k in FRONT_END)}, \
        [dict(model=case.name, **g) for g in groups]


def run(layers: tuple[int, ...] = (2, 8, 32), with_minilm: bool = True, repeats: int = 3, draws: int = 20,
        search_candidates: int = 4) -> dict:
    warnings.filterwarnings("ignore", category=RuntimeWarning)  # intervals overflowing to inf are verdicts
    models, groups = [], []
    SearchSpace.build(cases(list(layers), False)[0].load().graph)  # warm-up: egglog's first e-graph is slower
    for case in cases(list(layers), with_minilm):
        row, group_rows = measure(case, repeats, draws, search_candidates)
        models.append(row)
        groups += group_rows
        print(f"[compile_time] {case.name}: front end {row['front_end_s']!r} s, search {row['search_s']!r} s")
    df = pd.DataFrame(models)
    df["search_s_per_candidate"] = df.search_s / df.search_evaluated
    write_csv(df, "compile_time.csv")
    write_csv(pd.DataFrame(groups), "compile_time_groups.csv")
    llama = df[df.model.str.startswith("llama")].sort_values("layers")
    small, large = llama.iloc[0], llama.iloc[-1]
    return {f"llama front-end seconds ({int(r.layers)} layers)": float(r.front_end_s) for r in llama.itertuples()} | {
        f"llama front-end ratio {int(large.layers)} / {int(small.layers)} layers":
            float(large.front_end_s / small.front_end_s),
        f"llama search ratio {int(large.layers)} / {int(small.layers)} layers (per candidate)":
            float(large.search_s_per_candidate / small.search_s_per_candidate),
        **({"minilm front-end seconds": float(df.loc[df.model == "minilm", "front_end_s"].item())}
           if with_minilm else {}),
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 8, 32], help="Llama-tiny depths")
    ap.add_argument("--no-minilm", action="store_true", help="skip MiniLM")
    ap.add_argument("--repeats", type=int, default=3, help="passes per model; the minimum is kept")
    ap.add_argument("--search-candidates", type=int, default=4, help="candidates the timed search evaluates")
    args = ap.parse_args(argv)
    figures = run(args.layers, not args.no_minilm, args.repeats, search_candidates=args.search_candidates)
    for k, v in figures.items():
        print(f"{k}: {v!r}")
    return figures


if __name__ == "__main__":
    main()
