"""The calibrator: the one owner of the bands (margin and bias) predictions are decided by, of the
predictions each end-to-end measurement will check, and of the order those checks apply in.

A measurement takes a ticket when it is submitted (candidate order) and reports its result against it;
an observation is applied to the bands only once every earlier ticket has reported (or was withdrawn), so
the bands, and every verdict they decide later, are the same whatever order results arrive in (a pool or
a cluster returns them in completion order). A composed verdict records the bias it was corrected by;
`rebiased` re-corrects it by the band's current bias: the search applies that itself, in candidate order
(search.Searcher.follow_bias), never behind its back.
"""
from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

from .predict import Band, Prediction
from .verdict import Verdict


class BandKind(enum.StrEnum):
    """Which prediction a band calibrates."""
    FIRST_ORDER = "first_order"  # the sum of measured single changes (FirstOrderDeltas)
    SCALED = "scaled"            # the per-chunk composition, SCALED propagation (error/chunks.py)
    EXACT = "exact"              # the per-chunk composition, EXACT propagation


@dataclass(frozen=True)
class Observation:
    key: str         # the program measured
    measured: float  # its measured gate share over every metric


class Calibrator:
    def __init__(self, kinds: tuple[BandKind, ...]):
        # the composition bands are centred on the bias measurements reveal; the first-order band is not
        self.bands = {k: Band(centred=k is not BandKind.FIRST_ORDER) for k in kinds}
        self.expected: dict[BandKind, dict[str, Prediction]] = {k: {} for k in kinds}  # program key -> prediction
        self._issued = 0    # tickets handed out
        self._applied = 0   # tickets applied (every ticket below it has reported or was withdrawn)
        self._arrived: dict[int, Observation | None] = {}  # reported ahead of an earlier ticket (None: withdrawn)

    def band(self, kind: BandKind) -> Band | None:
        return self.bands.get(kind)

    @property
    def mismatches(self) -> int:
        """Measurements that fell outside the band of a prediction they checked (each widened it)."""
        return sum(b.mismatches for b in self.bands.values())

    def expect(self, kind: BandKind, key: str, prediction: Prediction | None, replace: bool = False) -> None:
        """A later measurement of program `key` checks `prediction` (the first one made, unless `replace`)."""
        if prediction is None or kind not in self.expected:
            return
        if replace:
            self.expected[kind][key] = prediction
        else:
            self.expected[kind].setdefault(key, prediction)

    def expects(self, kind: BandKind, key: str) -> bool:
        return key in self.expected.get(kind, {})

    # -- ordered observations ------------------------------------------------------------------
    def ticket(self) -> int:
        """The place of a measurement being submitted now in the order observations apply in."""
        self._issued += 1
        return self._issued - 1

    def report(self, ticket: int, observation: Observation | None) -> None:
        """A measurement's result (None: withdrawn, e.g. interrupted): applied once every earlier ticket is in."""
        if not self._applied <= ticket < self._issued or ticket in self._arrived:
            raise ValueError(f"ticket {ticket} was not issued or already reported")
        self._arrived[ticket] = observation
        while self._applied in self._arrived:
            obs = self._arrived.pop(self._applied)
            self._applied += 1
            if obs is not None:
                self._apply(obs)

    def _apply(self, obs: Observation) -> None:
        for kind, band in self.bands.items():
            p = self.expected[kind].get(obs.key)
            if p is not None:
                band.observe(p.ratio, obs.measured)

    # -- composed verdicts --------------------------------------------------------------------
    def rebiased(self, v: Verdict) -> Verdict:
        """A composed verdict re-corrected by its band's current bias (learnt from end-to-end runs made
        since): ranked against measured plans on the front, a stale estimate would look better than they
        do and cost a confirmation each. A pass whose estimate now exceeds the gate becomes a tentative
        reject. Any other verdict is returned as it is."""
        if v.bias is None:
            return v
        band = self.bands[BandKind.EXACT if v.exact else BandKind.SCALED]
        f = band.bias / v.bias
        if f == 1.0:
            return v
        share = v.share.times(f)
        passed = v.passed and share.gate <= 1.0
        return dataclasses.replace(v, passed=passed, share=share, bias=band.bias,
                                   tentative=v.tentative or passed != v.passed)
