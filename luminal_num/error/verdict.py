"""A verdict on one candidate: passed or not, what decided it (VerdictSource), the share of the budget its
error uses (error/share.py), the value of every budget metric it was judged on (error/metric_values.py),
and why."""
from __future__ import annotations

import enum
import hashlib
from dataclasses import dataclass, field

from ..codegen.llir import KernelKind, Program
from .metric_values import MetricValues
from .share import Share


class VerdictSource(enum.StrEnum):
    """What decided a verdict (its text is what plans and reports write)."""
    CACHE = "cache"          # a known program, or a genome containing a change that failed alone
    STATIC = "static"        # the static error bound certifies it (or finds an overflow)
    CHUNKS = "chunks"        # composed per-chunk effects, each chunk judged alone on FP64 inputs
    PREDICTED = "predicted"  # the first-order sum of measured single changes
    MEASURED = "measured"    # an end-to-end run against FP64


# verdicts decided from a prediction, not an end-to-end run: the front and the chosen plan re-measure them
PREDICTED_SOURCES = frozenset({VerdictSource.PREDICTED, VerdictSource.CHUNKS})


@dataclass(frozen=True)
class Verdict:
    passed: bool
    source: VerdictSource
    share: Share         # of the gate and of the user's budget (<= 1 passes)
    max_abs: float       # worst |y - ref| measured (nan when not measured)
    bound: float | None  # largest static error bound (None when not computed)
    reason: str
    # decided from a composition inside its band (no margin): a tentative pass is confirmed if it reaches the
    # front or is chosen, a tentative reject is measured if it would be chosen (search.confirm_finalists)
    tentative: bool = False
    bias: float | None = None  # a composed verdict: the bias its errors were multiplied by (None: not composed)
    exact: bool = False        # composed with EXACT propagation (its band is the calibrator's EXACT band)
    # the worst value of each budget metric over the calibration batches: measured (source MEASURED, or CACHE
    # for a known program), or predicted from composed outputs (CHUNKS, PREDICTED: before the bias its share
    # was multiplied by); empty where nothing was measured or predicted (static bounds, pruned changes). A
    # reject measured end to end stops at its first failing batch: its values are those of the batches run
    metrics: MetricValues = field(default=MetricValues(), kw_only=True)

    def __post_init__(self):
        object.__setattr__(self, "source", VerdictSource(self.source))  # one read back from a verdict store


def program_key(program: Program) -> str:
    """Identity of what runs: kernel kinds, dtypes, precisions, weight storage formats, views, bodies, which
    weights an EXTERNAL reads and how they are derived (concatenated, rotated, smoothed), not labels or
    provenance. Storage is part of it (format and fill): two plans that differ only in how a weight is held compute
    different values; so are the derivations (two smoothings of one weight have the same shape and kernels)."""
    items = [(k.kind.value, k.dtype.name, k.precision, k.acc.name if k.acc else None, k.axis, repr(k.body),
              tuple((i.buffer, i.view.encode()) for i in k.inputs), k.aliases, k.storage, k.fill,
              k.external, k.concat, repr(k.rotation), repr(k.smoothing)) for k in program.kernels]
    # a batch-invariant program runs other summation orders (and attention splits): its own key
    invariant = (("batch_invariant", [repr(k.value) for k in program.kernels if k.kind is KernelKind.ATTENTION]),) \
        if program.batch_invariant else ()
    return hashlib.sha256(repr((items, program.outputs) + invariant).encode()).hexdigest()[:20]
