"""A Gemm operand as the CPU backend's emulations read it (runtime/numerics.py, jit_gemm.py, fixed_gemm.py)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ..dtypes.variants import ScaleSpec


@dataclass(frozen=True, eq=False)
class Operand:
    """A Gemm operand in its format (and its scales), with values derived from it computed once."""

    values: np.ndarray  # float32 in the operand format (the quantized domain when scaled)
    scales: np.ndarray | None
    spec: ScaleSpec | None
    _derived: dict = field(default_factory=dict, repr=False)  # small values computed from it once

    def derived(self, key: str, make: Callable[[], object]):
        """make() once per operand: a prepared weight lives for the process, so its magnitudes and
        per-block scale vectors are computed once, not per run (values are never mutated)."""
        if key not in self._derived:
            self._derived[key] = make()
        return self._derived[key]

    def amax(self) -> float:
        return self.derived("amax", lambda: float(np.max(np.abs(self.values), initial=0.0)))

    def l1max(self, axis: int) -> float:
        """max of sum |v| along `axis` (K), in float64: a sum of at most 2^20 terms errs below 2^-32."""
        return self.derived(f"l1max{axis}", lambda: float(np.max(np.sum(np.abs(self.values), axis=axis, dtype=np.float64),
                                                               initial=0.0)) * (1 + 2.0 ** -32))

    def magnitudes(self) -> tuple[float, float] | None:
        """(min nonzero |v|, max |v|), or None when every value is zero."""
        def make():
            nonzero = np.abs(self.values[self.values != 0])
            return None if nonzero.size == 0 else (float(nonzero.min()), float(nonzero.max()))
        return self.derived("magnitudes", make)
