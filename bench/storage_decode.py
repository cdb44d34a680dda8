"""Modelled bytes and H200 latency of a SmolLM2-135M-shaped decode step per precision recipe.

The step is built with models/llama.py (30 layers, hidden 576, 9/3 heads, FFN 1536, vocab 49152, tied
embedding / LM head, RoPE theta 1e5; random weights: the cost model reads shapes, not values). Per
genome it reports kernels, bytes moved and modelled latency (runtime/latency.py, CUDA graph on), and a
hand count written independently of the cost model: every weight's stored bytes from its format's
definition (elements x bits / 8 + one scale per channel / group at the scale's size; the embedding
Gather reads one row, the tied LM head the whole table) + the KV cache the attention reads + the
activations (every activation buffer written once and read once: the FP32 genome's non-weight bytes
counted from buffer sizes). Writes reports/bench/storage_decode.csv.
"""
from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import numpy as np
import pandas as pd

from luminal_num.models.llama import LlamaConfig, build_decode, random_weights, weight_shapes
from luminal_num.runtime.latency import kernel_works, modelled_latency
from luminal_num.search.recipes import BF16_WEIGHTS, STORAGE_RECIPES, pick
from luminal_num.search.space import SearchSpace

OUT = Path("reports/bench")
SMOLLM2 = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                      num_key_value_heads=3, vocab_size=49152, rms_norm_eps=1e-5, rope_theta=1e5,
                      max_position_embeddings=2048, tie_word_embeddings=True)
EMBED = "model.embed_tokens.weight"

# genome label -> (tags it sets, weight bits, scale bytes per (row, K) weight), in the order the
# latency must decrease. Scales by definition: fp8/int8 per channel one FP32 per row; int4 g128 one
# FP16 per 128 elements of a row.
RECIPES = {
    "FP32": (frozenset(), 32, lambda r, k: 0),
    "BF16": (BF16_WEIGHTS, 16, lambda r, k: 0),
    "FP8 W8A8": (STORAGE_RECIPES["FP8 W8A8 dynamic per-token"], 8, lambda r, k: 4 * r),
    "W8A16": (STORAGE_RECIPES["W8A16 INT8 per-channel"], 8, lambda r, k: 4 * r),
    "W4A16": (STORAGE_RECIPES["W4A16 INT4 group 128"], 4, lambda r, k: 2 * r * math.ceil(k / 128)),
}


def hand_weight_bytes(config: LlamaConfig, bits: int, scales) -> float:
    total = 0.0
    for name, shape in weight_shapes(config).items():
        if len(shape) != 2:
            total += 4 * shape[0]  # norm gains stay FP32
            continue
        rows, k = shape
        full = rows * k * bits / 8 + scales(rows, k)
        total += full if name != EMBED else full + full / rows  # tied head reads it all; the Gather one row
    return total


def measure(config: LlamaConfig, max_cache: int) -> pd.DataFrame:
    """One row per recipe (RECIPES order): kernels, modelled bytes, the hand count, H200 latency."""
    start = time.perf_counter()
    model = build_decode(config, random_weights(config), max_cache)
    space = SearchSpace.build(model.graph, fusion=False)  # storage recipes alone (Gemm fusion: bench/fusion.py)
    inputs = model.make_inputs([1], [3])
    bindings = model.graph.bind_symbols(inputs)
    print(f"built {config.num_hidden_layers} layers in {time.perf_counter() - start:.1f} s")
    kv = 2 * config.num_hidden_layers * max_cache * config.kv_dim * 4  # the attention reads both caches
    rows, activations = [], None
    for label, (tags, bits, scales) in RECIPES.items():
        program = space.program(pick(space, tags.__contains__))
        works = kernel_works(program, bindings)
        moved = sum(w.bytes_read + w.bytes_written for w in works)
        lat = modelled_latency(program, "h200", bindings)
        weights = hand_weight_bytes(config, bits, scales)
        if activations is None:  # the FP32 genome: every non-weight, non-KV byte is an activation
            activations = moved - weights - kv
        hand = weights + kv + activations
        rows.append(dict(genome=label, kernels=len(works), bytes_moved=moved, hand_count=hand,
                         ratio=moved / hand, weight_bytes=weights, kv_bytes=kv, activation_bytes=activations,
                         h200_latency_ms=1e3 * lat.total_s))
        print(f"{label:9s} {len(works):5d} kernels  {moved / 1e6:8.2f} MB (hand {hand / 1e6:8.2f}, "
              f"x{moved / hand:.4f})  {1e3 * lat.total_s:.6f} ms")
    return pd.DataFrame(rows)


def main(argv=None) -> pd.DataFrame:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--layers", type=int, default=SMOLLM2.num_hidden_layers)
    ap.add_argument("--max-cache", type=int, default=256)
    args = ap.parse_args(argv)
    df = measure(SMOLLM2.with_layers(args.layers), args.max_cache)
    OUT.mkdir(parents=True, exist_ok=True)
    df.to_csv(OUT / "storage_decode.csv", index=False)
    return df


if __name__ == "__main__":
    main()
