"""Weight-only and mixed Gemms (W8A16, W4A16, ...): y = a @ W^T with W read in its storage format.

The weight stays in memory as its StorageFormat (luminal_num.quant.storage: (N, K), K contiguous) and
is widened in registers; the activations stay in their own format. What one variant computes, every
rounding to nearest even:
1. Activations: a^ = RN_act(a) (F32 activations pass unchanged; BF16/F16 ones already are values of
   their format, so this is the identity on what a real kernel receives).
2. Weights: w^ = RN_act(dequantize(stored)): the storage format's own dequantize (exact for int4,
   Q8_0, MXFP4; one FP32 rounding for fp8 / int8 per-channel, NVFP4 and Q4_1), then the MMA operand
   format, which is the activation format (an F32 variant uses the FP32 dequantized value).
3. Products p_k = fl32(a^_k w^_k): exact for 16-bit operands (11-bit significands at most) outside
   FP32's subnormal range; one rounding for F32 x F32 (no FMA contraction).
4. FP32 accumulation over K. SumOrder.SEQUENTIAL: acc = fl32(acc + p_k) in K order, the defined
   order a dequantize-on-load kernel with one K loop per output reproduces bit for bit (the CPU
   emulation is then exact). SumOrder.BLAS: FP32 BLAS in its own order, fast, bits library-dependent.
The bounds hold for every summation order: gamma_K(u32) over sum |p_k|, as in dtypes.variants.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

import numpy as np

from ..dtypes.formats import BF16, F16, F32, Format
from ..dtypes.rounding import Overflow, round_to
from ..dtypes.variants import _gamma, _times
from ..codegen.llir import Kernel, external_value
from ..quant.concat import concat_quantized
from ..quant.storage import STORAGE_FORMATS, Quantized, StorageFormat, StoredTensor
from ..quant.stored import stored_key, stored_values

ACTIVATION_FORMATS = (F32, BF16, F16)
U32, ETA32 = F32.unit_roundoff, F32.min_subnormal / 2.0
BOUND_SLACK = 1.0 + 2.0 ** -20  # the float64 evaluation of a bound must not undercut it
NONNEG_MATMUL = 1.0 + 2.0 ** -30  # float64 matmuls of non-negative terms, K < 2^22: gamma_K(2^-53) < 2^-31
_TILE_ELEMENTS = 1 << 22  # products materialised at once by the sequential accumulation (16 MB)


class SumOrder(enum.Enum):
    SEQUENTIAL = "sequential"
    BLAS = "blas"


@dataclass(frozen=True)
class WeightOnlyGemm:
    """One mixed Gemm: weights in `weight`'s storage format, activations (and MMA operands) in `activation`."""

    name: str
    weight: StorageFormat
    activation: Format

    def __post_init__(self):
        if self.activation not in ACTIVATION_FORMATS:
            raise ValueError(f"{self.name}: activations are {'/'.join(map(str, ACTIVATION_FORMATS))}, "
                             f"got {self.activation}")

    @property
    def label(self) -> str:
        """The recipe name people use: W4A16, W8A16, W16A32, ..."""
        return f"W{self.weight.bits}A{self.activation.bits}"

    @property
    def exact_products(self) -> bool:
        return self.activation is not F32

    def widen(self, weight: Quantized | StoredTensor) -> np.ndarray:
        """w^ (N, K) float32: the weight as the MMA reads it (step 2)."""
        quantized = self._quantized(weight)
        values = quantized.dequantize()
        return values if self.activation is F32 else round_to(values, self.activation, Overflow.INF)

    def _quantized(self, weight: Quantized | StoredTensor) -> Quantized:
        if weight.fmt != self.weight:
            raise ValueError(f"{self.name} reads {self.weight.name} weights, got {weight.fmt.name}")
        if len(weight.shape) != 2:
            raise ValueError(f"{self.name}: weights are (N, K) matrices, got shape {list(weight.shape)}")
        return weight if isinstance(weight, Quantized) else weight.fmt.unpack(weight)

    # -- bounds -----------------------------------------------------------------------------------
    def _activation_terms(self, amax_a: float) -> tuple[float, float]:
        if self.activation is F32:
            return 0.0, 0.0
        if not np.isfinite(round_to(np.float64(amax_a), self.activation, Overflow.INF)):
            return math.inf, math.inf
        return self.activation.unit_roundoff, self.activation.min_subnormal / 2.0

    def _bound(self, k: int, abs_dot, amax_a: float, amax_w: float, rel_w: float, abs_w: float):
        """|computed - sum a_k w_k| given |w^_k - w_k| <= rel_w |w_k| + abs_w (composition as in variants)."""
        abs_dot = np.asarray(abs_dot, dtype=np.float64)
        rel_a, abs_a = self._activation_terms(amax_a)
        cross = k * (_times(abs_a * (1 + rel_w), amax_w) + _times(abs_w * (1 + rel_a), amax_a) + abs_a * abs_w)
        with np.errstate(invalid="ignore"):
            operand_err = (rel_a + rel_w + rel_a * rel_w) * abs_dot + cross
            abs_hat = (1 + rel_a) * (1 + rel_w) * abs_dot + cross  # >= sum |a^ w^|
            u_product = 0.0 if self.exact_products else U32
            abs_p = abs_hat * (1 + u_product) + k * ETA32  # >= sum |p_k|
            gamma = _gamma(k, U32)
            bound = operand_err + u_product * abs_hat + k * ETA32 + gamma * abs_p + k * ETA32
            bound = np.where(abs_p * (1 + gamma) <= F32.max_finite, bound * BOUND_SLACK, math.inf)
            bound = np.nan_to_num(bound, nan=math.inf, posinf=np.inf, neginf=-np.inf)
        return float(bound) if bound.ndim == 0 else bound

    def a_priori_bound(self, k: int, abs_dot, amax_a: float, amax_w: float):
        """Worst-case |computed - exact| of one output from sum_k |a_k| |w_k| (the ORIGINAL weights) and
        max |a|, max |w|: storage error (StorageFormat.element_error), widening, products, accumulation."""
        rel_s, abs_s = self.weight.element_error(amax_w)
        rel_w, abs_w = rel_s, abs_s
        if self.activation is not F32:
            widest = amax_w * (1 + rel_s) + abs_s
            if not np.isfinite(round_to(np.float64(widest), self.activation, Overflow.INF)):
                return self._overflow(abs_dot)
            u, eta = self.activation.unit_roundoff, self.activation.min_subnormal / 2.0
            rel_w, abs_w = rel_s + u * (1 + rel_s), abs_s * (1 + u) + eta
        return self._bound(k, abs_dot, amax_a, amax_w, rel_w, abs_w)

    def arithmetic_bound(self, k: int, abs_dot_hat, amax_a: float, amax_w_hat: float):
        """|computed - sum a_k w^_k| with the widened weights w^ known exactly (static weights):
        activation rounding, products and accumulation only; abs_dot_hat = sum_k |a_k| |w^_k|."""
        return self._bound(k, abs_dot_hat, amax_a, amax_w_hat, 0.0, 0.0)

    @staticmethod
    def _overflow(abs_dot):
        shape = np.shape(abs_dot)
        return math.inf if shape == () else np.full(shape, math.inf)


def _catalogue() -> dict[str, WeightOnlyGemm]:
    out = {}
    for storage in STORAGE_FORMATS.values():
        if storage.name == "f32":
            continue  # FP32 weights with FP32 activations is the plain Gemm
        for activation in ACTIVATION_FORMATS:
            variant = WeightOnlyGemm(f"{storage.name}_a{activation.name}", storage, activation)
            out[variant.name] = variant
    return out


WEIGHT_ONLY_GEMMS: Mapping[str, WeightOnlyGemm] = MappingProxyType(_catalogue())


def emulate_weight_only_gemm(a, weight: Quantized | StoredTensor, variant: WeightOnlyGemm,
                             order: SumOrder = SumOrder.SEQUENTIAL) -> np.ndarray:
    """a (..., K) @ W^T -> (..., N) float32, exactly as the module doc defines it."""
    w_hat = variant.widen(weight)
    a = np.asarray(a)
    if a.ndim < 1 or a.shape[-1] != w_hat.shape[1]:
        raise ValueError(f"{variant.name}: activations of shape {list(a.shape)} do not have K = {w_hat.shape[1]}")
    lead = a.shape[:-1]
    a_hat = round_to(a, variant.activation, Overflow.INF).astype(np.float32, copy=False).reshape(-1, a.shape[-1])
    with np.errstate(over="ignore", invalid="ignore"):
        if order is SumOrder.BLAS:
            out = np.matmul(a_hat, w_hat.T)
        else:
            out = _sequential(a_hat, w_hat)
    return out.reshape(lead + (w_hat.shape[0],))


def _sequential(a_hat: np.ndarray, w_hat: np.ndarray) -> np.ndarray:
    """acc = fl32(acc + fl32(a_k w_k)) in K order for every output: np.cumsum in float32 is sequential.
    The products of a tile of outputs are formed at once (vectorized); tiles bound the memory."""
    rows, k = a_hat.shape
    n = w_hat.shape[0]
    out = np.empty((rows, n), np.float32)
    if k == 0:
        out[:] = 0.0
        return out
    cols = max(1, _TILE_ELEMENTS // max(1, rows * k))
    for start in range(0, n, cols):
        products = a_hat[:, None, :] * w_hat[None, start:start + cols, :]
        out[:, start:start + cols] = np.cumsum(products, axis=-1, dtype=np.float32)[..., -1]
    return out


@dataclass(frozen=True, eq=False)
class TransferResult:
    """The exact output's interval [lo, hi] and a bound on |computed - exact| per output."""

    lo: np.ndarray
    hi: np.ndarray
    err: np.ndarray


def weight_only_transfer(variant: WeightOnlyGemm, a_lo, a_hi, a_err, weight: Quantized | StoredTensor,
                         original) -> TransferResult:
    """Static-bound transfer of y = a @ w^T: the exact activation a lies in [a_lo, a_hi] (..., K), the
    executed one within a_err of it; `original` (N, K) is the graph's weight (an exact point).

    computed - exact = (arithmetic on a~, w^) + (a~ - a) . w^ + a . (w^ - w): the first is
    arithmetic_bound, the second a_err @ |w^|, the third uses the known storage error D = w^ - w
    (|mid . D| + rad @ |D|), so a kept GGUF weight (D = 0) costs nothing.
    """
    w_hat = variant.widen(weight).astype(np.float64)
    w = np.asarray(original, dtype=np.float64)
    if w.shape != w_hat.shape:
        raise ValueError(f"{variant.name}: the original weight is {list(w.shape)}, the stored one {list(w_hat.shape)}")
    lo, hi = np.asarray(a_lo, np.float64), np.asarray(a_hi, np.float64)
    err_in = np.broadcast_to(np.asarray(a_err, np.float64), lo.shape)
    with np.errstate(all="ignore"):
        finite = np.isfinite(lo) & np.isfinite(hi)
        mid = np.where(finite, lo / 2 + hi / 2, 0.0)
        rad = np.where(finite, np.maximum(hi - mid, mid - lo), np.inf)
        k = w.shape[1]
        center = mid @ w.T
        radius = (rad @ np.abs(w).T) * NONNEG_MATMUL + np.abs(center) * 2.0 ** -50 \
            + (np.abs(mid) @ np.abs(w).T) * (k * 2.0 ** -52)
        d = w_hat - w  # exact: both are FP32 values
        abs_d = np.abs(d)
        storage = np.abs(mid @ d.T) + ((np.abs(mid) @ abs_d.T) * (k * 2.0 ** -52) + rad @ abs_d.T) * NONNEG_MATMUL
        magnitude = np.maximum(np.abs(lo), np.abs(hi)) + err_in
        abs_w_hat = np.abs(w_hat)
        abs_dot = (magnitude @ abs_w_hat.T) * NONNEG_MATMUL
        amax_a = float(magnitude.max(initial=0.0))
        amax_w = float(abs_w_hat.max(initial=0.0))
        arithmetic = variant.arithmetic_bound(k, abs_dot, amax_a, amax_w)
        err = arithmetic + (err_in @ abs_w_hat.T) * NONNEG_MATMUL + storage
        err = np.nan_to_num(err * BOUND_SLACK, nan=np.inf, posinf=np.inf, neginf=-np.inf)
        out_lo = np.nan_to_num(center - radius, nan=-np.inf, posinf=np.inf, neginf=-np.inf)
        out_hi = np.nan_to_num(center + radius, nan=np.inf, posinf=np.inf, neginf=-np.inf)
    return TransferResult(out_lo, out_hi, err)


def stored_weight(w: Kernel, feed: Mapping[str, np.ndarray], stored_weights: Mapping | None = None) -> Quantized:
    """The stored tensor of EXTERNAL weight `w` (held in w.storage): the plan's weights file entry, else
    its compile-time conversion; a concatenation (KCatStored) joins its parts' own stored values and
    scales (quant/concat.py), never a quantization of the joined FP32 weights."""
    fmt = STORAGE_FORMATS[w.storage]

    def one(name: str, value=None) -> Quantized:
        held = (stored_weights or {}).get(stored_key(name, fmt, w.fill))
        return stored_values(feed[name] if value is None else value, fmt, held, w.fill)
    if w.concat:
        return concat_quantized([one(n) for n in w.concat], w.concat_axis)
    # a rotated (smoothed) weight (hlir/rotation.py, hlir/smoothing.py) is converted from its derived value,
    # stored under its own name
    return one(w.external, external_value(w, feed) if w.derived else None)
