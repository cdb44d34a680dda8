"""The soundness assertion every static-bound fuzz test makes: each output element's measured error is within
its static bound (a NaN or infinite output needs an infinite bound)."""
from __future__ import annotations

from typing import Mapping

import numpy as np


def errors_of(outputs: Mapping[str, np.ndarray], references: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """|output - FP64 reference| per output, in float64."""
    return {name: np.abs(np.asarray(outputs[name], dtype=np.float64) - r) for name, r in references.items()}


def assert_within_bounds(bounds: Mapping[str, np.ndarray], errors: Mapping[str, np.ndarray], context=None) -> None:
    for name, e in errors.items():
        bound = bounds[name]
        with np.errstate(invalid="ignore"):
            ok = (e <= bound) | np.isinf(bound)
        assert ok.all(), (name, float(np.nanmax(np.where(ok, 0, e))), float(np.max(np.where(ok, 0, bound))), context)
