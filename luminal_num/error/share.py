"""Share: how much of a budget an error uses (<= 1 is within it), the one type verdicts, plans and reports
hold it in.

A verdict needs the share three ways: of the gate (the user's budget with the headroom's share of every
allowance) over allclose and every metric limit, which the search ranks by and the gate passes on; of
the gate for allclose alone (static bounds and old records have no metric share); and of the user's own
budget for allclose alone, which plans state as their error. The reports' share of the user's budget over
every metric is the gate's share times the headroom (the headroom scales every allowance).
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass

NAN = float("nan")
# below float64's smallest normal a value keeps no relative precision: a share there is rounding noise (a
# one-hot softmax's KL underflows to ~1e-321), and ranking or comparing by it orders that noise
RESOLVED = sys.float_info.min


def resolved(value: float) -> float:
    """`value`, or 0 where it is a positive subnormal (no relative precision: indistinguishable from 0)."""
    return 0.0 if 0.0 < value < RESOLVED else value


@dataclass(frozen=True)
class Share:
    gate: float = NAN           # of the gate, over allclose and every metric (nan: not computed)
    allclose: float = NAN       # of the gate, allclose alone
    user_allclose: float = NAN  # of the user's budget, allclose alone

    @staticmethod
    def unreachable() -> "Share":
        """A candidate that cannot meet any budget (an overflow, a pruned change): every share infinite
        except the metric share, which nothing computed."""
        return Share(NAN, math.inf, math.inf)

    def rank(self) -> float:
        """What the search orders candidates by: the gate share over every metric, allclose where none
        (a subnormal share ranks as 0: `resolved`)."""
        return resolved(self.gate if math.isfinite(self.gate) else self.allclose)

    def of_budget(self, headroom: float) -> float:
        """The share of the user's budget over every metric (the reports' error axis): the gate share times
        the headroom; the user's allclose share where no metric share was recorded."""
        return self.gate * headroom if math.isfinite(self.gate) else self.user_allclose

    def times(self, factor: float) -> "Share":
        """Every share multiplied by `factor` (a composed estimate re-corrected by a new bias)."""
        return Share(self.gate * factor, self.allclose * factor, self.user_allclose * factor)
