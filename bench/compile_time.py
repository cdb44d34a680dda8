"""Compile time per stage (partition, saturate, enumerate) and e-graph sizes per group.

Dedupe shows as a 12-layer (or 32-layer) transformer costing about what a 2-layer one does, because
identical layers share one saturation. Ratios are measured in one run.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import pandas as pd

from luminal_num.hlir.partition import partition
from luminal_num.models.testnets import transformer
from luminal_num.search.choice import random_candidate
from luminal_num.search.saturate import saturate_group

OUT = Path("reports/bench")


def measure(name: str, graph, n_candidates: int = 20) -> list[dict]:
    t0 = time.perf_counter()
    part = partition(graph)
    t_part = time.perf_counter() - t0
    rows = []
    rng = np.random.default_rng(0)
    for gi, g in enumerate(part.groups):
        gs = saturate_group(graph, g)
        t1 = time.perf_counter()
        for _ in range(n_candidates):
            random_candidate(gs.space, rng)
        t_enum = (time.perf_counter() - t1) / n_candidates
        rows.append(dict(model=name, group=gi, chunks=len(g.chunks), ops_per_chunk=len(g.representative.nodes),
                         partition_s=t_part, encode_s=gs.stats.encode_s, saturate_s=gs.stats.saturate_s,
                         read_s=gs.stats.read_s, enumerate_s_per_candidate=t_enum, e_classes=gs.stats.e_classes,
                         e_nodes=gs.stats.e_nodes, gemm_layouts=gs.stats.gemm_candidates))
    return rows


def main(argv=None) -> pd.DataFrame:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 12, 32])
    args = ap.parse_args(argv)
    rows = []
    for n in args.layers:
        rows += measure(f"transformer{n}", transformer(n).graph)
    try:
        from luminal_num.models.llama import LLAMA_TINY, build_prefill, random_weights
        for n in args.layers:
            cfg = LLAMA_TINY.with_layers(n)
            rows += measure(f"llama_tiny{n}", build_prefill(cfg, random_weights(cfg, 0), seq=8, max_cache=16).graph)
    except ImportError:
        pass
    df = pd.DataFrame(rows)
    df["total_s"] = df.partition_s / df.groupby("model").group.transform("count") + df.encode_s + df.saturate_s + df.read_s
    OUT.mkdir(parents=True, exist_ok=True)
    df.to_csv(OUT / "compile_time.csv", index=False)
    totals = df.groupby("model", sort=False).agg(chunks=("chunks", "sum"), groups=("group", "count"),
                                                 total_s=("total_s", "sum"))
    base = {m: totals.loc[m, "total_s"] for m in totals.index if m.endswith(str(args.layers[0]))}
    totals["ratio_vs_smallest"] = [totals.loc[m, "total_s"] / base[m.rstrip("0123456789") + str(args.layers[0])]
                                   for m in totals.index]
    totals.to_csv(OUT / "compile_time_summary.csv")
    print(df.to_string(index=False))
    print(totals.to_string())
    return df


if __name__ == "__main__":
    main()
