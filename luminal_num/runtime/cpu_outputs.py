"""A CPU run's outputs as float64, each converted when first read.

Why: a decode step's outputs are its logits and every layer's K and V caches (60 of them for SmolLM2); the
teacher-forced positions read only the logits, and casting the caches to float64 at the end of every run was
~75 ms of a 30-layer step (10% of a positions pass). The values are the ones the eager cast gave: the stored
buffers are not written after the run, except by a later run of the same runtime that takes them over
(CpuRuntime keeps the last run's output buffers), and that run calls `settle()` first.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping

import numpy as np


class Float64Outputs(Mapping[str, np.ndarray]):
    """Output name -> a float64 copy of its stored value, made on first read and kept."""

    def __init__(self, stored: Mapping[str, np.ndarray]):
        self._names = tuple(stored)
        self._stored = dict(stored)   # the run's buffers, until settle()
        self._made: dict[str, np.ndarray] = {}

    def __getitem__(self, name: str) -> np.ndarray:
        made = self._made.get(name)
        if made is None:
            made = self._made[name] = self._stored[name].astype(np.float64)  # KeyError for a name it lacks
        return made

    def settle(self) -> None:
        """Convert every output not read yet and let go of the run's buffers (they are about to be reused)."""
        for name in self._names:
            self[name]
        self._stored = {}

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __contains__(self, name: object) -> bool:
        return name in self._names

    def __reduce__(self):  # pickled (a pool worker's results) as the plain dict of every value
        return dict, (dict(self.items()),)

    def __repr__(self) -> str:
        return f"Float64Outputs({', '.join(self._names)})"
