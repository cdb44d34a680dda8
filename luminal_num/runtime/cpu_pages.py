"""Which file-backed weight pages a streaming CPU run gives back, and after which kernel.

Why: a whole-model run reads every weight once; a process that keeps every page it touched mapped holds
the whole model in its resident set after one run (15.5 GB for a Gemma-3-4B shape), whereas a model
larger than the memory budget compiles only when each layer's pages go once the layer has run
(memory.MemoryPlan.streaming). The program says when: a weight is read by the EXTERNAL kernels made from
it (as is, in a storage format, concatenated with others) until their last reader has run. Releasing
earlier would only cost a re-read (the values are the file's), never a wrong value, but a later kernel of
the same run would fault the pages in again: the map below never does that.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np
from numpy.lib.array_utils import byte_bounds

from ..codegen.llir import KernelKind, Program
from ..hlir.store import is_file_backed, release_points


@dataclass(frozen=True)
class PageReleases:
    """`after`: kernel id -> the file-backed weights whose pages go once every batch has run it;
    `ranges`: the byte ranges of the runtime's file-backed weights (sorted)."""

    after: Mapping[int, tuple[np.ndarray, ...]]
    ranges: tuple[tuple[int, int], ...]

    def foreign(self, value: np.ndarray) -> bool:
        """Whether a stored form dropped after its last reader views mapped bytes that none of the runtime's
        weights covers (the weight cache's entry made from an equal weight of another file): then no later
        kernel of this run reads them, and they go right away (the map covers the runtime's own)."""
        if not is_file_backed(value):
            return False
        lo, hi = byte_bounds(value)
        return not any(a < hi and lo < b for a, b in self.ranges)


def external_last_reads(program: Program) -> dict[int, int]:
    """EXTERNAL kernel id -> the position of its last reader in the program (its own where nothing reads it):
    when a run may drop a weight's stored form (CpuRuntime) and give its pages back (page_releases)."""
    last = {k.id: pos for pos, k in enumerate(program.kernels) if k.kind is KernelKind.EXTERNAL}
    for pos, k in enumerate(program.kernels):
        for inp in k.inputs:
            if inp.buffer in last:
                last[inp.buffer] = pos
    return last


def page_releases(program: Program, weights: Mapping[str, np.ndarray]) -> PageReleases:
    """Each weight after the last reader of any EXTERNAL made from it (its `weight_sources`: itself, or the
    parts of a concatenation) and of any weight sharing bytes with it (hlir.store.release_points: a tied
    weight read later keeps its pages until then); a weight an output reads (copied after the last
    kernel) is never released. An EXTERNAL nothing reads (a weight read only in a storage format, made
    by its first reader) counts as read where it stands."""
    kernels = program.kernels
    last = external_last_reads(program)
    outputs = {kid for _, kid in program.outputs}
    read: dict[str, int] = {}
    for k in kernels:
        if k.kind is KernelKind.EXTERNAL:
            for name in k.weight_sources:
                if name in weights:
                    read[name] = max(read.get(name, -1), len(kernels) if k.id in outputs else last[k.id])
    after = {kernels[pos].id: tuple(arrays) for pos, arrays in release_points(read, weights).items()
             if pos < len(kernels)}
    return PageReleases(after, tuple(sorted(byte_bounds(w) for w in weights.values() if is_file_backed(w))))
