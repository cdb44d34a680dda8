"""Calibration Hessians of weights, by content key: what a calibration-aware rounding (GPTQ) fills a format with.

A weight's Hessian is sum_x x x^T over the FP64 activation rows x (its Gemm's K columns) the weight
multiplies on the calibration set (error/hessians.py collects them during the compile's one FP64 pass).
It is data of the compile, as the weights are: a GPTQ-stored weight's values depend on it, so the
conversion (quant/stored.py) reads it here, by the weight's content key, while a compile has installed it
(`CALIBRATION.installed`); the pool's workers receive it when they start. Outside a compile, a GPTQ-stored
weight comes from its plan's weights file; converting one with no Hessian installed is refused.
"""
from __future__ import annotations

import enum
from contextlib import contextmanager
from dataclasses import dataclass
from types import MappingProxyType
from typing import Iterator, Mapping

import numpy as np

from ..hlir.rotation import RotatedWeight, rotate_rows
from ..hlir.smoothing import (AWQ_GRID, SMOOTHINGS, SmoothedWeight, awq_scales, power_of_two_exponents,
                              smoothquant_scales)
from ..hlir.store import content_key, digest
from .storage import storage_format


class Fill(enum.StrEnum):
    """How a storage format's codes are chosen when not by its own round-to-nearest (the default: no fill)."""
    GPTQ = "gptq"  # quant/gptq.py under the weight's calibration Hessian


@dataclass(frozen=True, eq=False)
class Hessian:
    """sum x x^T over `rows` calibration rows x of one activation (or the sum over the activations one weight
    meets), FP64 and read-only; `key` is its content digest (conversions are cached under it)."""

    sum_xx: np.ndarray
    rows: int
    key: str
    amax: np.ndarray | None = None  # max |x_j| per channel over the same rows (SmoothQuant's statistic)

    @staticmethod
    def of(sum_xx: np.ndarray, rows: int, amax: np.ndarray | None = None) -> "Hessian":
        sum_xx = np.asarray(sum_xx, dtype=np.float64)
        sum_xx.flags.writeable = False
        if amax is not None:
            amax = np.array(amax, dtype=np.float64)
            amax.flags.writeable = False
        return Hessian(sum_xx, int(rows), digest(sum_xx, int(rows)), amax)

    @property
    def matrix(self) -> np.ndarray:
        """The paper's H = 2/n X^T X (GPTQ is invariant to its scale; this is the form it is written in)."""
        return self.sum_xx * (2.0 / max(self.rows, 1))


@dataclass(frozen=True)
class Hessians:
    """Weight content key -> its Hessian; weights that meet the same activations share one object."""

    by_weight: Mapping[str, Hessian]

    def __post_init__(self):
        object.__setattr__(self, "by_weight", MappingProxyType(dict(self.by_weight)))

    def of(self, w) -> Hessian | None:
        return self.by_weight.get(content_key(w)) if self.by_weight else None

    @property
    def nbytes(self) -> int:
        return sum(h.sum_xx.nbytes for h in {id(h): h for h in self.by_weight.values()}.values())


NO_HESSIANS = Hessians({})


class ActiveCalibration:
    """The Hessians conversions read now: the innermost installed set (a compile's), else none."""

    def __init__(self):
        self._stack: list[Hessians] = []

    @property
    def current(self) -> Hessians:
        return self._stack[-1] if self._stack else NO_HESSIANS

    @contextmanager
    def installed(self, hessians: Hessians) -> Iterator[Hessians]:
        self._stack.append(hessians)
        try:
            yield hessians
        finally:
            self._stack.pop()

    def install_for_process(self, hessians: Hessians) -> None:
        """A pool worker's: the Hessians of the compile that started it, for the worker's whole life."""
        self._stack[:] = [hessians]


CALIBRATION = ActiveCalibration()


def hessian_of(w) -> Hessian | None:
    """The installed calibration Hessian of weight `w` (by its content key), or None. A rotated weight W H
    (hlir/rotation.py) meets the rotated activations x H: its Hessian is H^T (sum x x^T) H, from its source's;
    a smoothed weight W diag(2^e) (hlir/smoothing.py) meets x diag(2^-e): diag(2^-e) (sum x x^T) diag(2^-e)."""
    if isinstance(w, RotatedWeight) and w.source is not None:
        source = CALIBRATION.current.of(w.source)
        return None if source is None else _rotated_hessian(source, w.block)
    if isinstance(w, SmoothedWeight) and w.source is not None:
        source = CALIBRATION.current.of(w.source)
        return None if source is None else _smoothed_hessian(source, w.exponents)
    return CALIBRATION.current.of(w)


def _smoothed_hessian(h: Hessian, exponents: np.ndarray) -> Hessian:
    """diag(2^-e) S diag(2^-e): exact (powers of two), so the same S and e give the same bytes."""
    inv = np.ldexp(1.0, -np.asarray(exponents, dtype=np.int32))
    amax = None if h.amax is None else h.amax * inv
    return Hessian.of(h.sum_xx * inv[:, None] * inv[None, :], h.rows, amax)


_ROTATED: dict[tuple[str, int], Hessian] = {}  # (source Hessian key, block) -> rotated Hessian, the last few


def _rotated_hessian(h: Hessian, block: int) -> Hessian:
    key = (h.key, block)
    if key not in _ROTATED:
        if len(_ROTATED) >= 8:  # recomputed when evicted (two products); never grows with the model
            _ROTATED.pop(next(iter(_ROTATED)))
        _ROTATED[key] = Hessian.of(rotate_rows(rotate_rows(h.sum_xx, block).T, block), h.rows)  # H^T S H, H symmetric
    return _ROTATED[key]


class MissingStatistics(RuntimeError):
    """A smoothing asked for outside the compile that has its activation statistics: a caller's mistake (a saved
    plan carries its exponents in its LLIR), not a verdict on a candidate."""


_EXPONENTS: dict[tuple, tuple[int, ...]] = {}  # (variant, statistics key, weight keys) -> exponents, the last few


def smoothing_exponents(variant: str, group: tuple[np.ndarray, ...]) -> tuple[int, ...]:
    """The power-of-two SmoothQuant exponents of the Gemms whose weights are `group` (one activation: the first
    weight's installed statistics), hlir/smoothing.py."""
    h = CALIBRATION.current.of(group[0])
    if h is None or h.amax is None:
        raise MissingStatistics(f"smoothing a weight of shape {list(np.shape(group[0]))} needs its activation's "
                                "calibration statistics: lower it in the compile that collected them")
    key = (variant, h.key, tuple(content_key(w) for w in group))
    if key not in _EXPONENTS:
        if len(_EXPONENTS) >= 256:  # recomputed when evicted (a max, or AWQ's search); never grows with the model
            _EXPONENTS.pop(next(iter(_EXPONENTS)))
        rule = SMOOTHINGS[variant]
        if rule.alpha is not None:
            _EXPONENTS[key] = power_of_two_exponents(smoothquant_scales(h.amax, group, rule.alpha))
        else:
            _EXPONENTS[key] = _awq_exponents(h, group, rule.searched_for)
    return _EXPONENTS[key]


def _awq_exponents(h: Hessian, group: tuple[np.ndarray, ...], fmt_name: str) -> tuple[int, ...]:
    """AWQ's grid search (hlir/smoothing.SmoothingRule): each a's power-of-two exponents, the group's weights
    scaled, rounded to nearest in the format and scaled back, charged their output error on the calibration
    rows, tr(D S D^T) with D the weight's change and S = sum x x^T (no activation is held); the least wins
    (the smallest a on a tie; a = 0 is the unsmoothed rounding)."""
    fmt = storage_format(fmt_name)
    rms = np.sqrt(np.maximum(np.diag(h.sum_xx), 0.0) / max(h.rows, 1))
    weights = [np.asarray(w, dtype=np.float32) for w in group]
    best, best_err, seen = None, np.inf, set()
    for alpha in AWQ_GRID:
        e = power_of_two_exponents(awq_scales(rms, alpha))
        if e in seen:
            continue
        seen.add(e)
        ei = np.asarray(e, dtype=np.int32)[None, :]
        err = 0.0
        for w in weights:
            for r in range(0, w.shape[0], AWQ_ROWS):  # a few MB at a time (an LM head has 49k rows); a format
                rows = w[r:r + AWQ_ROWS]              # rounds each row on its own, so blocks of rows are exact
                back = fmt.quantize(np.ldexp(rows, ei)).dequantize()
                d = np.ldexp(back.astype(np.float64), -ei) - rows.astype(np.float64)
                err += float(np.sum((d @ h.sum_xx) * d))
        if err < best_err:
            best, best_err = e, err
    return best


AWQ_ROWS = 2048  # weight rows per block of AWQ's error sums
