"""Per-channel smoothing of a Gemm's K dimension (SmoothQuant, issue 32): x W^T = (x diag(s)^-1)(W diag(s))^T.

Why: an activation channel j with large |x_j| makes per-token FP8 scales coarse for every other channel, and
the weight columns it multiplies matter most for a W4 rounding; dividing x_j by s_j and multiplying W's column
j by s_j moves the range from the activation into the weight (Xiao et al. 2022, SmoothQuant). s comes from
the calibration activations' per-channel max |x_j| (collected with the GPTQ Hessians, quant/calibration.py)
and the weights' per-column max |W_j|: s_j = max|x_j|^a / max|W_j|^(1-a), a = 0.5. Gemms reading one
activation (Q/K/V, gate/up) share one s, taken over their weights together, so the scaled activation is one
buffer.

s is rounded to a power of two (its exponent e_j = round(log2 s_j), clipped to +-SMOOTH_EXPONENT_LIMIT): x_j
2^-e_j and W_j 2^e_j are then exact in FP32 and in every float format away from overflow and subnormals, so
the scaled activation (one FP32 multiply, fused into its producer's elementwise kernel where one exists: the
norm's) equals the unscaled one up to that exact factor, and the derived weight W diag(2^e) is the source
weight's own FP32 values rescaled. Its distance to the exact W diag(s) is computed, not assumed
(`smoothing_error`: zero unless a value left the normal range). What changes is the rounding a storage format
or a Gemm variant's quantization applies to the rescaled values.

The exponents are data of the compile (like static weight scales): computed when a program is lowered, from
the installed calibration, and carried in the LLIR (`Kernel.smoothing`), so a saved plan runs and audits with
no calibration installed.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping, Sequence

import numpy as np

from .store import WeightArray, content_key, derived_key, digest, keyed
from .weightcache import WEIGHTS

@dataclass(frozen=True)
class SmoothingRule:
    """How s is chosen: SmoothQuant's formula at a fixed migration strength `alpha`, or AWQ's search: s_j =
    rms(x_j)^a (normalized by sqrt(max s min s)), a on AWQ_GRID, the a whose power-of-two s gives the least
    calibration output error sum ||X (Q(W diag(s)) diag(s)^-1 - W)^T||^2 when W diag(s) is rounded to nearest
    in storage format `searched_for` (quant/calibration.smoothing_exponents; rms from the Hessian's diagonal,
    where AWQ reads mean |x|)."""
    alpha: float | None = None
    searched_for: str | None = None


# The offered smoothings: SmoothQuant at a = 0.5 (the paper's default, for W8A8) and AWQ searched for int4 g128.
SMOOTHINGS: Mapping[str, SmoothingRule] = MappingProxyType({
    "sq50": SmoothingRule(alpha=0.5), "awq_int4_g128": SmoothingRule(searched_for="int4_g128")})
AWQ_GRID: tuple[float, ...] = tuple(i / 20 for i in range(21))  # a = 0 is s = 1: no smoothing is on the grid
SMOOTH_EXPONENT_LIMIT = 16  # |e_j| <= 16: W 2^e stays far inside FP32's (and FP16's) normal range for real weights


@dataclass(frozen=True)
class Smoothing:
    """The value of a derived EXTERNAL buffer: weight `source` with its columns scaled by 2^exponents, or with
    no source the (K,) vector 2^-exponents the activation is multiplied by. `group` names every weight reading
    the activation (the first names the smoothing); `variant` is the SMOOTHINGS entry s was computed by."""

    variant: str
    group: tuple[str, ...]
    exponents: tuple[int, ...]
    source: str | None = None

    def __post_init__(self):
        if self.variant not in SMOOTHINGS:
            raise ValueError(f"smoothing {self.variant!r}: offered smoothings are {tuple(SMOOTHINGS)}")
        if not self.group or (self.source is not None and self.source not in self.group):
            raise ValueError(f"smoothing of {self.source!r}: it is not in its group {self.group}")
        if any(abs(e) > SMOOTH_EXPONENT_LIMIT for e in self.exponents):
            raise ValueError(f"smoothing exponents beyond +-{SMOOTH_EXPONENT_LIMIT}")

    @property
    def name(self) -> str:
        """The buffer's name in a program (unique per source, or per group for the activation's scale)."""
        return (f"smooth_{self.variant}({self.source})" if self.source is not None
                else f"smooth_{self.variant}_inverse({self.group[0]})")


def smoothquant_scales(amax: np.ndarray, weights: Sequence[np.ndarray], alpha: float) -> np.ndarray:
    """s_j = max|x_j|^a / max|W_j|^(1-a), the column max taken over every weight of the group together (FP64);
    1 where a channel's activation or weights are all zero (nothing to migrate)."""
    wmax = np.max(np.stack([np.max(np.abs(np.asarray(w, dtype=np.float64)), axis=0) for w in weights]), axis=0)
    amax = np.asarray(amax, dtype=np.float64)
    if amax.shape != wmax.shape:
        raise ValueError(f"activation max over {amax.shape} channels, weights' K {wmax.shape}")
    ok = (amax > 0) & (wmax > 0) & np.isfinite(amax) & np.isfinite(wmax)
    s = np.ones_like(amax)
    s[ok] = amax[ok] ** alpha / wmax[ok] ** (1.0 - alpha)
    return s


def awq_scales(rms: np.ndarray, alpha: float) -> np.ndarray:
    """AWQ's s_j = stat_j^a normalized by sqrt(max s * min s) (FP64); 1 where the statistic is zero."""
    rms = np.asarray(rms, dtype=np.float64)
    ok = (rms > 0) & np.isfinite(rms)
    s = np.ones_like(rms)
    s[ok] = rms[ok] ** alpha
    if ok.any():
        s[ok] /= np.sqrt(s[ok].max() * s[ok].min())
    return s


def power_of_two_exponents(s: np.ndarray) -> tuple[int, ...]:
    """round(log2 s_j), clipped to +-SMOOTH_EXPONENT_LIMIT (2^e then scales exactly)."""
    e = np.clip(np.rint(np.log2(np.asarray(s, dtype=np.float64))), -SMOOTH_EXPONENT_LIMIT, SMOOTH_EXPONENT_LIMIT)
    return tuple(int(v) for v in e)


class SmoothedWeight(WeightArray):
    """A smoothed weight, knowing its source and exponents: a GPTQ fill of it finds its Hessian from the
    source's (quant/calibration.py: the activation it meets is x diag(2^-e)). A copy sent away is a plain weight."""

    source: np.ndarray | None = None
    exponents: np.ndarray | None = None


def smoothed_weight(w: np.ndarray, exponents: Sequence[int]) -> SmoothedWeight:
    """W diag(2^e) in FP32 (the source's FP32 values times powers of two: exact unless a value leaves the normal
    range, which `smoothing_error` charges), keyed by the source's content key and the exponents."""
    e = np.asarray(exponents, dtype=np.int64)
    w32 = np.asarray(w, dtype=np.float32)
    if w32.ndim != 2 or w32.shape[1] != e.size:
        raise ValueError(f"a smoothing of {e.size} channels cannot scale a weight of shape {w32.shape}")
    out = np.ldexp(w32, e[None, :].astype(np.int32)).astype(np.float32).view(SmoothedWeight)
    out.flags.writeable = False
    out._key = derived_key("smooth", _digest_exponents(e), "f32", content_key(w))
    out.source, out.exponents = w, e
    return out


def inverse_scale(exponents: Sequence[int]) -> np.ndarray:
    """The (K,) FP32 vector 2^-e (exact)."""
    return np.ldexp(np.float32(1.0), -np.asarray(exponents, dtype=np.int32)).astype(np.float32)


def smoothing_value(sm: Smoothing, feed: Mapping[str, np.ndarray]) -> np.ndarray:
    """The FP32 value a Smoothing names, from the weights by name (a weight's kept process-wide in the weight
    cache, as every value derived from a weight is)."""
    if sm.source is None:
        return keyed(inverse_scale(sm.exponents), derived_key("smooth_inverse", _digest_exponents(np.asarray(sm.exponents))))
    w = feed[sm.source]
    return WEIGHTS.get(w, ("smooth", _digest_exponents(np.asarray(sm.exponents))),
                       lambda: smoothed_weight(w, sm.exponents))


def smoothing_error(sm: Smoothing, feed: Mapping[str, np.ndarray]) -> np.ndarray:
    """|smoothing_value - its exact value| per element, computed in FP64 (every term is a float times a power
    of two: exact in FP64): W diag(2^e) against the graph's weight, 2^-e against itself (zero)."""
    if sm.source is None:
        return np.zeros(len(sm.exponents))
    w = np.asarray(feed[sm.source], dtype=np.float64)
    exact = np.ldexp(w, np.asarray(sm.exponents, dtype=np.int32)[None, :])
    return np.abs(np.asarray(smoothing_value(sm, feed), dtype=np.float64) - exact)


def _digest_exponents(e: np.ndarray) -> str:
    return digest(np.ascontiguousarray(e, dtype=np.int64))
