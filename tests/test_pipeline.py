"""Compile pipeline: partition/group, egglog saturation, choice space, LLIR lowering, CPU runtime.

Genome fuzzing (Luminal's method): every random candidate drawn from the choice space must compute
the same function as the FP64 reference, up to FP32 rounding.
"""
import numpy as np
import pytest

from luminal_num.codegen.llir import KernelKind
from luminal_num.search.lower import lower_program
from luminal_num.hlir import Graph, Op, evaluate, index_input
from luminal_num.hlir.partition import partition
from luminal_num.models.testnets import all_test_models, attention_kv, transformer
from luminal_num.runtime.cpu import CpuRuntime
from luminal_num.search.choice import mutate, random_candidate, reachable
from luminal_num.search.saturate import saturate_group

MODELS = {m.name: m for m in all_test_models()}


def compile_spaces(graph, fusion: bool = True):
    part = partition(graph)
    return part, {g.key: saturate_group(graph, g, fusion=fusion) for g in part.groups}


def fp32_tolerance(ref: np.ndarray) -> float:
    """A loose FP32 envelope: 64 ulps of the output's magnitude (a wrong function misses by far more)."""
    return 64 * 2.0 ** -24 * float(np.max(np.abs(ref)))


@pytest.mark.parametrize("name", sorted(MODELS))
def test_genome_fuzzing_matches_fp64(name):
    model = MODELS[name]
    part, spaces = compile_spaces(model.graph)
    rng = np.random.default_rng(7)
    inputs = model.make_inputs(3)
    ref = evaluate(model.graph, inputs)
    seen = set()
    for _ in range(50):
        choices = {c.index: random_candidate(spaces[g.key].space, rng) for g in part.groups for c in g.chunks}
        seen.add(tuple(sorted((k, v.key) for k, v in choices.items())))
        out = CpuRuntime(lower_program(model.graph, part, spaces, choices), model.graph.weights).run(inputs).outputs
        for k in ref:
            assert np.max(np.abs(out[k] - ref[k])) <= fp32_tolerance(ref[k]), k
    if sum(s.space.n_nodes - s.space.n_classes for s in spaces.values()) > 0:
        assert len(seen) > 1  # the fuzzer explores the space, not one candidate


@pytest.mark.parametrize("name", sorted(MODELS))
def test_gemm_rule_fires_on_every_matmul(name):
    model = MODELS[name]
    part, spaces = compile_spaces(model.graph, fusion=False)  # (fusion adds fused Gemms' own classes)
    for g in part.groups:
        rep = set(g.representative.nodes)
        n_matmuls = sum(1 for m in model.graph.matmuls if m in rep)
        gemm_classes = sum(1 for nodes in spaces[g.key].space.classes.values() if any(n.op == "KGemm" for n in nodes))
        assert gemm_classes == n_matmuls
    assert len(model.graph.matmuls) > 0


def test_after_lowering_only_kernel_ops_are_selectable():
    part, spaces = compile_spaces(MODELS["transformer4"].graph)
    for s in spaces.values():
        assert not any(n.op.startswith("H") for nodes in s.space.classes.values() for n in nodes)


def _scatter_graph(second_reader: bool) -> Graph:
    g = Graph()
    cache, src = g.input("cache", (8, 4)), g.input("src", (2, 4))
    pos = index_input(g, "pos", (2,))
    g.output(cache.scatter(src, pos).sum(-1), "y")
    if second_reader:
        g.output(cache.sum(0), "old")
    return g


@pytest.mark.parametrize("second_reader", [False, True])
def test_scatter_no_copy_only_when_legal(second_reader):
    g = _scatter_graph(second_reader)
    part, spaces = compile_spaces(g)
    ops = {n.op for s in spaces.values() for nodes in s.space.classes.values() for n in nodes}
    assert ("KScatterNoCopy" in ops) is (not second_reader)
    rng = np.random.default_rng(0)
    choices = {c.index: random_candidate(spaces[gr.key].space, rng) for gr in part.groups for c in gr.chunks}
    prog = lower_program(g, part, spaces, choices)
    kinds = {k.kind for k in prog.kernels}
    assert (KernelKind.SCATTER_NOCOPY in kinds) is (not second_reader)
    assert (KernelKind.SCATTER in kinds) is second_reader
    inputs = {"cache": np.arange(32.0).reshape(8, 4), "src": -np.ones((2, 4)), "pos": np.array([1, 6])}
    out = CpuRuntime(prog).run(inputs).outputs
    ref = evaluate(g, inputs)
    for k in ref:
        np.testing.assert_array_equal(out[k], ref[k])


def test_dedupe_groups_identical_layers():
    p2, p12 = partition(transformer(2).graph), partition(transformer(12).graph)
    assert len(p2.groups) == len(p12.groups) == 2
    assert len(p12.chunks) == 13 and len(p12.groups[0].chunks) == 12


def test_mutation_changes_few_choices_and_stays_valid():
    model = MODELS["mlp"]
    part, spaces = compile_spaces(model.graph)
    space = spaces[part.groups[0].key].space
    rng = np.random.default_rng(1)
    base = random_candidate(space, rng)
    inputs = model.make_inputs(0)
    ref = evaluate(model.graph, inputs)["y"]
    changed = 0
    for _ in range(20):
        m = mutate(space, base, rng, n_changes=1)
        changed += m.key != base.key
        assert set(reachable(space, m)) <= set(m.as_dict())
        out = CpuRuntime(lower_program(model.graph, part, spaces, {0: m}), model.graph.weights).run(inputs).outputs["y"]
        assert np.max(np.abs(out - ref)) <= fp32_tolerance(ref)
    assert changed > 0


def test_buffer_reuse_and_inplace_aliasing():
    model = attention_kv()
    part, spaces = compile_spaces(model.graph)
    rng = np.random.default_rng(0)
    choices = {c.index: random_candidate(spaces[g.key].space, rng) for g in part.groups for c in g.chunks}
    prog = lower_program(model.graph, part, spaces, choices)
    res = CpuRuntime(prog, model.graph.weights).run(model.make_inputs(0))
    assert res.plan.total_bytes < res.plan.naive_bytes
    for k in prog.kernels:
        if k.aliases is not None:
            assert res.plan.slot_of[k.id] == res.plan.slot_of[k.inputs[k.aliases].buffer]
    assert len(res.kernel_seconds) == len(prog.launched())


def test_symbolic_sequence_length_binds_at_run_time():
    model = transformer(2, symbolic_seq=True)
    part, spaces = compile_spaces(model.graph)
    rng = np.random.default_rng(0)
    choices = {c.index: random_candidate(spaces[g.key].space, rng) for g in part.groups for c in g.chunks}
    rt = CpuRuntime(lower_program(model.graph, part, spaces, choices), model.graph.weights)
    for s in (3, 9):
        x = {"x": np.random.default_rng(s).standard_normal((s, 32))}
        ref = evaluate(model.graph, x)["y"]
        assert np.max(np.abs(rt.run(x).outputs["y"] - ref)) <= fp32_tolerance(ref)
