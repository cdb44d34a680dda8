"""The numba loops of dtypes (jit_loops: float8 codes, float32 rounding), loaded at first use: numba's
import costs ~0.7 s, paid only by a process that converts large arrays. LUMINAL_NUM_JIT=0 (the switch of
runtime.jit_gemm too) or a missing numba leaves the numpy paths, which give the same bits."""
from __future__ import annotations

import os

ENABLED = os.environ.get("LUMINAL_NUM_JIT", "1") != "0"


def loops():
    """The jit_loops module, or None."""
    if not ENABLED:
        return None
    try:
        from . import jit_loops
    except ImportError:
        return None
    return jit_loops
