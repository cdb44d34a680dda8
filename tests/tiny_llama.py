"""A tiny Llama prefill with its search space (rotation and GPTQ offered, smoothing on request), two input batches and the Hessians their
FP64 pass collects: the model the rotation, W8A8-head and mixed-recipe tests judge plans on (one copy, cached)."""
from __future__ import annotations

import functools

import numpy as np

from luminal_num.error.hessians import HessianCollector
from luminal_num.error.reference import references
from luminal_num.models.llama import build_prefill, random_weights
from luminal_num.search.space import SearchSpace


@functools.lru_cache(maxsize=None)
def llama_with_hessians(cfg, seq: int = 6, smoothing: bool = False):
    """(model, space, batches, hessians) for config `cfg` at `seq` tokens (`smoothing`: smoothed Gemms offered too)."""
    m = build_prefill(cfg, random_weights(cfg, seed=0), seq=seq, max_cache=8)
    space = SearchSpace.build(m.graph, rotation=True, smoothing=smoothing, calibrated=True)
    batches = tuple(m.make_inputs(np.random.default_rng(s).integers(0, cfg.vocab_size, seq), np.arange(seq))
                    for s in (1, 2))
    collector = HessianCollector(m.graph)
    references(m.graph, batches, space.part, collector)
    return m, space, batches, collector.result()
