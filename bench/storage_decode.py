"""Modelled bytes and H200 latency of a SmolLM2-135M-shaped decode step per precision recipe.

The step is built with models/llama.py (30 layers, hidden 576, 9/3 heads, FFN 1536, vocab 49152, tied
embedding / LM head, RoPE theta 1e5; random weights: the cost model reads shapes, not values). Per
genome it reports kernels, bytes moved and modelled latency (runtime/latency.py, CUDA graph on), and a
hand count written independently of the cost model: every weight's stored bytes from its format's
definition (elements x bits / 8 + one scale per channel / group at the scale's size; the embedding
Gather reads one row, the tied LM head the whole table) + the KV cache the attention reads + the
activations (every activation buffer written once and read once: the FP32 genome's non-weight bytes
counted from buffer sizes). KV-cache formats (BF16 weights + a BF16 / FP16 / FP8 per-token / FP8 per-head
cache) are counted the same way: the cache read at its stored bytes (codes + one FP32 scale per row or
per head of a row), the row each step writes likewise. Writes reports/bench/storage_decode.csv.
"""
from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import numpy as np
import pandas as pd

from luminal_num.codegen.llir import KernelKind
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
# KV-cache formats on top of BF16 weights: genome label -> (kv tag, bits per element, scale bytes per
# cache row of the config). Per token one FP32 scale per row; per head one FP32 per head of a row.
KV_RECIPES = {
    "BF16 + BF16 KV": ("kv:bf16", 16, lambda c: 0),
    "BF16 + FP16 KV": ("kv:f16", 16, lambda c: 0),
    "BF16 + FP8 KV per-token": ("kv:f8e4m3_channel", 8, lambda c: 4),
    "BF16 + FP8 KV per-head": ("kv:f8e4m3_g{head}", 8, lambda c: 4 * c.num_key_value_heads),
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
    def kv_bytes(bits: int, row_scales: int, rows: int) -> float:  # both caches of every layer, `rows` rows
        return 2 * config.num_hidden_layers * rows * (config.kv_dim * bits / 8 + row_scales)

    kv_read = kv_bytes(32, 0, max_cache)  # the attention reads both caches whole
    kv_fp32_write = kv_bytes(32, 0, 1)  # the in-place Scatter writes one row each (an activation in FP32)
    genomes = [(label, tags, hand_weight_bytes(config, bits, scales), kv_read, "f32")
               for label, (tags, bits, scales) in RECIPES.items()]
    bf16 = hand_weight_bytes(config, 16, lambda r, k: 0)
    head = config.head_dim
    for label, (tag, bits, row_scales) in KV_RECIPES.items():
        tag = tag.format(head=head)
        genomes.append((label, BF16_WEIGHTS | {tag}, bf16, kv_bytes(bits, row_scales(config), max_cache),
                        tag.split(":")[1]))
    rows, activations = [], None
    for label, tags, weights, kv, kv_format in genomes:
        program = space.program(pick(space, tags.__contains__))
        held = {k.storage for k in program.kernels if k.kind is KernelKind.SCATTER_NOCOPY} - {None}
        if held != ({kv_format} - {"f32"}):
            raise SystemExit(f"{label}: the space did not offer KV format {kv_format} (got {sorted(held)})")
        works = kernel_works(program, bindings)
        moved = sum(w.bytes_read + w.bytes_written for w in works)
        lat = modelled_latency(program, "h200", bindings)
        if activations is None:  # the FP32 genome: every non-weight, non-KV byte is an activation
            activations = moved - weights - kv
        written = 0.0 if kv_format == "f32" else \
            kv_bytes(*next((b, s(config)) for t, b, s in KV_RECIPES.values() if t.format(head=head) == "kv:" + kv_format),
                     1) - kv_fp32_write
        hand = weights + kv + activations + written
        rows.append(dict(genome=label, kv_format=kv_format, kernels=len(works), bytes_moved=moved, hand_count=hand,
                         ratio=moved / hand, weight_bytes=weights, kv_bytes=kv, activation_bytes=activations + written,
                         h200_latency_ms=1e3 * lat.total_s))
        print(f"{label:24s} {len(works):5d} kernels  {moved / 1e6:8.2f} MB (hand {hand / 1e6:8.2f}, "
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
