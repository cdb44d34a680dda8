"""A CPU run's inputs stored in their kernels' formats (runtime/cpu.py's EXTERNAL kernels that are not weights,
and weights the first time the weight cache makes their stored form)."""
from __future__ import annotations

import numpy as np

from ..codegen.llir import Kernel
from ..dtypes.formats import F32, Kind
from .cpu_bodies import store32


def store_input(k: Kernel, val) -> np.ndarray:
    """An input's value as its kernel stores it (a read-only array; NaN or Inf refused)."""
    val = np.asarray(val)
    if k.dtype.kind is not Kind.FLOAT:
        return val.astype(k.dtype.storage)
    if not np.all(np.isfinite(val)):
        raise ValueError(f"input {k.external!r} contains NaN or Inf")
    if val.dtype.itemsize > 8 or val.dtype.kind in "biu":  # longdouble / ints: via float64, as before
        val = val.astype(np.float64)
    out = store32(val.astype(np.float32, copy=False) if k.dtype is F32 else val, k.dtype)
    out = np.ascontiguousarray(out).astype(k.dtype.storage, copy=False)
    out = out.view() if out is val else out  # never change the caller's own array's flags
    out.flags.writeable = False
    return out


def f32_into(k: Kernel, val, out: np.ndarray) -> bool:
    """An FP32 input stored straight into its slot (`out`), as store_input stores it (numpy's IEEE conversion);
    False (nothing checked) where val is not a float64 array of out's shape. Why: a decode step's KV caches
    are float64 inputs of every row; a fresh float32 copy of each, then copied into its slot, cost a pass more.
    A finite sum of the stored values proves every input finite (a NaN or inf stays one); else they are checked."""
    if not (isinstance(val, np.ndarray) and val.dtype == np.float64 and val.shape == out.shape
            and out.dtype == np.float32):
        return False
    np.copyto(out, val, casting="unsafe")
    with np.errstate(over="ignore", invalid="ignore"):
        finite = bool(np.isfinite(np.sum(out))) or bool(np.all(np.isfinite(val)))
    if not finite:
        raise ValueError(f"input {k.external!r} contains NaN or Inf")
    return True
