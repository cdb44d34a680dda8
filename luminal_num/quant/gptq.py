"""GPTQ: a calibration-aware way to fill a storage format (issue 32; Frantar et al., 2022, Algorithm 1).

Why: round-to-nearest chooses each weight's code alone; what matters is the Gemm's output X W^T on the
inputs the layer sees. GPTQ rounds the columns of W (the K axis) one at a time and spreads each column's
rounding error over the columns not yet rounded, weighted by the inverse Hessian H^-1 of the layer's
squared output error, H = 2/n X^T X, which calibration activations give. The result is an ordinary
`Quantized` of the format (the same codes, scales and zeros a kernel reads), so everything downstream
(storage bytes, dequantize-on-load, the error bounds of the format) is unchanged: only which codes.

Group parameters (scales, zeros) are the format's own (its codec on the group's current, error-updated
columns, computed when the group's first column is reached, as GPTQ does without static groups); each
column is then encoded with its group's parameters (`_ENCODERS`, the codec's own arithmetic). The K sum
runs in FP64 over columns in order (no activation reordering), blocks of BLOCK columns with lazy batch
updates; the same inputs give the same bytes on one machine (numpy's LAPACK could round a tie elsewhere).
"""
from __future__ import annotations

from typing import Callable, Mapping

import numpy as np

from .layout import Layout, Part, Scheme
from .quantize import QuantOverflow, convert
from .storage import CODECS, Quantized, StorageFormat, storage_format

BLOCK = 128           # columns per lazy batch (the paper's B)
DAMPING = 0.01        # of the mean diagonal of H added to it (the paper's percdamp)


def hessian(x: np.ndarray) -> np.ndarray:
    """H = 2/n X^T X in FP64 from calibration inputs x (n, K) of the layer."""
    x = np.asarray(x, dtype=np.float64).reshape(-1, np.shape(x)[-1])
    return 2.0 / max(len(x), 1) * (x.T @ x)


def _rows(per_tile: np.ndarray, fmt: StorageFormat, rows: int) -> np.ndarray:
    """A group's per-row parameter: TILE layouts hold one per `block` rows."""
    column = per_tile[:, 0]
    return np.repeat(column, fmt.block)[:rows] if fmt.layout is Layout.TILE else column


def _encode_amax(fmt: StorageFormat, x: np.ndarray, parts: Mapping[Part, np.ndarray]) -> np.ndarray:
    with np.errstate(over="ignore"):
        scaled = x.astype(np.float32) / _rows(parts[Part.SCALE], fmt, len(x))
    return convert(scaled, fmt.element, QuantOverflow.SATURATE)


def _encode_int4_symmetric(fmt: StorageFormat, x: np.ndarray, parts: Mapping[Part, np.ndarray]) -> np.ndarray:
    return np.clip(np.rint(x.astype(np.float32) / parts[Part.SCALE][:, 0]), -8.0, 7.0).astype(np.float32)


def _encode_int4_asymmetric(fmt: StorageFormat, x: np.ndarray, parts: Mapping[Part, np.ndarray]) -> np.ndarray:
    codes = np.rint(x.astype(np.float32) / parts[Part.SCALE][:, 0]) + parts[Part.ZERO][:, 0]
    return np.clip(codes, 0.0, 15.0).astype(np.float32)


def _encode_ieee(fmt: StorageFormat, x: np.ndarray, parts: Mapping[Part, np.ndarray]) -> np.ndarray:
    return CODECS[fmt.scheme].quantize(fmt, x.astype(np.float32)[:, None])[Part.Q][:, 0]


# scheme -> codes of one column under its group's parameters, exactly as the scheme's codec computes them
_ENCODERS: dict[Scheme, Callable[[StorageFormat, np.ndarray, Mapping[Part, np.ndarray]], np.ndarray]] = {
    Scheme.AMAX: _encode_amax, Scheme.INT4_SYMMETRIC: _encode_int4_symmetric,
    Scheme.INT4_ASYMMETRIC: _encode_int4_asymmetric, Scheme.IEEE: _encode_ieee}


def fills(fmt: StorageFormat) -> bool:
    """Whether GPTQ fills `fmt` (its scheme has a column encoder here)."""
    return fmt.scheme in _ENCODERS


def group_width(fmt: StorageFormat, k: int) -> int:
    """Columns that share one set of group parameters: a group or tile, a whole row, or one column."""
    if fmt.scheme not in _ENCODERS:
        raise ValueError(f"GPTQ is not built for {fmt.name} (scheme {fmt.scheme.name}): it fills AMAX (int8, fp8, "
                         f"mxfp4), int4 and IEEE formats")
    return {Layout.GROUP: fmt.block, Layout.TILE: fmt.block, Layout.CHANNEL: k, Layout.NONE: 1}[fmt.layout]


class _Rounder:
    """Rounds columns in order with the format's group parameters; collects codes and parameters."""

    def __init__(self, fmt: StorageFormat, shape: tuple[int, int]):
        self.fmt, self.shape = fmt, shape
        self.width = group_width(fmt, shape[1])
        self.codes = np.zeros(shape, np.float32)
        self.groups: list[dict[Part, np.ndarray]] = []

    def column(self, j: int, current: np.ndarray, block_of_group: Callable[[], np.ndarray]) -> np.ndarray:
        """Column j rounded (dequantized values, FP64); opens a new group at its first column."""
        if j % self.width == 0:
            values = CODECS[self.fmt.scheme].quantize(self.fmt, block_of_group().astype(np.float32))
            self.groups.append({p: v for p, v in values.items() if p is not Part.Q})
        parts = self.groups[-1]
        self.codes[:, j] = _ENCODERS[self.fmt.scheme](self.fmt, current, parts)
        single = Quantized(self.fmt, (len(current), 1), {Part.Q: self.codes[:, j:j + 1], **_one_column(parts)})
        return self.fmt.dequantize(single)[:, 0].astype(np.float64)

    def result(self) -> Quantized:
        values = {Part.Q: self.codes}
        for part in self.fmt.parts:
            if part is not Part.Q:
                values[part] = np.concatenate([g[part] for g in self.groups], axis=1).astype(np.float32)
        return Quantized(self.fmt, self.shape, values)


def _one_column(parts: Mapping[Part, np.ndarray]) -> dict[Part, np.ndarray]:
    """A group's parameters as those of a one-column tensor (the first of their K groups)."""
    return {p: v[:, :1] for p, v in parts.items()}


def gptq(weight: np.ndarray, h: np.ndarray, fmt: StorageFormat | str, damping: float = DAMPING,
         block: int = BLOCK) -> Quantized:
    """`weight` (rows, K) filled into `fmt` by GPTQ under the layer's Hessian `h` (K, K)."""
    fmt = storage_format(fmt)
    w = np.array(weight, dtype=np.float64)
    rows, k = fmt.check_shape(w.shape)
    h = np.array(h, dtype=np.float64)
    if h.shape != (k, k):
        raise ValueError(f"GPTQ: the Hessian is {h.shape}, the weight's K is {k}")
    dead = np.diag(h) == 0  # inputs that are always zero: any code works, round the weight to 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    h[np.diag_indices(k)] += damping * float(np.mean(np.diag(h)))
    upper = np.linalg.cholesky(np.linalg.inv(h)).T  # H^-1 = U^T U: row j of U is column j's update
    rounder = _Rounder(fmt, (rows, k))
    block = rounder.width * max(1, block // rounder.width)  # a group never straddles a lazy batch
    for start in range(0, k, block):
        end = min(start + block, k)
        errors = np.zeros((rows, end - start))
        for j in range(start, end):
            i = j - start
            q = rounder.column(j, w[:, j], lambda: w[:, j:j + rounder.width])
            errors[:, i] = (w[:, j] - q) / upper[j, j]
            w[:, j:end] -= np.outer(errors[:, i], upper[j, j:end])
            w[:, j] = q
        w[:, end:] -= errors @ upper[start:end, end:]
    return rounder.result()
