"""Precision recipes users pick today, as genomes over a search space (labelled baselines).

A recipe is a set of tags; its genome takes, for every knob, the first of the knob's tags in the set
(weights get their storage format, Gemms their variant), so a recipe applies wherever it can.
"""
from __future__ import annotations

from typing import Callable

from .space import Genome, SearchSpace

# label -> the tags it sets (a storage format for every 2-D weight and a Gemm variant for every Gemm)
STORAGE_RECIPES: dict[str, frozenset[str]] = {
    "W8A16 INT8 per-channel": frozenset({"store:int8_channel", "gemm:bf16"}),
    "W4A16 INT4 group 128": frozenset({"store:int4_g128", "gemm:bf16"}),
    "FP8 W8A8 dynamic per-token": frozenset({"store:f8e4m3_channel", "gemm:f8e4m3_channel_prologue"}),
}
BF16_WEIGHTS = frozenset({"store:bf16", "gemm:bf16"})  # BF16 weights and BF16 Gemms (no KV-cache format yet)


def pick(space: SearchSpace, pred: Callable[[str], bool]) -> Genome:
    """For every knob of every group, its first tag satisfying `pred` (knobs with none stay FP32)."""
    out = {}
    for gk, ks in space.knobs.items():
        for k in ks:
            tag = next((t for t in k.tags if pred(t)), None)
            if tag is not None:
                out[(gk, k.cls)] = tag
    return frozenset((g, c, t) for (g, c), t in out.items())


def recipe_genomes(space: SearchSpace) -> dict[str, Genome]:
    return {name: pick(space, tags.__contains__) for name, tags in STORAGE_RECIPES.items()}
