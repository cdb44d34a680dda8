"""Running one ONNX backend node test case through the importer: FP64 reference and the FP32 CPU plan.

Shared by the node-test module and the importer tests. Graph inputs that feed an op's static slot
(axes, shapes, exponents: `OpSpec.static`) are frozen at import, as an exported model's would be.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import numpy_helper

from luminal_num.hlir.evaluate import evaluate
from luminal_num.onnx import OnnxModel, import_model, load_proto
from luminal_num.onnx.ops import OPS
from luminal_num.runtime.cpu import CpuRuntime
from luminal_num.search.space import SearchSpace


def as_array(x) -> np.ndarray:
    return numpy_helper.to_array(x) if isinstance(x, onnx.TensorProto) else np.asarray(x)


def fp32_plan_outputs(model: OnnxModel, feed: dict) -> dict:
    """The all-FP32 plan (no precision rules) lowered and run on the CPU backend."""
    if not model.graph.outputs:
        return model.restore({})
    program = SearchSpace.build(model.graph, with_precision=False).program(frozenset())
    return model.restore(CpuRuntime(program, model.graph.weights).run(feed).outputs)


class CaseRefused(Exception):
    """A case whose inputs the runtime refuses by policy (NaN/Inf inputs, negative run-time indices)."""


@dataclass(frozen=True)
class CaseResult:
    max_err_f64: float
    max_err_f32: float
    fp32_plan_ran: bool  # False where the runtime refuses the case's NaN/Inf inputs (FP64 checked only)


def run_case(case) -> CaseResult:
    """Import, evaluate FP64 and FP32-plan per data set, assert both match the expected outputs."""
    graph = case.model.graph
    static = {n.input[i] for n in graph.node if n.op_type in OPS for i in OPS[n.op_type].static if i < len(n.input)}
    loaded = load_proto(case.model)
    errs, plan_ran = [0.0, 0.0], True
    for ins, outs in case.data_sets:
        feeds = {i.name: as_array(v) for i, v in zip(graph.input, ins)}
        known = {n: v for n, v in feeds.items() if n in static}
        model = import_model(loaded, known_inputs=known)
        feed = model.feed({n: v for n, v in feeds.items() if n not in known})
        finite = all(np.all(np.isfinite(v)) for v in feed.values() if v.dtype.kind == "f")
        plan_ran = plan_ran and finite
        for name, v in feed.items():
            if v.dtype.kind == "i" and np.any(v < 0):
                raise CaseRefused(f"input {name!r} holds negative run-time indices (the graph's Gather takes [0, n))")
        ref = model.restore(evaluate(model.graph, feed)) if model.graph.outputs else model.restore({})
        f32 = fp32_plan_outputs(model, feed) if finite else None  # the runtime refuses NaN/Inf inputs
        for out, expected in zip(graph.output, outs):
            expected = as_array(expected)
            for slot, got in enumerate((ref[out.name], f32[out.name]) if f32 else (ref[out.name],)):
                if expected.dtype == np.bool_:
                    np.testing.assert_array_equal(got, expected, err_msg=f"{case.name} {out.name}")
                    continue
                got = np.asarray(got, dtype=np.float64)
                want = expected.astype(np.float64)
                np.testing.assert_allclose(got, want, rtol=case.rtol, atol=case.atol,
                                           err_msg=f"{case.name} {out.name} ({('fp64', 'fp32')[slot]})")
                both = np.isfinite(want) & np.isfinite(got)
                if both.any():
                    errs[slot] = max(errs[slot], float(np.max(np.abs(got[both] - want[both]))))
    return CaseResult(*errs, plan_ran)
