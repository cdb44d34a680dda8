"""The soundness assertion every static-bound fuzz test makes: each output element's measured error is within
its static bound (a NaN or infinite output needs an infinite bound)."""
from __future__ import annotations

from typing import Mapping

import numpy as np


def errors_of(outputs: Mapping[str, np.ndarray], references: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """|output - FP64 reference| per output, in float64."""
    return {name: np.abs(np.asarray(outputs[name], dtype=np.float64) - r) for name, r in references.items()}


def assert_within_bounds(bounds: Mapping[str, np.ndarray], errors: Mapping[str, np.ndarray], context=None) -> None:
    for name, e in errors.items():
        bound = bounds[name]
        with np.errstate(invalid="ignore"):
            ok = (e <= bound) | np.isinf(bound)
        assert ok.all(), (name, float(np.nanmax(np.where(ok, 0, e))), float(np.max(np.where(ok, 0, bound))), context)


def assert_random_genome_bounded(graph, space, batch: Mapping[str, np.ndarray], hessians, seed: int) -> None:
    """A random alternative for every e-class of `space`, per chunk, lowered on `graph` with `hessians`
    installed (GPTQ fills, smoothing scales): its measured error <= its static bound. An overflow verdict or a
    run the plan's policy refuses is a verdict, not a value: nothing to compare."""
    from luminal_num.error.interval import Interval
    from luminal_num.error.static import static_bound
    from luminal_num.hlir import evaluate
    from luminal_num.quant.calibration import CALIBRATION
    from luminal_num.runtime.cpu import CpuRuntime
    from luminal_num.search.choice import random_candidate
    from luminal_num.search.lower import lower_program
    rng = np.random.default_rng(seed)
    genome = {c.index: random_candidate(space.groups[g.key].space, rng) for g in space.part.groups for c in g.chunks}
    ranges = {k: Interval.point(np.asarray(v, dtype=np.float64)) for k, v in batch.items()}
    with CALIBRATION.installed(hessians):
        program = lower_program(graph, space.part, space.groups, genome)
        rep = static_bound(program, ranges, graph.bind_symbols(batch), graph.weights)
        if rep.overflow is not None:
            return
        try:
            out = CpuRuntime(program, graph.weights).run(batch).outputs
        except ValueError:
            return
    assert_within_bounds(rep.error_bounds, errors_of(out, evaluate(graph, batch)))


def assert_plan_bounded(program, graph, batch: Mapping[str, np.ndarray], hessians) -> None:
    """`program` run on `batch` (with `hessians` installed, as it was lowered) is within its static bound of the FP64
    `graph`, every output element."""
    from luminal_num.error.interval import Interval
    from luminal_num.error.static import static_bound
    from luminal_num.hlir import evaluate
    from luminal_num.quant.calibration import CALIBRATION
    from luminal_num.runtime.cpu import CpuRuntime
    ranges = {n: Interval.point(np.asarray(v, dtype=np.float64)) for n, v in batch.items()}
    with CALIBRATION.installed(hessians):
        rep = static_bound(program, ranges, graph.bind_symbols(batch), graph.weights)
        out = CpuRuntime(program, graph.weights).run(batch).outputs
    assert_within_bounds(rep.error_bounds, errors_of(out, evaluate(graph, batch)))
