"""The error contract: static bounds are sound, overflow is a verdict that names the op, and the gate
decides cheapest first."""
import warnings

import numpy as np
import pytest

from luminal_num.search.lower import lower_program
from luminal_num.dtypes.formats import F8E4M3
from luminal_num.error.budget import Budget
from luminal_num.error.interval import Interval
from luminal_num.error.judge import Judge
from luminal_num.error.static import static_bound
from luminal_num.hlir import Graph, evaluate
from luminal_num.models.testnets import transformer
from luminal_num.runtime.cpu import CpuRuntime
from luminal_num.search.choice import random_candidate
from luminal_num.search.space import SearchSpace

warnings.filterwarnings("ignore", category=RuntimeWarning)
LO, HI = -2.0, 2.0


def random_graph(rng: np.random.Generator) -> Graph:
    """A chain of 1-3 op families from {matmul, softmax, layer_norm, gelu (tanh/erf), exp, log}."""
    g = Graph()
    x = g.input("x", (4, 16), value_range=(LO, HI))
    for _ in range(int(rng.integers(1, 4))):
        kind = rng.choice(["matmul", "softmax", "layer_norm", "gelu", "exp", "log"])
        if kind == "matmul":
            x = x @ g.weight(f"w{len(g)}", rng.standard_normal((16, 16)) / 4)
        elif kind == "softmax":
            x = x.softmax(-1)
        elif kind == "layer_norm":
            x = x.layer_norm()
        elif kind == "gelu":
            x = x.gelu("tanh" if rng.random() < 0.5 else "none")
        elif kind == "exp":
            x = (x * 0.5).exp()
        else:
            x = (x * x + 1.0).log()
    g.output(x, "y")
    return g


def test_static_bound_is_sound_on_random_graphs_variants_and_inputs():
    """>= 2,000 (graph, candidate, input) cases: measured error never exceeds the static bound."""
    rng = np.random.default_rng(2026)
    cases = violations = finite = 0
    while cases < 2000:
        g = random_graph(rng)
        space = SearchSpace.build(g)
        ranges = {"x": Interval(np.full((4, 16), LO), np.full((4, 16), HI))}
        for _ in range(5):
            choices = {c.index: random_candidate(space.groups[gr.key].space, rng)
                       for gr in space.part.groups for c in gr.chunks}
            program = lower_program(g, space.part, space.groups, choices)
            rep = static_bound(program, ranges, {}, g.weights)
            if rep.overflow is not None:
                continue
            bound = rep.error_bounds["y"]
            finite += bool(np.all(np.isfinite(bound)))
            rt = CpuRuntime(program, g.weights)
            for _ in range(8):
                x = {"x": rng.uniform(LO, HI, (4, 16))}
                err = np.abs(rt.run(x).outputs["y"] - evaluate(g, x)["y"])
                violations += int(np.sum(err > bound))
                cases += 1
    assert violations == 0
    assert finite > 0


def _layer_norm_graph() -> Graph:
    g = Graph()
    g.output(g.input("x", (4, 64)).layer_norm(), "y")
    return g


def test_fp16_layer_norm_variance_overflow_is_rejected_statically():
    g = _layer_norm_graph()
    space = SearchSpace.build(g)
    # store the squares x*x (the variance's terms) in FP16: |x| ~ 1000 gives 1e6 > 65504
    (gk, knobs), = space.knobs.items()
    square = next(k for k in knobs if "Mul" in k.origin and "ew:f16_computef32" in k.tags
                  and _is_square(space, gk, k))
    program = space.program(frozenset([(gk, square.cls, "ew:f16_computef32")]))
    x = {"x": np.random.default_rng(0).uniform(500, 1500, (4, 64)) * np.sign(np.random.default_rng(1).standard_normal((4, 64)))}
    judge = Judge(g, Budget.parse("atol=1e-2,rtol=1e-2"), [x], use_static=True)
    v = judge.judge(program)
    assert not v.passed and v.source == "static"
    assert "overflow" in v.reason and "Mul" in v.reason and "f16" in v.reason
    assert judge.stats.measured == 0  # rejected without running it


def _is_square(space, gk, knob) -> bool:
    """The knob's value is x*x (a Mul of one value with itself)."""
    nodes = space.groups[gk].space.classes[knob.cls]
    for n in nodes:
        if n.op == "Ew":
            body = space.groups[gk].space.classes[n.children[0].id]
            for b in body:
                if b.op == "FMul" and b.children[0] == b.children[1]:
                    return True
    return False


def test_fp8_activation_beyond_448_without_scale_is_rejected_statically():
    g = Graph()
    g.output(g.input("x", (8,)).cast(F8E4M3), "y")
    space = SearchSpace.build(g)
    program = space.program(frozenset())
    judge = Judge(g, Budget.parse("atol=1,rtol=1"), [{"x": np.linspace(-1000, 1000, 8)}], use_static=True)
    v = judge.judge(program)
    assert not v.passed and v.source == "static"
    assert "overflow" in v.reason and "Cast" in v.reason and "f8e4m3" in v.reason
    # in range it is fine, and certified without measurement
    judge2 = Judge(g, Budget.parse("atol=1,rtol=0.07"), [{"x": np.linspace(-400, 400, 8)}], use_static=True)
    v2 = judge2.judge(program)
    assert v2.passed and v2.source == "static"


@pytest.mark.parametrize("budget,expect", [("atol=1e-3,rtol=1e-3", True), ("atol=1e-9,rtol=0", False)])
def test_fp32_baseline_verdicts(budget, expect):
    model = transformer(2)
    space = SearchSpace.build(model.graph)
    judge = Judge(model.graph, Budget.parse(budget), [model.make_inputs(4)], use_static=False)
    assert judge.judge(space.program(frozenset())).passed is expect
