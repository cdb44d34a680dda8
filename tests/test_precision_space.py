"""The precision search space: every variant is in the e-graph, and every candidate drawn from it
computes the same function up to its variants' rounding (measured error <= the static bound)."""
import warnings

import numpy as np
import pytest

from luminal_num.dtypes.variants import ELEMENTWISE_VARIANTS, GEMM_VARIANTS, REDUCE_VARIANTS
from luminal_num.error.interval import Interval
from luminal_num.error.static import static_bound
from luminal_num.hlir import evaluate
from luminal_num.models.testnets import all_test_models, transformer
from luminal_num.runtime.cpu import CpuRuntime
from luminal_num.search.choice import random_candidate
from luminal_num.search.extract import node_tag
from luminal_num.search.lower import lower_program
from luminal_num.search.space import SearchSpace

warnings.filterwarnings("ignore", category=RuntimeWarning)


def test_transformer_layer_space_contains_every_variant():
    space = SearchSpace.build(transformer(2).graph)
    layer = space.groups[space.part.groups[0].key].space
    tags = {node_tag(n) for nodes in layer.classes.values() for n in nodes}
    assert {f"gemm:{v}" for v in GEMM_VARIANTS if v != "f32"} <= tags
    assert {f"ew:{v}" for v in ELEMENTWISE_VARIANTS if v != "f32"} <= tags
    assert {f"sum:{v}" for v in REDUCE_VARIANTS if v != "f32"} <= tags
    assert "softmax:bf16" in tags
    # static-scale variants only where B is a compile-time weight: the attention Gemms (Q K^T, P V)
    # multiply two activations and must not offer int8 with static weight scales
    static_b = {n for n, v in GEMM_VARIANTS.items() if v.b_scale is not None and v.b_scale.static}
    activation_only = {n for n in GEMM_VARIANTS if n not in static_b}
    kinds = set()
    concat = {cid for cid, nodes in layer.classes.items() if any(n.op == "KCatW" for n in nodes)}
    for nodes in layer.classes.values():
        precs = frozenset(n.arg("prec") for n in nodes if n.op == "KGemm" and n.arg("dt") == "f32")
        if precs and not any(n.op == "KGemm" and n.cls("b") in concat for n in nodes):  # (a fused q/k/v: one
            # variant per class, those whose scales do not span parts: tests/test_fuse_gemm.py)
            assert precs in (frozenset(GEMM_VARIANTS), frozenset(activation_only)), sorted(precs)
            kinds.add(precs == frozenset(GEMM_VARIANTS))
    assert kinds == {True, False}  # weight Gemms get every variant; Q K^T and P V only dynamic ones


def test_precision_rules_terminate_and_keep_dtypes():
    # saturation finishes (guarded rules) and the dtype analysis saw no conflict (it would raise)
    space = SearchSpace.build(transformer(4).graph)
    stats = [g.stats for g in space.groups.values()]
    assert all(s.e_nodes < 5000 for s in stats)


@pytest.mark.parametrize("model", all_test_models(), ids=lambda m: m.name)
def test_genome_fuzzing_with_variants_stays_within_bounds(model):
    """50 random candidates over the whole space (structure and precision): measured error vs FP64
    never exceeds the static bound built from the candidate's own variants."""
    space = SearchSpace.build(model.graph)
    rng = np.random.default_rng(11)
    inputs = model.make_inputs(5)
    ref = evaluate(model.graph, inputs)
    ranges = {k: Interval.point(np.asarray(v, dtype=np.float64)) for k, v in inputs.items()}
    bounded = 0
    for _ in range(50):
        choices = {c.index: random_candidate(space.groups[g.key].space, rng)
                   for g in space.part.groups for c in g.chunks}
        program = lower_program(model.graph, space.part, space.groups, choices)
        rep = static_bound(program, ranges, model.graph.bind_symbols(inputs), model.graph.weights)
        if rep.overflow is not None:
            continue  # a certain overflow is a rejection, not a number to compare
        out = CpuRuntime(program, model.graph.weights).run(inputs).outputs
        for name in ref:
            err = np.abs(out[name] - ref[name])
            assert np.all(err <= rep.error_bounds[name]), name
            bounded += bool(np.all(np.isfinite(rep.error_bounds[name])))
    if model.name == "matmul_chain":
        assert bounded >= 10  # worst-case bounds stay finite (informative) on the Gemm-only model


@pytest.mark.parametrize("name", ["matmul_chain", "mlp"])
def test_every_gemm_variant_alone_has_a_sound_bound(name):
    """Each Gemm variant alone: the bound holds; on the Gemm-only chain it is also finite everywhere
    (through GELU and LayerNorm the first-order worst case may be unbounded: then measurement decides)."""
    from luminal_num.models import testnets
    model = getattr(testnets, name)()
    space = SearchSpace.build(model.graph)
    inputs = model.make_inputs(2)
    ref = evaluate(model.graph, inputs)["y"]
    ranges = {k: Interval.point(np.asarray(v, dtype=np.float64)) for k, v in inputs.items()}
    seen = set()
    for change in space.all_changes():
        if not change[2].startswith("gemm:"):
            continue
        program = space.program(frozenset([change]))
        rep = static_bound(program, ranges, {}, model.graph.weights)
        err = np.abs(CpuRuntime(program, model.graph.weights).run(inputs).outputs["y"] - ref)
        assert rep.overflow is None, change
        if name == "matmul_chain":
            assert np.all(np.isfinite(rep.error_bounds["y"])), change
        assert np.all(err <= rep.error_bounds["y"]), change
        seen.add(change[2])
    assert seen == {f"gemm:{v}" for v in GEMM_VARIANTS if v != "f32"}
