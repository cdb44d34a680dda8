"""The headroom a plan may use on the calibration set, from data: how much worse a recipe does on the
calibration batches it was not judged on.

The calibration batches are split in two (even / odd positions). For each probe program (the peer
baselines) and each direction, the held-out split's error over the judged split's error (as shares of
the user's budget, every metric included) is one sample; the margin is a stated quantile of the samples,
never below a floor, and the headroom is its inverse. With one batch there is nothing to split: the
fixed fallback is used and the record says so.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

QUANTILE = 0.9   # margin covers this share of the observed held-out / judged error ratios
FLOOR = 1.25     # never trust the calibration set more than this (headroom <= 0.8)
CEILING = 5.0    # a margin above this means the calibration set says little: capped (headroom >= 0.2)
FALLBACK = 0.5   # one calibration batch: the fixed headroom


@dataclass(frozen=True)
class HeadroomEstimate:
    headroom: float
    source: str                    # "data" | "fallback: ..." | "override"
    margin: float = float("nan")
    quantile: float = QUANTILE
    floor: float = FLOOR
    samples: tuple[float, ...] = ()

    def as_dict(self) -> dict:
        return {"headroom": self.headroom, "headroom_source": self.source, "headroom_margin": self.margin,
                "headroom_quantile": self.quantile, "headroom_floor": self.floor,
                "headroom_samples": list(self.samples)}


def split_ratios(per_batch: Sequence[float]) -> list[float]:
    """held-out / judged worst error, both directions of the even/odd split (finite, nonzero only)."""
    a, b = max(per_batch[0::2], default=0.0), max(per_batch[1::2], default=0.0)
    return [x / y for x, y in ((b, a), (a, b)) if np.isfinite(x) and np.isfinite(y) and x > 0 and y > 0]


def estimate_headroom(per_batch_ratios: Sequence[Sequence[float]], quantile: float = QUANTILE,
                      floor: float = FLOOR) -> HeadroomEstimate:
    """`per_batch_ratios`: for each probe program, its share of the budget on each calibration batch."""
    if not per_batch_ratios or min(len(r) for r in per_batch_ratios) < 2:
        return HeadroomEstimate(FALLBACK, "fallback: fewer than 2 calibration batches to split")
    samples = tuple(s for r in per_batch_ratios for s in split_ratios(r))
    if not samples:
        return HeadroomEstimate(FALLBACK, "fallback: no probe had a finite, nonzero error on both splits")
    margin = float(min(max(floor, np.quantile(samples, quantile)), CEILING))
    return HeadroomEstimate(1.0 / margin, "data", margin, quantile, floor, samples)
