"""Launched kernels per layer, bytes moved and modelled H200 latency with the fusion rules off and on.

Issue 16: decode latency of small models is launches, not bytes. For a SmolLM2-135M-shaped decode step
(the config of bench/storage_decode.py: 30 layers, hidden 576, 9/3 heads, random weights: the cost
model reads shapes) and MiniLM (all-MiniLM-L6-v2, its calibration batch), each space is built with
`SearchSpace.build(graph, fusion=...)`; every fusion rule any module registers is in it, so kinds added
later show up here unchanged. Per space and genome (FP32, BF16, the storage recipes of
search/recipes.py) the plan is lowered and modelled (runtime/latency.py, CUDA graph on); the row
marked `fastest` is the genome with the lowest modelled latency (the budget is not applied: this
bench is about launches). Layers are the chunks of the largest group (structurally identical layers);
`kernels_per_layer` is the most any of them launches. Writes reports/bench/fusion.csv.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import pandas as pd

from luminal_num.models.llama import build_decode, random_weights
from luminal_num.models.registry import minilm_job
from luminal_num.runtime.latency import kernel_works, modelled_latency
from luminal_num.runtime.targets import get_target
from luminal_num.search.recipes import BF16_WEIGHTS, STORAGE_RECIPES, pick
from luminal_num.search.space import SearchSpace
from .storage_decode import SMOLLM2

OUT = Path("reports/bench")
TARGET = "h200"
_PLAIN = {"FP32": frozenset(), "BF16": BF16_WEIGHTS, **STORAGE_RECIPES}
# fused attention is a knob choice (attn: tags, search/rules/fuse_attention.py): each genome also with it,
# FP32 attention in the FP32 genome, BF16 operands in the others (absent from a space without fusion)
GENOMES = {**_PLAIN, **{f"{label} + fused attention": tags | {"attn:flash_f32" if label == "FP32" else "attn:flash_bf16"}
                        for label, tags in _PLAIN.items()}}


def _cases(layers: int, max_cache: int, with_minilm: bool):
    """(model name, graph, shape bindings) of each benchmarked step."""
    config = SMOLLM2.with_layers(layers)
    model = build_decode(config, random_weights(config), max_cache)
    yield "SmolLM2-135M decode", model.graph, model.graph.bind_symbols(model.make_inputs([1], [3]))
    if with_minilm:
        job = minilm_job()
        yield "MiniLM-L6 encoder", job.graph, job.graph.bind_symbols(job.calibration[0])


def measure(name: str, graph, bindings, fusion: bool) -> list[dict]:
    start = time.perf_counter()
    space = SearchSpace.build(graph, fusion=fusion)
    layers = max(space.part.groups, key=lambda g: len(g.chunks)).chunks
    layer_ids = {c.index for c in layers}
    launch_s = get_target(TARGET).graph_launch_s
    rows = []
    for label, tags in GENOMES.items():
        program = space.program(pick(space, tags.__contains__))
        launched = program.launched()
        per_layer = [sum(k.chunk == c for k in launched) for c in sorted(layer_ids)]
        works = kernel_works(program, bindings)
        lat = modelled_latency(program, TARGET, bindings).total_s
        rows.append(dict(model=name, fusion="on" if fusion else "off", genome=label, kernels=len(launched),
                         layers=len(layers), kernels_per_layer=max(per_layer),
                         kernels_outside_layers=sum(k.chunk not in layer_ids for k in launched),
                         bytes_moved=sum(w.bytes_moved for w in works), h200_latency_ms=1e3 * lat,
                         launch_ms=1e3 * launch_s * len(launched), launch_share=launch_s * len(launched) / lat,
                         fastest=False))
    best = min(range(len(rows)), key=lambda i: rows[i]["h200_latency_ms"])
    rows[best]["fastest"] = True
    r = rows[best]
    print(f"{name:20s} fusion {r['fusion']:3s}: fastest {r['genome']:28s} {r['kernels']:5d} kernels "
          f"({r['kernels_per_layer']} per layer), {r['bytes_moved'] / 1e6:8.2f} MB, {r['h200_latency_ms']:.4f} ms, "
          f"launch share {r['launch_share']:.2f}  [{time.perf_counter() - start:.1f} s]")
    return rows


def run(layers: int = SMOLLM2.num_hidden_layers, max_cache: int = 256, with_minilm: bool = True) -> dict:
    """Writes fusion.csv; returns the headline figures of the fastest plans (for SUMMARY.md)."""
    rows = []
    for name, graph, bindings in _cases(layers, max_cache, with_minilm):
        for fusion in (False, True):
            rows += measure(name, graph, bindings, fusion)
    df = pd.DataFrame(rows)
    OUT.mkdir(parents=True, exist_ok=True)
    df.to_csv(OUT / "fusion.csv", index=False)
    fastest = df[df.fastest]
    return {f"{r.model} fusion {r.fusion}: kernels per layer / total / H200 ms / launch share":
            f"{r.kernels_per_layer} / {r.kernels} / {r.h200_latency_ms:.4f} / {r.launch_share:.2f}"
            for r in fastest.itertuples()}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--layers", type=int, default=SMOLLM2.num_hidden_layers)
    ap.add_argument("--max-cache", type=int, default=256)
    ap.add_argument("--no-minilm", action="store_true", help="the SmolLM2 step only")
    args = ap.parse_args(argv)
    return run(args.layers, args.max_cache, not args.no_minilm)


if __name__ == "__main__":
    main()
